"""The evidence pass's line in the trainer's progress bar (TQDM or Rich)."""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

from .package import LightningPackage, Trainer

__all__ = ["progress"]

DESCRIPTION = "Evidence pass"


@contextmanager
def progress(trainer: Trainer, batches: Iterable, package: LightningPackage) -> Iterator[Optional[Callable[[int], None]]]:
    """A line for the evidence pass in the trainer's progress bar, TQDM or Rich (rank 0 only, if it is on).

    TQDM: placed and drawn as the bar's validation line, and gone when the pass ends as that one
    is. Rich: one line under the training bar, showing the latest pass.

    Yields:
        The per-batch callback for ``collect_statistics(on_batch=...)``, or ``None`` without a bar.
    """
    bars = trainer.progress_bar_callback
    if bars is None or not bars.is_enabled or not trainer.is_global_zero:
        yield None
        return
    try:
        total: Optional[int] = len(batches)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if isinstance(bars, package.tqdm_bar):
        # not init_validation_tqdm(): that bar draws an empty "Validation:" line when it is made
        bar = package.tqdm(
            desc=DESCRIPTION, total=total, position=2 * bars.process_position + 1, disable=bars.is_disabled,
            leave=False, dynamic_ncols=True, file=sys.stdout, bar_format=bars.BAR_FORMAT,
        )
        try:
            yield lambda _: bar.update(1)
        finally:
            bar.close()
    elif isinstance(bars, package.rich_bar) and bars.progress is not None:
        # one line under the training bar, reset for every pass and kept (a log file gets the last pass)
        rich = bars.progress
        size = math.inf if total is None else total
        task = next((t.id for t in rich.tasks if t.description == DESCRIPTION), None)
        if task is None:
            task = rich.add_task(DESCRIPTION, total=size)
        else:
            rich.reset(task, total=size, visible=True)

        def step(_: int) -> None:
            rich.update(task, advance=1)
            bars.refresh()

        yield step
        bars.refresh()
    else:
        yield None
