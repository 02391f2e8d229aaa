"""Small LightningModules and data shared by the Trainer-level tests."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, map_loss


class RegressorSteps:
    """The body of :class:`Regressor`, for a LightningModule of either Lightning package."""

    def __init__(self, n_data: int = 64, hidden: int = 16, lr: float = 1e-2, dropout: float = 0.0, weight_decay: float = 0.0):
        super().__init__()
        layers = [nn.Linear(1, hidden), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        self.net = nn.Sequential(*layers, nn.Linear(hidden, 1))
        self.prior = GaussianPrior(self.net)
        self.likelihood = GaussianLikelihood()
        self.n_data = n_data
        self.lr = lr
        self.weight_decay = weight_decay
        self.train_modes: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.train_modes.append(self.training)
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", ((self(x) - y) ** 2).mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.lr, weight_decay=self.weight_decay)


class Regressor(RegressorSteps, pl.LightningModule):
    """1-D regression MLP trained with the MAP loss that matches the evidence."""


def regression_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n).unsqueeze(1)
    return TensorDataset(x, torch.sin(2 * x) + 0.1 * torch.randn(x.shape, generator=g))


def loader(dataset: TensorDataset, batch_size: int = 16, shuffle: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def trainer(callbacks, max_epochs: int, **kwargs) -> pl.Trainer:
    defaults = dict(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        accelerator="cpu",
        deterministic=True,
    )
    defaults.update(kwargs)
    return pl.Trainer(max_epochs=max_epochs, callbacks=callbacks, **defaults)


class Classifier(pl.LightningModule):
    """Small MLP classifier for the model-selection tests (``norm``: a BatchNorm after each hidden layer)."""

    def __init__(self, n_data: int, width: int = 8, depth: int = 1, in_features: int = 2, classes: int = 3,
                 norm: bool = False):
        super().__init__()
        layers, size = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width, bias=not norm), *([nn.BatchNorm1d(width)] if norm else []), nn.Tanh()]
            size = width
        self.net = nn.Sequential(*layers, nn.Linear(size, classes))
        self.prior = GaussianPrior(self.net)
        self.likelihood = CategoricalLikelihood()
        self.n_data = n_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=3e-2)


def blobs(n: int, seed: int) -> TensorDataset:
    """Three Gaussian blobs in 2-D."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    return TensorDataset((centers[y] + torch.randn(n, 2, generator=g)).float(), y)


class BlobData(pl.LightningDataModule):
    def __init__(self, n_train: int = 60, n_test: int = 90, batch_size: int = 20):
        super().__init__()
        self.n_train, self.n_test, self.batch_size = n_train, n_test, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(blobs(self.n_train, 0), batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(blobs(self.n_test, 1), batch_size=self.batch_size)
