"""Paper Fig. 4: online prior-precision learning reaches the optimum of a grid search.

A scalar prior precision ``delta`` of a small MLP classifier (scikit-learn's breast-cancer data,
bundled offline) is learned online by ``MargLikCallback`` from three initializations
``delta_init in {1e-3, 1, 1e2}``. For the grid search, the same network is trained to the end with
each fixed ``delta`` (``GaussianPrior(learn=False)``), and the evidence of the trained network is
computed with ``LaplaceEvidence.fit(...).log_marglik()``; the grid optimum is the best of these.

Usage::

    python examples/prior_selection.py                 # full run, a few minutes on one CPU thread
    python examples/prior_selection.py --quick         # smoke test: 3 epochs, 3 grid points
    python examples/prior_selection.py --trainer.max_epochs=100   # any config override
    python examples/prior_selection.py --results       # rewrite examples/results/prior_selection.png

From Python (e.g. a test)::

    from prior_selection import run     # with examples/ on sys.path
    out = run(overrides=["--trainer.max_epochs=3"], inits=(1e-3, 1.0), grid=(0.1, 1.0))
    out["final_log_prior_precision"], out["grid_optimum"]

Writes ``outputs/prior_selection.png`` (``--output-dir``/``--results`` for elsewhere).
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("prior_selection: importing PyTorch, Lightning and scikit-learn ...", flush=True)

import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from common import CONFIGS, MLPClassifier, TensorData, accuracy_and_nll, configured, markdown_table, parse, parser  # noqa: E402
from lightning_marglik import LaplaceEvidence, MargLikCallback  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

CONFIG = os.path.join(CONFIGS, "prior_selection.yaml")
INITS = (1e-3, 1.0, 1e2)
GRID = tuple(float(v) for v in np.logspace(-3, 3, 13))
QUICK = ["--trainer.max_epochs=3", "--trainer.callbacks.init_args.frequency=1", "--trainer.callbacks.init_args.steps=5"]
QUICK_GRID = (1e-2, 1.0, 1e2)


class BreastCancerData(TensorData):
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


class HyperparameterTrace(pl.Callback):
    """Record ``log delta`` before the first epoch and after every epoch.

    Put it after ``MargLikCallback`` in ``trainer.callbacks``: it then sees the values the
    evidence steps of the epoch just wrote. ``rows``: ``[(epoch, log delta), ...]``.
    """

    def __init__(self) -> None:
        self.rows: List[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows.append((0, pl_module.prior.log_precision[0].item()))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows.append((trainer.current_epoch + 1, pl_module.prior.log_precision[0].item()))


def train(config: str, overrides: Sequence[str], trace: Optional[pl.Callback] = None) -> Dict[str, Any]:
    """Train the configured network; return it with its data, callback and seconds."""
    cli = configured(MLPClassifier, BreastCancerData, config, overrides)
    if trace is not None:
        cli.trainer.callbacks.append(trace)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, MargLikCallback))
    return {"model": cli.model, "data": cli.datamodule, "callback": callback, "seconds": time.perf_counter() - start}

def run(
    config: str = CONFIG,
    overrides: Sequence[str] = (),
    inits: Sequence[float] = INITS,
    grid: Sequence[float] = GRID,
    plot: Optional[str] = None,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Online runs from each ``delta_init`` and the fixed-``delta`` grid search.

    Returns:
        ``final_log_prior_precision``: ``{delta_init: final log delta}``;
        ``grid_optimum``: ``{"prior_precision", "log_prior_precision", "marglik"}`` of the best grid point;
        ``grid``: one row per grid point; ``online``: one row per initialization;
        ``traces``: ``{delta_init: [(epoch, log delta), ...]}``.
    """
    online: List[Dict[str, Any]] = []
    traces: Dict[float, List[Any]] = {}
    for init in inits:
        trace = HyperparameterTrace()
        result = train(config, [*overrides, f"--model.prior_precision={init}", "--model.learn_prior=true"], trace)
        model, data, callback = result["model"], result["data"], result["callback"]
        traces[init] = trace.rows
        test = accuracy_and_nll(model, data.x_test, data.y_test)
        on_train = accuracy_and_nll(model, data.x_train, data.y_train)
        online.append({
            "delta_init": init,
            "final_log_delta": model.prior.log_precision.item(),
            "final_delta": model.prior.precision.item(),
            "marglik": callback.final_marglik,
            "train_acc": on_train["acc"],
            "test_acc": test["acc"],
            "test_nll": test["nll"],
            "seconds": result["seconds"],
        })
        if verbose:
            print(f"online  delta_init={init:g}: final log delta {online[-1]['final_log_delta']:.3f} "
                  f"(delta {online[-1]['final_delta']:.4g}), marglik {callback.final_marglik:.4f}, "
                  f"{result['seconds']:.1f} s", flush=True)

    rows: List[Dict[str, Any]] = []
    for delta in grid:
        result = train(config, [
            *overrides, f"--model.prior_precision={delta}", "--model.learn_prior=false",
            "--trainer.callbacks.init_args.frequency=1000000",  # only the final estimate (nothing to learn)
        ])
        model, data, callback = result["model"], result["data"], result["callback"]
        # The evidence of the trained network at the fixed delta, straight from the engine:
        loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256)
        evidence = LaplaceEvidence.fit(model.net, loader, model.likelihood, model.prior, structure=callback.structure,
                                       approx=callback.approx)
        marglik = evidence.log_marglik().item() / evidence.n_data
        test = accuracy_and_nll(model, data.x_test, data.y_test)
        on_train = accuracy_and_nll(model, data.x_train, data.y_train)
        rows.append({
            "delta": delta,
            "log_delta": math.log(delta),
            "marglik": marglik,
            "callback_marglik": callback.final_marglik,
            "train_acc": on_train["acc"],
            "test_acc": test["acc"],
            "test_nll": test["nll"],
            "seconds": result["seconds"],
        })
        if verbose:
            print(f"grid    delta={delta:<8.3g} log evidence/N {marglik:.4f}  test acc {test['acc']:.3f}  "
                  f"{result['seconds']:.1f} s", flush=True)
    finite = [r for r in rows if math.isfinite(r["marglik"])]
    best = max(finite, key=lambda r: r["marglik"]) if finite else None
    grid_optimum = (
        {"prior_precision": best["delta"], "log_prior_precision": best["log_delta"], "marglik": best["marglik"]}
        if best else {"prior_precision": math.nan, "log_prior_precision": math.nan, "marglik": math.nan}
    )
    out = {
        "final_log_prior_precision": {r["delta_init"]: r["final_log_delta"] for r in online},
        "grid_optimum": grid_optimum,
        "grid": rows,
        "online": online,
        "traces": traces,
    }
    if verbose:
        print(markdown_table(online, ["delta_init", "final_log_delta", "final_delta", "marglik", "train_acc", "test_acc",
                                      "test_nll", "seconds"]))
        print(markdown_table(rows, ["delta", "log_delta", "marglik", "callback_marglik", "train_acc", "test_acc",
                                    "test_nll", "seconds"]))
        print(f"grid optimum: delta {grid_optimum['prior_precision']:.4g} "
              f"(log delta {grid_optimum['log_prior_precision']:.3f}), log evidence/N {grid_optimum['marglik']:.4f}")
    if plot:
        make_plot(out, plot)
        if verbose:
            print(f"saved {plot}")
    return out


