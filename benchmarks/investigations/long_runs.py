"""The defaults in runs long enough for the training loss to settle (issue 23: a user must never lose accuracy).

``benchmarks/never_worse.py`` trains 12 epochs, where the default ``settle=0.05`` rarely fires, so the
defaults there mostly train at delta = 1 until their one estimate at the end. This script trains the
five image networks of ``benchmarks/_zoo.py`` on MNIST-5k (500 train / 500 test, 14x14; Adam batch 32,
lr 3e-3, Fixup 1e-2) for ``EPOCHS`` epochs, long enough to settle, and compares on the same seeds:

* ``defaults``: ``MargLikCallback()`` as shipped (the learned prior fed back once the loss has settled);
* ``Algorithm 1``: ``MargLikCallback(settle=None, max_step=None, biases="learn")`` (every precision
  learned and fed back from epoch 1, each estimate solved to convergence: the defaults before issue 23);
* ``delta=1`` and ``delta=0.1``: the prior fixed (no callback).

Columns: test accuracy and NLL (mean over seeds), the defaults' gap to delta = 1, the epoch the loss
settled in (per seed) and the number of estimates, the largest learned weight-decay log delta rise.

Usage::

    python benchmarks/investigations/long_runs.py                 # trains what is not cached, writes benchmarks/results/long_runs.md
    python benchmarks/investigations/long_runs.py --seeds 0 --networks mlp
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the shared harness

import _zoo  # noqa: E402
from _common import RESULTS, hand_written, now, write_with_data  # noqa: E402
from common import library_state  # noqa: E402  (examples/common.py, on the path through _zoo)

NAME = "long_runs"
NETWORKS = ("mlp", "cnn", "bn_resnet", "fixup_resnet", "gn_cnn")
EPOCHS = 40
LR = {"fixup_resnet": 1e-2}
ARMS: Dict[str, Dict[str, Any]] = {
    "defaults": {"callback": {}},
    "Algorithm 1": {"callback": {"settle": None, "max_step": None, "biases": "learn"}},
    "delta=1": {},
    "delta=0.1": {"precision": 0.1},
}


def spec(network: str, seed: int, arm: str) -> _zoo.RunSpec:
    return _zoo.RunSpec(network=network, dataset="mnist", seed=seed, epochs=EPOCHS, n_train=500, n_test=500,
                        batch_size=32, lr=LR.get(network, 3e-3), **ARMS[arm])


def summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    start = [math.log(r["spec"]["precision"]) for r in runs]
    wd = max((v - s for r, s in zip(runs, start) for row in r["trace"] for v in row["wd_log_delta"]), default=0.0)
    return {
        "acc": float(np.mean([r["final"]["acc"] for r in runs])), "nll": float(np.mean([r["final"]["nll"] for r in runs])),
        "estimates": [len(r["history"]) for r in runs],
        "first_estimate": [r["history"][0]["epoch"] if r["history"] else None for r in runs],
        "wd_rise": wd, "libraries": sorted({r["library"] for r in runs}),
        "cpu": float(np.mean([r["cpu_seconds"] for r in runs])),
    }


def markdown(table: Dict[str, Dict[str, Dict[str, Any]]], seeds: Sequence[int], command: str, seconds: float) -> str:
    libraries = sorted({lib for by in table.values() for s in by.values() for lib in s["libraries"]})
    lines = [
        "# The defaults in runs long enough to settle (issue 23)", "",
        f"Date: {now()}. Library: {'; '.join(libraries)} (this process: {library_state()}). Command: `{command}`; "
        f"{seconds / 60:.1f} min wall for this invocation (cached runs are not retrained); one CPU thread.", "",
        f"MNIST-5k, 500 train / 500 test, 14x14, Adam batch 32 (lr 3e-3, Fixup 1e-2), {EPOCHS} epochs, layerwise "
        f"prior from delta = 1 (delta=0.1: fixed at 0.1), seeds {', '.join(map(str, seeds))}; means over seeds. "
        "`first estimate`: the epoch of each seed's first estimate (for the defaults: the epoch after the loss "
        "settled; 40 = never settled, the one estimate at the end); `wd rise`: the largest log delta above its "
        "start that the MAP loss used.", "",
        "| network | arm | test acc | vs delta=1 (points) | test NLL | first estimate (per seed) | estimates | wd rise "
        "| CPU s |",
        "|---|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for network, by in table.items():
        ref = by.get("delta=1")
        for arm, s in by.items():
            gap = f"{100 * (s['acc'] - ref['acc']):+.1f}" if ref else ""
            first = ", ".join("-" if e is None else str(e) for e in s["first_estimate"])
            lines.append(f"| {network} | {arm} | {s['acc']:.4f} | {gap} | {s['nll']:.4f} | {first} | "
                         f"{', '.join(map(str, s['estimates']))} | {s['wd_rise']:.1f} | {s['cpu']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = os.path.join(_zoo.output_dir(NAME), "runs")
    start = time.perf_counter()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {} for n in args.networks}
    for seed in args.seeds:
        for network in args.networks:
            for arm in ARMS:
                runs[network].setdefault(arm, []).append(_zoo.cached(spec(network, seed, arm), cache))
    table = {network: {arm: summary(got) for arm, got in by.items()} for network, by in runs.items()}
    command = ("python benchmarks/investigations/long_runs.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    text = markdown(table, args.seeds, command, time.perf_counter() - start)
    print(text)
    path = RESULTS / f"{NAME}.md"
    write_with_data(path, text + "\n" + hand_written(path) + "\n", {"table": table})
    return table


if __name__ == "__main__":
    main()
