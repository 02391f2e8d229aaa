"""The set-up analysis: what an estimating callback decides before the first step, and why.

Two moments. :func:`check_fit` runs in Lightning's ``setup`` (before the optimizers and data exist): the
model, the processes, the strategy's sharding, stock early stopping, the model's ``forward``, a named
evidence loader, and (``MargLikCallback``) weight averaging and the training statistics' needs.
:func:`analyse_setup` runs when training starts, on one evidence batch: the hyperparameters are finite, the
batch goes through ``forward`` and fits the targets (``MargLikCallback``: the same forward finds the output
layer, treated below), the scale-invariant tensors are treated, the evidence
pass runs on the batch (and resolves ``mc_samples="auto"`` into the estimator every later pass is given),
and (``MargLikCallback``) the cost is checked and the biases and the output layer are treated. Its
:class:`SetupAnalysis` records what it decided, as :func:`.report.setup_line` prints it, and the first
training batch follows its scale-invariance decision into the modes training really runs
(:meth:`SetupAnalysis.follow_training_modes`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional

import torch

from ..curvature import CurvatureOptions, check_model
from ..curvature.scale_invariance import training_modes
from . import checks
from .averaging import WeightAveragingFollower
from .cost import CostCheck
from .data import named_loader_method
from .output_layer import treat_output_layer
from .package import LightningModule, MargLikConfigurationError, Trainer
from .sharding import check_strategy, whole_parameters

__all__ = ["SetupAnalysis", "analyse_setup", "check_fit"]


@dataclasses.dataclass
class SetupAnalysis:
    """What set-up decided on the set-up batch, and why.

    Attributes:
        options: The curvature the estimates run: the requested one, ``mc_samples="auto"`` resolved.
        estimator: Which GGN estimator the estimates run, and why (with the structures' notes), as the set-up
            batch's pass resolved it.
        batch: The set-up batch, as the evidence data yield it.
        inputs: Its model inputs, on the prior's device and dtype.
        output: The set-up batch's eval-mode outputs (the target checks' shape).
        plan: The set-up batch's evidence-pass statistics, kept where the training statistics take their
            layout (``None`` otherwise: they are as large as the curvature).
        seconds: Wall time of the set-up batch's evidence pass.
        output_decision: What was decided for the output layer, and why (``MargLikCallback``'s; ``None``
            for a callback without an ``output_layer`` treatment).
        scale_modes: The module modes the scale-invariance decision assumed (``None``: Lightning's training
            modes, every module training).
        scale_note: The scale-invariance warning, given once the modes training runs are known.
        modes_followed: Whether this fit's training batches have been checked for their modes.
    """

    options: CurvatureOptions
    estimator: str
    batch: Any
    inputs: Any
    output: torch.Tensor
    plan: Any
    seconds: float
    output_decision: Optional[Dict[str, Any]] = None
    scale_modes: Optional[Dict[str, bool]] = None
    scale_note: Optional[str] = None
    modes_followed: bool = False

    def follow_training_modes(self, trainer: Trainer, pl_module: LightningModule, callback: Any) -> Optional[str]:
        """Decide the scale-invariant tensors again if training runs modules in other modes than the
        set-up assumed (e.g. a BatchNorm kept in eval mode); returns the one warning still to give.

        Args:
            trainer: The trainer (under FSDP every rank enters with whole weights).
            pl_module: The module as training runs it.
            callback: The callback (its prior and ``scale_invariant`` treatment).

        Returns:
            The scale-invariance warning not given yet, or ``None``.
        """
        modes = training_modes(pl_module)
        assumed = self.scale_modes if self.scale_modes is not None else dict.fromkeys(modes, True)
        if modes != assumed:
            prior, _ = callback._hyperparameters()
            with whole_parameters(trainer):  # the same modes on every rank: all enter it
                self.scale_note = checks.follow_training_modes(
                    pl_module, prior, self.inputs, callback.scale_invariant, assumed, modes
                )
            self.scale_modes = modes
        note, self.scale_note = self.scale_note, None
        return note


def check_fit(
    callback: Any, trainer: Trainer, pl_module: LightningModule, averaging: Optional[WeightAveragingFollower] = None,
    training_statistics: bool = False,
) -> None:
    """What Lightning's ``setup`` of a fit can check before the optimizers and data exist.

    Args:
        callback: The estimating callback, its prior and likelihood found.
        trainer: The trainer of the fit.
        pl_module: The module it trains.
        averaging: ``MargLikCallback``'s follower of Lightning's weight averaging, set up on the trainer's
            averaging callbacks (``None``: none).
        training_statistics: Whether the estimates take the training passes' sums (``statistics="training"``).

    Raises:
        MargLikConfigurationError: On a model, strategy, callback order or setting the evidence cannot take,
            naming the fix.
    """
    try:
        check_model(pl_module, callback.prior, callback.options)
    except ValueError as err:  # the engine's message names the module and a structure that works
        raise MargLikConfigurationError(str(err)) from err
    checks.check_processes(callback.options, trainer)
    check_strategy(callback, trainer)
    if averaging is not None:  # before the stock monitors: weight averaging names what works beside it
        averaging.setup(trainer, callback)
    who = f"{type(callback).__name__}({callback.schedule.describe()})"
    checks.check_stock_monitors(trainer, who, callback.schedule.every_epoch())
    checks.check_model_forward(pl_module, callback._package)
    if isinstance(callback.dataloader, str):
        named_loader_method(callback.dataloader, trainer, pl_module)  # a wrong name fails now, not after burn-in
    if training_statistics:
        checks.check_training_statistics(trainer, pl_module)


def analyse_setup(
    callback: Any, trainer: Trainer, pl_module: LightningModule, cost: Optional[CostCheck] = None,
    biases: Optional[str] = None, output_layer: Optional[str] = None,
) -> SetupAnalysis:
    """Everything the evidence needs, decided on one evidence batch when training starts.

    Args:
        callback: The estimating callback (its prior, likelihood, requested options, seed, evidence data).
        trainer: The trainer of the fit.
        pl_module: The module it trains.
        cost: ``MargLikCallback``'s cost check, set up on the batch (``None``: none).
        biases: ``MargLikCallback``'s ``biases`` treatment (with ``output_layer`` given).
        output_layer: ``MargLikCallback``'s ``output_layer`` treatment (``None``: the output layer is not
            treated, nor are the biases).

    Returns:
        The record of what was decided (``callback.options`` is set to its ``options``).

    Raises:
        MargLikConfigurationError: On hyperparameters, a batch, outputs or an evidence pass the evidence
            cannot take, naming the fix.
    """
    prior, likelihood = callback._hyperparameters()
    dtype, device = prior.params[0].dtype, prior.params[0].device
    checks.check_finite_hyperparameters(prior, likelihood, dtype)
    batch = callback._first_batch(trainer, pl_module, warn=True)
    # one forward for the target check and, where the output layer is treated, its search
    inputs, output, found = checks.check_forward(pl_module, likelihood, batch, callback._batch_fn(pl_module), device,
                                                 dtype, output_layer=output_layer is not None)
    # decided in Lightning's training modes; the first training batch re-checks them (follow_training_modes)
    scale_note = checks.treat_scale_invariant(pl_module, prior, inputs, callback.scale_invariant)
    started = time.perf_counter()
    try:  # the evidence pass itself on this batch, exact per-example path included (e.g. what vmap refuses)
        stats = callback._collect(pl_module, [batch], callback.requested_options, torch.Generator().manual_seed(callback.seed))
    except (ValueError, RuntimeError) as err:
        raise MargLikConfigurationError(f"MargLikCallback, one evidence batch through the evidence pass: {err}") from err
    # the pass resolved mc_samples="auto" from the outputs (curvature.estimator): the estimates run what it ran
    callback.options = stats.options
    analysis = SetupAnalysis(
        stats.options, stats.estimator, batch, inputs, output,
        # sums as large as the curvature: kept through training only where the training statistics take their layout
        stats if callback._training is not None else None, time.perf_counter() - started, scale_note=scale_note,
    )
    if cost is not None:
        cost.setup(callback, pl_module, analysis)
    if output_layer is not None:
        # declared when training starts, as the scale-invariant treatment: resumes get them again
        checks.treat_biases(prior, biases)
        assert found is not None  # check_forward found it (output_layer given)
        analysis.output_decision = treat_output_layer(pl_module, prior, found, output_layer)
    return analysis
