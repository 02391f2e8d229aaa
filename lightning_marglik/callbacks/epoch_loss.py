"""The epoch's mean training loss that a settle rule reads (:class:`~.schedule.SettledSchedule`).

A batch's loss is what ``training_step`` returns (a tensor, or a dict's ``"loss"``) or, when it
returns none, as a manual-optimization ``training_step`` usually does, the sum of the losses the
batch backpropagated (``manual_backward``): the callback sees them at ``on_before_backward``, as
the prior-in-loss check does. A batch that neither returns nor backpropagates a loss (a skipped
step) does not count; an epoch without any loss has a NaN mean, which never counts as settled.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor

__all__ = ["EpochLoss"]


class EpochLoss:
    """Sums one epoch's batch losses, on one process."""

    def __init__(self) -> None:
        self.epoch_start()

    def epoch_start(self) -> None:
        """A new epoch: nothing summed yet."""
        self._total, self._batches = 0.0, 0
        self._backpropagated: Optional[Tensor] = None

    def before_backward(self, loss: Tensor) -> None:
        """A loss about to be backpropagated in the current batch (kept on its device: read only if needed)."""
        loss = loss.detach()
        self._backpropagated = loss if self._backpropagated is None else self._backpropagated + loss

    def batch_end(self, outputs: Any) -> None:
        """The batch's ``training_step`` result; its loss, else the losses it backpropagated, count."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            loss = self._backpropagated
        self._backpropagated = None
        if loss is not None:
            self._total += float(loss.detach())
            self._batches += 1

    @property
    def mean(self) -> float:
        """This process's mean batch loss of the epoch (NaN without any)."""
        return self._total / self._batches if self._batches else math.nan
