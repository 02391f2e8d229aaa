"""Densities over the log prior precisions: the hyperprior of type-II MAP (MacKay; Tipping's ARD).

With a hyperprior the evidence engine maximizes, and reports, ``log q(D|delta) + sum_g log p(log delta_g)``
over the learned groups; :class:`~lightning_marglik.GaussianPrior` carries it (``hyperprior=``).
"""
from __future__ import annotations

import abc
import math
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .validators import number, optional

__all__ = ["GammaHyperprior", "Hyperprior", "LogNormalHyperprior"]


class Hyperprior(abc.ABC):
    """A density over the log prior precision ``rho_g = log delta_g`` of each learned group (type-II MAP).

    With a hyperprior the evidence engine maximizes, and reports, ``log q(D|delta) + sum_g log
    p(rho_g)`` over the groups the evidence learns (MacKay 1992, Tipping 2001). Without one, a
    group whose weights are (near) zero has an evidence that keeps rising as ``delta_g -> inf``
    (the ARD pruning of ``benchmarks/results/runaway_mechanism.md``); a hyperprior that falls off fast enough makes the maximum
    finite. Subclasses give the density and its first two derivatives, elementwise, in ``rho``.

    Raises:
        TypeError: On building the base itself, which has no density (use :class:`GammaHyperprior` or
            :class:`LogNormalHyperprior`), or a subclass without :meth:`log_density` and :meth:`derivatives`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Hyperprior":
        # the base has no density: GaussianPrior took it, and the first evidence failed with an empty error
        if cls is Hyperprior:
            raise TypeError("Hyperprior is the abstract base of the hyperpriors and has no density: use "
                            "GammaHyperprior(...) or LogNormalHyperprior(...), or a subclass that implements "
                            "log_density and derivatives.")
        return super().__new__(cls)

    @abc.abstractmethod
    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        """``log p(rho)`` per entry of ``log_precision`` (a density in ``rho``, Jacobian included).

        Args:
            log_precision: ``rho``, any shape.
            initial_log_precision: ``log`` of the prior's constructor ``precision``: the centre of
                a hyperprior whose location is not given.

        Returns:
            Tensor of ``log_precision``'s shape.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        """First and second derivative of :meth:`log_density` in ``rho``, elementwise (closed form)."""
        raise NotImplementedError


class LogNormalHyperprior(Hyperprior):
    """``rho = log delta ~ N(loc, scale^2)``: a log-normal hyperprior on the precision.

    Its pull is ``-(rho - loc) / scale^2`` per group: a group may move ``scale`` in ``log delta``
    from ``loc`` at the cost of half a nat. A weak choice is ``scale`` 2 to 3 (a factor ``e^2`` to
    ``e^3`` costs 0.5 nats, ``e^8`` costs 3.5 to 8 nats): large groups (weights, ``P_g`` in the
    hundreds) barely feel it, while a group the data do not determine stays within a few scales of
    ``loc`` instead of running to ``e^20``.

    Args:
        scale: Standard deviation ``s > 0`` of ``log delta`` (``1e-150`` to ``1e150``).
        loc: Mean of ``log delta``; ``None``: the log of the prior's initial ``precision``.

    Raises:
        ValueError: On a ``scale`` outside ``[1e-150, 1e150]`` (where ``1/scale**2`` is a finite positive float),
            or a ``loc`` that is not finite.

    Example:
        >>> hyper = LogNormalHyperprior(scale=2.0)
        >>> round(float(hyper.log_density(torch.tensor(2.0), 0.0)), 4)  # -(2/2)^2/2 - log(2 sqrt(2 pi))
        -2.1121
    """

    def __init__(self, scale: float = 2.0, loc: Optional[float] = None) -> None:
        # the pull's curvature 1/scale**2 must be a finite positive float: it underflows to 0 (ZeroDivisionError)
        # below about 1e-154 and overflows above about 1e154
        self.scale = number(scale, "scale", low=1e-150, high=1e150, low_open=False,
                            what="the standard deviation of log delta, e.g. 2, where 1/scale**2 is a finite float")
        self.loc = optional(number, loc, "loc", low=-math.inf, what="the mean of log delta, or None")

    def _centred(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        return (log_precision - (initial_log_precision if self.loc is None else self.loc)) / self.scale

    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        z = self._centred(log_precision, initial_log_precision)
        return -0.5 * z**2 - math.log(self.scale * math.sqrt(2 * math.pi))

    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        first = -self._centred(log_precision, initial_log_precision) / self.scale
        return first, torch.full_like(log_precision, -1.0 / self.scale**2)

    def __repr__(self) -> str:
        return f"LogNormalHyperprior(scale={self.scale:g}, loc={self.loc!r})"


class GammaHyperprior(Hyperprior):
    """``delta ~ Gamma(concentration a, rate b)``: the conjugate hyperprior of ARD (Tipping 2001).

    In ``rho = log delta`` (Jacobian ``delta`` included) the density is
    ``a rho - b e^rho + a log b - lgamma(a)``, whose maximum is at ``delta = a / b``. Its effect on
    the MacKay fixed point ``delta* = gamma / ||theta||^2`` is pseudo-data:
    ``delta* = (gamma + 2a) / (||theta||^2 + 2b)``, ``gamma`` the group's well-determined
    parameters, so a group the data do not determine (``gamma ~ 0``, ``theta ~ 0``) ends near
    ``a / b`` instead of running away. A weak choice is ``a`` about 1 (two pseudo-parameters),
    small against the size of the groups that matter, with the mode ``a / b`` at the initial
    precision (``rate=None``); the fall-off above the mode is exponential in ``log delta``.

    Args:
        concentration: Shape ``a > 0``.
        rate: Rate ``b > 0``; ``None``: ``a / precision`` with the prior's initial ``precision``
            (the mode in ``log delta`` at the initial precision).

    Raises:
        ValueError: On a ``concentration`` or ``rate`` that is not positive and finite.

    Example:
        >>> hyper = GammaHyperprior(concentration=2.0, rate=1.0)
        >>> round(float(hyper.log_density(torch.tensor(0.0), 0.0)), 4)  # 2*0 - e^0 + 2 log 1 - lgamma(2)
        -1.0
    """

    def __init__(self, concentration: float = 1.0, rate: Optional[float] = None) -> None:
        self.concentration = number(concentration, "concentration", what="the Gamma shape a, e.g. 1")
        self.rate = optional(number, rate, "rate", what="the Gamma rate b, or None for a / precision")

    def _rate(self, initial_log_precision: float) -> float:
        return self.concentration / math.exp(initial_log_precision) if self.rate is None else self.rate

    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        a, b = self.concentration, self._rate(initial_log_precision)
        return a * log_precision - b * log_precision.exp() + a * math.log(b) - math.lgamma(a)

    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        b_delta = self._rate(initial_log_precision) * log_precision.exp()
        return self.concentration - b_delta, -b_delta

    def __repr__(self) -> str:
        return f"GammaHyperprior(concentration={self.concentration:g}, rate={self.rate!r})"
