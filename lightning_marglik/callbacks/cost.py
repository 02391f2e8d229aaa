"""Say it before paying it: one warning at set-up when an explicit setting breaks the cost bound.

The README promises that a run with the callback costs at most about twice a run without it: an
estimate every ``frequency`` epochs may cost up to ``frequency`` training epochs. Two explicit
settings can break that by far, and only they are checked: the exact GGN (``mc_samples=0``) where it
takes more than :data:`~lightning_marglik.curvature.estimator.EXACT_COLUMNS` backward passes per
batch (many classes, token outputs), and ``structure="full"`` over many parameters. The cost is
measured on the set-up batch: its evidence pass against a forward and backward pass of the same
batch (the set-up pass also plans, so the figure errs high).
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence

import torch

from ..curvature import CurvatureOptions, eval_mode
from ..curvature.batches import call_model
from ..curvature.estimator import AUTO, EXACT_COLUMNS
from ..hyperparameters import GaussianPrior, Likelihood

__all__ = ["FULL_PARAMETERS", "cost_warning", "training_step_seconds"]

#: Parameters above which ``structure="full"`` (a ``P x P`` matrix and its factorisation) is checked.
FULL_PARAMETERS = 5_000


def training_step_seconds(model: torch.nn.Module, inputs: Any, params: List[torch.Tensor]) -> float:
    """Wall time of one forward and backward pass of ``inputs`` through ``model``: a training step's work
    (in eval mode: a BatchNorm's running statistics stay as they are)."""
    started = time.perf_counter()
    with eval_mode(model), torch.enable_grad():
        output = call_model(model, inputs)
        torch.autograd.grad(output.float().sum(), params, allow_unused=True)
    return time.perf_counter() - started


def cost_warning(
    requested: CurvatureOptions, options: CurvatureOptions, likelihood: Likelihood, prior: GaussianPrior,
    output_shape: Sequence[int], frequency: int, pass_seconds: float, step_seconds: Callable[[], float],
) -> Optional[str]:
    """The warning for a setting that breaks the cost bound, or ``None``.

    Args:
        requested: The options as the user gave them.
        options: The options the estimates run (``mc_samples`` resolved).
        likelihood: Counts the factor's columns.
        prior: Its parameters count for ``structure="full"``.
        output_shape: The set-up batch's output shape.
        frequency: Epochs between estimates.
        pass_seconds: Wall time of the set-up batch's evidence pass.
        step_seconds: Measures a training step on the same batch (called only when a setting is suspect).

    Returns:
        One message naming the expected cost in training epochs and the cheaper setting, or ``None``.
    """
    if options.structure == "full" and sum(prior.param_sizes) > FULL_PARAMETERS:
        what = f"structure='full' over {sum(prior.param_sizes):,} parameters (a P x P matrix)"
        cheaper = "structure='kron' (the default) costs a few training epochs"
    elif requested.mc_samples != AUTO and options.approx == "ggn" and not options.mc_samples:
        columns = likelihood.factor_columns(output_shape, options.approx, 0)
        if columns <= EXACT_COLUMNS:
            return None
        what = f"mc_samples=0: the exact GGN takes {columns} backward passes per batch for outputs {tuple(output_shape[1:])}"
        cheaper = "mc_samples='auto' (the default: the Monte-Carlo GGN here) costs one"
    else:
        return None
    epochs = pass_seconds / max(step_seconds(), 1e-9)
    if epochs <= frequency:
        return None
    return (
        f"MargLikCallback({what}): one estimate costs about {epochs:.0f} training epochs (measured on the first "
        f"batch), more than frequency={frequency} allows for a run within twice one without the callback; {cheaper}."
    )
