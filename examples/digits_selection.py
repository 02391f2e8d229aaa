"""Paper Sec. 5.2 (Fig. 5): architecture selection by the evidence on scikit-learn ``load_digits``.

MLPs of several widths/depths and small CNNs of several widths/depths are each trained once with
``MargLikCallback(structure="diag", approx="ef")`` (layerwise prior precisions learned online) by
:func:`lightning_marglik.select_models` (the ``marglik-select`` YAML front end). The candidates are
ranked by their final log evidence per datum, computed from the training data alone; the test
metrics (accuracy, NLL, ECE of the MAP softmax) are only reported. The script adds Spearman's rank
correlation between evidence and test accuracy (paper: 0.69 FMNIST, 0.97 CIFAR-10) and whether
the evidence prefers the CNNs.

Usage::

    python examples/digits_selection.py               # full run, ~10 min on 2 shared CPU cores
    python examples/digits_selection.py --quick       # smoke test: 4 candidates, 2 epochs
    python examples/digits_selection.py --config configs/digits_selection.yaml --output-dir DIR
    PYTHONPATH=examples marglik-select configs/digits_selection.yaml    # the ranking only

Writes ``examples/results/digits_selection/{results.csv,results.json,evidence.png}`` (from
``select_models``), ``examples/results/digits_selection.png`` and ``examples/results/digits_selection.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, Optional, Sequence

import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the YAML names digits_models.<Class>
    sys.path.insert(0, HERE)

from common import CONFIGS, RESULTS, markdown_table, quiet  # noqa: E402

from lightning_marglik.selection import select_from_config  # noqa: E402

CONFIG = os.path.join(CONFIGS, "digits_selection.yaml")
QUICK_CANDIDATES = ("mlp16x1", "mlp64x2", "cnn4x1", "cnn16x2")


def quick_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """Tiny settings for a smoke test: 4 candidates, 2 epochs, few hyperparameter steps."""
    config = dict(config)
    config["candidates"] = {k: v for k, v in config["candidates"].items() if k in QUICK_CANDIDATES}
    config["trainer"] = {**config.get("trainer", {}), "max_epochs": 2}
    config["callback"] = {**config.get("callback", {}), "frequency": 1, "steps": 5}
    return config


def family(name: str) -> str:
    return "CNN" if name.startswith("cnn") else "MLP"


def analyse(results) -> Dict[str, Any]:
    """Spearman correlations, ranks, and whether the evidence prefers the CNNs."""
    from scipy.stats import spearmanr

    marglik = np.array([r.marglik for r in results])
    acc = np.array([r.metrics["accuracy"] for r in results])
    nll = np.array([r.metrics["nll"] for r in results])
    ranks = {r.name: i + 1 for i, r in enumerate(results)}  # results come best evidence first
    acc_order = sorted(results, key=lambda r: -r.metrics["accuracy"])
    mean_rank = {f: float(np.mean([ranks[r.name] for r in results if family(r.name) == f])) for f in ("MLP", "CNN")}
    return {
        "rho_acc": float(spearmanr(marglik, acc).statistic),
        "rho_nll": float(spearmanr(marglik, -nll).statistic),
        "best_evidence": results[0].name,
        "best_accuracy": acc_order[0].name,
        "mean_rank": mean_rank,
        "cnn_preferred": family(results[0].name) == "CNN" and mean_rank["CNN"] < mean_rank["MLP"],
    }


def plot(results, path: str, stats: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    biggest = max(r.n_params for r in results)
    for ax, metric, label in ((axes[0], "accuracy", "test accuracy"), (axes[1], "nll", "test NLL")):
        for fam, color in (("MLP", "tab:blue"), ("CNN", "tab:orange")):
            rs = [r for r in results if family(r.name) == fam]
            ax.scatter([r.marglik for r in rs], [r.metrics[metric] for r in rs], c=color, label=fam, alpha=0.7,
                       s=[20 + 200 * r.n_params / biggest for r in rs])
            for r in rs:
                ax.annotate(r.name, (r.marglik, r.metrics[metric]), fontsize=7)
        ax.set_xlabel("log marginal likelihood / N (train data only)")
        ax.set_ylabel(label)
        ax.legend()
    axes[0].set_title(f"Spearman rho(evidence, acc) = {stats['rho_acc']:.2f}")
    axes[1].set_title(f"Spearman rho(evidence, -NLL) = {stats['rho_nll']:.2f}")
    fig.suptitle("load_digits: architecture selection by the Laplace evidence (diag-EF); size = #params")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_markdown(results, stats: Dict[str, Any], path: str, config: Dict[str, Any], command: str,
                   seconds: float) -> None:
    rows = [{"rank": i + 1, "candidate": r.name, "family": family(r.name), "marglik/N": r.marglik,
             "params": r.n_params, "test acc": r.metrics["accuracy"], "test NLL": r.metrics["nll"],
             "test ECE": r.metrics["ece"], "epochs": r.epochs, "train s": r.train_seconds}
            for i, r in enumerate(results)]
    cols = ["rank", "candidate", "family", "marglik/N", "params", "test acc", "test NLL", "test ECE", "epochs", "train s"]
    text = [
        "# Architecture selection on load_digits by the Laplace evidence",
        "",
        f"Command: `{command}` (config `configs/digits_selection.yaml`, total {seconds:.0f} s on 2 CPU cores).",
        f"Seed {config.get('seed', 0)} for every candidate (`pl.seed_everything`), data split seed "
        f"{config['data']['init_args'].get('seed', 0)}; trainer {config['trainer']}; callback {config['callback']}.",
        "Test metrics use the MAP softmax and are never used for the ranking.",
        "",
        markdown_table(rows, cols),
        "",
        f"* Spearman rho(evidence, test accuracy) = **{stats['rho_acc']:.3f}** (target >= 0.7; paper 0.69 FMNIST, 0.97 CIFAR-10)",
        f"* Spearman rho(evidence, -test NLL) = {stats['rho_nll']:.3f}",
        f"* best evidence: `{stats['best_evidence']}`; best test accuracy: `{stats['best_accuracy']}`",
        f"* mean evidence rank: MLP {stats['mean_rank']['MLP']:.2f}, CNN {stats['mean_rank']['CNN']:.2f} "
        f"-> CNN preferred: **{stats['cnn_preferred']}**",
        "",
        "![evidence vs test metrics](digits_selection.png)",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(text))


def run(config_path: str = CONFIG, quick: bool = False, output_dir: Optional[str] = None,
        results_dir: Optional[str] = RESULTS, argv: Sequence[str] = ()) -> Dict[str, Any]:
    quiet()
    with open(config_path) as f:
        config = yaml.safe_load(f)
    if quick:
        config = quick_config(config)
        config["output_dir"] = output_dir  # None: no files
        results_dir = None
    elif output_dir:
        config["output_dir"] = output_dir
    if config.get("output_dir") and not os.path.isabs(config["output_dir"]):
        config["output_dir"] = os.path.join(os.path.dirname(HERE), config["output_dir"])  # relative to the repo
    start = time.perf_counter()
    results = select_from_config(config)
    seconds = time.perf_counter() - start
    stats = analyse(results)
    print(f"Spearman rho(evidence, acc) = {stats['rho_acc']:.3f}, rho(evidence, -nll) = {stats['rho_nll']:.3f}, "
          f"best evidence {stats['best_evidence']}, mean rank {stats['mean_rank']}, total {seconds:.0f}s")
    if results_dir:
        os.makedirs(results_dir, exist_ok=True)
        plot(results, os.path.join(results_dir, "digits_selection.png"), stats)
        command = "python examples/digits_selection.py" + (" " + " ".join(argv) if argv else "")
        write_markdown(results, stats, os.path.join(results_dir, "digits_selection.md"), config, command, seconds)
    return {"results": results, "stats": stats, "seconds": seconds}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny settings, no files written")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--output-dir", help="overrides output_dir of the YAML")
    args = parser.parse_args(argv)
    run(args.config, args.quick, args.output_dir, argv=list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
