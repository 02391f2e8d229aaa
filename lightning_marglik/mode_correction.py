"""The mode-corrected Laplace evidence: the evidence of the quadratic model at its own mode (issue 52).

An estimate within training reads the current weights ``theta`` as the mode of the MAP objective at every prior
precision it tries; they are not (training has not converged, and it trained at another precision). The quadratic
model of the objective around ``theta``, with the tempered negative log likelihood's gradient ``g`` there (summed
over the evidence data) and the evidence's curvature ``s C``, has its mode one Newton step away, and its evidence
there is (Lin, Antoran and Hernandez-Lobato, 2023: mode-corrected online Laplace)::

    log Z_corrected(delta) = log Z_laplace(delta) + r^T H^-1 r / 2,    r = g + delta theta,    H = s C + diag(delta)

exact for a linear model with a Gaussian likelihood at any weights. In the log precisions ``rho_t = log delta_t``
of the prior's tensors, with ``x = H^-1 r`` and ``w = theta - x``, the correction's derivatives are::

    d / d rho_t             = delta_t (theta_t - x_t / 2)^T x_t
    d^2 / d rho_k d rho_t   = [k = t] d / d rho_t + delta_k delta_t w_t^T (H^-1 P_k w)_t

(``P_k w``: tensor ``k``'s part of ``w``, zero elsewhere): two solves per evaluation where every block of ``H``
holds one tensor (``kron``, ``ekfac``, ``diag``: :attr:`~.curvature.statistics.Structure.tensor_blocks`), one more
per learned tensor where a block couples several (``full``).

Alone it is not the remedy: as a tensor's precision grows it tends to the likelihood of the network's linearization
at zero weights with no Occam factor left, and where the declared prior already fits it switches a weakly determined
layer off (``benchmarks/results/online_remedies.md``). The callback's prior guard scores, per tensor, the weaker of
its precision and the plain evidence's (:mod:`.callbacks.prior_guard`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import solvers
from .evidence import LaplaceEvidence

__all__ = ["ModeCorrectedEvidence"]


class ModeCorrectedEvidence(LaplaceEvidence):
    """The mode-corrected evidence of a :class:`~.evidence.LaplaceEvidence`, sharing its statistics.

    Its variables are the prior's learned log precisions: the likelihood's hyperparameters (``sigma``, ``T``) stay
    at the evidence's, whose ``g`` and ``s`` the correction holds.

    Args:
        evidence: The Laplace evidence at the current weights, of a ``"layerwise"`` or ``"scalar"`` prior.
        gradient: The gradient of the tempered negative log likelihood of the evidence data at those weights
            (summed over the data and the processes), flat in the prior's parameter order.

    Raises:
        ValueError: On a ``"diagonal"`` prior (a precision per scalar: its Newton Hessian would be ``P x P``), or
            a ``gradient`` that is not one entry per prior parameter.

    Example:
        >>> from torch import nn
        >>> from lightning_marglik import GaussianLikelihood, GaussianPrior
        >>> net = nn.Linear(3, 1)
        >>> x, y = torch.randn(40, 3), torch.randn(40, 1)
        >>> prior, likelihood = GaussianPrior(net), GaussianLikelihood()
        >>> evidence = LaplaceEvidence.fit(net, [(x, y)], likelihood, prior)
        >>> loss = likelihood.nll(net(x), y).sum()
        >>> gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(net.parameters()))])
        >>> corrected = ModeCorrectedEvidence(evidence, gradient)
        >>> bool(corrected.log_marglik() >= evidence.log_marglik())  # the quadratic model's mode lies below theta
        True
        >>> solution = corrected.maximize()
        >>> sorted(solution.values)
        ['log_precision']
    """

    def __init__(self, evidence: LaplaceEvidence, gradient: Tensor) -> None:
        prior = evidence.prior
        if prior.structure == "diagonal":
            raise ValueError("ModeCorrectedEvidence: a diagonal prior (a precision per scalar) has no closed-form "
                             "Newton step here; use a 'layerwise' prior.")
        if gradient.numel() != prior.n_params:
            raise ValueError(f"ModeCorrectedEvidence: `gradient` needs one entry per prior parameter "
                             f"({prior.n_params}), got {gradient.numel()}.")
        self.__dict__.update(evidence.__dict__)  # the same statistics, structures, prior and likelihood
        device = prior.log_precision.device
        self._gradient = list(gradient.detach().to(device, torch.float64).reshape(-1).split(prior.param_sizes))
        self._theta = [p.detach().reshape(-1).to(device, torch.float64) for p in prior.params]

    def _learnable_values(self) -> Dict[str, Tensor]:
        return {n: v for n, v in super()._learnable_values().items() if n == "log_precision"}

    def _solves(self, values: Dict[str, Tensor]) -> Tuple[List[Tensor], List[Tensor], List[Tensor], Tensor]:
        """Per prior tensor ``delta_t``, ``r_t`` and ``x_t = (H^-1 r)_t`` at the log hyperparameters ``values``
        (differentiable in them), and the scale ``s``."""
        values = {k: v.to(torch.float64) for k, v in values.items()}
        scale = self._scale(values)
        delta = [d.exp() for d in self.prior.tensor_log_precisions(values["log_precision"])]
        r = [g + d * t for g, d, t in zip(self._gradient, delta, self._theta)]
        x: List[Tensor] = [torch.empty(0)] * len(r)
        for structure in self.structures:
            for i, solved in zip(structure.indices, structure.inverse(scale, delta)([r[i] for i in structure.indices])):
                x[i] = solved
        return delta, r, x, scale

    def correction(self, values: Dict[str, Tensor]) -> Tensor:
        """``r^T H^-1 r / 2`` at the log hyperparameters ``values`` (every name of :meth:`hyperparameters`),
        differentiable in them."""
        _, r, x, _ = self._solves(values)
        return 0.5 * sum((ri * xi).sum() for ri, xi in zip(r, x))

    def log_marglik_at(self, values: Dict[str, Tensor]) -> Tensor:
        return super().log_marglik_at(values) + self.correction(values)

    def _correction_derivatives(self, full: Dict[str, Tensor], learned: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The correction, its gradient ``(G,)`` and Hessian ``(G, G)`` in the prior's log precision groups, in
        closed form (the module's formulas); the Hessian's rows of groups not ``learned`` are left zero."""
        delta, r, x, scale = self._solves(full)
        value = 0.5 * sum((ri * xi).sum() for ri, xi in zip(r, x))
        per_tensor = torch.stack([(d * (t - 0.5 * xi) * xi).sum() for d, t, xi in zip(delta, self._theta, x)])
        w = [t - xi for t, xi in zip(self._theta, x)]
        hessian = torch.diag(per_tensor)
        is_learned = [bool(learned[groups].any()) for groups in self._tensor_groups]
        for structure in self.structures:
            solve, indices = structure.inverse(scale, delta), structure.indices
            if structure.tensor_blocks:  # one solve: each tensor's own block
                for i, y in zip(indices, solve([w[i] for i in indices])):
                    hessian[i, i] += (delta[i] * delta[i] * w[i] * y).sum()
                continue
            for k in (k for k in indices if is_learned[k]):
                for i, y in zip(indices, solve([w[i] if i == k else torch.zeros_like(w[i]) for i in indices])):
                    hessian[k, i] += (delta[k] * delta[i] * w[i] * y).sum()
        # tensors -> groups (a scalar prior's one group sums them all)
        owner = torch.cat(self._tensor_groups)
        groups = full["log_precision"].numel()
        onehot = torch.zeros(len(owner), groups, dtype=torch.float64, device=owner.device)
        onehot[torch.arange(len(owner)), owner] = 1.0
        return value, onehot.T @ per_tensor, onehot.T @ hessian @ onehot

    def _second_order(self, current: Dict[str, Tensor], learned: Tensor,
                      values: Dict[str, Tensor]) -> solvers.SecondOrder:
        plain = super()._second_order(current, learned, values)
        full = {k: v.detach() for k, v in self._with_fixed(current, values).items()}
        value, first, second = self._correction_derivatives(full, learned)
        if not (torch.isfinite(value) and torch.isfinite(first).all() and torch.isfinite(second).all()):
            raise torch.linalg.LinAlgError("the mode correction is not finite at this point")
        second = second[learned][:, learned]
        gradient = plain.gradient + first[learned]
        n = len(gradient)
        coupled = not all(structure.tensor_blocks for structure in self.structures)
        if plain.dense.numel() == 0 and (not coupled or n > solvers.DENSE_LIMIT):
            # the plain evidence's diagonal form: the correction's diagonal (exact where no block couples tensors)
            return solvers.SecondOrder(plain.value + value, gradient, plain.dense, plain.rows,
                                       plain.diagonal + torch.diagonal(second))
        rows = torch.diag(plain.diagonal) if plain.dense.numel() == 0 else plain.rows
        return solvers.SecondOrder(plain.value + value, gradient, torch.arange(n, device=gradient.device),
                                   rows + second, gradient.new_zeros(0))

    def maximize(self, max_step: Optional[float] = None, max_evaluations: int = 100, tol: float = 1e-6) -> solvers.Solution:
        """Newton on the learned log precisions from their current values, as :meth:`optimize` but without its
        warning where a precision runs to the edge of its buffer: the corrected evidence does where it switches a
        tensor off, and the prior guard scores that candidate as any other (``Solution.unbounded`` names them).

        Args:
            max_step: Largest change of any learned ``log delta_g`` from its start; ``None``: unbounded.
            max_evaluations: Newton's evaluation budget.
            tol: Newton's tolerance (predicted increase of a full step, nats).

        Returns:
            The solution (``values["log_precision"]``: every group's, float64).
        """
        with self.reusing_decompositions():
            solution, _ = self._solve(self._learnable_values(), 0, 0.0, None, "newton", tol, max_evaluations, max_step)
        return solution

    def optimize(self, *args: Any, **kwargs: Any) -> solvers.Solution:
        with self.reusing_decompositions():  # every solve of the correction at once
            return super().optimize(*args, **kwargs)
