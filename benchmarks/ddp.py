"""Evidence-pass time under DDP: 2 CPU processes against 1, on the MLP 784-256-256-10.

    python benchmarks/ddp.py [--n 10000] [--batch-size 128] [--repeats 3]

For each of kron-ggn and diag-ef, runs ``MargLikCallback.estimate`` (K=0 hyperparameter steps:
the data pass, the all-reduce, the eigendecompositions and the broadcasts) on N synthetic
MNIST-shaped examples, once with ``devices=1`` and once with ``devices=2`` (``ddp``, gloo), each
process on one thread (``torch.set_num_threads(1)``), and reports the ratio of the wall times
(2 processes / 1 process; ideal 0.5 on 2 free cores). Per rank it also reports the CPU time of
the local data pass, which is insensitive to other load on the machine. Writes
``benchmarks/results/ddp.md``.

Each measurement is a subprocess running this file with ``--worker``: Lightning's ``ddp``
launcher re-executes the script for rank 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
CONFIGS = [("kron", "ggn"), ("diag", "ef")]


# --------------------------------------------------------------------------------------------
# worker: one Trainer, one configuration, 1 or 2 processes
# --------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_marglik.callbacks.estimating as callbacks_module  # where the callbacks call collect_statistics
    from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss

    class MLP(pl.LightningModule):
        def __init__(self, n_data: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
            self.prior = GaussianPrior(self.net, structure="layerwise")
            self.likelihood = CategoricalLikelihood()
            self.n_data = n_data

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=1e-3)

    # time (wall and CPU) of the local data pass inside every estimate, on this rank
    local_passes: List[Dict[str, float]] = []
    collect = callbacks_module.collect_statistics

    def timed_collect(*a, **k):
        wall, cpu = time.perf_counter(), time.process_time()
        result = collect(*a, **k)
        local_passes.append({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu})
        return result

    callbacks_module.collect_statistics = timed_collect

    class TimedMargLik(MargLikCallback):
        """Repeats the estimate; every repeat starts after a barrier, so ranks start together."""

        def __init__(self, repeats: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.repeats = repeats
            self.walls: List[float] = []
            self.cpus: List[float] = []

        def estimate(self, trainer, pl_module, *args, **kwargs):
            value = None
            for _ in range(self.repeats + 1):  # the first one warms up
                trainer.strategy.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                value = super().estimate(trainer, pl_module, *args, **kwargs)
                self.cpus.append(time.process_time() - cpu)
                trainer.strategy.barrier()
                self.walls.append(time.perf_counter() - start)
            return value

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, 784, generator=gen)
    y = torch.randint(0, 10, (args.n,), generator=gen)
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    module = MLP(args.n)
    callback = TimedMargLik(args.repeats, structure=args.structure, approx=args.approx, frequency=1, steps=0)
    strategy: Any = "auto"
    if args.devices > 1:
        strategy = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=600))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=1, limit_train_batches=1,
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out,
    )
    trainer.fit(module, train_dataloaders=data)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "walls": callback.walls[1:],
        "cpus": callback.cpus[1:],
        "local_passes": local_passes[1:],
        "marglik": callback.last_marglik,
        "n_data": callback.evidence.n_data if callback.evidence is not None else None,
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the slow interpreter teardown of torch/Lightning


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def measure(structure: str, approx: str, devices: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        command = [
            sys.executable, str(Path(__file__).resolve()), "--worker", "--structure", structure, "--approx", approx,
            "--devices", str(devices), "--n", str(args.n), "--batch-size", str(args.batch_size),
            "--repeats", str(args.repeats), "--out", out,
        ]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{structure}-{approx} devices={devices} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(devices)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--structure", default="kron")
    parser.add_argument("--approx", default="ggn")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(HERE / "results" / "ddp.md"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    rows = []
    load_before = os.getloadavg()
    for structure, approx in CONFIGS:
        single = measure(structure, approx, 1, args)[0]
        double = measure(structure, approx, 2, args)
        assert single["n_data"] == double[0]["n_data"] == double[1]["n_data"] == args.n
        t1 = statistics.median(single["walls"])
        t2 = statistics.median(max(a, b) for a, b in zip(double[0]["walls"], double[1]["walls"]))
        cpu1 = statistics.median(p["cpu"] for p in single["local_passes"])
        cpu2 = [statistics.median(p["cpu"] for p in r["local_passes"]) for r in double]
        est1 = statistics.median(single["cpus"])
        est2 = statistics.median(max(a, b) for a, b in zip(double[0]["cpus"], double[1]["cpus"]))
        rel = abs(single["marglik"] - double[0]["marglik"]) / abs(single["marglik"])
        rows.append(
            {
                "config": f"{structure}-{approx}", "t1": t1, "t2": t2, "ratio": t2 / t1,
                "est1": est1, "est2": est2, "est_ratio": est2 / est1,
                "cpu1": cpu1, "cpu2": cpu2, "cpu_ratio": max(cpu2) / cpu1, "marglik_rel_diff": rel,
                "walls1": single["walls"], "walls2": [max(a, b) for a, b in zip(double[0]["walls"], double[1]["walls"])],
            }
        )
        print(f"{structure}-{approx}: wall 1 proc {t1:.2f}s, 2 procs {t2:.2f}s, ratio {t2 / t1:.2f}; CPU of the "
              f"estimate {est1:.2f}s vs {est2:.2f}s, ratio {est2 / est1:.2f}; local pass CPU ratio "
              f"{max(cpu2) / cpu1:.2f}; evidence rel. diff {rel:.1e}", flush=True)
    load_after = os.getloadavg()

    import torch

    lines = [
        "# Evidence pass under DDP: 2 processes vs 1",
        "",
        f"`python benchmarks/ddp.py` on {datetime.date.today().isoformat()}: MLP 784-256-256-10, N={args.n} synthetic "
        f"examples (float32), batch size {args.batch_size}, categorical likelihood, `MargLikCallback.estimate` with "
        "K=0 (data pass, all-reduce, eigendecompositions, broadcasts), one thread per process "
        f"(`torch.set_num_threads(1)`), `ddp` with gloo on CPU; median of {args.repeats} repeats after a warm-up. "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores.",
        "",
        "| structure-approx | wall, 1 process (s) | wall, 2 processes (s) | **wall ratio 2/1** | "
        "CPU of the estimate, 1 proc / busier rank (s) | **CPU ratio 2/1** | local data pass CPU, 1 proc / "
        "rank 0 / rank 1 (s) | evidence rel. diff 2 vs 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['t1']:.2f} | {r['t2']:.2f} | **{r['ratio']:.2f}** | {r['est1']:.2f} / "
            f"{r['est2']:.2f} | **{r['est_ratio']:.2f}** | {r['cpu1']:.2f} / {r['cpu2'][0]:.2f} / {r['cpu2'][1]:.2f} "
            f"| {r['marglik_rel_diff']:.1e} |"
        )
    lines += [
        "",
        "Ideal ratio on two free cores: 0.5 (each rank passes over half the data; the reduction, the "
        "eigendecompositions and the broadcasts are not split: every rank does them). The wall ratio is what "
        "a user sees but depends on other load on the machine (see the load averages below: above 2, other "
        "jobs shared the 2 cores, and two busy processes suffer more from that than one); the CPU ratio (CPU "
        "seconds of the busier rank's whole estimate over the single process's; waiting in gloo collectives "
        "costs no CPU) is about what the wall ratio would be on two otherwise idle cores (it leaves out the "
        "loopback communication and the two processes' competition for memory bandwidth) and does not depend "
        "on the load.",
        "",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{v:.1f}' for v in load_before)}; after: "
        f"{', '.join(f'{v:.1f}' for v in load_after)} (other jobs were running on the same 2 cores when the "
        "load is above 2).",
        "",
        "Raw wall times (s): " + "; ".join(
            f"{r['config']}: 1 proc {', '.join(f'{w:.2f}' for w in r['walls1'])}, 2 procs "
            f"{', '.join(f'{w:.2f}' for w in r['walls2'])}" for r in rows
        ),
        "",
    ]
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
