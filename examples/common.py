"""What the examples share: an MLP LightningModule, in-memory data, the YAML configs, the command line.

* ``MLPRegressor`` / ``MLPClassifier``: the pattern of the README's quick start (a plain
  ``nn.Sequential`` with a ``GaussianPrior`` and a likelihood, trained with ``map_loss``).
* ``TensorData``: a LightningDataModule over in-memory train/test tensors.
* ``configured``: trainer (with its ``MargLikCallback``), model and data from a YAML under
  ``configs/`` plus LightningCLI overrides such as ``--trainer.max_epochs=5``.
* ``parse``: the options every example has: ``--quick``, ``--threads``, ``--output-dir``,
  ``--results``, ``--config``; any other argument is a LightningCLI override.
* ``select``: ``marglik-select`` over ``configs/<name>.yaml`` for the architecture-selection examples.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, map_loss
from lightning_marglik.selection import DEFAULT_THREADS, run_command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
OUTPUTS = os.path.join(ROOT, "outputs")  # ignored by git: what a run writes by default
RESULTS = os.path.join(ROOT, "examples", "results")  # committed: rewritten only with --results

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


class MapModule(pl.LightningModule):
    """``net`` trained on ``map_loss`` under ``prior`` and ``likelihood``: the recipe the examples share.

    Adam at ``lr`` over the trainable parameters, without weight decay (the prior *is* the weight decay);
    a subclass builds the network and may override :meth:`configure_optimizers` (a schedule).
    """

    def __init__(self, net: nn.Module, prior: GaussianPrior, likelihood: Any, n_data: int, lr: float) -> None:
        super().__init__()
        self.net, self.prior, self.likelihood = net, prior, likelihood
        self.n_data, self.lr = n_data, lr

    def forward(self, x: Tensor) -> Tensor:  # the evidence pass calls forward(x)
        return self.net(x)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.net.parameters() if p.requires_grad], lr=self.lr)


def cosine_schedule(optimizer: torch.optim.Optimizer, max_epochs: int, lr_min: float) -> Any:
    """``optimizer`` cosine-annealed to ``lr_min`` over ``max_epochs``, as ``configure_optimizers`` returns it."""
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs, eta_min=lr_min)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


def quick_or_results(options: argparse.ArgumentParser, quick: str, results: str) -> None:
    """Add ``--quick`` and ``--results``, which never go together: a smoke test's figures must not replace the
    committed ones."""
    either = options.add_mutually_exclusive_group()
    either.add_argument("--quick", action="store_true", help=quick)
    either.add_argument("--results", action="store_true", help=results)


def study_options(doc: str, name: str, quick: str, plot: bool = False) -> argparse.ArgumentParser:
    """The options of a study example (``--quick``, ``--results``, ``--output-dir``, ``--threads``); it adds its seeds."""
    options = argparse.ArgumentParser(description=doc.split("\n")[0])
    quick_or_results(options, f"smoke test: {quick}",
                     f"write the table{' and plot' if plot else ''} to examples/results/")
    options.add_argument("--output-dir", default=os.path.join(OUTPUTS, name))
    options.add_argument("--threads", type=int, default=1)
    return options


def write_report(name: str, argv: Optional[Sequence[str]], target: str, markdown: Callable[[str], str],
                 plot: Optional[Callable[[str], None]] = None) -> None:
    """Write ``<target>/<name>.md`` (``markdown`` of the command that reran it) and the plot, if any."""
    os.makedirs(target, exist_ok=True)
    command = f"python examples/{name}.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(os.path.join(target, f"{name}.md"), "w") as f:
        f.write(markdown(command.strip()))
    if plot is not None:
        plot(os.path.join(target, f"{name}.png"))


class _MLP(MapModule):
    """An MLP with ``depth`` hidden layers of ``width`` units and a ``GaussianPrior`` over it.

    Subclasses choose the likelihood. Adam without weight decay (the prior *is* the weight decay),
    cosine-annealed from ``lr`` to ``lr_min`` over ``max_epochs`` (no schedule if ``lr_min >= lr``).
    """

    def __init__(self, n_data: int, in_features: int, out_features: int, width: int, depth: int, activation: str,
                 prior_precision: float, prior_structure: str, learn_prior: bool, lr: float, lr_min: float,
                 likelihood: nn.Module) -> None:
        layers: List[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), ACTIVATIONS[activation]()]
        net = nn.Sequential(*layers, nn.Linear(width if depth else in_features, out_features))
        prior = GaussianPrior(net, precision=prior_precision, structure=prior_structure, learn=learn_prior)
        super().__init__(net, prior, likelihood, n_data, lr)
        self.lr_min = lr_min

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if self.lr_min >= self.lr or not self.trainer.max_epochs or self.trainer.max_epochs < 0:
            return optimizer
        return cosine_schedule(optimizer, self.trainer.max_epochs, self.lr_min)


class MLPRegressor(_MLP):
    """MLP regression with a Gaussian likelihood whose noise ``sigma`` the evidence learns.

    Args:
        n_data: Training set size ``N`` (linked from the data by :func:`configured`).
        in_features, out_features: Input and output dimension.
        width, depth: Units per hidden layer and number of hidden layers (0: linear).
        activation: ``"tanh"``, ``"relu"`` or ``"gelu"``.
        prior_precision, prior_structure, learn_prior: Initial ``delta``, ``"scalar"``/``"layerwise"``/
            ``"diagonal"``, and whether the evidence learns it (False: a fixed weight decay).
        sigma, learn_sigma: Initial observation noise and whether the evidence learns it.
        lr, lr_min: Adam learning rate, cosine-annealed to ``lr_min``.
    """

    def __init__(self, n_data: int = 1, in_features: int = 1, out_features: int = 1, width: int = 50, depth: int = 1,
                 activation: str = "tanh", prior_precision: float = 1.0, prior_structure: str = "layerwise",
                 learn_prior: bool = True, sigma: float = 1.0, learn_sigma: bool = True, lr: float = 1e-2,
                 lr_min: float = 1e-3) -> None:
        super().__init__(n_data, in_features, out_features, width, depth, activation, prior_precision, prior_structure,
                         learn_prior, lr, lr_min, GaussianLikelihood(sigma=sigma, learn_sigma=learn_sigma))


class MLPClassifier(_MLP):
    """MLP classification with a categorical likelihood (softmax over ``out_features`` logits).

    Args: as :class:`MLPRegressor`, without the noise.
    """

    def __init__(self, n_data: int = 1, in_features: int = 2, out_features: int = 2, width: int = 50, depth: int = 2,
                 activation: str = "tanh", prior_precision: float = 1.0, prior_structure: str = "layerwise",
                 learn_prior: bool = True, lr: float = 1e-2, lr_min: float = 1e-3) -> None:
        super().__init__(n_data, in_features, out_features, width, depth, activation, prior_precision, prior_structure,
                         learn_prior, lr, lr_min, CategoricalLikelihood())


class TensorData(pl.LightningDataModule):
    """In-memory ``x_train, y_train, x_test, y_test`` set by a subclass's ``__init__`` (so ``n_train`` is known at once).

    ``batch_size <= 0``: full batch.
    """

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
        generator = torch.Generator().manual_seed(0) if shuffle else None
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size if self.batch_size > 0 else len(x),
                          shuffle=shuffle, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.x_train, self.y_train, shuffle=self.batch_size > 0)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.x_test, self.y_test, shuffle=False)


class _LinkedCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.n_train", "model.n_data", apply_on="instantiate")  # N for map_loss


def configured(model_class: type, data_class: type, config: str, overrides: Sequence[str] = ()) -> LightningCLI:
    """Trainer, model and data (``.trainer``, ``.model``, ``.datamodule``) of ``config`` with ``overrides``.

    The model's ``n_data`` is the data's ``n_train``. Nothing is trained.
    """
    with warnings.catch_warnings():  # the script's own options are in sys.argv: LightningCLI need not see them
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        return _LinkedCLI(model_class, data_class, args=["--config", config, *overrides], run=False,
                          save_config_callback=None)  # do not write config.yaml into the working directory


def parser(description: str, config: str) -> argparse.ArgumentParser:
    """The options every example has; an example may add its own before :func:`parse`."""
    found = argparse.ArgumentParser(
        description=description, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other argument is a LightningCLI override of the config, e.g. --trainer.max_epochs=5.",
    )
    found.add_argument("--config", default=config, help="YAML with trainer, model and data (default: %(default)s)")
    quick_or_results(found, "smoke test: a few epochs (seconds)", "rewrite the committed examples/results/ instead")
    found.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                       help="torch threads (default %(default)s: fastest for these small models, see docs/install.md)")
    found.add_argument("--output-dir", help="where plots and tables go (default: outputs/, ignored by git)")
    return found


def parse(options: argparse.ArgumentParser, argv: Optional[Sequence[str]], quick: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """``(options, overrides)``; ``--quick`` puts ``quick`` before the user's own overrides, which win."""
    args, overrides = options.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    args.output_dir = args.output_dir or (RESULTS if args.results else OUTPUTS)
    return args, [*(quick if args.quick else ()), *overrides]


