"""Paper Fig. 4: online prior-precision learning reaches the optimum of a grid search.

A scalar prior precision ``delta`` of a small MLP classifier (scikit-learn's breast-cancer data,
bundled offline) is learned online by ``MargLikCallback`` from three initializations
``delta_init in {1e-3, 1, 1e2}``. For the grid search, the same network is trained to the end with
each fixed ``delta`` (``GaussianPrior(learn=False)``), and the evidence of the trained network is
computed with ``LaplaceEvidence.fit(...).log_marglik()``; the grid optimum is the best of these.

Usage::

    python examples/prior_selection.py                 # full run, a few minutes on CPU
    python examples/prior_selection.py --quick         # smoke test: 3 epochs, 3 grid points, no plot
    python examples/prior_selection.py --trainer.max_epochs=100   # any config override
    python examples/prior_selection.py fit --config configs/prior_selection.yaml   # one plain fit

From Python (e.g. a test)::

    from prior_selection import run     # with examples/ on sys.path
    out = run(overrides=["--trainer.max_epochs=3"], inits=(1e-3, 1.0), grid=(0.1, 1.0), plot=None)
    out["final_log_prior_precision"], out["grid_optimum"]

Script options: ``--config PATH``, ``--plot PATH``, ``--no-plot``, ``--quick``; the rest are
LightningCLI overrides of the config. Writes ``examples/results/prior_selection.png``.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

try:
    from .common import (CONFIGS, RESULTS, BreastCancerData, HyperparameterTrace, MLPClassifier,
                         classification_metrics, evidence_per_datum, fit, markdown_table, script_main)
except ImportError:  # run as a script: examples/ is on sys.path
    from common import (CONFIGS, RESULTS, BreastCancerData, HyperparameterTrace, MLPClassifier,
                        classification_metrics, evidence_per_datum, fit, markdown_table, script_main)

CONFIG = os.path.join(CONFIGS, "prior_selection.yaml")
PLOT = os.path.join(RESULTS, "prior_selection.png")
INITS = (1e-3, 1.0, 1e2)
GRID = tuple(float(v) for v in np.logspace(-3, 3, 13))
QUICK = ["--trainer.max_epochs=3", "--trainer.callbacks.init_args.frequency=1", "--trainer.callbacks.init_args.steps=5"]
QUICK_GRID = (1e-2, 1.0, 1e2)


def _structure(result: Dict[str, Any]) -> "tuple[str, str]":
    callback = result["callback"]
    return (callback.structure, callback.approx) if callback is not None else ("kron", "ggn")


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
        result = fit(MLPClassifier, BreastCancerData, config,
                     [*overrides, f"--model.prior_precision={init}", "--model.learn_prior=true"], [trace])
        model, data, callback = result["model"], result["data"], result["callback"]
        traces[init] = [(r["epoch"], r["log_prior_precision"][0]) for r in trace.rows]
        test = classification_metrics(model, data.x_test, data.y_test)
        train = classification_metrics(model, data.x_train, data.y_train)
        online.append({
            "delta_init": init,
            "final_log_delta": model.prior.log_precision.item(),
            "final_delta": model.prior.precision.item(),
            "marglik": callback.final_marglik,
            "train_acc": train["acc"],
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
        result = fit(MLPClassifier, BreastCancerData, config, [
            *overrides, f"--model.prior_precision={delta}", "--model.learn_prior=false",
            "--trainer.callbacks.init_args.frequency=1000000",  # only the final estimate (nothing to learn)
        ])
        model, data = result["model"], result["data"]
        structure, approx = _structure(result)
        marglik = evidence_per_datum(model, data, structure, approx)  # LaplaceEvidence.fit(...).log_marglik() / N
        test = classification_metrics(model, data.x_test, data.y_test)
        train = classification_metrics(model, data.x_train, data.y_train)
        rows.append({
            "delta": delta,
            "log_delta": math.log(delta),
            "marglik": marglik,
            "callback_marglik": result["callback"].final_marglik if result["callback"] is not None else math.nan,
            "train_acc": train["acc"],
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
    return script_main(argv, MLPClassifier, BreastCancerData, CONFIG, PLOT, run, QUICK, grid=QUICK_GRID)


if __name__ == "__main__":
    main()
