"""When a callback estimates the evidence, and whether its latest estimate is fresh.

A schedule answers two questions for the callback that estimates and for those that follow its
estimates (``MargLikCheckpoint``, ``MargLikEarlyStopping``): :meth:`Schedule.is_due` (is an
estimate due at this point of training) and :meth:`Schedule.is_fresh` (was the latest estimate
made in the epoch now ending). A new schedule is one subclass with its own ``is_due``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Optional

from ..validators import integer
from .package import Trainer

__all__ = ["BatchSchedule", "EpochSchedule", "Schedule"]


class Schedule(ABC):
    """When estimates are due, and the record of the latest one (saved in the callback's checkpoint state).

    Args:
        burnin: Epochs without an estimate (``B``).

    Raises:
        ValueError: On a ``burnin`` that is not an int >= 0.
    """

    def __init__(self, burnin: int) -> None:
        self.burnin = integer(burnin, "burnin", 0)
        self.reset()

    def reset(self) -> None:
        """The record of a fit that has not estimated yet."""
        self.last_epoch = -1  # trainer.current_epoch of the latest estimate
        self.last_step = -1  # trainer.global_step of the latest estimate

    @abstractmethod
    def is_due(self, trainer: Trainer, batch_idx: Optional[int] = None) -> bool:
        """Whether an estimate is due after training batch ``batch_idx`` of the current epoch or, with
        ``None``, at the end of the current epoch (``trainer.current_epoch + 1``, counted from 1)."""

    def record(self, trainer: Trainer, epoch: int) -> None:
        """Note an estimate made in ``epoch`` (counted from 1) at the trainer's current step."""
        self.last_epoch, self.last_step = epoch - 1, trainer.global_step

    def is_fresh(self, trainer: Trainer) -> bool:
        """Whether the latest estimate was made in the epoch now ending."""
        return self.last_epoch == trainer.current_epoch

    def is_current(self, trainer: Trainer) -> bool:
        """Whether no training step was taken since the latest estimate."""
        return self.last_step == trainer.global_step

    def state_dict(self) -> Dict[str, int]:
        return {"last_estimate_epoch": self.last_epoch, "last_estimate_step": self.last_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a checkpoint's record; a key it lacks keeps a fresh fit's value."""
        self.reset()
        self.last_epoch = state.get("last_estimate_epoch", self.last_epoch)
        self.last_step = state.get("last_estimate_step", self.last_step)


class EpochSchedule(Schedule):
    """Algorithm 1's schedule: an estimate after epoch ``e`` (from 1) with ``e > burnin`` and
    ``e % frequency == 0``, and after the last epoch of ``max_epochs``; never within an epoch.

    Args:
        frequency: Estimate every ``frequency`` epochs (``F``).
        burnin: Epochs before the first estimate (``B``).

    Raises:
        ValueError: On a ``frequency`` that is not an int >= 1 or a ``burnin`` that is not an int >= 0.
    """

    def __init__(self, frequency: int, burnin: int) -> None:
        self.frequency = integer(frequency, "frequency", 1)
        super().__init__(burnin)

    def is_due(self, trainer: Trainer, batch_idx: Optional[int] = None) -> bool:
        epoch = trainer.current_epoch + 1
        at_end = (epoch > self.burnin and epoch % self.frequency == 0) or epoch == trainer.max_epochs
        return batch_idx is None and at_end


class BatchSchedule(Schedule):
    """The bound callback's schedule: an estimate after every ``every``-th training batch of each epoch
    from epoch ``burnin + 1`` on (the count restarts every epoch); never at an epoch's end.

    Args:
        every: A step after every ``every``-th batch (``every_k_batches``).
        burnin: Epochs without steps.

    Raises:
        ValueError: On an ``every`` that is not an int >= 1 or a ``burnin`` that is not an int >= 0.
    """

    def __init__(self, every: int, burnin: int) -> None:
        self.every = integer(every, "every_k_batches", 1)
        super().__init__(burnin)

    def is_due(self, trainer: Trainer, batch_idx: Optional[int] = None) -> bool:
        return batch_idx is not None and trainer.current_epoch >= self.burnin and (batch_idx + 1) % self.every == 0