def library_state() -> str:
    """``HEAD <commit>`` and whether ``lightning_marglik/`` had uncommitted changes when this process
    imported the library: read once at import, since a run saved later executes the code imported then,
    whatever was committed in between."""
    return _LIBRARY_STATE


def _read_library_state() -> str:
    import subprocess

    if os.environ.get("LIGHTNING_MARGLIK_COMMIT"):  # a copied tree (a lent device machine): what its sender named
        return os.environ["LIGHTNING_MARGLIK_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_marglik"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        head, dirty = "", ""
    if not head:
        return "unknown"
    return f"HEAD {head}" + (" with uncommitted changes in lightning_marglik/" if dirty else "")


_LIBRARY_STATE = _read_library_state()

@torch.no_grad()
def accuracy_and_nll(model: nn.Module, x: Tensor, y: Tensor) -> Dict[str, float]:
    """Accuracy and mean negative log-likelihood of a classifier's softmax."""
    logits = model.eval()(x)
    return {"acc": (logits.argmax(1) == y).float().mean().item(), "nll": nn.functional.cross_entropy(logits, y).item()}


def markdown_table(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a markdown table, floats to 4 significant digits."""
    def cell(v: Any) -> str:
        if isinstance(v, float) and math.isfinite(v) and v != 0 and not 1e-3 <= abs(v) < 1e4:
            return f"{v:.3e}"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows])


def select(name: str, argv: Optional[Sequence[str]]) -> Tuple[List[Any], str, Dict[str, Any], float]:
    """``marglik-select configs/<name>.yaml`` with the script's arguments.

    Every ``marglik-select`` option works (``--quick``, ``--threads``, ``--rerun``,
    ``--trainer.max_epochs=5``, ...); the results go to ``outputs/<name>/``, or with
    ``--results`` to the committed ``examples/results/<name>/``, unless ``--output_dir`` says otherwise.

    Returns:
        The results (best evidence first), the output directory, the configuration used and the seconds taken.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "--results" in args and "--quick" in args:
        sys.exit(f"{name}: --quick and --results go apart: a smoke test's figures must not replace the committed ones.")
    into = RESULTS if "--results" in args else OUTPUTS
    args = [a for a in args if a != "--results"]
    start = time.perf_counter()
    results, config = run_command_line([os.path.join(CONFIGS, f"{name}.yaml"), f"--output_dir={os.path.join(into, name)}", *args])
    return results, config["output_dir"], config, time.perf_counter() - start
