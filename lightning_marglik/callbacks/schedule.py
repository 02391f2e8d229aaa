"""When a callback estimates the evidence, and whether its latest estimate is fresh.

A schedule answers two questions for the callback that estimates and for those that follow its
estimates (``MargLikCheckpoint``, ``MargLikEarlyStopping``): :meth:`Schedule.is_due` (is an
estimate due at this point of training) and :meth:`Schedule.is_fresh` (was the latest estimate
made in the epoch now ending). A new schedule is one subclass with its own ``is_due``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional

from ..schedule_rules import loss_has_settled
from ..validators import integer, number
from .package import Trainer

__all__ = ["BatchSchedule", "EpochSchedule", "Schedule", "SettledSchedule"]


class Schedule(ABC):
    """When estimates are due, and the record of the latest one (saved in the callback's checkpoint state).

    Args:
        burnin: Epochs without an estimate (``B``).

    Raises:
        ValueError: On a ``burnin`` that is not an int >= 0.
    """

    # whether is_due needs the epochs' mean training loss (observe_loss), which costs a collective per epoch
    needs_loss = False

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

    def observe_loss(self, loss: float) -> None:
        """The mean training loss of the epoch now ending (over every rank), before :meth:`is_due`."""

    def estimates_every(self, epochs: int) -> bool:
        """Whether every epoch whose number (from 1) is a multiple of ``epochs`` ends with a fresh estimate (what a
        learning-rate scheduler that monitors it every ``epochs`` epochs needs)."""
        return False

    def every_epoch(self) -> bool:
        """Whether every training epoch ends with an estimate (what Lightning's ``EarlyStopping`` needs)."""
        return self.estimates_every(1)

    def describe(self) -> str:
        """The callback's arguments that set this schedule, for messages."""
        return f"burnin={self.burnin}"


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

    def estimates_every(self, epochs: int) -> bool:
        return epochs % self.frequency == 0 and epochs > self.burnin

    def describe(self) -> str:
        return f"frequency={self.frequency}, {super().describe()}"


class SettledSchedule(EpochSchedule):
    """Algorithm 1 once training has settled: as :class:`EpochSchedule`, but no estimate before the
    epochs' mean training loss, once below its first epoch's by more than ``settle`` (relatively), has
    changed by at most ``settle`` over ``window`` epochs
    (:func:`lightning_marglik.schedule_rules.loss_has_settled`); from then on (it is not undone) every
    ``frequency``-th epoch. The last epoch of ``max_epochs`` always estimates.

    Far from a MAP the evidence of weakly determined groups (zero-initialised biases, Fixup scalars)
    starts the ARD feedback loop that drives their precisions away (``benchmarks/results/runaway_mechanism.md``);
    a fixed burn-in has to be guessed per problem, the settle point is measured.

    Args:
        frequency: Estimate every ``frequency`` epochs (``F``) once settled.
        burnin: Epochs before the first estimate in any case (``B``).
        settle: Largest relative change of the mean training loss over ``window`` epochs that counts
            as settled, in (0, 1) (e.g. 0.05).
        window: Epochs the change is taken over.

    Raises:
        ValueError: On a bad ``frequency``, ``burnin``, ``settle`` (a number in (0, 1)) or ``window``.
    """

    needs_loss = True

    def __init__(self, frequency: int, burnin: int, settle: float, window: int = 2) -> None:
        # at 1 a loss that starts positive must fall to 0 or below to count as fallen: it never settles
        self.settle = number(settle, "settle", 0, 1, high_open=True,
                             what="the largest relative change of the training loss, e.g. 0.05")
        self.window = integer(window, "window", 1)
        super().__init__(frequency, burnin)

    def reset(self) -> None:
        super().reset()
        self.losses: List[float] = []
        self.settled_epoch = -1  # the epoch (from 1) the loss settled in; -1: not yet

    def observe_loss(self, loss: float) -> None:
        self.losses.append(float(loss))
        if self.settled_epoch < 0 and loss_has_settled(self.losses, self.window, self.settle):
            self.settled_epoch = len(self.losses)

    def is_due(self, trainer: Trainer, batch_idx: Optional[int] = None) -> bool:
        epoch = trainer.current_epoch + 1
        if batch_idx is not None:
            return False
        settled = 0 <= self.settled_epoch <= epoch
        return (settled and super().is_due(trainer)) or epoch == trainer.max_epochs

    def estimates_every(self, epochs: int) -> bool:
        return False  # not before the loss has settled

    def describe(self) -> str:
        return f"{super().describe()}, settle={self.settle}"

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "training_losses": list(self.losses), "settled_epoch": self.settled_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.losses = list(state.get("training_losses", self.losses))
        self.settled_epoch = state.get("settled_epoch", self.settled_epoch)


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

    def estimates_every(self, epochs: int) -> bool:
        return epochs > self.burnin  # every epoch after burn-in estimates, and its steps are logged at its end

    def describe(self) -> str:
        return f"every_k_batches={self.every}, {super().describe()}"
