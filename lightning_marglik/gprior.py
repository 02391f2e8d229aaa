"""The g-prior scaling of the evidence (Antorán et al., ICLR 2023; Zellner's g-prior).

Jacobian columns of different layers have very different scales, so one prior precision cannot
suit them all, and per-layer precisions let the evidence trade layers against each other. The
g-prior rescales every Jacobian column ``J_p`` by ``sqrt(c_p)``, ``c_p = diag(C)_p`` the
(unit-scale) curvature diagonal, and puts ONE precision ``delta_g`` on the rescaled weights
``theta~_p = sqrt(c_p) theta_p``. That model is the original one with the prior precision
``delta_g c_p`` on ``theta_p``: the likelihood is unchanged (``J theta = J~ theta~``), and the
Laplace evidence is invariant under the linear change of variables (``|H~| = |H| / prod c_p`` and
the prior's normalizer gains ``prod c_p``), so it is computed in the original parametrization:

    log q = log p(D|theta)/T - 1/2 sum_p delta_g c_p theta_p^2 + 1/2 sum_p log(delta_g c_p)
            - 1/2 log|s C + delta_g diag(c)| + const.

Two granularities, chosen by the evidence's prior:

* ``layerwise`` prior: per tensor, ``c_t = mean_p diag(C)_p`` over the tensor (any curvature
  structure: the prior stays one precision per tensor, ``log delta_t = log delta_g + log c_t``);
* ``diagonal`` prior: per parameter (structures ``diag`` and ``full``). With ``diag`` every
  parameter's rescaled curvature is exactly 1, so only the number of parameters and the fit matter.

Entries of ``diag(C)`` below ``1e-12`` times the largest are raised to it (a parameter no datum
informs, e.g. a dead unit, would get precision 0); such a parameter then adds almost nothing to
the evidence. Note that under a layerwise prior with one learned precision per tensor the scaling
changes nothing at the optimum (``delta_t`` absorbs ``c_t``): the g-prior's effect is the single
shared ``delta_g``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from . import solvers
from .curvature import CurvatureOptions, collect_statistics
from .curvature.batches import BatchFn
from .evidence import LaplaceEvidence
from .hyperparameters import GaussianPrior, Likelihood

__all__ = ["GPriorSolution", "curvature_diagonal", "g_prior_offsets", "optimize_g_prior"]

FLOOR = 1e-12


def curvature_diagonal(
    model: nn.Module,
    dataloader: Iterable,
    likelihood: Likelihood,
    prior: GaussianPrior,
    approx: str = "ggn",
    mc_samples: int = 0,
    generator: Optional[torch.Generator] = None,
    batch_fn: Optional[BatchFn] = None,
) -> List[Tensor]:
    """The exact diagonal of the unit-scale curvature ``C`` per prior tensor (one ``diag`` pass).

    Returns:
        Per prior tensor (``prior.param_names`` order), a float64 tensor shaped like the parameter.
    """
    stats = collect_statistics(model, dataloader, likelihood, prior, generator=generator, batch_fn=batch_fn,
                               options=CurvatureOptions("diag", approx, mc_samples))
    diagonal = {index: block for structure in stats.structures for index, block in structure.diagonal().items()}
    return [diagonal[t].reshape(p.shape) for t, p in enumerate(prior.params)]


def g_prior_offsets(diagonal: Sequence[Tensor], prior: GaussianPrior) -> Tensor:
    """``log c`` shaped like ``prior.log_precision``: per tensor (layerwise) or per parameter (diagonal).

    Raises:
        ValueError: For a scalar prior (it has one precision for all tensors, so no room for the
            scaling: build the evidence with a layerwise prior), or a diagonal that does not fit.
    """
    if prior.structure == "scalar":
        raise ValueError(
            "The g-prior sets every tensor's precision to delta_g times its curvature scale, which a scalar prior "
            "cannot hold: build the evidence with GaussianPrior(structure='layerwise') (per-tensor scaling) or "
            "'diagonal' (per-parameter scaling, structures 'diag'/'full')."
        )
    sizes = [d.numel() for d in diagonal]
    if sizes != list(prior.param_sizes):
        raise ValueError(f"`diagonal` has tensors of sizes {sizes}, the prior's are {list(prior.param_sizes)}.")
    flat = torch.cat([d.reshape(-1).to(torch.float64) for d in diagonal])
    if not bool(torch.isfinite(flat).all()) or float(flat.max()) <= 0:
        raise ValueError("The curvature diagonal is not finite or is zero everywhere: no g-prior scale exists.")
    flat = flat.clamp(min=FLOOR * float(flat.max()))
    if prior.structure == "diagonal":
        return flat.log()
    return torch.stack([part.mean() for part in torch.split(flat, sizes)]).log()


@dataclass
class GPriorSolution:
    """The evidence maximized over the g-prior's single precision (and the likelihood's learned hyperparameters).

    Attributes:
        value: Total log marginal likelihood there (0-dim float64).
        log_scale: ``log delta_g``.
        values: Every learnable log hyperparameter, ``log_precision = log delta_g + log c``; write
            them with ``evidence.set_hyperparameters(values)``.
        converged: Newton's convergence flag.
    """

    value: Tensor
    log_scale: Tensor
    values: Dict[str, Tensor]
    converged: bool


def optimize_g_prior(
    evidence: LaplaceEvidence, diagonal: Sequence[Tensor], tol: float = 1e-6, max_evaluations: int = 50
) -> GPriorSolution:
    """Maximize the evidence with prior precision ``delta_g c`` over ``log delta_g`` (and the likelihood's
    learned hyperparameters) by Newton's method; nothing is written.

    Args:
        evidence: A fitted evidence; its prior decides the granularity (layerwise: per tensor,
            diagonal: per parameter). Every tensor follows ``delta_g``, fixed groups included.
        diagonal: The unit-scale curvature diagonal per prior tensor (:func:`curvature_diagonal`).
        tol: Newton's tolerance (nats).
        max_evaluations: Newton's evaluation budget.

    Returns:
        The optimum.

    Raises:
        ValueError: See :func:`g_prior_offsets`.
    """
    offsets = g_prior_offsets(diagonal, evidence.prior).to(evidence.prior.log_precision.device)
    current = {n: t.detach().to(torch.float64) for n, t in evidence.hyperparameters().items()}
    learned = [n for n in evidence.learnable() if n != "log_precision"]
    initial = {"log_scale": (current["log_precision"] - offsets).mean(), **{n: current[n].clone() for n in learned}}

    def full(values: Dict[str, Tensor]) -> Dict[str, Tensor]:
        rest = {n: v for n, v in values.items() if n != "log_scale"}
        return {**current, **rest, "log_precision": values["log_scale"] + offsets}

    solution = solvers.newton(lambda v: evidence.log_marglik_at(full(v)), initial, tol=tol,
                              max_evaluations=max_evaluations)
    values = {n: v.detach() for n, v in full(solution.values).items() if n == "log_precision" or n in learned}
    return GPriorSolution(solution.value, solution.values["log_scale"], values, bool(solution.converged))
