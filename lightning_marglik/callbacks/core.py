"""The core of the callbacks that estimate the evidence: hooks, the estimate, resume.

:class:`EstimatorCore` is what ``MargLikCallback`` and ``MargLikBoundCallback`` share: the
set-up checks (:mod:`.checks`), the count of ``N`` stored on the prior, the record of estimates
(``history``, last and best) and their :mod:`schedule <.schedule>`, the logged values and the
checkpoint state. :class:`MargLikCallbackCore` adds Algorithm 1: the evidence pass after the
epochs an :class:`~.schedule.EpochSchedule` names, or the training passes' own sums
(``statistics="training"``, :mod:`.training_statistics`), and the hyperparameter steps.
The set-up check's, the first training batch's and the estimates' evidence passes all call
``collect_statistics`` from this module (:meth:`EstimatorCore._collect`), where tests and benchmarks count them.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages
from torch.utils.data import DataLoader

from ..curvature import CurvatureOptions, check_model, collect_statistics, with_notes
from ..curvature.batches import move, split_batch
from ..curvature.estimator import resolve_mc_samples
from ..curvature.scale_invariance import training_modes
from ..curvature.structures.sharded import Exchange
from ..denormals import DenormalFlush
from ..diagnostics import ef_ratio_of, ef_unreliable_message
from ..distributed import reduce_statistics, run_on_all_ranks, sharded_pass
from ..evidence import SOLVERS, LaplaceEvidence, require_data
from ..folding import Folded, fold_batchnorm
from ..hyperparameters import SCALE_INVARIANT_TREATMENTS, TREATMENTS, GaussianPrior, Likelihood, learnable_values
from ..runaway import runaway_message, runaway_precisions
from ..validators import choice, flag, integer, number, optional
from . import checks
from .arguments import CALLBACK_KEYWORDS, KnownKeywords
from .averaging import WeightAveragingFollower
from .cost import CostCheck
from .data import count_data, evidence_batches, isolate_rng, named_loader_method
from .epoch_loss import EpochLoss
from .fit_record import FitRecord
from .logged import log_after_training, logged_values
from .output_layer import treat_output_layer
from .package import MONITOR, LightningModule, LightningPackage, MargLikConfigurationError, Trainer, check_package, find_hyperparameters
from .prior_in_loss import PriorInLossCheck
from .progress import progress
from .report import announce_end, announce_setup
from .resume import follow_changed_learnables
from .schedule import EpochSchedule, Schedule, SettledSchedule
from .sharding import check_strategy, shards_parameters, whole_parameters
from .training_statistics import TrainingStatistics

__all__ = ["EstimatorCore", "MargLikCallbackCore"]


class EstimatorCore(KnownKeywords):
    """What the callbacks that estimate the evidence share, combined with a package's ``Callback``.

    Args:
        options: The curvature of the set-up check's evidence pass (and of the estimates).
        schedule: When estimates are due; it records each.
        lr: Learning rate of the hyperparameter steps.
        seed: Seed of the Monte-Carlo samples.
        scale_invariant: Treatment of the scale-invariant tensors.
        dataloader: The evidence data (``None``: the training data).
        flush_denormals: Flush denormal floats to zero on the CPU from ``on_fit_start`` to ``teardown`` of a
            fit (:mod:`lightning_marglik.denormals`).

    Raises:
        ValueError: On an invalid argument (the message names it).
    """

    _package: ClassVar[LightningPackage]
    # statistics="training" (MargLikCallback's option): they take the set-up batch's sums as their layout
    _training: Optional[TrainingStatistics] = None

    # state_dict key -> attribute; every key is optional in load_state_dict (default: a fresh fit's value).
    # The schedule's record travels with them (Schedule.state_dict).
    _STATE = {
        "estimations": "estimations",
        "last_marglik": "last_marglik",
        "best_marglik": "best_marglik",
        "best_epoch": "best_epoch",
        "history": "history",
        "optimizer_state": "_optimizer_state",
        "optimizer_signature": "_optimizer_signature",
    }

    def __init__(
        self, options: CurvatureOptions, schedule: Schedule, lr: float, seed: int, scale_invariant: str,
        dataloader: Union[DataLoader, str, None] = None, flush_denormals: bool = True,
    ) -> None:
        super().__init__()
        # as asked; ``options`` is what runs: mc_samples="auto" is resolved from the outputs at each fit's set-up
        self.requested_options = self.options = options
        self.structure, self.approx, self.mc_samples = options.structure, options.approx, options.mc_samples
        self.estimator = ""  # which GGN estimator the estimates run, and why (decided at set-up)
        self.schedule = schedule
        self.burnin = schedule.burnin
        self.lr = number(lr, "lr")
        if dataloader is not None and not isinstance(dataloader, (DataLoader, str)):
            raise ValueError(f"`dataloader` must be a DataLoader or a method name, got {type(dataloader).__name__}.")
        self.dataloader = dataloader
        self.seed = integer(seed, "seed", 0)
        self.scale_invariant = choice(scale_invariant, SCALE_INVARIANT_TREATMENTS, "scale_invariant")
        self.flush_denormals = flag(flush_denormals, "flush_denormals")
        self._flush = DenormalFlush(self.flush_denormals)
        self.prior: Optional[GaussianPrior] = None
        self.likelihood: Optional[Likelihood] = None
        self._setup_plan: Any = None  # the set-up batch's evidence-pass statistics (their structures' layout)
        self._setup_seconds = 0.0  # wall time of the set-up batch's evidence pass (the cost warning measures by it)
        # the set-up batch's inputs, the modes the scale-invariance analysis assumed (None: Lightning's training
        # modes) and its warning, given at the first training batch once the modes training uses are known
        self._scale_inputs: Any = None
        self._scale_modes: Optional[Dict[str, bool]] = None
        self._scale_note: Optional[str] = None
        self._modes_followed = False  # whether this fit's training batches have been checked for their modes
        self._fit_record = FitRecord()  # the previous fit's record, through a fit that trains nothing
        self._reset_state()

    def _reset_state(self) -> None:
        """The state of a fit that has not estimated yet."""
        self.estimations = 0
        self.last_marglik = math.nan
        self.best_marglik = -math.inf
        self.best_epoch = -1
        self.final_marglik = math.nan
        self.history: List[Dict[str, float]] = []
        self.summary: Optional[Dict[str, Any]] = None  # the facts of the fit's end (report.summarize)
        self._counted_loader: Any = None  # the training loader N was counted on (a reload counts again)
        self._target_like: Optional[torch.Tensor] = None  # outputs of one evidence batch, for the target checks
        self._warned_runaway: Set[str] = set()  # the tensors a run-away warning named in this fit
        self._prior_in_loss = PriorInLossCheck(type(self).__name__)  # decided on this fit's first training batch
        self._optimizer_state: dict = {}
        # the hyperparameters the Adam state belongs to (_learnable_signature)
        self._optimizer_signature: Optional[List[Tuple[str, List[int], List[str]]]] = None
        self.schedule.reset()

    @property
    def last_estimate_epoch(self) -> int:
        """``trainer.current_epoch`` of the latest estimate (-1 before the first)."""
        return self.schedule.last_epoch

    def is_fresh(self, trainer: Trainer) -> bool:
        """Whether ``marglik`` was estimated in the epoch now ending."""
        return self.schedule.is_fresh(trainer)

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_package(self, trainer)
        if stage != "fit":
            return
        # Every fit starts afresh: the Adam state and history of another model must not carry over.
        # Lightning restores a checkpoint (load_state_dict) after setup, so a resumed fit gets its state back.
        self._fit_record.keep(self)
        self._reset_state()
        self.prior, self.likelihood = find_hyperparameters(pl_module)
        try:
            check_model(pl_module, self.prior, self.options)
        except ValueError as err:  # the engine's message names the module and a structure that works
            raise MargLikConfigurationError(str(err)) from err
        checks.check_processes(self.options, trainer)
        check_strategy(self, trainer)
        who = f"{type(self).__name__}({self.schedule.describe()})"
        checks.check_stock_early_stopping(trainer, who, self.schedule.every_epoch())
        checks.check_model_forward(pl_module, self._package)
        if isinstance(self.dataloader, str):
            named_loader_method(self.dataloader, trainer, pl_module)  # a wrong name fails now, not after burn-in

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        checks.check_weight_decay(trainer, self._hyperparameters()[0])  # before training: the optimizers exist
        # from here to teardown (or an exception), set-up check and training included: weights the evidence
        # shrinks turn denormal. Not in setup, which a test or a tool may call alone and leave the mode set
        self._flush.start()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._end_fit()
            message = self._fit_record.end(self, trainer)
            if message:
                rank_zero_warn(message)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end_fit()  # Lightning calls no callback teardown after an exception

    def _end_fit(self) -> None:
        """Undo what the fit changed outside the callback: the CPU's denormal mode, and the prior's record of
        its penalty (it records none outside the fit)."""
        self._flush.stop()
        self._prior_in_loss.stop()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check everything the evidence needs, before the first step (the training data exist from here)."""
        self._fit_record.drop()
        self._count_data(trainer, pl_module, lambda: self._check_setup(trainer, pl_module))
        self._follow_changed_learnables()  # after the set-up check, which decides the scale-invariant treatment
        announce_setup(self)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # reload_dataloaders_every_n_epochs: the N of the loss follows the loader this epoch draws from
        if self.dataloader is None and trainer.train_dataloader is not self._counted_loader:
            self._count_data(trainer, pl_module, lambda: self._target_like)

    def _count_data(self, trainer: Trainer, pl_module: LightningModule, like: Callable[[], torch.Tensor]) -> None:
        """Count ``N`` over the evidence data of every rank and store it on the prior; ``like()`` gives
        outputs whose shape the targets must fit (the set-up check's)."""
        _, likelihood = self._hyperparameters()

        def local() -> int:  # one rank's failure (e.g. its shard's first batch) is raised on every rank
            self._target_like = like()
            return count_data(self.dataloader, trainer, pl_module, likelihood, self._batch_fn(pl_module), self._target_like)

        strategy = trainer.strategy
        with whole_parameters(trainer):  # under FSDP: the check's forwards need whole weights, on every rank
            n_data = strategy.reduce(torch.tensor(run_on_all_ranks(strategy, local), device=strategy.root_device), reduce_op="sum")
        self._record_n_data(int(n_data))
        self._counted_loader = trainer.train_dataloader

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # an epoch's first batch (the user's on_train_epoch_start hooks have set its modes), or the fit's first
        # (a resume within an epoch starts past batch 0)
        if batch_idx == 0 or not self._modes_followed:
            self._follow_training_modes(trainer, pl_module)
            self._modes_followed = True
        self._prior_in_loss.batch_start(self._hyperparameters()[0])

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._prior_in_loss.before_backward(loss)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        message = self._prior_in_loss.batch_end()
        if message:
            rank_zero_warn(message)

    def _follow_training_modes(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Decide the scale-invariant tensors again if training runs modules in other modes than the
        set-up check assumed (e.g. a BatchNorm kept in eval mode), then give the one warning."""
        modes = training_modes(pl_module)
        assumed = self._scale_modes if self._scale_modes is not None else dict.fromkeys(modes, True)
        if modes != assumed and self._scale_inputs is not None:
            prior, _ = self._hyperparameters()
            with whole_parameters(trainer):  # the same modes on every rank: all enter it
                self._scale_note = checks.follow_training_modes(
                    pl_module, prior, self._scale_inputs, self.scale_invariant, assumed, modes
                )
            self._scale_modes = modes
        if self._scale_note:
            rank_zero_warn(self._scale_note)
            self._scale_note = None

    def _follow_changed_learnables(self) -> None:
        """After a resume (:func:`.resume.follow_changed_learnables`)."""
        prior, likelihood = self._hyperparameters()
        saved, state = self._optimizer_signature, bool(self._optimizer_state)
        if follow_changed_learnables(prior, likelihood, saved, self._learnable_signature(), state):
            self._optimizer_state, self._optimizer_signature = {}, None

    def _check_setup(self, trainer: Trainer, pl_module: LightningModule) -> torch.Tensor:
        """Everything the evidence needs, on one evidence batch; returns that batch's outputs."""
        prior, likelihood = self._hyperparameters()
        dtype, device = prior.params[0].dtype, prior.params[0].device
        checks.check_finite_hyperparameters(prior, likelihood, dtype)
        batch = self._first_batch(trainer, pl_module, warn=True)
        inputs, output = checks.check_forward(pl_module, likelihood, batch, self._batch_fn(pl_module), device, dtype)
        # decided in Lightning's training modes; the first training batch re-checks them (_follow_training_modes)
        self._scale_inputs, self._scale_modes, self._modes_followed = inputs, None, False
        self._scale_note = checks.treat_scale_invariant(pl_module, prior, inputs, self.scale_invariant)
        mc_samples, self.estimator = resolve_mc_samples(self.requested_options.mc_samples, self.approx, likelihood, output.shape)
        self.options = dataclasses.replace(self.requested_options, mc_samples=mc_samples)
        started = time.perf_counter()
        try:  # the evidence pass itself on this batch, exact per-example path included (e.g. what vmap refuses)
            stats = self._collect(pl_module, [batch], self.options, torch.Generator().manual_seed(self.seed))
        except (ValueError, RuntimeError) as err:
            raise MargLikConfigurationError(f"MargLikCallback, one evidence batch through the evidence pass: {err}") from err
        self.estimator = with_notes(self.estimator, stats.structures)  # e.g. a diagonal output factor
        # sums as large as the curvature: kept through training only where the training statistics take their layout
        self._setup_plan = stats if self._training is not None else None
        self._setup_seconds = time.perf_counter() - started
        return output

    # --- estimates ---------------------------------------------------------------------------

    def _collect(
        self, pl_module: LightningModule, batches: Iterable, options: CurvatureOptions,
        generator: Optional[torch.Generator] = None, on_batch: Optional[Callable[[int], None]] = None,
        prior: Optional[GaussianPrior] = None, exchange: Optional[Exchange] = None,
    ) -> Any:
        """This rank's curvature statistics of ``batches`` at the current weights (the evidence pass), under
        the callback's prior or ``prior`` (a folded copy's, :meth:`fold_batchnorm`); with ``exchange``, the
        layer-owned statistics summed onto their owners during the pass (sharded training)."""
        own, likelihood = self._hyperparameters()
        return collect_statistics(
            pl_module, batches, likelihood, own if prior is None else prior, generator=generator, batch_fn=self._batch_fn(pl_module),
            on_batch=on_batch, options=options, exchange=exchange,
        )

    def _record_estimate(self, trainer: Trainer, epoch: int, marglik: float, **extra: Any) -> float:
        """Book an estimate after ``epoch`` (counted from 1): history, last and best (never NaN)."""
        self.estimations += 1
        self.schedule.record(trainer, epoch)
        self.last_marglik = marglik
        if marglik > self.best_marglik:  # False for NaN
            self.best_marglik, self.best_epoch = marglik, epoch - 1
        self.history.append({"epoch": epoch, "step": trainer.global_step, MONITOR: marglik, **extra})
        self._warn_runaway()
        return marglik

    def _warn_runaway(self) -> None:
        """Name, once per fit, each tensor whose learned precision has run away (:mod:`..runaway`)."""
        prior, _ = self._hyperparameters()
        rises = {name: rise for name, rise in runaway_precisions(prior).items() if name not in self._warned_runaway}
        if rises:
            rank_zero_warn(runaway_message(prior, rises, who=type(self).__name__))
            self._warned_runaway.update(rises)

    def _log(self, pl_module: LightningModule, marglik: float) -> None:
        for key, value in self.logged_values(marglik).items():
            # identical on every rank: the sync is exact and keeps Lightning's DDP logging contract
            pl_module.log(key, value, prog_bar=key == MONITOR, on_step=False, on_epoch=True, sync_dist=True)

    def logged_values(self, marglik: float) -> Dict[str, float]:
        """What the callback logs for an estimate: ``marglik`` and every hyperparameter by name."""
        return logged_values(*self._hyperparameters(), marglik)

    # --- helpers -----------------------------------------------------------------------------

    def _hyperparameters(self) -> Tuple[GaussianPrior, Likelihood]:
        """The prior and likelihood found at set-up."""
        assert self.prior is not None and self.likelihood is not None
        return self.prior, self.likelihood

    def _record_n_data(self, n_data: int) -> None:
        """Store the evidence's ``N`` on the prior, where ``map_loss`` reads it; refuse data without a datum."""
        prior, likelihood = self._hyperparameters()
        try:
            require_data(n_data, likelihood)
        except ValueError as err:
            raise MargLikConfigurationError(f"MargLikCallback: {err} Or pass `dataloader=` data with labels.") from err
        prior.record_n_data(n_data)

    def _learnable_signature(self) -> List[Tuple[str, List[int], List[str]]]:
        """What the Adam steps optimize, in the engine's order: each hyperparameter's name and shape,
        and for ``log_precision`` the names of the tensors whose precision is learned (the same shape
        may hold other groups)."""
        prior, likelihood = self._hyperparameters()
        return [
            (name, list(value.shape), prior.learned_names() if name == "log_precision" else [])
            for name, value in learnable_values(prior, likelihood).items()
        ]

    @staticmethod
    def _batch_fn(pl_module: LightningModule) -> Optional[Callable[[Any], Any]]:
        method = getattr(pl_module, "marglik_batch", None)
        return method if callable(method) else None

    def _evidence_batches(self, trainer: Trainer, pl_module: LightningModule, warn: bool = False) -> Iterable:
        return evidence_batches(self.dataloader, trainer, pl_module, warn)

    def _first_batch(self, trainer: Trainer, pl_module: LightningModule, warn: bool = False) -> Any:
        """One evidence batch, drawn without shifting training's batch order (a shuffled loader's seed).

        Raises:
            MargLikConfigurationError: If the evidence data yield no batch.
        """
        try:
            with isolate_rng():
                return next(iter(self._evidence_batches(trainer, pl_module, warn=warn)))
        except StopIteration:
            raise MargLikConfigurationError("MargLikCallback: the evidence data loader yields no batches.") from None

    # --- resume ------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        state = {key: getattr(self, attribute) for key, attribute in self._STATE.items()}
        state["history"] = list(self.history)
        return {**state, **self.schedule.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a checkpoint's state; a key it lacks keeps a fresh fit's value."""
        self._reset_state()
        for key, attribute in self._STATE.items():
            if key in state_dict:
                setattr(self, attribute, state_dict[key])
        self.schedule.load_state_dict(state_dict)
        self.history = list(self.history)
        self._fit_record.drop()


class MargLikCallbackCore(EstimatorCore):
    """The logic of ``MargLikCallback`` (Algorithm 1), combined with a package's ``Callback``.

    Documented on ``lightning_marglik.MargLikCallback``; the subclass sets ``_package``.
    """

    schedule: EpochSchedule
    _foreign_keywords = CALLBACK_KEYWORDS

    def __init__(
        self,
        structure: str = "kron",
        approx: str = "ggn",
        frequency: int = 10,
        burnin: int = 0,
        steps: int = 100,
        lr: float = 0.1,
        mc_samples: Union[int, str] = "auto",
        dataloader: Union[DataLoader, str, None] = None,
        seed: int = 0,
        solver: str = "newton",
        backend: str = "hooks",
        scale_invariant: str = "decoupled",
        statistics: str = "pass",
        statistics_fraction: float = 1.0,
        max_step: Optional[float] = None,
        biases: Optional[str] = None,
        settle: Optional[float] = None,
        flush_denormals: bool = True,
        output_layer: str = "fixed",
    ) -> None:
        options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
        self.statistics = checks.check_statistics(statistics, options)
        self.statistics_fraction = checks.check_fraction(statistics_fraction, self.statistics)
        schedule = EpochSchedule(frequency, burnin) if settle is None else SettledSchedule(frequency, burnin, settle)
        self.settle = None if settle is None else schedule.settle  # type: ignore[attr-defined]
        self.frequency = schedule.frequency
        self.steps = integer(steps, "steps", 0)
        super().__init__(options, schedule, lr, seed, scale_invariant, dataloader, flush_denormals)
        self.solver = choice(solver, SOLVERS, "solver")
        self.max_step = optional(number, max_step, "max_step", what="the largest change of log delta per estimate, or None")
        self.biases = optional(choice, biases, TREATMENTS, "biases")
        self.output_layer = choice(output_layer, TREATMENTS, "output_layer")
        self.output_decision: Optional[Dict[str, Any]] = None  # what set-up decided for the output layer, and why
        # statistics='training': the sums of the training passes in estimation epochs
        self._training = TrainingStatistics(schedule, self.statistics_fraction) if self.statistics == "training" else None
        self._averaging = WeightAveragingFollower()  # keeps the hyperparameters out of Lightning's weight averages

    def _reset_state(self) -> None:
        super()._reset_state()
        self.evidence: Optional[LaplaceEvidence] = None
        self._warned_ef = False  # the empirical Fisher's curvature check warns once per fit
        self._epoch_loss = EpochLoss()  # the epoch's training loss, for a settle rule
        self._cost = CostCheck()  # warns once if a run would cost more than twice one without the callback

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._averaging.setup(trainer, self)
        if stage == "fit" and self._training is not None:
            checks.check_training_statistics(trainer, pl_module)

    def _check_setup(self, trainer: Trainer, pl_module: LightningModule) -> torch.Tensor:
        output = super()._check_setup(trainer, pl_module)
        prior, _ = self._hyperparameters()
        self._cost.setup(self, trainer, pl_module, output.shape)
        # declared when training starts, as the scale-invariant treatment: resumes get them again
        checks.treat_biases(prior, self.biases)
        self.output_decision = treat_output_layer(pl_module, prior, self._scale_inputs, self.output_layer)
        return output

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._training is not None:
            _, likelihood = self._hyperparameters()
            self._training.start(
                trainer, pl_module, likelihood, self._setup_plan, self._batch_fn(pl_module), self.dataloader
            )

    # --- Algorithm 1 -------------------------------------------------------------------------

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._cost.epoch_end(self)
        if self.schedule.needs_loss:  # the epoch's mean training loss over every rank (one collective, all ranks)
            strategy = trainer.strategy
            # an epoch without a loss (every step skipped) is NaN: it never counts as settled
            mean = torch.tensor(self._epoch_loss.mean, device=strategy.root_device)
            self.schedule.observe_loss(float(strategy.reduce(mean, reduce_op="mean")))
        if self.schedule.is_due(trainer):
            with self._cost.estimating(self):
                self._log(pl_module, self.estimate(trainer, pl_module, epoch=trainer.current_epoch + 1))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # weight averaging wrote the weights the fit returns (its callbacks run first): their evidence is owed
        if self.schedule.is_current(trainer) and not self._averaging.active:
            self.final_marglik = self.last_marglik
        else:  # trainer.current_epoch counts the completed epochs here
            self.final_marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch)
            log_after_training(trainer, self.logged_values(self.final_marglik), trainer.current_epoch)
        self.summary = announce_end(self)

    def estimate(self, trainer: Trainer, pl_module: LightningModule, epoch: int) -> float:
        """Evidence pass, all-reduce, ``steps`` hyperparameter steps; returns log evidence / N.

        Runs the same collectives on every rank. A non-finite evidence leaves the hyperparameters
        unchanged and returns NaN (``MargLikEarlyStopping`` stops on it, ``MargLikCheckpoint``
        skips it). Updates ``history``, ``last_marglik`` and ``best_marglik``/``best_epoch``.

        Args:
            trainer: The trainer (its strategy runs the collectives).
            pl_module: The module whose forward the evidence pass calls.
            epoch: Number of the epoch (from 1) the estimate follows, for ``history`` and the
                Monte-Carlo seed.

        Returns:
            The log evidence per datum after the hyperparameter steps (NaN if not finite).
        """
        strategy = trainer.strategy
        rank, world = trainer.global_rank, trainer.world_size
        # distinct Monte-Carlo draws on every rank, reproducible for a given (seed, epoch, rank)
        generator = torch.Generator().manual_seed((self.seed + epoch) * world + rank) if self.options.mc_samples else None
        evidence = self._evidence(trainer, pl_module, self.options, generator)
        self.evidence = evidence
        self._record_n_data(evidence.n_data)  # the N of map_loss follows the evidence (e.g. a stream's new masks)
        if not torch.isfinite(evidence.log_marglik().detach()):
            rank_zero_warn("The evidence is not finite at the current weights; hyperparameters left unchanged.")
            marglik = math.nan
        else:
            solution = evidence.optimize(
                self.steps, self.lr, state=self._optimizer_state, solver=self.solver, max_evaluations=max(self.steps, 1),
                max_step=self.max_step,
            )
            self._optimizer_state = solution.state
            self._optimizer_signature = self._learnable_signature()
            # rank 0's values everywhere: bit-identical hyperparameters on every rank
            evidence.set_hyperparameters(strategy.broadcast(solution.values, src=0))
            marglik = solution.value.item() / evidence.n_data
        extra = {}
        ratio = ef_ratio_of(evidence) if self.options.approx == "ef" else None  # from the pass's own sums
        if ratio is not None:
            extra["ef_curvature_ratio"] = ratio
            message = ef_unreliable_message({f"the model after epoch {epoch}": ratio}, where="callback")
            if message and not self._warned_ef:
                rank_zero_warn(message)
                self._warned_ef = True
        self._averaging.sync(pl_module)  # the averaged copies hold the learned values, not an average of them
        return self._record_estimate(trainer, epoch, marglik, **extra)

    def _evidence(
        self, trainer: Trainer, pl_module: LightningModule, options: CurvatureOptions,
        generator: Optional[torch.Generator], folded: Optional[Folded] = None,
    ) -> LaplaceEvidence:
        """The evidence of the curvature ``options`` at the current weights, summed over all ranks:
        this epoch's training-pass sums where they are the callback's own, complete and hold as many
        data as the evidence data, else one evidence pass over this rank's evidence batches (of the
        ``folded`` copy under its prior, if given)."""
        prior, likelihood = self._hyperparameters()
        model = pl_module if folded is None else folded.model
        prior = prior if folded is None else folded.prior
        taken_training = False

        def local_pass(training: bool) -> Any:  # may fail on one rank only: run_on_all_ranks (and a sharded exchange) tell the others
            nonlocal taken_training
            taken = self._training.take(trainer) if training else None  # type: ignore[union-attr]
            taken_training = taken is not None
            if taken is not None:
                return taken
            with sharded_pass(trainer.strategy, shards_parameters(trainer)) as sharded:  # FSDP: layers owned by rank
                batches = self._evidence_batches(trainer, pl_module)
                with isolate_rng(), progress(trainer, batches, self._package) as on_batch:  # as _first_batch draws
                    return self._collect(model, batches, options, generator, on_batch, prior, sharded)

        own = self._training is not None and options is self.options and folded is None
        with whole_parameters(trainer):  # under FSDP: the pass and the prior's norms read whole weights
            stats = reduce_statistics(run_on_all_ranks(trainer.strategy, lambda: local_pass(own)), trainer.strategy)
            if taken_training and int(stats.n_data) != int(prior.n_data):  # summed over ranks: the same on every rank
                rank_zero_warn(
                    f"MargLikCallback(statistics='training'): the epoch's training batches held {int(stats.n_data)} "
                    f"data, the evidence data {int(prior.n_data)} (examples dropped, repeated or padded across "
                    "processes): this estimate runs the evidence pass instead."
                )
                stats = reduce_statistics(run_on_all_ranks(trainer.strategy, lambda: local_pass(False)), trainer.strategy)
            return LaplaceEvidence.from_statistics(stats, likelihood, prior)

    def evidence_with(
        self, trainer: Trainer, pl_module: LightningModule, structure: str, approx: str,
        folded: Optional[Folded] = None,
    ) -> float:
        """The log evidence per datum at the current weights with another curvature approximation.

        One evidence pass over the callback's evidence data with ``structure`` and ``approx``
        (exact, no Monte-Carlo), then the learnable hyperparameters re-optimised on that curvature
        by Newton from their current values, as after training for ranking models
        (:func:`lightning_marglik.select_models`, ``rank_by``). Nothing is written: the
        hyperparameters and the callback's state stay as they are.

        Args:
            trainer: The trainer that trained ``pl_module`` (its data and strategy).
            pl_module: The trained module.
            structure: ``"kron"``, ``"ekfac"``, ``"diag"`` or ``"full"``.
            approx: ``"ggn"`` or ``"ef"``.
            folded: :meth:`fold_batchnorm` of ``pl_module``: the evidence of that copy under its prior
                (its hyperparameters re-optimised; the likelihood's are the callback's).

        Returns:
            The re-optimised log evidence per datum (NaN if the evidence is not finite).

        Raises:
            ValueError: On an unknown ``structure`` or ``approx``, or a ``folded`` that is not a
                :class:`~lightning_marglik.folding.Folded` with a prior.
            RuntimeError: If the callback has not been set up by a fit (no prior or likelihood yet).
        """
        options = CurvatureOptions(structure, approx, 0, backend=self.options.backend)
        self._require_fit("evidence_with")
        if folded is not None and not isinstance(folded, Folded):
            raise ValueError(f"MargLikCallback.evidence_with(folded=...) takes what MargLikCallback.fold_batchnorm "
                             f"returns, got {type(folded).__name__}.")
        if folded is not None and folded.prior is None:
            raise ValueError("MargLikCallback.evidence_with(folded=...) needs the folded copy's prior: make it with "
                             "MargLikCallback.fold_batchnorm(trainer, module), not fold_batchnorm(model, inputs).")
        evidence = self._evidence(trainer, pl_module, options, None, folded)
        if not torch.isfinite(evidence.log_marglik().detach()):
            return math.nan
        solution = evidence.optimize(solver="newton", max_evaluations=50)
        return solution.value.item() / evidence.n_data

    def fold_batchnorm(self, trainer: Trainer, pl_module: LightningModule) -> Folded:
        """A copy of the trained ``pl_module`` with its BatchNorms folded into the layers before them.

        :func:`lightning_marglik.folding.fold_batchnorm` on one evidence batch, the callback's prior carried over
        to the copy: pass the result to :meth:`evidence_with` for the evidence of the test-time function as a
        network without normalization (what ``select_models`` ranks by). ``pl_module`` is left as it is.

        Args:
            trainer: The trainer that trained ``pl_module`` (its data).
            pl_module: The trained module.

        Returns:
            The folded copy, its prior and what was folded (nothing for a network without BatchNorm).

        Raises:
            RuntimeError: If the callback has not been set up by a fit, or folding changed the
                eval-mode outputs (a ``forward`` that uses a norm other than as its layer's only consumer).
            ValueError: If the network's eval-mode outputs on the evidence batch are not finite.
            MargLikConfigurationError: Under FSDP2, whose modules cannot be copied.
        """
        self._require_fit("fold_batchnorm")
        with whole_parameters(trainer, copy_for="fold_batchnorm"):  # under FSDP: the copy takes whole weights
            return fold_batchnorm(pl_module, self.example_inputs(trainer, pl_module), prior=self.prior)

    def example_inputs(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The model inputs of one evidence batch (split by ``marglik_batch``), on the prior's device and dtype.

        Raises:
            RuntimeError: If the callback has not been set up by a fit.
            MargLikConfigurationError: If the evidence data yield no batch.
        """
        self._require_fit("example_inputs")
        prior, _ = self._hyperparameters()
        inputs, _ = split_batch(self._first_batch(trainer, pl_module), self._batch_fn(pl_module))
        return move(inputs, prior.params[0].device, prior.params[0].dtype)

    def _require_fit(self, method: str) -> None:
        """Refuse a call that reads the prior and likelihood before a fit has found them."""
        if self.prior is None or self.likelihood is None:
            raise RuntimeError(
                f"MargLikCallback.{method} reads the prior and likelihood the callback found when training "
                "started: call it after trainer.fit(module) with this callback."
            )

    # --- statistics from the training passes (statistics="training") ---------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._epoch_loss.epoch_start()
        if self._training is not None:
            self._training.epoch_start()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._cost.batch_start()
        if self._training is not None:
            self._training.batch_start(trainer, batch, batch_idx)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        if self.schedule.needs_loss:  # a manual training_step returns no loss: the settle rule reads this one
            self._epoch_loss.before_backward(loss)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._training is not None:
            self._training.after_backward(trainer, lambda batch: self._collect(pl_module, [batch], self.options))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.schedule.needs_loss:
            self._epoch_loss.batch_end(outputs)
        self._averaging.sync(pl_module)  # after the averaging callbacks' update of this step (they run first)
        if self._training is not None:
            self._training.batch_end(trainer)

    def _end_fit(self) -> None:
        """Also remove the training passes' hooks (``statistics="training"``)."""
        super()._end_fit()
        if self._training is not None:
            self._training.stop()
