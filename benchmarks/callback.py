"""Cost of MargLikCallback in a real Trainer: total `fit` time with it over the same epochs without it.

    python benchmarks/callback.py [--quick] [--epochs 10]

Same models and synthetic data as benchmarks/engine.py (MLP 784-256-256-10 on N=10,000, small
CNN on N=5,000), F=5, K=100, one thread, process CPU time (robust to other load on the machine).
Writes benchmarks/results/callback.md.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
import warnings
from typing import Dict, List, Optional

import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import make_problem  # noqa: E402  (same models and data as the engine benchmark)

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss  # noqa: E402

CONFIGS = [
    ("kron-ggn exact", dict(structure="kron", approx="ggn")),
    ("kron-ggn MC", dict(structure="kron", approx="ggn", mc_samples=1)),
    ("diag-ef", dict(structure="diag", approx="ef")),
]
TARGETS = {"kron-ggn exact": 1.4, "diag-ef": 1.15}


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module, n_data: int) -> None:
        super().__init__()
        self.net = net
        self.prior = GaussianPrior(net)
        self.likelihood = CategoricalLikelihood()
        self.n_data = n_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=1e-2)


def fit_seconds(name: str, n: int, epochs: int, quick: bool, callback: Optional[MargLikCallback]) -> float:
    net, data, _ = make_problem(name, n, 256, seed=0, quick=quick)
    module = Module(net, n)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[callback] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    start = time.process_time()
    trainer.fit(module, data)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "callback.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sizes = {"mlp": 512 if args.quick else 10_000, "cnn": 256 if args.quick else 5_000}
    epochs = 5 if args.quick else args.epochs
    rows: List[Dict] = []
    for model in ("mlp", "cnn"):
        fit_seconds(model, sizes[model], 1, args.quick, None)  # warm-up
        plain = fit_seconds(model, sizes[model], epochs, args.quick, None)
        for label, kwargs in CONFIGS:
            with_cb = fit_seconds(model, sizes[model], epochs, args.quick, MargLikCallback(frequency=5, steps=100, lr=0.1, **kwargs))
            rows.append(dict(model=model, config=label, plain=plain, with_cb=with_cb, ratio=with_cb / plain))
            print(f"{model} {label}: {with_cb:.1f}s / {plain:.1f}s = {with_cb / plain:.2f}", flush=True)
    lines = [
        "# MargLikCallback cost in a real Trainer",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: `python benchmarks/callback.py"
        + (" --quick" if args.quick else "") + f"`; torch {torch.__version__}, pytorch-lightning {pl.__version__}",
        f"- {epochs} epochs, F=5 (estimates after epochs 5 and 10), K=100, lr 0.1, batch size 256, SGD, one thread,"
        " process CPU seconds of `trainer.fit` (the machine is shared; CPU time is robust to other load).",
        f"- MLP 784-256-256-10, N={sizes['mlp']:,}; CNN Conv16-Pool-Conv32-Pool-Linear, N={sizes['cnn']:,}.",
        "",
        "| model | callback | fit without (s) | fit with (s) | ratio | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        target = TARGETS.get(r["config"])
        verdict = "" if target is None else f"≤ {target} ({'met' if r['ratio'] <= target else 'missed'})"
        lines.append(f"| {r['model']} | {r['config']} | {r['plain']:.1f} | {r['with_cb']:.1f} | **{r['ratio']:.2f}** | {verdict} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
