"""The harness of the tests' two-process workers (``ddp_worker.py``, ``fsdp_worker.py``, ``fsdp2_worker.py``,
``training_statistics_ddp.py``, ``bound_ddp_worker.py``): a Trainer of two CPU processes over gloo, the
shuffled loaders, the result files and the worker's exit.

Lightning's launcher re-executes the worker's script for rank 1; each rank writes its own result file, which
the test reads. Importing has no side effects.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, List

from torch.utils.data import DataLoader, Dataset

__all__ = ["TIMEOUT", "ddp", "loader", "run_worker", "two_processes", "write_result"]

# A desync fails within a minute, not Lightning's default 30. The rendezvous shares this timeout:
# rank 1 (a fresh interpreter) must import torch and Lightning within it (about 20 s at a load of 5
# on 2 cores); raise it with DDP_TEST_TIMEOUT_S on a slower machine.
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("DDP_TEST_TIMEOUT_S", "60")))


def ddp(package: Any, start_method: str = "popen", timeout: datetime.timedelta = TIMEOUT) -> Any:
    """``DDPStrategy`` of ``package`` (``pytorch_lightning`` or ``lightning.pytorch``) over gloo."""
    return package.strategies.DDPStrategy(start_method=start_method, process_group_backend="gloo", timeout=timeout)


def two_processes(package: Any, out: Path, strategy: Any, callbacks: List[Any], **options: Any) -> Any:
    """A ``package.Trainer`` of two CPU processes under ``strategy``: no logger, progress bar or summary,
    checkpoints only where a ``ModelCheckpoint`` is among ``callbacks``, files under ``out``; ``options``
    (``max_epochs``, ``precision``, ...) are the Trainer's own and override these."""
    settings = dict(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, package.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=str(out),
    )
    settings.update(options)
    return package.Trainer(**settings)


def loader(dataset: Dataset, batch_size: int = 8, shuffle: bool = True, drop_last: bool = False) -> DataLoader:
    """The training loader of a worker's fit (Lightning gives each rank its shard)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)


def write_result(out: Path, name: str, payload: Any) -> None:
    """Write ``payload`` as JSON to ``out/name`` at once (the test never reads a half-written file)."""
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload, default=float))
    tmp.replace(out / name)


def run_worker(main: Callable[[], None]) -> None:
    """Run a worker's ``main`` and leave without the interpreter's slow teardown of torch and Lightning (several
    seconds per process on a loaded 2-core machine): every result is written by then; a failure is printed and
    the exit code says so."""
    code = 0
    try:
        main()
    except BaseException:  # noqa: BLE001 - printed, then the exit code says it failed
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
