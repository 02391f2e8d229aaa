"""Say it before paying it: one warning when a run would cost more than twice one without the callback,
whatever chose the estimator (``mc_samples="auto"`` included).

The README promises that a run with the callback costs at most about twice a run without it. An estimate
that costs ``e`` training epochs, every ``frequency`` epochs, makes a run cost ``e / frequency + 1`` runs
without the callback: above 2 is warned about, once per fit, naming ``e`` and the cheaper settings that fit
what was chosen (:func:`cost_message`), unless an estimate takes under :data:`MIN_SECONDS` (a toy's: its cost
is negligible, and its ratio to an epoch of milliseconds is noise). Any setting can break the bound: the
exact GGN over many outputs (an explicit ``mc_samples=0``, or ``"auto"``'s exact GGN at 11 classes with
``frequency=1``), ``structure="full"`` over many parameters, a large output layer's Kronecker factor.
:class:`CostCheck` measures ``e`` in three steps, the cheap way first:

1. At set-up: the set-up batch's evidence pass against a forward and backward pass of that batch. Both err
   toward a costly estimate (the set-up pass also plans; a training step also steps the optimizer and runs
   Lightning's loop): within the bound, no more passes are timed.
2. Otherwise the pass is timed again on that batch, once alone and once twice over: the difference is one
   batch's pass without the planning. At the first epoch's end, before its estimate, against that epoch's wall
   time per training batch (its first batch left out), it predicts ``e``, assuming an evidence pass reads as
   many batches as a training epoch (the default evidence data).
3. The first estimate itself, against the first epoch's wall time: the measured ``e``, the estimate's fixed
   work (the hyperparameter steps, decompositions, logging) included, where step 2 did not warn.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ..curvature import CurvatureOptions, eval_mode
from ..curvature.batches import call_model
from .data import isolate_rng
from .package import LightningModule

__all__ = ["MIN_SECONDS", "CostCheck", "cost_message", "training_step_seconds"]

#: Wall time below which an estimate is not warned about, whatever its ratio to a training epoch: on a loaded
#: 2-core machine a toy's 2-batch epoch measured 3 ms in one fit and 15 ms in the next, and its 20-50 ms
#: estimate adds seconds to a whole run.
MIN_SECONDS = 1.0


def _now(device: torch.device) -> float:
    """The clock once the accelerator's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _seconds(work: Callable[[], Any], device: torch.device) -> float:
    """Wall time of ``work()``, the accelerator's queue included."""
    started = _now(device)
    work()
    return _now(device) - started


def training_step_seconds(model: torch.nn.Module, inputs: Any, params: List[torch.Tensor]) -> float:
    """Wall time of one forward and backward pass of ``inputs`` through ``model``: a training step's work
    (in eval mode: a BatchNorm's running statistics stay as they are)."""

    def step() -> None:
        with eval_mode(model), torch.enable_grad():
            output = call_model(model, inputs)
            torch.autograd.grad(output.float().sum(), params, allow_unused=True)

    return _seconds(step, params[0].device)


def cost_message(
    who: str, estimator: str, options: CurvatureOptions, columns: int, frequency: int, estimate_epochs: float,
    estimate_seconds: float, basis: str = "measured", adam_steps: int = 0,
) -> Optional[str]:
    """The warning for a run predicted above twice a run without the callback, or ``None`` (also for an
    estimate under :data:`MIN_SECONDS`).

    Args:
        who: The callback, as the message names it.
        estimator: Which GGN estimator runs, and why (the callback's ``estimator``).
        options: The curvature the estimates run (``mc_samples`` resolved).
        columns: Backward passes the evidence pass takes per batch.
        frequency: Epochs between estimates.
        estimate_epochs: One estimate's cost in training epochs.
        estimate_seconds: Its wall time.
        basis: How ``estimate_epochs`` was found, for the message.
        adam_steps: The Adam steps of an estimate under ``solver="adam"`` (0: the Newton solver).

    Returns:
        One message with the estimate's cost, the run's predicted cost and the cheaper settings that apply.

    Example:
        >>> options = CurvatureOptions("kron", "ggn", 0)
        >>> message = cost_message("MargLikCallback", "auto: the exact GGN", options, 10, 1, 2.5, 30.0)
        >>> print(message)  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        MargLikCallback: one estimate costs about 2.5 training epochs, 30 s (...), so a run at frequency=1 costs
        about 3.5x one without the callback, more than 2x; cheaper: mc_samples=1 (one backward pass per batch
        instead of 10), or frequency=3.
        >>> cost_message("MargLikCallback", "auto: the exact GGN", options, 10, 3, 2.5, 30.0) is None
        True
    """
    if estimate_epochs / frequency + 1 <= 2 or estimate_seconds < MIN_SECONDS:
        return None
    cheaper = []
    if options.approx == "ggn" and not options.mc_samples and columns > 1:
        cheaper.append(f"mc_samples=1 (one backward pass per batch instead of {columns})")
    if options.structure == "full":
        cheaper.append("structure='kron' (a Kronecker factor per layer, not a P x P matrix)")
    elif options.structure == "ekfac":
        cheaper.append("structure='kron' (one pass over the evidence data, not two)")
    if adam_steps:
        cheaper.append(f"solver='newton' (a few Newton steps, not {adam_steps} Adam steps)")
    cheaper.append(f"frequency={math.ceil(estimate_epochs)}")
    return (
        f"{who}: one estimate costs about {estimate_epochs:.1f} training epochs, {estimate_seconds:.3g} s "
        f"({estimator}; structure={options.structure!r}; {basis}), so a run at frequency={frequency} costs about "
        f"{estimate_epochs / frequency + 1:.1f}x one without the callback, more than 2x; cheaper: "
        f"{', or '.join(cheaper)}."
    )


