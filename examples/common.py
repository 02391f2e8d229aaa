"""Models, data and the command line shared by the examples.

* ``MLPRegressor`` / ``MLPClassifier``: LightningModules around a plain ``nn.Sequential`` MLP,
  trained with :func:`lightning_marglik.map_loss`, carrying a ``GaussianPrior`` and a likelihood
  (the hyperparameters ``MargLikCallback`` learns).
* ``ToyRegressionData``, ``MoonsData``, ``BreastCancerData``: small in-memory data generated or
  loaded offline with a fixed seed.
* ``MargLikCLI``: ``LightningCLI`` that links the training set size into the model, so one YAML
  under ``configs/`` configures the trainer (with its callbacks), the model and the data.
* ``build`` / ``fit``: instantiate from a YAML plus dotted overrides, train, return what the
  examples report.

Every example script runs in two ways::

    python examples/<name>.py [--quick] [--config configs/<name>.yaml] [--trainer.max_epochs=...]
    python examples/<name>.py fit --config configs/<name>.yaml      # one plain LightningCLI fit
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikCallback,
    map_loss,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = os.path.join(ROOT, "configs")
RESULTS = os.path.join(HERE, "results")

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def quiet() -> None:
    """Silence Lightning's per-run banners and the small-data warnings of these toy problems."""
    import logging

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*number of training batches.*")
    warnings.filterwarnings("ignore", message=".*LightningCLI.*")
    torch.set_num_threads(1)  # tiny tensors: threads only add synchronisation overhead


# --- models ----------------------------------------------------------------------------------


def mlp(in_features: int, out_features: int, width: int, depth: int, activation: str = "tanh") -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units (``depth=0``: a linear model)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {tuple(ACTIVATIONS)}, got {activation!r}.")
    layers: List[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_features if i == 0 else width, width), ACTIVATIONS[activation]()]
    layers.append(nn.Linear(width if depth else in_features, out_features))
    return nn.Sequential(*layers)


class _MargLikMLP(pl.LightningModule):
    """Shared part: the MLP, the prior, MAP training with Adam (no weight decay)."""

    likelihood: Any

    def __init__(
        self,
        n_data: int,
        in_features: int,
        out_features: int,
        width: int,
        depth: int,
        activation: str,
        prior_precision: float,
        prior_structure: str,
        learn_prior: bool,
        lr: float,
        lr_min: float,
    ) -> None:
        super().__init__()
        self.net = mlp(in_features, out_features, width, depth, activation)
        self.prior = GaussianPrior(self.net, precision=prior_precision, structure=prior_structure, learn=learn_prior)
        self.n_data = n_data
        self.lr = lr
        self.lr_min = lr_min

    def forward(self, x: Tensor) -> Tensor:  # the evidence pass calls forward(x)
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = map_loss(self(x), y, self.likelihood, self.prior, self.n_data)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        # No weight_decay: the GaussianPrior in map_loss *is* the weight decay.
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        if self.lr_min >= self.lr or self.trainer is None or not self.trainer.max_epochs or self.trainer.max_epochs < 0:
            return optimizer
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs, eta_min=self.lr_min)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


class MLPRegressor(_MargLikMLP):
    """MLP regression with a Gaussian likelihood whose noise ``sigma`` the evidence learns.

    Args:
        n_data: Training set size ``N`` (linked from the data module by ``MargLikCLI``).
        in_features, out_features: Input and output dimension.
        width: Units per hidden layer.
        depth: Number of hidden layers.
        activation: ``"tanh"``, ``"relu"`` or ``"gelu"``.
        prior_precision: Initial prior precision ``delta``.
        prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diagonal"``.
        learn_prior: Whether the evidence learns ``delta`` (False: a fixed weight decay).
        sigma: Initial observation noise.
        learn_sigma: Whether the evidence learns ``sigma``.
        lr, lr_min: Adam learning rate on the weights, cosine-annealed to ``lr_min`` over
            ``max_epochs`` (no schedule if ``lr_min >= lr``).
    """

    def __init__(
        self,
        n_data: int = 1,
        in_features: int = 1,
        out_features: int = 1,
        width: int = 50,
        depth: int = 1,
        activation: str = "tanh",
        prior_precision: float = 1.0,
        prior_structure: str = "layerwise",
        learn_prior: bool = True,
        sigma: float = 1.0,
        learn_sigma: bool = True,
        lr: float = 1e-2,
        lr_min: float = 1e-3,
    ) -> None:
        super().__init__(
            n_data, in_features, out_features, width, depth, activation, prior_precision, prior_structure, learn_prior,
            lr, lr_min,
        )
        self.likelihood = GaussianLikelihood(sigma=sigma, learn_sigma=learn_sigma)
        self.save_hyperparameters()


