"""The logic of ``MargLikCallback``: Algorithm 1 of Immer et al., its schedule of estimates and the steps.

:class:`MargLikCallbackCore` adds to :class:`~.estimating.EstimatorCore` (what both estimating callbacks share)
the evidence pass after the epochs an :class:`~.schedule.EpochSchedule` names, or the training passes' own sums
(``statistics="training"``, :mod:`.training_statistics`), and the hyperparameter steps. Its set-up decisions
are :mod:`.setup_analysis`'s; what a user asks of the trained module (the evidence with another curvature, a
folded copy, example inputs) is :class:`~.trained.TrainedModuleQueries`'.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages
from torch.utils.data import DataLoader

from ..curvature import CurvatureOptions
from ..diagnostics import ef_ratio_of, ef_unreliable_message
from ..curvature.exchange import sharded_pass
from ..distributed import reduce_statistics, run_on_all_ranks
from ..evidence import SOLVERS, LaplaceEvidence
from ..folding import Folded
from ..hyperparameters import TREATMENTS
from ..validators import choice, flag, integer, number, optional
from . import checks
from .arguments import CALLBACK_KEYWORDS
from .averaging import WeightAveragingFollower
from .cost import CostCheck
from .data import isolate_rng
from .epoch_loss import EpochLoss
from .estimating import EstimatorCore
from .logged import log_after_training
from .package import MONITOR, LightningModule, Trainer
from .prior_guard import drop_unguarded_decision, guard_off_reason, restore_guard, run_guard
from .progress import progress
from .report import announce_end
from .schedule import EpochSchedule, SettledSchedule
from .sharding import release_applied_gradients, shards_parameters, whole_parameters
from .trained import TrainedModuleQueries
from .training_statistics import TrainingStatistics

__all__ = ["MargLikCallbackCore"]


class MargLikCallbackCore(TrainedModuleQueries, EstimatorCore):
    """The logic of ``MargLikCallback`` (Algorithm 1), combined with a package's ``Callback``.

    Documented on ``lightning_marglik.MargLikCallback``; the subclass sets ``_package``.
    """

    schedule: EpochSchedule
    _foreign_keywords = CALLBACK_KEYWORDS
    _STATE = {**EstimatorCore._STATE, "guard_decisions": "guard_decisions"}

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
        guard: bool = True,
    ) -> None:
        options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
        self.statistics = checks.check_statistics(statistics, options)
        self.statistics_fraction = checks.check_fraction(statistics_fraction, self.statistics)
        schedule = EpochSchedule(frequency, burnin) if settle is None else SettledSchedule(frequency, burnin, settle)
        self.settle = None if settle is None else schedule.settle  # type: ignore[attr-defined]
        self.frequency = schedule.frequency
        self.steps = integer(steps, "steps", 0)
        self.guard = flag(guard, "guard", what="feed the learned weight decay back only while it scores better")
        super().__init__(options, schedule, lr, seed, scale_invariant, dataloader, flush_denormals)
        self.solver = choice(solver, SOLVERS, "solver")
        self.max_step = optional(number, max_step, "max_step", what="the largest change of log delta per estimate, or None")
        self.biases = optional(choice, biases, TREATMENTS, "biases")
        self.output_layer = checks.check_output_layer(output_layer)
        # statistics='training': the sums of the training passes in estimation epochs
        self._training = TrainingStatistics(schedule, self.statistics_fraction) if self.statistics == "training" else None
        self._averaging = WeightAveragingFollower()  # keeps the hyperparameters out of Lightning's weight averages

    def _reset_state(self) -> None:
        super()._reset_state()
        self.evidence: Optional[LaplaceEvidence] = None
        self._warned_ef = False  # the empirical Fisher's curvature check warns once per fit
        self._epoch_loss = EpochLoss()  # the epoch's training loss, for a settle rule
        self._cost = CostCheck()  # warns once if a run would cost more than twice one without the callback
        self.guard_decisions: list = []  # the prior guard's decisions (prior_guard.run_guard)
        self.guard_off: Optional[str] = None if self.guard else "off (guard=False)"  # why it does not run

    def _load_for_evaluation(self, state_dict: Dict[str, Any]) -> None:
        """Where the fit's prior is the loaded module's, its guard treatment follows the checkpoint's last decision:
        ``prior.applied_precision`` is then the weight decay a fit resumed from the checkpoint trains with."""
        module = self._stage_module
        if self.prior is not None and self.guard_off is None and module is not None and any(
                m is self.prior for m in module.modules()):
            restore_guard(self.prior, state_dict.get("guard_decisions", []))

    def _fit_checks(self) -> Dict[str, Any]:
        return dict(averaging=self._averaging, training_statistics=self._training is not None)

    def _setup_decisions(self) -> Dict[str, Any]:
        return dict(cost=self._cost, biases=self.biases, output_layer=self.output_layer)

    def _decide_after_setup(self, trainer: Trainer, pl_module: LightningModule) -> None:
        prior, _ = self._hyperparameters()
        if self.guard:
            self.guard_off = guard_off_reason(trainer, prior)
        restore_guard(prior, self.guard_decisions if self.guard_off is None else [])
        self._guard_the_last_estimate(trainer, pl_module)

    def _guard_the_last_estimate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Score the estimate a resumed fit starts from where the earlier fit ended right after it, unscored (no
        training followed it then): at the same weights, hyperparameters and Monte-Carlo draws, as an
        uninterrupted run scored it, so that training to more epochs goes on as that run's (with
        ``statistics="training"`` on an evidence pass: the epoch's training sums are not in the checkpoint)."""
        last = self.history[-1] if self.history else None
        if (self.guard_off is not None or last is None or last["epoch"] != trainer.current_epoch
                or not math.isfinite(last[MONITOR]) or any(d["epoch"] == last["epoch"] for d in self.guard_decisions)):
            return
        self.evidence = self._evidence(trainer, pl_module, self.options, self._generator(trainer, last["epoch"]))
        run_guard(self, trainer, pl_module, epoch=last["epoch"])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        epochs = trainer.max_epochs
        if epochs is not None and 0 < epochs <= self.burnin:  # not refused as the bound callback's: the last estimates
            rank_zero_warn(
                f"MargLikCallback(burnin={self.burnin}), but the fit trains {epochs} epochs (max_epochs): the only "
                "estimate is the one after the last epoch, and training runs at the prior's declared precision "
                f"throughout; choose burnin < {epochs} to learn it during training."
            )
        if self._training is not None:
            _, likelihood = self._hyperparameters()
            self._training.start(
                trainer, pl_module, likelihood, self.setup_analysis.plan, self._batch_fn(pl_module), self.dataloader
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
            release_applied_gradients(trainer, pl_module, self._package.lightning_module)
            with self._cost.estimating(self):
                epoch = trainer.current_epoch + 1
                marglik = self.estimate(trainer, pl_module, epoch=epoch)
                # a non-finite estimate left the hyperparameters, and the guard's choice, as they were; after the
                # last epoch no training follows that a choice could guard
                if math.isfinite(marglik) and epoch != trainer.max_epochs:
                    run_guard(self, trainer, pl_module, epoch=epoch)
                self._log(pl_module, marglik)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        drop_unguarded_decision(self, trainer)
        # weight averaging wrote the weights the fit returns (its callbacks run first): their evidence is owed
        if self.schedule.is_current(trainer) and not self._averaging.active:
            self.final_marglik = self.last_marglik
        else:  # trainer.current_epoch counts the completed epochs here
            self.final_marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch)
            log_after_training(trainer, self.logged_values(self.final_marglik), trainer.current_epoch)
            self.estimated_at_end = True
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
        generator = self._generator(trainer, epoch)
        evidence = self._evidence(trainer, pl_module, self.options, generator)
        self.evidence = evidence
        self._record_n_data(evidence.n_data)  # the N of map_loss follows the evidence (e.g. a stream's new masks)
        start = evidence.log_marglik().detach()  # at the hyperparameters as they are
        if not torch.isfinite(start):
            rank_zero_warn("The evidence is not finite at the current weights; hyperparameters left unchanged (where "
                           "the weights are NaN or inf, training diverged or training data hold NaN or inf).")
            marglik = math.nan
        else:
            solution = evidence.optimize(
                self.steps, self.lr, state=self._optimizer_state, solver=self.solver, max_evaluations=max(self.steps, 1),
                max_step=self.max_step,
            )
            # rank 0's solution everywhere: bit-identical hyperparameters, and one decision, on every rank
            values, unbounded = strategy.broadcast((solution.values, solution.unbounded), src=0)
            if unbounded:  # no optimum to learn (the engine's warning says why): training keeps sane values
                rank_zero_warn(f"MargLikCallback: where the evidence has no finite optimum in {', '.join(unbounded)}, "
                               "the estimate leaves the hyperparameters unchanged; its marglik is theirs.")
                marglik = start.item() / evidence.n_data
            else:
                self._optimizer_state = solution.state
                self._optimizer_signature = self._learnable_signature()
                evidence.set_hyperparameters(values)
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

    def _generator(self, trainer: Trainer, epoch: int) -> Optional[torch.Generator]:
        """The Monte-Carlo draws of the estimate after ``epoch`` (:meth:`_seeded`); ``None`` for an exact curvature."""
        if not self.options.mc_samples:
            return None
        return self._seeded(trainer, epoch)

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
            with sharded_pass(trainer.strategy, sharded) as exchange:
                batches = self._evidence_batches(trainer, pl_module)
                with isolate_rng(), progress(trainer, batches, self._package) as on_batch:  # as _first_batch draws
                    return self._collect(model, batches, options, generator, on_batch, prior, exchange)

        own = self._training is not None and options is self.options and folded is None
        sharded = shards_parameters(trainer)  # FSDP: each layer's curvature summed onto one rank (the exchange)
        with whole_parameters(trainer):  # under FSDP: the pass reads whole weights
            stats = reduce_statistics(run_on_all_ranks(trainer.strategy, lambda: local_pass(own)), trainer.strategy)
            if taken_training and int(stats.n_data) != int(prior.n_data):  # summed over ranks: the same on every rank
                rank_zero_warn(
                    f"MargLikCallback(statistics='training'): the epoch's training batches held {int(stats.n_data)} "
                    f"data, the evidence data {int(prior.n_data)} (examples dropped, repeated or padded across "
                    "processes): this estimate runs the evidence pass instead."
                )
                stats = reduce_statistics(run_on_all_ranks(trainer.strategy, lambda: local_pass(False)), trainer.strategy)
        if sharded:  # the owned factors' decomposition reads no weight: with the whole weights released (FSDP's peak)
            run_on_all_ranks(trainer.strategy, stats.prepare)
        with whole_parameters(trainer):  # the prior's norms read whole weights
            return LaplaceEvidence.from_statistics(stats, likelihood, prior)

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
