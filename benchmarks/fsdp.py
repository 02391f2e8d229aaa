"""Per-rank peak memory and time of an estimate under DDP, FSDP FULL_SHARD and FSDP2 (2 CPU processes, gloo).

    python benchmarks/fsdp.py [--width 2048] [--layers 3] [--n 256]

An MLP whose weights dominate memory (``--layers`` hidden Linear layers of ``--width`` units,
float32, Adam), trained one epoch with ``MargLikCallback(structure="kron", frequency=1, steps=0)``
under three strategies, each rank on one thread:

* ``ddp``: ``strategy="ddp"``;
* ``fsdp``: FSDP ``FULL_SHARD`` (a CPU subclass of Lightning's ``FSDPStrategy``, as in
  ``tests/fsdp_worker.py``; one FSDP unit per Linear);
* ``fsdp2``: FSDP2, Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``
  with ``fully_shard`` on every Linear and the root in ``configure_model``, as in ``tests/fsdp2_worker.py``.

Per rank it reports, above the resident set at the start of the epoch: the peak of the training
epoch and the peak of the estimate that follows it (the kernel's peak RSS, reset between the two
through ``/proc/self/clear_refs``, with glibc's mmap threshold fixed at 128 KiB so that freed
tensors leave the resident set), their ratio (the issue's target under FULL_SHARD: at most 1.2),
and the estimate's wall time. Writes ``benchmarks/results/fsdp.md``.

Each measurement is a subprocess running this file with ``--worker``: Lightning's launcher
re-executes the script for rank 1. The CPU subclass of ``FSDPStrategy`` and the FSDP2 wrapping are
the tests' own (``tests/fsdp_worker.py``, ``tests/fsdp2_worker.py``); the results file is written
with the studies' harness (``_common.py``: the library commit, machine, date and load, the raw data
kept in the file).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests")]

from _common import RESULTS, cpu_name, hand_written, load_avg, now, reset_peak_rss, rss_mib, write_with_data  # noqa: E402
from common import library_state  # noqa: E402  (examples/common.py)

STRATEGIES = ["ddp", "fsdp", "fsdp2"]
RESULT = RESULTS / "fsdp.md"


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_marglik import GaussianLikelihood, GaussianPrior, MargLikCallback, map_loss

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            sizes = [args.width] * (args.layers + 1) + [1]
            layers: List[nn.Module] = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers += [nn.Tanh()] if i else []
                layers.append(nn.Linear(a, b))
            self.net = nn.Sequential(*layers)
            self.prior = GaussianPrior(self.net, structure="layerwise")
            self.likelihood = GaussianLikelihood()

        def configure_model(self) -> None:
            if args.strategy == "fsdp2":  # FSDP2 shards here, once Lightning has set up the device mesh
                from fsdp2_worker import shard_linears

                shard_linears(self.net, self.device_mesh["data_parallel"])

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return map_loss(self(x), y, self.likelihood, self.prior)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Before(Callback):  # runs before MargLikCallback's hooks: the training peak
        def on_train_epoch_start(self, trainer, pl_module):
            self.base = rss_mib("VmRSS")
            reset_peak_rss()

        def on_train_epoch_end(self, trainer, pl_module):
            self.train_peak = rss_mib("VmHWM") - self.base
            reset_peak_rss()
            self.started = time.perf_counter()

    class After(Callback):  # runs after MargLikCallback's: the estimate's peak and time
        def __init__(self, before: Before) -> None:
            self.before = before

        def on_train_epoch_end(self, trainer, pl_module):
            b = self.before
            self.result = {
                "seconds": time.perf_counter() - b.started,
                "train_peak_mib": b.train_peak,
                "estimate_peak_mib": rss_mib("VmHWM") - b.base,
                "base_mib": b.base,
            }

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.n, args.width, generator=gen), torch.randn(args.n, 1, generator=gen))
    timeout = datetime.timedelta(seconds=120)
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo", timeout=timeout)
    elif args.strategy == "fsdp":
        from fsdp_worker import CPUFSDPStrategy

        strategy = CPUFSDPStrategy(process_group_backend="gloo", timeout=timeout, sharding_strategy="FULL_SHARD",
                                   auto_wrap_policy={nn.Linear})
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
                                         timeout=timeout)
    before = Before()
    after = After(before)
    marglik = MargLikCallback(structure="kron", frequency=1, steps=0, settle=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[before, marglik, after],
    )
    pl.seed_everything(0, verbose=False)  # one initialisation for the three strategies
    trainer.fit(MLP(), DataLoader(data, batch_size=32))
    after.result["marglik"] = marglik.last_marglik  # per datum: the sharded float32 sums against DDP's float64
    Path(args.out, f"{args.strategy}-rank{trainer.global_rank}.json").write_text(json.dumps(after.result))


def run(strategy: str, args: argparse.Namespace, out: Path) -> List[Dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT")}
    # glibc's malloc keeps a freed block in its heap (the resident set) once its mmap threshold has risen above
    # the block's size (it rises to every freed mmapped block's size, up to 32 MiB); a fixed threshold returns
    # every block over 128 KiB to the kernel when torch frees it, so the peak resident set is the peak of live memory
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    command = [sys.executable, __file__, "--worker", "--strategy", strategy, "--out", str(out),
               "--width", str(args.width), "--layers", str(args.layers), "--n", str(args.n)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"{strategy} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads((out / f"{strategy}-rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--strategy", choices=STRATEGIES)
    parser.add_argument("--out")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--n", type=int, default=256)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    data = {"library": library_state(), "machine": cpu_name(), "date": now(), "load": load_avg(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        results = {strategy: run(strategy, args, Path(tmp)) for strategy in STRATEGIES}
    data["results"] = results
    weights = args.layers * args.width * args.width + args.width  # the Linear weights (biases aside)
    rows = []
    for strategy, ranks in results.items():
        for rank, r in enumerate(ranks):
            ratio = r["estimate_peak_mib"] / r["train_peak_mib"]
            rows.append(f"| {strategy} | {rank} | {r['train_peak_mib']:.0f} | {r['estimate_peak_mib']:.0f} | "
                        f"**{ratio:.2f}** | {r['seconds']:.1f} | {r['base_mib']:.0f} | {r['marglik']:.8g} |")
    text = "\n".join([
        "# Estimate memory under DDP, FSDP FULL_SHARD and FSDP2",
        "",
        f"`python benchmarks/fsdp.py --width {args.width} --layers {args.layers} --n {args.n}`, library "
        f"{data['library']}, {data['machine']}, {data['date']} at load {data['load']:.1f}: an MLP of {args.layers} hidden Linear layers of {args.width} units "
        f"({weights * 4 / 2**20:.0f} MiB of float32 weights), Gaussian likelihood, Adam, one epoch of {args.n} "
        "examples (batch 32) and one estimate (`structure='kron'`, K=0), 2 CPU processes over gloo, one "
        "thread each; `fsdp`: FSDP FULL_SHARD with one unit per Linear; `fsdp2`: FSDP2 (`ModelParallelStrategy`, "
        "data-parallel size 2) with `fully_shard` on every Linear and the root. Memory is resident-set size "
        "above the start of the "
        "epoch (the kernel's peak, reset between training and the estimate; glibc's mmap threshold fixed at "
        "128 KiB, `MALLOC_MMAP_THRESHOLD_=131072`, so that freed tensors leave the resident set).",
        "",
        "| strategy | rank | training peak (MiB) | estimate peak (MiB) | **estimate / training** | estimate (s) | "
        "RSS at epoch start (MiB) | log marglik / datum |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    write_with_data(RESULT, text + "\n\n" + hand_written(RESULT), data)
    print(text)


if __name__ == "__main__":
    main()
