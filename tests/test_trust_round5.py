"""Trust, fifth round (issue 41, items 1-7): the Trainer features of real training jobs.

Real Trainers, real Lightning callbacks and loggers, files on disk.
"""
from __future__ import annotations

import csv
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_marglik import MargLikCallback, map_loss
from tests.lightning_models import Regressor, loader, regression_data, trainer


class ManualRegressor(Regressor):
    """The Regressor under manual optimization, its ``training_step`` returning nothing (Lightning's idiom)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(map_loss(self(x), y, self.likelihood, self.prior, self.n_data))
        optimizer.step()


def _estimate_epochs(module: pl.LightningModule, max_epochs: int = 30) -> list:
    callback = MargLikCallback(structure="diag", frequency=2, settle=0.05, steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer([callback], max_epochs).fit(module, loader(regression_data()))
    return [entry["epoch"] for entry in callback.history]


# --- item 1: the settle rule reads the loss a manual training_step backpropagates ------------------


def test_settle_rule_under_manual_optimization_estimates_as_under_automatic_optimization():
    torch.manual_seed(0)
    automatic = _estimate_epochs(Regressor())
    torch.manual_seed(0)
    manual = _estimate_epochs(ManualRegressor())
    assert len(automatic) > 2 and automatic[-1] == 30  # settled before the end: estimates every 2nd epoch
    assert manual == automatic
