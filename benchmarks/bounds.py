"""The stochastic evidence bounds (lightning_marglik.bounds): their slack against the exact evidence,
and the cost of MargLikBoundCallback against Algorithm 1 (MargLikCallback, F=1 and F=5).

    python benchmarks/bounds.py --quick      # smoke test (about a minute), prints only
    python benchmarks/bounds.py              # measures both parts, writes benchmarks/results/bounds.md

Part 1, slack (Immer et al. 2023, Fig. 2 style): an MLP 64-16-10 (P=1,210) trained to its MAP on
N=600 digits (sklearn ``load_digits``, standardized), float64, a scalar prior. At the log precision
that maximizes the exact evidence (full GGN, dense), every bound per datum against it: the
parametric bound per batch size (kron, diag, full per batch) and the NTK bound per subset size.
Also the log precision that maximizes each bound (grid of step 0.25), against the exact optimum.

Part 2, cost: the MLP 784-256-256-10 of ``benchmarks/engine.py`` on N=10,000 synthetic examples
with random labels, batch size 256 (40 batches per epoch), SGD lr 1e-2, 10 epochs, one thread;
process CPU and wall seconds of ``trainer.fit`` per epoch, for a plain fit, Algorithm 1 (kron GGN,
Newton, F=1 and F=5) and the bound callback (several settings). Each fit ends with the exact kron
evidence per datum at its final weights and hyperparameters (not timed): how good the learned
hyperparameters are, on one scale.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from _common import RESULTS, cpu_name, freeze_startup, load_avg, now, package_version, timed  # noqa: E402
from callback import Module  # noqa: E402 - the same classifier as the callback benchmark (SGD, lr 1e-2)
from engine import make_problem  # noqa: E402
from lightning_marglik import (  # noqa: E402
    CategoricalLikelihood,
    EvidenceBound,
    GaussianPrior,
    LaplaceEvidence,
    MargLikBoundCallback,
    MargLikCallback,
    map_loss,
)

OUTPUT = RESULTS / "bounds.md"
GRID = [x / 4 for x in range(-12, 25)]  # log precision -3 ... 6
BATCHES = 40  # training batches per epoch of the cost part (--quick: 4; every_k_batches is capped there)


# --- part 1: slack --------------------------------------------------------------------------------


def digits(n: int) -> TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[:n], dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0).clamp(min=1e-3)
    return TensorDataset(x, torch.tensor(y[:n]))


def trained_mlp(data: TensorDataset, steps: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    prior, lik = GaussianPrior(net, structure="scalar"), CategoricalLikelihood()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, y = data.tensors
    for _ in range(steps):
        optimizer.zero_grad()
        map_loss(net(x), y, lik, prior, n_data=len(x)).backward()
        optimizer.step()
    return net


def slack(n: int, steps: int, batch_sizes: List[int], subset_sizes: List[int]) -> Dict[str, Any]:
    data = digits(n)
    net = trained_mlp(data, steps)
    prior, lik = GaussianPrior(net, structure="scalar"), CategoricalLikelihood()
    everything = [data.tensors]
    exact = LaplaceEvidence.fit(net, everything, lik, prior, structure="full")
    exact.set_hyperparameters(exact.optimize(solver="newton").values)
    log_delta = prior.log_precision.item()

    def at(value: float) -> Dict[str, torch.Tensor]:
        return {"log_precision": torch.tensor([value], dtype=torch.float64), "log_temperature": torch.zeros((), dtype=torch.float64)}

    def row(label: str, size: Optional[int], objective) -> Dict[str, Any]:
        values = [objective(at(v)).item() / n for v in GRID]
        best = max(range(len(GRID)), key=lambda i: values[i])
        return {"label": label, "size": size, "value": objective(at(log_delta)).item() / n, "argmax": GRID[best]}

    rows = [row("exact (full GGN)", n, exact.log_marglik_at)]
    for structure in ("kron", "diag"):
        evidence = LaplaceEvidence.fit(net, everything, lik, prior, structure=structure)
        rows.append(row(f"{structure}, all data", n, evidence.log_marglik_at))
    for structure in ("kron", "diag", "full"):
        for size in batch_sizes:
            batches = DataLoader(data, batch_size=size)
            bound = EvidenceBound.fit(net, batches, lik, prior, bound="parametric", structure=structure)
            rows.append(row(f"parametric {structure}", size, bound.log_marglik_at))
    for size in subset_sizes:
        bound = EvidenceBound.fit(net, everything, lik, prior, bound="ntk", subset_size=size)
        rows.append(row("ntk", size, bound.log_marglik_at))
    return {"n": n, "n_params": prior.n_params, "log_delta": log_delta, "rows": rows}


# --- part 2: cost ----------------------------------------------------------------------------------


CONFIGS = [  # (label, callback factory)
    ("plain", lambda: None),
    ("Algorithm 1, kron-ggn, F=1", lambda: MargLikCallback(structure="kron", frequency=1, steps=20)),
    ("Algorithm 1, kron-ggn, F=5", lambda: MargLikCallback(structure="kron", frequency=5, steps=20)),
    ("bound parametric kron-ggn, k=1", lambda: MargLikBoundCallback(structure="kron", every_k_batches=1, lr=0.1)),
    ("bound parametric kron-ggn, k=10", lambda: MargLikBoundCallback(structure="kron", every_k_batches=min(10, BATCHES), lr=0.1)),
    ("bound parametric diag-ef, k=1", lambda: MargLikBoundCallback(structure="diag", approx="ef", every_k_batches=1, lr=0.1)),
    ("Algorithm 1, kron-ef, statistics='training', F=1",
     lambda: MargLikCallback(structure="kron", approx="ef", frequency=1, steps=20, statistics="training")),
    ("bound parametric kron-ef, k=1", lambda: MargLikBoundCallback(structure="kron", approx="ef", every_k_batches=1, lr=0.1)),
    ("bound ntk S=8, k=40", lambda: MargLikBoundCallback(bound="ntk", subset_size=8, every_k_batches=min(40, BATCHES), lr=0.1)),
    ("plain", lambda: None),
]


def cost(n: int, epochs: int, quick: bool) -> List[Dict[str, Any]]:
    out = []
    for label, make in CONFIGS:
        net, data, _ = make_problem("mlp", n, 256, seed=0, quick=quick)
        module = Module(net, n)
        callback = make()
        trainer = pl.Trainer(
            max_epochs=epochs, callbacks=[callback] if callback else [], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        )
        pl.seed_everything(0, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu, wall, _ = timed(lambda: trainer.fit(module, data))
            evidence = LaplaceEvidence.fit(module.net, data, module.likelihood, module.prior, structure="kron")
        out.append({
            "label": label, "cpu": cpu / epochs, "wall": wall / epochs,
            "marglik": evidence.log_marglik().item() / n,
            "log_delta": module.prior.log_precision.mean().item(),
        })
        print(f"  {label}: {cpu / epochs:.2f} s CPU / epoch, kron evidence {out[-1]['marglik']:.4f}", flush=True)
    return out


# --- report ---------------------------------------------------------------------------------------


def render(part1: Dict[str, Any], part2: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    exact = part1["rows"][0]
    lines = [
        "# Stochastic evidence bounds: slack and cost",
        "",
        f"- `{meta['command']}` on {meta['date']}, commit {meta['commit']}; load average (1 min) at start / end "
        f"{meta['load_start']:.1f} / {meta['load_end']:.1f}; run time {meta['run_time']:.0f} s",
        f"- torch {package_version('torch')}, pytorch-lightning {package_version('pytorch-lightning')}; one thread; "
        f"machine: {os.cpu_count()} CPU cores, {cpu_name()}, no GPU",
        "",
        "## Slack of the bounds (log evidence per datum)",
        "",
        f"MLP 64-16-10 (P={part1['n_params']:,}) at its MAP on N={part1['n']} digits, float64, scalar prior, at the "
        f"log precision that maximizes the exact evidence (log δ = {part1['log_delta']:.2f}). *slack*: exact − bound "
        "(nats per datum; ≥ 0 where it is a bound of the exact evidence). *argmax*: the log δ that maximizes the "
        f"row's objective on a grid of step 0.25 (exact: {exact['argmax']:.2f}).",
        "",
        "| objective | batch / subset size | value | slack | argmax log δ |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in part1["rows"]:
        lines.append(f"| {r['label']} | {r['size']} | {r['value']:.4f} | {exact['value'] - r['value']:.4f} | {r['argmax']:.2f} |")
    plain = sorted(r["cpu"] for r in part2 if r["label"] == "plain")
    base = plain[len(plain) // 2] if len(plain) % 2 else sum(plain) / len(plain)
    lines += [
        "",
        "The parametric bound of a structure bounds the evidence of the sum of the batches' curvatures: the "
        "all-data evidence for diag and full (so also the exact one, below which diag's all-data evidence lies by "
        "Hadamard's inequality), the sum of per-batch Kronecker products for kron (not the all-data kron). "
        "parametric full of batch B equals ntk of subset B (Sylvester).",
        "",
        "## Cost per epoch against Algorithm 1",
        "",
        "MLP 784-256-256-10, N=10,000 random-label synthetic examples (benchmarks/engine.py), batch 256 (40 batches "
        "per epoch), SGD lr 1e-2, 10 epochs, all in one run; process CPU and wall seconds of `trainer.fit` per "
        "epoch. Algorithm 1: `MargLikCallback(structure='kron', frequency=F, steps=20)` (Newton). Bound: "
        "`MargLikBoundCallback(...)`, one Adam step (lr 0.1) every k batches. *ratio*: CPU over the plain fits' "
        f"mean ({', '.join(f'{p:.2f}' for p in plain)} s). *kron evidence*: the all-data kron evidence per datum "
        "at the final weights and hyperparameters (not timed); *mean log δ* over the layerwise prior.",
        "",
        "| configuration | CPU s / epoch | wall s / epoch | ratio | kron evidence / N | mean log δ |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in part2:
        lines.append(
            f"| {r['label']} | {r['cpu']:.2f} | {r['wall']:.2f} | {r['cpu'] / base:.2f} | {r['marglik']:.4f} | {r['log_delta']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, prints only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    freeze_startup()
    start, load_start = time.time(), load_avg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if args.quick:
        part1 = slack(200, 100, [200, 50, 10], [200, 20, 1])
    else:
        part1 = slack(600, 500, [600, 300, 100, 50, 20, 10], [600, 100, 50, 20, 10, 5, 1])
    for r in part1["rows"]:
        print(f"  {r['label']} [{r['size']}]: {r['value']:.4f} (argmax {r['argmax']:.2f})", flush=True)
    global BATCHES
    BATCHES = 4 if args.quick else 40
    dtype = torch.get_default_dtype()
    part2 = cost(1024 if args.quick else 10_000, 2 if args.quick else 10, args.quick)
    torch.set_default_dtype(dtype)
    meta = {
        "command": "python benchmarks/bounds.py" + (" --quick" if args.quick else ""), "date": now(), "commit": commit,
        "load_start": load_start, "load_end": load_avg(), "run_time": time.time() - start,
    }
    text = render(part1, part2, meta)
    if args.quick:
        print(text)
    else:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
