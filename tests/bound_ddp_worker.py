"""Worker of ``tests/test_bound_callback.py::test_ddp_steps_sum_both_ranks_batches``: MargLikBoundCallback
under a real DDP run of 2 CPU processes (gloo), weights held fixed (lr=0), float64. Each rank writes
its hyperparameters and history to ``<out>/rank<r>.json``.

    python tests/bound_ddp_worker.py <out>
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_marglik import MargLikBoundCallback  # noqa: E402
from tests.lightning_models import Regressor, regression_data  # noqa: E402

BATCH, EVERY_K, LR = 8, 2, 0.05


def main(out: Path) -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(0, verbose=False)
    model = Regressor(lr=0.0)
    callback = MargLikBoundCallback(structure="kron", every_k_batches=EVERY_K, lr=LR)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(out),
        strategy=DDPStrategy(start_method="popen", process_group_backend="gloo", timeout=timedelta(seconds=120)),
    )
    trainer.fit(model, DataLoader(regression_data(), batch_size=BATCH))
    result = {
        "log_precision": model.prior.log_precision.tolist(),
        "log_sigma": model.likelihood.log_sigma.item(),
        "history": callback.history,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # skip the slow interpreter teardown; the result is written
