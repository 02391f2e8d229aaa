"""Accuracy of MargLikCallback(statistics="training") against the evidence pass at the same epochs.

    python benchmarks/investigations/training_statistics_accuracy.py      # writes results/training_statistics_accuracy.md

1. Same weights up to the estimate: ``frequency`` = the number of epochs, so all fits train
   identically until their only estimate; the learned log δ (layerwise, kron-EF and diag-EF,
   Newton) then differ only by what the training sums see (the epoch's moving weights, and with
   ``statistics_fraction`` < 1 only the epoch's last batches) and the pass does not (the
   end-of-epoch weights). MLP of ``benchmarks/callback.py``, N=10,000, 40 batches per epoch.
2. Paper Fig. 4 setting (``examples/prior_selection.py``: breast-cancer MLP, scalar δ from three
   initializations), with kron-EF, 150 epochs, F=5, minibatches of 64 (also with
   ``statistics_fraction=0.25``) and full batch: final log δ and test NLL with the pass and with the
   training sums (here the trajectories differ after the first estimate).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
    sys.path.insert(0, str(path))

import torch  # noqa: E402

import callback as bench  # noqa: E402
from _common import RESULTS, load_avg, now  # noqa: E402
from engine import make_problem  # noqa: E402
from lightning_marglik import MargLikCallback  # noqa: E402

OUTPUT = RESULTS / "training_statistics_accuracy.md"
FRACTIONS = (1.0, 0.25, 0.125)  # statistics_fraction of the training sums in part 1


def same_weights() -> list:
    rows = []
    for structure in ("diag", "kron"):
        for epochs in (1, 3):
            res = {}
            for source, fraction in [("pass", 1.0)] + [("training", f) for f in FRACTIONS]:
                net, data, _ = make_problem("mlp", 10_000, 256, seed=0, quick=False)
                module = bench.Module(net, 10_000)
                callback = MargLikCallback(structure=structure, approx="ef", frequency=epochs, statistics=source,
                                           statistics_fraction=fraction)
                bench.trainer(epochs, callback).fit(module, data)
                res[source, fraction] = (module.prior.log_precision.detach().reshape(-1), callback.history[-1]["marglik"])
            reference = res["pass", 1.0]
            cells = [f"{float((reference[0] - res['training', f][0]).abs().max()):.4f} ({res['training', f][1]:.4f})"
                     for f in FRACTIONS]
            rows.append(f"| {structure}-EF | {epochs} | {reference[1]:.4f} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    return rows


def fig4() -> list:
    from prior_selection import run

    rows = []
    for batch_size, fraction in ((64, 1.0), (64, 0.25), (0, 1.0)):
        out = {}
        for source in ("pass", "training"):
            out[source] = run(overrides=[
                "--trainer.callbacks.init_args.structure=kron", "--trainer.callbacks.init_args.approx=ef",
                f"--trainer.callbacks.init_args.statistics={source}", f"--data.batch_size={batch_size}",
                f"--trainer.callbacks.init_args.statistics_fraction={fraction if source == 'training' else 1.0}",
                "--trainer.max_epochs=150"], grid=(), verbose=False)["online"]
        for a, b in zip(out["pass"], out["training"]):
            rows.append(
                f"| {batch_size or 'full'} | {fraction:g} | {a['delta_init']:g} | {a['final_log_delta']:.3f} | "
                f"{b['final_log_delta']:.3f} | {abs(a['final_log_delta'] - b['final_log_delta']):.3f} | "
                f"{a['test_nll']:.4f} | {b['test_nll']:.4f} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: --help only
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    start, load = now(), load_avg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    first, second = same_weights(), fig4()
    text = "\n".join([
        "# statistics='training': hyperparameters against the end-of-epoch evidence pass",
        "",
        f"`python benchmarks/investigations/training_statistics_accuracy.py`, commit {commit}, {start}, load average {load:.1f} "
        "(see the script's docstring).",
        "",
        "## Same weights up to the estimate (MLP, N=10,000, layerwise δ, Newton)",
        "",
        "Cells of the training sums: the largest absolute difference of log δ to the pass's (the marglik per datum "
        "after the estimate).",
        "",
        "| structure | epochs before the estimate | marglik (pass) | training, all batches | "
        "statistics_fraction=0.25 | statistics_fraction=0.125 |",
        "|---|---|---|---|---|---|",
        *first,
        "",
        "## Paper Fig. 4 setting, kron-EF, 150 epochs, F=5",
        "",
        "| batch | statistics_fraction | δ init | final log δ (pass) | final log δ (training) | abs. difference | "
        "test NLL (pass) | test NLL (training) |",
        "|---|---|---|---|---|---|---|---|",
        *second,
        "",
    ])
    print(text)
    OUTPUT.write_text(text)


if __name__ == "__main__":
    main()
