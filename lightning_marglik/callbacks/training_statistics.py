"""``statistics="training"``: the curvature sums of the training passes, as one helper the callback owns.

The lifecycle, hook by hook: :meth:`TrainingStatistics.start` (``on_train_start``: hooks on the
layers, laid out as the set-up batch's evidence pass), :meth:`~TrainingStatistics.batch_start`
and :meth:`~TrainingStatistics.batch_end` around every training batch of an estimation epoch
(and the first batch of the fit), :meth:`~TrainingStatistics.after_backward` (the first batch's
sums checked against the evidence pass at the same weights), :meth:`~TrainingStatistics.take`
(the epoch's sums for the estimate, if they cover the whole epoch) and
:meth:`~TrainingStatistics.stop` (``teardown``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from torch.utils.data import DistributedSampler

from ..curvature.training_pass import TrainingPassStatistics, mismatch
from ..distributed import run_on_all_ranks
from ..hyperparameters import Likelihood
from .data import BatchFn, dropped_examples, limiting_flag
from .package import LightningModule, MargLikConfigurationError, Trainer
from .schedule import Schedule
from .sharding import whole_parameters

__all__ = ["TrainingStatistics", "check_coverage"]


def check_coverage(trainer: Trainer, dataloader: Any) -> None:
    """Refuse a training epoch that does not draw every example of the evidence data exactly once.

    The training sums stand in for the evidence pass only if they cover the same examples: the
    default evidence data (the training sampler's examples, each once), every batch of the epoch
    (no ``limit_train_batches`` below the loader's length) and no example dropped (``drop_last``
    with a partial last batch drops a different part each epoch under shuffling). Samplers that
    draw another distribution (weights, replacement) are refused by the evidence data themselves.
    The estimates check the count of data as well (:meth:`MargLikCallbackCore._evidence`).

    Raises:
        MargLikConfigurationError: Naming what differs and the fix.
    """
    fix = "use statistics='pass' (the evidence pass)"
    if dataloader is not None:
        raise MargLikConfigurationError(
            "MargLikCallback(statistics='training', dataloader=...): the training passes sum the training batches, "
            f"but `dataloader` names other evidence data, which they never see; drop `dataloader` or {fix}."
        )
    loader = trainer.train_dataloader
    try:
        length: Optional[int] = len(loader)
    except TypeError:  # a stream: its epoch is the evidence data (bounded by limit_train_batches)
        return
    batches = trainer.num_training_batches
    if math.isfinite(batches) and int(batches) < length:
        raise MargLikConfigurationError(
            f"MargLikCallback(statistics='training'): a training epoch runs {int(batches)} of the loader's {length} "
            f"batches (Trainer({limiting_flag(trainer)})), but the evidence covers every "
            f"example; train on every batch or {fix}."
        )
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and sampler.total_size != len(sampler.dataset):
        examples, drawn = len(sampler.dataset), sampler.total_size
        raise MargLikConfigurationError(
            f"MargLikCallback(statistics='training'): the DistributedSampler gives the {sampler.num_replicas} processes "
            f"{drawn} of {examples} examples per epoch ({'repeating' if drawn > examples else 'dropping'} "
            f"{abs(drawn - examples)} to divide them evenly), but the evidence covers every example once; use a "
            f"number of examples the processes divide, or {fix}."
        )
    dropped = dropped_examples(loader)
    if dropped is not None:
        count, examples, size, _ = dropped
        raise MargLikConfigurationError(
            f"MargLikCallback(statistics='training'): the training DataLoader drops the last {count} of "
            f"{examples} examples each epoch (drop_last=True with batch_size={size}; a different part under "
            f"shuffling), but the evidence covers every example; set drop_last=False, a batch size that divides the "
            f"data, or {fix}."
        )


class TrainingStatistics:
    """The sums of the training passes in the epochs ``schedule`` estimates after.

    Args:
        schedule: The callback's schedule: the epochs it is due at the end of are summed.
        fraction: ``statistics_fraction``: the share of an epoch's batches, its last, whose layer
            products are summed.
    """

    def __init__(self, schedule: Schedule, fraction: float) -> None:
        self.schedule, self.fraction = schedule, fraction
        self._pass: Optional[TrainingPassStatistics] = None
        self._check: Any = None  # True until the first batch, then that batch until its sums are checked

    def start(
        self, trainer: Trainer, pl_module: LightningModule, likelihood: Likelihood, layout: Any, batch_fn: BatchFn,
        dataloader: Any = None,
    ) -> None:
        """Hooks for the training passes, laid out as ``layout`` (the set-up batch's evidence-pass
        statistics); the first training batch is checked against the evidence pass (:meth:`after_backward`).

        Args:
            dataloader: The callback's ``dataloader`` argument (other evidence data are refused).

        Raises:
            MargLikConfigurationError: If a training epoch does not draw every example of the evidence
                data once (:func:`check_coverage`; a stream without length or limit the evidence data
                refuse before), or the module cannot be followed.
        """
        check_coverage(trainer, dataloader)
        try:
            self._pass = TrainingPassStatistics(pl_module, likelihood, layout, batch_fn)
        except ValueError as err:
            raise MargLikConfigurationError(f"MargLikCallback: {err}") from err
        self._pass.attach()
        self._check = True  # replaced by the first batch in batch_start

    def _collects(self, trainer: Trainer) -> bool:
        """Whether this epoch's training batches are summed: estimation epochs, and the first batch (its check)."""
        return self._pass is not None and (self._check is True or self.schedule.is_due(trainer))

    def _first_summed_batch(self, trainer: Trainer) -> int:
        """The first batch of an epoch whose layer products are summed (``statistics_fraction``)."""
        batches = trainer.num_training_batches
        if self.fraction == 1 or not math.isfinite(batches):
            return 0
        return int(batches) - math.ceil(self.fraction * int(batches))

    def epoch_start(self) -> None:
        if self._pass is not None:
            self._pass.reset()

    def batch_start(self, trainer: Trainer, batch: Any, batch_idx: int) -> None:
        if not self._collects(trainer):
            return
        assert self._pass is not None
        layers = self._check is True or batch_idx >= self._first_summed_batch(trainer)
        if self._check is True:
            self._pass.reset()  # the check compares this batch's sums alone
            self._check = batch
        self._pass.begin(batch, trainer.accumulate_grad_batches, layers)

    def after_backward(self, trainer: Trainer, reference: Callable[[Any], Any]) -> None:
        """Check the first batch's sums (once), on every rank: ``reference(batch)`` is the evidence pass's."""
        if self._pass is None or self._check is None or self._check is True:
            return
        batch, self._check = self._check, None
        self._pass.end()  # the batch's backward is done; the reference pass must not be recorded
        with whole_parameters(trainer):  # under FSDP: the reference pass needs whole weights, on every rank
            run_on_all_ranks(trainer.strategy, lambda: self._check_batch(trainer, batch, reference))

    def _check_batch(self, trainer: Trainer, batch: Any, reference: Callable[[Any], Any]) -> None:
        """The first batch's training-pass sums must equal the evidence pass's at the same weights.

        Raises:
            MargLikConfigurationError: Naming the statistic that differs and the likely causes.
        """
        assert self._pass is not None
        problems = list(self._pass.problems)
        if not problems:
            precision = str(trainer.precision)
            rtol = 5e-2 if "16" in precision else 1e-8 if "64" in precision else 1e-3  # (b)f16 gradients, float64, float32
            found = mismatch(self._pass.stats, reference(batch), rtol)
            if found is not None:
                problems.append(
                    f"the first training batch's sums differ from the evidence pass's at the same weights ({found})"
                )
        if problems:
            raise MargLikConfigurationError(
                f"MargLikCallback(statistics='training'): {'; '.join(problems)}. The training backward gives the "
                "empirical Fisher only if training_step returns map_loss(self(x), y, ...) (mean reduction, no label "
                "smoothing or other loss terms on the outputs) of one forward call, the training forward equals the "
                "eval-mode one (no dropout, no batch statistics) and, for (batch, positions, classes) outputs, layers "
                "do not mix positions. Use statistics='pass' (the evidence pass) otherwise."
            )

    def batch_end(self, trainer: Trainer) -> None:
        if self._pass is None:
            return
        self._pass.end()
        if not self.schedule.is_due(trainer):
            self._pass.reset()  # only the check's batch was summed

    def take(self, trainer: Trainer) -> Any:
        """This rank's sums of the epoch now ending, if they cover all its batches (else ``None``:
        the evidence pass runs, e.g. after a resume within the epoch or for a final estimate after
        ``max_steps``).

        Raises:
            MargLikConfigurationError: If a batch after the first showed sums that are not the EF's.
        """
        if self._pass is None:
            return None
        if self._pass.problems:  # seen after the first batch's check: the sums are not the EF's
            raise MargLikConfigurationError(
                f"MargLikCallback(statistics='training'): {'; '.join(self._pass.problems)}; use statistics='pass'."
            )
        stats, batches = self._pass.take(), self._pass.batches
        self._pass.reset()
        expected = trainer.num_training_batches
        complete = batches > 0 and (not math.isfinite(expected) or batches == int(expected))
        return stats if complete else None

    def stop(self) -> None:
        """Remove the hooks (``teardown``)."""
        if self._pass is not None:
            self._pass.detach()
            self._pass = None