class CostCheck:
    """One fit's cost check of ``MargLikCallback`` (the module's three steps); it warns at most once.

    Attributes:
        pass_seconds: One batch's evidence pass without the planning (step 2; ``None``: within the bound at
            set-up, or no pass: ``statistics="training"``).
        epoch_seconds: The first epoch's wall time (``None`` before its end).
        estimate_epochs: One estimate's cost in training epochs: step 2's prediction, then step 3's measurement
            (``None`` before either).
    """

    def __init__(self) -> None:
        self.pass_seconds: Optional[float] = None
        self.epoch_seconds: Optional[float] = None
        self.estimate_epochs: Optional[float] = None
        self._warned = False
        self._columns = 0
        self._device = torch.device("cpu")
        self._starts: List[float] = []  # the first epoch's first two batch starts
        self._batches = 0

    def setup(self, callback: Any, pl_module: LightningModule, analysis: Any) -> None:
        """Step 1, and step 2's timing of the pass where step 1 finds the estimate costly, on the set-up batch
        (:class:`~.setup_analysis.SetupAnalysis`: its inputs, outputs, options and pass time)."""
        prior, likelihood = callback._hyperparameters()
        self._device = prior.params[0].device
        options = analysis.options
        self._columns = likelihood.factor_columns(analysis.output.shape, options.approx, int(options.mc_samples))
        if callback.statistics != "pass":  # the sums come from the training passes: no pass to pay
            return
        step = training_step_seconds(pl_module, analysis.inputs, prior.params)
        if analysis.seconds <= callback.frequency * step:
            return
        batch = analysis.batch

        def collect(copies: int) -> float:
            generator = torch.Generator().manual_seed(callback.seed)
            return _seconds(lambda: callback._collect(pl_module, [batch] * copies, options, generator), self._device)

        # backpack draws from the global generator; the pass's own warnings were given by the set-up pass
        with isolate_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            alone = collect(1)
            self.pass_seconds = max(collect(2) - alone, 0.0)

    def batch_start(self) -> None:
        """A training batch starts: the first epoch's are timed."""
        if self.epoch_seconds is None:
            if self._batches < 2:
                self._starts.append(_now(self._device))
            self._batches += 1

    def epoch_end(self, callback: Any) -> None:
        """An epoch ends, before its estimate: the first one's wall time, and step 2's prediction."""
        if self.epoch_seconds is not None or not self._batches:
            return
        timed = self._batches - (len(self._starts) - 1)  # the first batch left out where there are others
        per_batch = max((_now(self._device) - self._starts[-1]) / timed, 1e-9)
        self.epoch_seconds = per_batch * self._batches
        if self.pass_seconds is not None:
            self._check(callback, self.pass_seconds / per_batch, self.pass_seconds * self._batches,
                        "predicted: the first batch's evidence pass against the first epoch's training batches")

    @contextmanager
    def estimating(self, callback: Any) -> Iterator[None]:
        """Time an estimate: the first one after the first epoch is step 3."""
        measure = self.epoch_seconds is not None and not self._warned and callback.estimations == 0
        started = _now(self._device)
        yield
        if measure:
            assert self.epoch_seconds is not None
            seconds = _now(self._device) - started
            basis = "measured: the first estimate against the first epoch"
            self._check(callback, seconds / self.epoch_seconds, seconds, basis)

    def _check(self, callback: Any, estimate_epochs: float, estimate_seconds: float, basis: str) -> None:
        self.estimate_epochs = estimate_epochs
        message = cost_message(
            type(callback).__name__, callback.estimator, callback.options, self._columns, callback.frequency,
            estimate_epochs, estimate_seconds, basis, callback.steps if callback.solver == "adam" else 0,
        )
        if message and not self._warned:
            rank_zero_warn(message)
            self._warned = True
