"""The end-of-training estimate's metrics, written where the epoch-end estimates' go.

``self.log`` is not allowed in ``on_train_end``: the values go into ``trainer.callback_metrics``
(where callbacks and users read them) and to every logger directly. Each row carries what
Lightning's own epoch-end rows carry: the ``epoch`` (index from 0) and the step of the epoch's last
training batch (Lightning's count of batches that stepped, less one), so that in ``metrics.csv``
the final estimate's row is counted like the others.
"""
from __future__ import annotations

from typing import Dict

import torch

from .package import Trainer

__all__ = ["log_after_training"]


def log_after_training(trainer: Trainer, values: Dict[str, float], epoch: int) -> None:
    """Write an estimate made in ``on_train_end`` after ``epoch`` (counted from 1).

    Args:
        trainer: The trainer (its metrics and loggers).
        values: The logged values (``marglik`` and the hyperparameters).
        epoch: The last epoch trained, counted from 1 (``history``'s count).
    """
    trainer.callback_metrics.update({key: torch.tensor(value) for key, value in values.items()})
    # Lightning logs an epoch's end at its batch count less one (its logger connector); global_step counts
    # optimizer steps instead, which differ under manual optimization with several optimizers
    batches = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
    for logger in trainer.loggers:
        logger.log_metrics({**values, "epoch": epoch - 1}, step=max(batches - 1, 0))
