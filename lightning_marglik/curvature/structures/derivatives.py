"""Closed-form derivatives of a structure's log-determinant in its log hyperparameters.

``log|s C + diag(delta)|`` depends on the log curvature scale ``u = log s`` and on the log
precision ``rho_t = log delta_t`` of every prior tensor ``t`` (0-dim, or one per scalar under a
diagonal prior). Under ``kron``, ``diag`` and a full curvature with one precision, it is a sum of
terms ``log(s lambda + delta)`` over cached eigenvalues (or diagonal entries) ``lambda``, each term
depending on one ``delta`` only. With the prior's share ``r = delta / (s lambda + delta)`` of a
term, its derivatives are ``d/drho = r``, ``d/du = 1 - r`` and
``d2/drho2 = d2/du2 = -d2/drho du = r (1 - r)``: the Hessian in ``(rho, u)`` is diagonal in the
``rho`` plus a border for ``u``, at the cost of one pass over the eigenvalues.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["LogDetDerivatives", "separable_terms"]


@dataclass
class LogDetDerivatives:
    """A log-determinant with its first and second derivatives in ``u = log s`` and the ``rho_t``.

    Attributes:
        value: The log-determinant (0-dim).
        u: ``d/du``.
        uu: ``d2/du2``.
        rho: Per prior index ``t``: ``d/drho_t``, shaped like ``rho_t``.
        rho_u: Per prior index: ``d2/drho_t du``.
        rho_rho: Per prior index: ``d2/drho_t2`` (elementwise for a per-scalar ``rho_t``).
        cross: Second derivatives between different prior indices, ``(indices, matrix)`` with the
            off-diagonal entries of ``d2/drho_t drho_r`` among 0-dim ``rho`` (its diagonal is
            zero; the diagonal is in ``rho_rho``). ``None`` where the terms of different indices
            are independent.
        exact_diagonal: False where ``rho_rho`` is only the diagonal of a dense Hessian among
            per-scalar precisions (a diagonal prior on a full curvature).
    """

    value: Tensor
    u: Tensor
    uu: Tensor
    rho: Dict[int, Tensor] = field(default_factory=dict)
    rho_u: Dict[int, Tensor] = field(default_factory=dict)
    rho_rho: Dict[int, Tensor] = field(default_factory=dict)
    cross: Optional[Tuple[List[int], Tensor]] = None
    exact_diagonal: bool = True

    @classmethod
    def zero(cls, like: Tensor) -> "LogDetDerivatives":
        zero = like.new_zeros(())
        return cls(zero, zero, zero)

    def add_terms(self, index: int, value: Tensor, first: Tensor, second: Tensor, count: int) -> None:
        """Add separable terms of prior index ``index`` (see :func:`separable_terms`)."""
        self.value = self.value + value
        self.u = self.u + (count - first.sum())
        self.uu = self.uu + second.sum()
        for store, part in ((self.rho, first), (self.rho_u, -second), (self.rho_rho, second)):
            store[index] = store[index] + part if index in store else part


def separable_terms(scaled: Tensor, log_delta: Tensor) -> Tuple[Tensor, Tensor, Tensor, int]:
    """``sum log(s lambda + delta)`` over the entries ``s lambda`` of ``scaled``, with its
    derivatives ``sum r`` and ``sum r (1 - r)`` in ``log delta`` (see the module docstring).

    Args:
        scaled: Eigenvalues or diagonal entries times the scale ``s``; shaped like ``log_delta``
            when ``log_delta`` is per scalar, any shape when it is 0-dim.
        log_delta: ``log delta``: 0-dim or elementwise.

    Returns:
        The value (0-dim), the first and second derivatives in ``log delta`` (shaped like
        ``log_delta``: summed over the terms for a 0-dim one), and the number of terms.
    """
    delta = log_delta.exp()
    total = scaled + delta
    share = delta / total
    value = torch.log(total).sum()
    if log_delta.dim() == 0:
        first = share.sum()
        return value, first, first - share.pow(2).sum(), scaled.numel()
    return value, share.reshape(log_delta.shape), (share - share * share).reshape(log_delta.shape), scaled.numel()
