"""What the estimating callbacks log: an estimate's values, and the end-of-training estimate's row.

An estimate logs ``marglik`` and every hyperparameter by name (:func:`logged_values`). For the
end-of-training estimate (:func:`log_after_training`), ``self.log`` is not allowed in
``on_train_end``: the values go into ``trainer.callback_metrics`` (where callbacks and users read
them) and to every logger directly. Each row carries what
Lightning's own epoch-end rows carry: the ``epoch`` (index from 0) and the step of the epoch's last
training batch (Lightning's count of batches that stepped, less one), so that in ``metrics.csv``
the final estimate's row is counted like the others.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..hyperparameters import GaussianPrior, Likelihood
from ..private import batches_that_stepped
from .package import MONITOR, Trainer

__all__ = ["log_after_training", "logged_values"]


def logged_values(prior: GaussianPrior, likelihood: Likelihood, marglik: float) -> Dict[str, float]:
    """``marglik`` and every hyperparameter by name: one ``prior_precision`` for a scalar prior, else
    ``prior_precision/<tensor>`` (the geometric mean of a diagonal prior's), and the likelihood's."""
    out = {MONITOR: marglik}
    if prior.structure == "scalar":
        out["prior_precision"] = prior.precision.item()
    else:
        per_tensor = prior.tensor_log_precisions(prior.log_precision)
        for name, log_prec in zip(prior.param_names, per_tensor):
            out[f"prior_precision/{name}"] = log_prec.mean().exp().item()
    for name, log_value in likelihood.hyperparameters().items():
        out[name[len("log_"):]] = log_value.exp().item()
    return out


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
    batches = batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics({**values, "epoch": epoch - 1}, step=max(batches - 1, 0))
