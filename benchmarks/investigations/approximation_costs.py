"""Cost of the ranking study's post-hoc approximations relative to kron-GGN, side by side.

Run from the repository root (needs ``pip install mlxtend``)::

    python benchmarks/investigations/approximation_costs.py      # mlp512x1, cnn32x2; writes benchmarks/results/approximation_costs.md
    python benchmarks/investigations/approximation_costs.py --candidates cnn8x1 --reps 1 --epochs 1   # smoke test

Each candidate of ``examples/ranking_study.py`` is trained for ``--epochs`` epochs of Adam on the
MNIST-5k training split (map_loss, layerwise prior at delta = 1, no callback), then every
approximation of the study's table runs ``examples/ranking_study.posthoc_evidence`` at those
weights (its evidence pass(es) and the Newton solve) ``--reps`` times, the approximations
interleaved within each round. Reported: process CPU seconds (median over the rounds), one thread,
and the ratio to kron-GGN of the same round set.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import ranking_study as study  # noqa: E402
from common import library_state  # noqa: E402
from lightning_marglik import map_loss  # noqa: E402


def trained(name: str, data, epochs: int):
    """The candidate after ``epochs`` epochs of Adam (the study's recipe without the callback)."""
    family, kwargs = study.CANDIDATES[name]
    x_tr, y_tr = data[0], data[1]
    torch.manual_seed(0)
    module = study.Candidate(study.build_network(family, 14, **kwargs), len(x_tr), 1e-3, 1.0, "layerwise")
    optimizer = torch.optim.Adam(module.net.parameters(), lr=1e-3)
    for _ in range(epochs):
        for x, y in DataLoader(TensorDataset(x_tr, y_tr), batch_size=128, shuffle=True):
            optimizer.zero_grad()
            map_loss(module(x), y, module.likelihood, module.prior, len(x_tr)).backward()
            optimizer.step()
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", nargs="+", default=["mlp512x1", "cnn32x2"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "approximation_costs.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = study.load_mnist()
    loader = DataLoader(TensorDataset(data[0], data[1]), batch_size=500)
    load_before = open("/proc/loadavg").read().split()[:3]
    rows = []
    for name in args.candidates:
        module = trained(name, data, args.epochs)
        state = study.snapshot(module)
        seconds = {a: [] for a in study.APPROXIMATIONS}
        values = {}
        for _ in range(args.reps):
            for approx in study.APPROXIMATIONS:
                start = time.process_time()
                out = study.posthoc_evidence(module.net, state, loader, approx, "layerwise", 0)
                seconds[approx].append(time.process_time() - start)
                values[approx] = out["marglik"]
        base = statistics.median(seconds["kron-GGN"])
        for approx in study.APPROXIMATIONS:
            cpu = statistics.median(seconds[approx])
            rows.append((name, module.prior.n_params, approx, cpu, cpu / base, values[approx]))
            print(f"{name:10s} {approx:22s} {cpu:7.2f} s  x{cpu / base:5.2f}  evidence/N {values[approx]:.4f}",
                  flush=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    lines = [
        "# Post-hoc approximations: cost relative to kron-GGN",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `python benchmarks/investigations/approximation_costs.py "
        f"{' '.join(sys.argv[1:])}`; library {library_state()}. One CPU thread, process CPU seconds, median of {args.reps} interleaved rounds; "
        f"load average {' '.join(load_before)} before, {' '.join(load_after)} after (2 cores shared with other jobs). "
        f"Weights: {args.epochs} epochs of Adam (lr 1e-3, batch 128) on the 4000 MNIST-5k training images, layerwise "
        "prior at delta = 1. Each time is `examples/ranking_study.posthoc_evidence` (evidence pass(es) and the Newton "
        f"solve) over the 4000 images in batches of 500; linearized: {study.LINEARIZED_STEPS} L-BFGS iterations.",
        "",
        "| candidate | params | approximation | CPU s | x kron-GGN | evidence / N |",
        "|---|---|---|---|---|---|",
        *[f"| {n} | {p} | {a} | {c:.2f} | {r:.2f} | {v:.4f} |" for n, p, a, c, r, v in rows],
    ]
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
