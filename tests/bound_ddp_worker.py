"""Worker of ``tests/test_bound_callback.py::test_ddp_steps_sum_both_ranks_batches``: MargLikBoundCallback
under a real DDP run of 2 CPU processes (gloo), weights held fixed (lr=0), float64. Each rank writes
its hyperparameters and history to ``<out>/rank<r>.json``.

    python tests/bound_ddp_worker.py <out>
"""
from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from lightning_marglik import MargLikBoundCallback  # noqa: E402
from tests.lightning_models import Regressor, regression_data  # noqa: E402
from tests.worker_harness import ddp, loader, run_worker, two_processes, write_result  # noqa: E402

BATCH, EVERY_K, LR = 8, 2, 0.05


def main(out: Path) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(0, verbose=False)
    model = Regressor(lr=0.0)
    callback = MargLikBoundCallback(structure="kron", every_k_batches=EVERY_K, lr=LR)
    trainer = two_processes(pl, out, ddp(pl, timeout=timedelta(seconds=120)), [callback], max_epochs=1)
    trainer.fit(model, loader(regression_data(), BATCH, shuffle=False))
    result = {
        "log_precision": model.prior.log_precision.tolist(),
        "log_sigma": model.likelihood.log_sigma.item(),
        "history": callback.history,
    }
    write_result(out, f"rank{trainer.global_rank}.json", result)


if __name__ == "__main__":
    run_worker(lambda: main(Path(sys.argv[1])))
