"""What the callbacks that estimate the evidence share: hooks, the record of estimates, resume.

:class:`EstimatorCore` is what ``MargLikCallback`` and ``MargLikBoundCallback`` share: the
set-up checks and decisions (:mod:`.setup_analysis`), the count of ``N`` stored on the prior, the record of
estimates (``history``, last and best) and their :mod:`schedule <.schedule>`, the logged values and the
checkpoint state. The set-up check's, the first training batch's and the estimates' evidence passes all call
``collect_statistics`` from this module (:meth:`EstimatorCore._collect`), where tests and benchmarks count them.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages
from torch.utils.data import DataLoader

from ..curvature import CurvatureOptions, collect_statistics
from ..curvature.exchange import Exchange
from ..denormals import DenormalFlush
from ..distributed import run_on_all_ranks
from ..evidence import require_data
from ..hyperparameters import SCALE_INVARIANT_TREATMENTS, GaussianPrior, Likelihood, learnable_values
from ..runaway import runaway_message, runaway_precisions
from ..validators import choice, flag, integer, number
from . import checks
from .arguments import KnownKeywords
from .data import count_data, evidence_batches, isolate_rng, ranks_hold_their_own_data
from .fit_record import FitRecord
from .logged import logged_values
from .package import MONITOR, LightningModule, LightningPackage, MargLikConfigurationError, Trainer, check_package, find_hyperparameters
from .prior_in_loss import PriorInLossCheck
from .report import announce_setup
from .resume import follow_changed_learnables
from .schedule import Schedule
from .setup_analysis import SetupAnalysis, analyse_setup, check_fit
from .sharding import whole_parameters
from .training_statistics import TrainingStatistics

__all__ = ["EstimatorCore"]


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
        self.schedule = schedule
        self.burnin = schedule.burnin
        self.lr = number(lr, "lr")
        if dataloader is not None and not isinstance(dataloader, (DataLoader, str)):
            raise ValueError(f"`dataloader` must be a DataLoader or a method name, got {type(dataloader).__name__}.")
        self.dataloader = dataloader
        self.seed = integer(seed, "seed", 0, maximum=2**64 - 1, what="torch.Generator.manual_seed's range")
        self.scale_invariant = choice(scale_invariant, SCALE_INVARIANT_TREATMENTS, "scale_invariant")
        self.flush_denormals = flag(flush_denormals, "flush_denormals")
        self._flush = DenormalFlush(self.flush_denormals)
        self.prior: Optional[GaussianPrior] = None
        self.likelihood: Optional[Likelihood] = None
        self.setup_analysis: Optional[SetupAnalysis] = None  # what the last set-up decided, and why
        self._fit_record = FitRecord()  # the previous fit's record, through a fit that trains nothing
        # the stage Lightning last set up, and its module: a checkpoint loaded outside a fit is the module's alone
        self._fitting, self._stage_module = True, None
        self._reset_state()

    def _reset_state(self) -> None:
        """The state of a fit that has not estimated yet."""
        self.estimations = 0
        self.last_marglik = math.nan
        self.best_marglik = -math.inf
        self.best_epoch = -1
        self.final_marglik = math.nan
        # whether on_train_end estimated (training ended between scheduled estimates): MargLikCheckpoint ranks it
        self.estimated_at_end = False
        self.history: List[Dict[str, float]] = []
        self.summary: Optional[Dict[str, Any]] = None  # the facts of the fit's end (report.summarize)
        self._counted_loader: Any = None  # the training loader N was counted on (a reload counts again)
        self._own_data = False  # each process's loader holds its own examples (data.ranks_hold_their_own_data)
        self._target_like: Optional[torch.Tensor] = None  # outputs of one evidence batch, for the target checks
        self._warned_runaway: Set[str] = set()  # the tensors a run-away warning named in this fit
        self._prior_in_loss = PriorInLossCheck(type(self).__name__)  # decided on this fit's first training batch
        self._optimizer_state: dict = {}
        # the hyperparameters the Adam state belongs to (_learnable_signature)
        self._optimizer_signature: Optional[List[Tuple[str, List[int], List[str]]]] = None
        self.schedule.reset()

    @property
    def estimator(self) -> str:
        """Which GGN estimator the estimates run, and why (decided at set-up; empty before)."""
        return "" if self.setup_analysis is None else self.setup_analysis.estimator

    @property
    def output_decision(self) -> Optional[Dict[str, Any]]:
        """What set-up decided for the output layer, and why (``None`` before, or without the treatment)."""
        return None if self.setup_analysis is None else self.setup_analysis.output_decision

    @property
    def last_estimate_epoch(self) -> int:
        """``trainer.current_epoch`` of the latest estimate (-1 before the first)."""
        return self.schedule.last_epoch

    def is_fresh(self, trainer: Trainer) -> bool:
        """Whether ``marglik`` was estimated in the epoch now ending."""
        return self.schedule.is_fresh(trainer)

    def _seeded(self, trainer: Trainer, draw: int) -> torch.Generator:
        """The Monte-Carlo draws numbered ``draw`` (an epoch, a step): distinct on every rank, reproducible for a given
        (seed, draw, rank). Taken modulo 2**63, which leaves every seed below it as it is: a seed near
        ``manual_seed``'s limit would overflow it."""
        return torch.Generator().manual_seed(((self.seed + draw) * trainer.world_size + trainer.global_rank) % 2**63)

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_package(self, trainer)
        self._fitting, self._stage_module = stage == "fit", pl_module  # what a checkpoint's state is loaded for
        if stage != "fit":
            return
        others = [type(c).__name__ for c in trainer.callbacks if isinstance(c, EstimatorCore) and c is not self]
        if others:
            raise MargLikConfigurationError(
                f"{type(self).__name__} next to {', '.join(others)} in one Trainer: both would step the same "
                f"hyperparameters and log one '{MONITOR}' (Lightning's mean of their evidences), on which the "
                "checkpoint and early stopping would act; keep one estimating callback per fit."
            )
        # Every fit starts afresh: the Adam state and history of another model must not carry over.
        # Lightning restores a checkpoint (load_state_dict) after setup, so a resumed fit gets its state back.
        self._fit_record.keep(self)
        self._reset_state()
        self.prior, self.likelihood = find_hyperparameters(pl_module)
        check_fit(self, trainer, pl_module, **self._fit_checks())

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        checks.check_weight_decay(trainer, self._hyperparameters()[0])  # before training: the optimizers exist
        checks.check_monitoring_schedulers(trainer, f"{type(self).__name__}({self.schedule.describe()})",
                                           self.schedule.estimates_every)
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
        self._decide_after_setup(trainer, pl_module)
        announce_setup(self)

    def _decide_after_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Decisions that read the set-up check's treatments, made before the set-up line names them."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # reload_dataloaders_every_n_epochs: the N of the loss follows the loader this epoch draws from
        if self.dataloader is None and trainer.train_dataloader is not self._counted_loader:
            self._count_data(trainer, pl_module, lambda: self._target_like)

    def _count_data(self, trainer: Trainer, pl_module: LightningModule, like: Callable[[], torch.Tensor]) -> None:
        """Count ``N`` over the evidence data of every rank and store it on the prior; ``like()`` gives
        outputs whose shape the targets must fit (the set-up check's)."""
        _, likelihood = self._hyperparameters()

        self._own_data = ranks_hold_their_own_data(self.dataloader, trainer, pl_module)

        def local() -> int:  # one rank's failure (e.g. its shard's first batch) is raised on every rank
            self._target_like = like()
            return count_data(self.dataloader, trainer, pl_module, likelihood, self._batch_fn(pl_module),
                              self._target_like, own=self._own_data)

        strategy = trainer.strategy
        with whole_parameters(trainer):  # under FSDP: the check's forwards need whole weights, on every rank
            n_data = strategy.reduce(torch.tensor(run_on_all_ranks(strategy, local), device=strategy.root_device), reduce_op="sum")
        self._record_n_data(int(n_data))
        self._counted_loader = trainer.train_dataloader

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # an epoch's first batch (the user's on_train_epoch_start hooks have set its modes), or the fit's first
        # (a resume within an epoch starts past batch 0)
        analysis = self.setup_analysis
        if analysis is not None and (batch_idx == 0 or not analysis.modes_followed):
            note = analysis.follow_training_modes(trainer, pl_module, self)  # the set-up's scale-invariance decision
            analysis.modes_followed = True
            if note:
                rank_zero_warn(note)
        self._prior_in_loss.batch_start(self._hyperparameters()[0])

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._prior_in_loss.before_backward(loss)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        message = self._prior_in_loss.batch_end()
        if message:
            rank_zero_warn(message)

    def _follow_changed_learnables(self) -> None:
        """After a resume (:func:`.resume.follow_changed_learnables`)."""
        prior, likelihood = self._hyperparameters()
        saved, state = self._optimizer_signature, bool(self._optimizer_state)
        if follow_changed_learnables(prior, likelihood, saved, self._learnable_signature(), state):
            self._optimizer_state, self._optimizer_signature = {}, None

    def _check_setup(self, trainer: Trainer, pl_module: LightningModule) -> torch.Tensor:
        """Everything the evidence needs, on one evidence batch (:func:`.setup_analysis.analyse_setup`); returns
        that batch's outputs."""
        self.setup_analysis = analyse_setup(self, trainer, pl_module, **self._setup_decisions())
        return self.setup_analysis.output

    def _fit_checks(self) -> Dict[str, Any]:
        """The checks of this callback's fit beyond the shared ones (:func:`.setup_analysis.check_fit`)."""
        return {}

    def _setup_decisions(self) -> Dict[str, Any]:
        """The set-up decisions of this callback beyond the shared ones (:func:`.setup_analysis.analyse_setup`)."""
        return {}

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
        return evidence_batches(self.dataloader, trainer, pl_module, warn, own=self._own_data)

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
        """Restore a checkpoint's state for a fit that resumes from it; a key it lacks keeps a fresh fit's value.

        Loaded to test, validate or predict (``trainer.test(ckpt_path="best")``: Lightning loads every callback's
        state for any stage), the checkpoint is the module's: the callback keeps its fit's record (``history``,
        ``best_marglik``, ``final_marglik``, ``summary``, ``evidence``; :meth:`_load_for_evaluation`).
        """
        if not self._fitting:
            self._load_for_evaluation(state_dict)
            return
        self._reset_state()
        for key, attribute in self._STATE.items():
            if key in state_dict:
                setattr(self, attribute, state_dict[key])
        self.schedule.load_state_dict(state_dict)
        self.history = list(self.history)
        self._fit_record.drop()

    def _load_for_evaluation(self, state_dict: Dict[str, Any]) -> None:
        """A checkpoint's state, loaded with its module to test, validate or predict: nothing of the callback's."""
