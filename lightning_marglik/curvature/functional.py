"""Per-example Jacobian rows ``L_n^T J_n`` with torch.func, for any module graph.

Used for the full structure and for the diagonal when some parameter lives outside
``nn.Linear``/``nn.Conv2d``. Costs ``k`` vector-Jacobian products per example.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap


def jacobian_rows(model: nn.Module, names: List[str], params: List[Tensor], x: Tensor, factor: Tensor) -> Tensor:
    """Rows ``L_n[:, j]^T J_n`` of every example ``n`` and factor column ``j``.

    Args:
        model: The network, called as ``model(x)``.
        names: Names (in ``model``) of the parameters to differentiate.
        params: The parameter tensors themselves, in ``names`` order.
        x: Input batch ``(B, ...)``.
        factor: Loss-Hessian factor ``(B, C, k)``.

    Returns:
        Tensor ``(B * k, P)`` with ``P`` the total size of ``params``, flattened in order.
    """
    detached = tuple(p.detach() for p in params)

    def single_output(theta: tuple, xi: Tensor) -> Tensor:
        return functional_call(model, dict(zip(names, theta)), (xi.unsqueeze(0),)).squeeze(0)

    def single_rows(theta: tuple, xi: Tensor, li: Tensor) -> tuple:
        _, pullback = vjp(lambda t: single_output(t, xi), theta)
        return vmap(pullback)(li.T)[0]

    rows = vmap(single_rows, in_dims=(None, 0, 0))(detached, x, factor)
    b, k = factor.shape[0], factor.shape[2]
    return torch.cat([r.reshape(b, k, -1) for r in rows], dim=2).reshape(b * k, -1)
