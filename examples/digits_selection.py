"""Paper Sec. 5.2 (Fig. 5): architecture selection by the evidence on scikit-learn ``load_digits``.

Seven MLPs and seven small CNNs (``digits_models.py``) are each trained once with
``MargLikCallback(structure="diag", approx="ef")`` (layerwise prior precisions learned online) by
``marglik-select configs/digits_selection.yaml`` (:func:`lightning_marglik.select_models`). The
candidates are ranked by their final log evidence per datum, computed from the training data
alone; the test metrics (accuracy, NLL, ECE of the MAP softmax) are only reported. This script
adds Spearman's rank correlation between evidence and test accuracy (paper: 0.69 FMNIST, 0.97
CIFAR-10) and whether the evidence prefers the CNNs.

Usage (every ``marglik-select`` option works, see ``marglik-select --help``)::

    python examples/digits_selection.py               # full run, ~10 min on one CPU thread
    python examples/digits_selection.py --quick       # smoke test: 1 epoch of 2 batches per candidate
    python examples/digits_selection.py --trainer.max_epochs=30 --callback.structure=kron
    python examples/digits_selection.py --results     # rewrite examples/results/digits_selection{/,.md}
    PYTHONPATH=examples marglik-select configs/digits_selection.yaml    # the ranking only

A killed run resumes: finished candidates are reused (``--rerun`` trains them again). Writes
``outputs/digits_selection/{results.csv,results.json,evidence.png}`` and ``outputs/digits_selection.md``.
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("digits_selection: importing PyTorch, Lightning and scikit-learn ...", flush=True)

import sys  # noqa: E402
from typing import Any, Dict, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from common import markdown_table, select  # noqa: E402


def family(name: str) -> str:
    return "CNN" if name.startswith("cnn") else "MLP"


def analyse(results) -> Dict[str, Any]:
    """Spearman correlations, ranks, and whether the evidence prefers the CNNs."""
    from scipy.stats import spearmanr

    marglik = np.array([r.marglik for r in results])
    acc = np.array([r.metrics["accuracy"] for r in results])
    nll = np.array([r.metrics["nll"] for r in results])
    ranks = {r.name: i + 1 for i, r in enumerate(results)}  # results come best evidence first
    mean_rank = {f: float(np.mean([ranks[r.name] for r in results if family(r.name) == f])) for f in ("MLP", "CNN")}
    return {
        "rho_acc": float(spearmanr(marglik, acc).statistic),
        "rho_nll": float(spearmanr(marglik, -nll).statistic),
        "best_evidence": results[0].name,
        "best_accuracy": max(results, key=lambda r: r.metrics["accuracy"]).name,
        "mean_rank": mean_rank,
        "cnn_preferred": family(results[0].name) == "CNN" and mean_rank["CNN"] < mean_rank["MLP"],
    }


def summary(results, stats: Dict[str, Any], config: Dict[str, Any], command: str, seconds: float, figure: str) -> str:
    rows = [{"rank": i + 1, "candidate": r.name, "family": family(r.name), "marglik/N": r.marglik,
             "params": r.n_params, "test acc": r.metrics["accuracy"], "test NLL": r.metrics["nll"],
             "test ECE": r.metrics["ece"], "epochs": r.epochs, "train s": r.train_seconds}
            for i, r in enumerate(results)]
    return "\n".join([
        "# Architecture selection on load_digits by the Laplace evidence",
        "",
        f"Command: `{command}` (config `configs/digits_selection.yaml`, total {seconds:.0f} s on 2 CPU cores).",
        f"Seed {config['seed']} for every candidate (`pl.seed_everything`), data {config['data']}; "
        f"trainer {config['trainer']}; callback {config['callback']}.",
        "Test metrics use the MAP softmax and are never used for the ranking.",
        "",
        markdown_table(rows, list(rows[0])),
        "",
        f"* Spearman rho(evidence, test accuracy) = **{stats['rho_acc']:.3f}** (paper 0.69 FMNIST, 0.97 CIFAR-10)",
        f"* Spearman rho(evidence, -test NLL) = {stats['rho_nll']:.3f}",
        f"* best evidence: `{stats['best_evidence']}`; best test accuracy: `{stats['best_accuracy']}`",
        f"* mean evidence rank: MLP {stats['mean_rank']['MLP']:.2f}, CNN {stats['mean_rank']['CNN']:.2f} "
        f"-> CNN preferred: **{stats['cnn_preferred']}**",
        "",
        f"![evidence vs test accuracy]({figure})",
        "",
    ])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    results, output_dir, config, seconds = select("digits_selection", argv)
    stats = analyse(results)
    print(f"Spearman rho(evidence, acc) = {stats['rho_acc']:.3f}, rho(evidence, -nll) = {stats['rho_nll']:.3f}, "
          f"best evidence {stats['best_evidence']}, mean rank {stats['mean_rank']}, total {seconds:.0f} s")
    command = " ".join(["python examples/digits_selection.py", *argv])
    figure = f"{output_dir.rstrip('/').rpartition('/')[2]}/evidence.png"  # relative to the summary next to the directory
    with open(output_dir.rstrip("/") + ".md", "w") as f:
        f.write(summary(results, stats, config, command, seconds, figure))
    print(f"summary in {output_dir.rstrip('/')}.md")
    return {"results": results, "stats": stats, "seconds": seconds}


if __name__ == "__main__":
    main()