def make_plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    best = out["grid_optimum"]["log_prior_precision"]
    for i, (init, trace) in enumerate(out["traces"].items()):
        epochs, values = zip(*trace)
        left.plot(epochs, values, color=f"C{i}", lw=2, label=rf"online, $\delta_0$ = {init:g}")
    if math.isfinite(best):
        left.axhline(best, color="k", ls="--", lw=1, label="grid-search optimum")
    left.set_xlabel("epoch")
    left.set_ylabel(r"$\log \delta$")
    left.set_title("online prior precision (Algorithm 1)")
    left.legend(fontsize=8)

    grid = out["grid"]
    right.plot([r["log_delta"] for r in grid], [r["marglik"] for r in grid], "ko-", ms=4,
               label="grid: trained with fixed $\\delta$")
    for i, row in enumerate(out["online"]):
        right.plot(row["final_log_delta"], row["marglik"], marker="*", ms=14, color=f"C{i}", ls="none",
                   label=rf"online end, $\delta_0$ = {row['delta_init']:g}")
    if math.isfinite(best):
        right.axvline(best, color="k", ls="--", lw=1)
    right.set_xlabel(r"$\log \delta$")
    right.set_ylabel("log evidence / N")
    right.set_title("evidence of the trained network")
    right.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args, overrides = parse(parser(__doc__, CONFIG), argv, QUICK)
    start = time.perf_counter()
    with quiet_lightning():
        out = run(args.config, overrides, grid=QUICK_GRID if args.quick else GRID,
                  plot=os.path.join(args.output_dir, "prior_selection.png"))
    print(f"total {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    main()