class MLPClassifier(_MargLikMLP):
    """MLP classification with a categorical likelihood (softmax over ``out_features`` logits).

    Args: as :class:`MLPRegressor`, without the noise.
    """

    def __init__(
        self,
        n_data: int = 1,
        in_features: int = 2,
        out_features: int = 2,
        width: int = 50,
        depth: int = 2,
        activation: str = "tanh",
        prior_precision: float = 1.0,
        prior_structure: str = "layerwise",
        learn_prior: bool = True,
        lr: float = 1e-2,
        lr_min: float = 1e-3,
    ) -> None:
        super().__init__(
            n_data, in_features, out_features, width, depth, activation, prior_precision, prior_structure, learn_prior,
            lr, lr_min,
        )
        self.likelihood = CategoricalLikelihood()
        self.save_hyperparameters()


# --- data ------------------------------------------------------------------------------------


class _TensorData(pl.LightningDataModule):
    """In-memory train/test tensors, generated in ``__init__`` (so ``n_train`` is known at once)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    def _loader(self, x: Tensor, y: Tensor, shuffle: bool) -> DataLoader:
        size = self.batch_size if self.batch_size > 0 else len(x)  # batch_size <= 0: full batch
        generator = torch.Generator().manual_seed(0) if shuffle else None
        return DataLoader(TensorDataset(x, y), batch_size=size, shuffle=shuffle, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.x_train, self.y_train, shuffle=self.batch_size > 0)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.x_test, self.y_test, shuffle=False)


class ToyRegressionData(_TensorData):
    """1-D regression with a gap: ``x`` uniform on ``[-x_max, -gap] U [gap, x_max]``, ``y = sin(3x) + noise``.

    Args:
        n_train: Number of training points (half on each side of the gap).
        n_test: Number of test points (same distribution, fresh draw).
        gap: Half-width of the gap around 0.
        x_max: Half-width of the input range.
        noise: Standard deviation of the observation noise.
        seed: Seed of the data.
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(
        self, n_train: int = 100, n_test: int = 500, gap: float = 0.3, x_max: float = 1.0, noise: float = 0.1,
        seed: int = 0, batch_size: int = 0,
    ) -> None:
        super().__init__(batch_size)
        if not 0 <= gap < x_max:
            raise ValueError(f"need 0 <= gap < x_max, got gap={gap}, x_max={x_max}")
        g = torch.Generator().manual_seed(seed)
        self.noise, self.gap, self.x_max = noise, gap, x_max
        self.x_train, self.y_train = self.sample(n_train, gap, x_max, noise, g)
        self.x_test, self.y_test = self.sample(n_test, gap, x_max, noise, g)

    @staticmethod
    def function(x: Tensor) -> Tensor:
        return torch.sin(3 * x)

    @classmethod
    def sample(cls, n: int, gap: float, x_max: float, noise: float, g: torch.Generator):
        side = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        x = side * (gap + (x_max - gap) * torch.rand(n, generator=g))
        x, _ = torch.sort(x)
        y = cls.function(x) + noise * torch.randn(n, generator=g)
        return x.unsqueeze(1), y.unsqueeze(1)


