"""The evidence pass of several library commits, measured in one run (issue 26 item 9).

Each commit is checked out into a temporary ``git worktree``; one subprocess per commit and round
imports the library from that worktree and times, in process CPU (one thread), a plain training
epoch and the evidence passes on the engine benchmark's MLP (784-256-256-10, N = 10,000 random
inputs, random labels, batch 256). The commits alternate round by round, so that load on the
machine falls on both alike; each ratio is taken against the epoch timed in the same subprocess.

Usage::

    python benchmarks/investigations/engine_commits.py 64eb9dc e24a1ed HEAD    # writes benchmarks/results/engine_commits.md
    python benchmarks/investigations/engine_commits.py 64eb9dc HEAD --rounds 5 --quick   # smaller data, prints only
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import cpu_name, load_avg, now, package_version  # noqa: E402

METHODS = (("kron", "ggn"), ("diag", "ef"), ("kron", "ef"), ("diag", "ggn"))

# What one subprocess runs: the library is imported from the worktree given as argv[1].
MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence
torch.set_num_threads(1)
n, methods = int(sys.argv[2]), json.loads(sys.argv[3])
gen = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))
loader = DataLoader(data, batch_size=256)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

def epoch():
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

def cpu(fn):
    start = time.process_time(); fn(); return time.process_time() - start

lik, prior = CategoricalLikelihood(), GaussianPrior(net)
passes = {f"{s}-{a}": (lambda s=s, a=a: LaplaceEvidence.fit(net, loader, lik, prior, structure=s, approx=a))
          for s, a in methods}
for fn in [epoch, *passes.values()]:  # warm-up
    fn()
base = cpu(epoch)
out = {"epoch_s": base}
for name, fn in passes.items():
    out[name] = cpu(fn) / base
print(json.dumps(out))
"""


def measure(worktree: Path, n: int) -> Dict[str, float]:
    """One subprocess: the ratios of each evidence pass to a training epoch, at this worktree."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(worktree), str(n), json.dumps(METHODS)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+", help="two or more commits (any git revision)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = 2,000 and 2 rounds; prints, writes nothing")
    args = parser.parse_args()
    if len(args.commits) < 2:
        parser.error("give at least two commits to compare")
    n, rounds = (2000, 2) if args.quick else (10_000, args.rounds)
    shas = [subprocess.run(["git", "rev-parse", "--short", c], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.strip() for c in args.commits]
    load_start, started = load_avg(), now()
    results: Dict[str, List[Dict[str, float]]] = {sha: [] for sha in shas}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {sha: Path(tmp) / sha for sha in shas}
        for sha, tree in trees.items():
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                           capture_output=True)
        try:
            for r in range(rounds):
                for sha in (shas if r % 2 == 0 else shas[::-1]):  # alternate the order: no commit always runs first
                    results[sha].append(measure(trees[sha], n))
                    print(f"round {r + 1}/{rounds} {sha}: {results[sha][-1]}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    names = ["epoch_s"] + [f"{s}-{a}" for s, a in METHODS]
    lines = [
        "# Evidence pass of library commits, side by side",
        "",
        f"`python benchmarks/investigations/engine_commits.py {' '.join(args.commits)} --rounds {rounds}` on {started}; "
        f"load average (1 min) at start / end {load_start:.1f} / {load_avg():.1f}; torch {package_version('torch')}; "
        f"one thread; {cpu_name()}. MLP 784-256-256-10, N = {n:,} random inputs, batch 256, layerwise prior. "
        "Median over rounds of process CPU time; each pass as a ratio to a plain SGD epoch timed in the same "
        "subprocess; the commits alternate round by round.",
        "",
        "| commit | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for sha in shas:
        cells = [statistics.median(r[name] for r in results[sha]) for name in names]
        lines.append(f"| {sha} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    lines.append("")
    lines.append("Every round (ratios):")
    lines.append("")
    for sha in shas:
        for r in results[sha]:
            lines.append(f"- {sha}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        (ROOT / "benchmarks" / "results" / "engine_commits.md").write_text(text)


if __name__ == "__main__":
    main()