class MoonsData(_TensorData):
    """``sklearn.datasets.make_moons`` (generated, offline), standardized with the training statistics.

    Args:
        n_train, n_test: Sizes of the training and the (independent) test set.
        noise: ``make_moons`` noise.
        seed: Seed; the test set uses ``seed + 1``.
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(self, n_train: int = 60, n_test: int = 2000, noise: float = 0.3, seed: int = 0, batch_size: int = 0):
        super().__init__(batch_size)
        from sklearn.datasets import make_moons

        x_tr, y_tr = make_moons(n_train, noise=noise, random_state=seed)
        x_te, y_te = make_moons(n_test, noise=noise, random_state=seed + 1)
        self.mean, self.std = x_tr.mean(0), x_tr.std(0)
        self.x_train, self.y_train = self._tensors(x_tr, y_tr)
        self.x_test, self.y_test = self._tensors(x_te, y_te)

    def _tensors(self, x: np.ndarray, y: np.ndarray):
        return torch.tensor((x - self.mean) / self.std, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


class BreastCancerData(_TensorData):
    """``sklearn.datasets.load_breast_cancer`` (bundled with scikit-learn: offline), 30 features, 2 classes.

    Args:
        test_fraction: Share of the 569 examples held out (stratified split).
        seed: Seed of the split.
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(self, test_fraction: float = 0.3, seed: int = 0, batch_size: int = 0) -> None:
        super().__init__(batch_size)
        from sklearn.datasets import load_breast_cancer
        from sklearn.model_selection import train_test_split

        x, y = load_breast_cancer(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
        mean, std = x_tr.mean(0), x_tr.std(0)
        self.x_train = torch.tensor((x_tr - mean) / std, dtype=torch.float32)
        self.x_test = torch.tensor((x_te - mean) / std, dtype=torch.float32)
        self.y_train, self.y_test = torch.tensor(y_tr), torch.tensor(y_te)


# --- command line ----------------------------------------------------------------------------


class MargLikCLI(LightningCLI):
    """``LightningCLI`` that passes the data module's training set size to the model (``model.n_data``)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.n_train", "model.n_data", apply_on="instantiate")

    def after_fit(self) -> None:
        """``fit`` subcommand: print what the evidence learned (the config turns the logger off)."""
        callbacks = [c for c in self.trainer.callbacks if isinstance(c, MargLikCallback)]
        if callbacks and self.trainer.is_global_zero:
            model = self.model
            print(f"final log evidence / N (marglik): {callbacks[0].final_marglik:.4f}")
            print("prior precision:", [round(v, 4) for v in model.prior.precision.tolist()])
            if hasattr(model.likelihood, "sigma"):
                print(f"sigma: {model.likelihood.sigma.item():.4f}")


def build(
    model_class: type, data_class: type, config: str, overrides: Sequence[str] = (), run: bool = False
) -> LightningCLI:
    """Instantiate trainer (with its callbacks), model and data from ``config`` plus ``overrides``.

    Args:
        model_class, data_class: The LightningModule and DataModule classes.
        config: Path of a YAML with ``seed_everything``, ``trainer``, ``model`` and ``data``.
        overrides: Dotted command-line overrides such as ``"--model.depth=3"``.
        run: Let LightningCLI parse a subcommand (``fit``) and run it.
    """
    args: List[str] = list(overrides) if run else ["--config", config, *overrides]
    return MargLikCLI(
        model_class,
        data_class,
        args=args,
        run=run,
        save_config_callback=None,  # do not write config.yaml into the working directory
        parser_kwargs={"fit": {"default_config_files": [config]}} if run else None,
    )


class HyperparameterTrace(pl.Callback):
    """Record the hyperparameters after every training epoch (and once before the first).

    Put it after ``MargLikCallback`` (``trainer.callbacks.append``): it then sees the values the
    evidence steps of the epoch just wrote. ``rows``: ``{"epoch", "log_prior_precision" (list),
    "log_sigma"?}``.
    """

    def __init__(self) -> None:
        self.rows: List[Dict[str, Any]] = []

    def _record(self, epoch: int, pl_module: pl.LightningModule) -> None:
        row: Dict[str, Any] = {"epoch": epoch, "log_prior_precision": pl_module.prior.log_precision.tolist()}
        if hasattr(pl_module.likelihood, "log_sigma"):
            row["log_sigma"] = pl_module.likelihood.log_sigma.item()
        self.rows.append(row)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(0, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer.current_epoch + 1, pl_module)


def marglik_callback(trainer: pl.Trainer) -> MargLikCallback:
    found = [c for c in trainer.callbacks if isinstance(c, MargLikCallback)]
    if len(found) != 1:
        raise ValueError(f"the config must put exactly one MargLikCallback in trainer.callbacks, found {len(found)}")
    return found[0]


def fit(
    model_class: type,
    data_class: type,
    config: str,
    overrides: Sequence[str] = (),
    extra_callbacks: Sequence[pl.Callback] = (),
) -> Dict[str, Any]:
    """Train one model as configured and return it with its data, trainer, callback and timing.

    ``extra_callbacks`` run after the configured ones (e.g. a :class:`HyperparameterTrace`).
    """
    cli = build(model_class, data_class, config, overrides)
    cli.trainer.callbacks.extend(extra_callbacks)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - start
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, MargLikCallback)]
    return {
        "model": cli.model,
        "data": cli.datamodule,
        "trainer": cli.trainer,
        "callback": callbacks[0] if callbacks else None,
        "seconds": seconds,
    }


def evidence_per_datum(model: _MargLikMLP, data: _TensorData, structure: str = "kron", approx: str = "ggn") -> float:
    """Laplace log evidence / N of ``model`` at its current weights and hyperparameters (no steps)."""
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256)
    evidence = LaplaceEvidence.fit(model.net, loader, model.likelihood, model.prior, structure=structure, approx=approx)
    return evidence.log_marglik().item() / evidence.n_data


@torch.no_grad()
def classification_metrics(model: nn.Module, x: Tensor, y: Tensor) -> Dict[str, float]:
    """Accuracy and mean negative log-likelihood of a classifier."""
    model.eval()
    logits = model(x)
    return {
        "acc": (logits.argmax(1) == y).float().mean().item(),
        "nll": nn.functional.cross_entropy(logits, y).item(),
    }


def script_args(argv: Optional[Sequence[str]]) -> "tuple[bool, Optional[str], Optional[str], List[str]]":
    """``(quick, config, plot, overrides)`` from an example's command line.

    Script options: ``--quick`` (tiny settings for smoke tests), ``--config PATH`` (default
    ``configs/<name>.yaml``), ``--plot PATH`` / ``--no-plot``. ``plot`` is ``""`` for the default
    path under ``examples/results``, ``None`` for no plot; ``--quick`` implies ``--no-plot`` unless
    ``--plot`` is given, so smoke tests never overwrite the stored results. Everything else
    (``--trainer.max_epochs=5``, ``--model.width=20``, ...) is a LightningCLI override of the config.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    quick, config, plot, plot_given = False, None, "", False
    rest: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, _, value = arg.partition("=")
        if key in ("--config", "--plot"):
            if not _:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{key} needs a value")
                value, i = argv[i + 1], i + 1
            if key == "--config":
                config = value
            else:
                plot, plot_given = value, True
        elif arg == "--quick":
            quick = True
        elif arg == "--no-plot":
            plot, plot_given = None, True
        else:
            rest.append(arg)
        i += 1
    if quick and not plot_given:
        plot = None
    return quick, config, plot, rest


def split_args(argv: Optional[Sequence[str]]) -> "tuple[bool, Optional[str], List[str]]":
    """``(quick, config, overrides)`` from the script's command line (the rest goes to LightningCLI).

    Kept for other examples; :func:`script_args` also handles ``--plot``/``--no-plot``.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    config = None
    rest: List[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            config, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--config="):
            config = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return quick, config, rest


def markdown_table(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if (v == 0 or 1e-3 <= abs(v) < 1e4 or not math.isfinite(v)) else f"{v:.3e}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def script_main(
    argv: Optional[Sequence[str]],
    model_cls: type,
    data_cls: type,
    config: str,
    plot: str,
    run: Any,
    quick_overrides: Sequence[str],
    **quick_kwargs: Any,
) -> Dict[str, Any]:
    """The command line shared by the comparison examples.

    ``fit ...`` runs one plain LightningCLI fit of the config; otherwise ``run(config, overrides,
    plot=...)`` with the script options of :func:`script_args`, and ``--quick`` adds
    ``quick_overrides`` and ``quick_kwargs``.
    """
    quiet()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fit":  # plain LightningCLI: one model as configured
        build(model_cls, data_cls, config, argv, run=True)
        return {}
    quick, chosen, plot_path, overrides = script_args(argv)
    start = time.perf_counter()
    out = run(chosen or config, [*(quick_overrides if quick else []), *overrides],
              plot=plot if plot_path == "" else plot_path, **(quick_kwargs if quick else {}))
    print(f"total {time.perf_counter() - start:.1f} s")
    return out
