"""Denormal floats flushed to zero on the CPU while the library trains or estimates.

When the evidence raises a group's prior precision, the MAP loss decays that group's weights, and
with them Adam's moment estimates, towards zero; below the smallest normal float (1.2e-38 in float32)
an x86 CPU computes with *denormal* numbers many times more slowly. Every operation that touches them
slows down, in training as in the evidence pass: one machine measured a 40-epoch MLP run at 3.7 times the
CPU unflushed (issue 34); on this project's AMD EPYC the penalty is smaller (an Adam step 1.6x at 10 % denormal
moments) and whole runs cost the same either way (``benchmarks/results/whole_run.md``). Flushing them to zero (the
CPU's FTZ and DAZ modes, ``torch.set_flush_denormal``) changes a value only where it is smaller than
the smallest normal float, and so any result by less than the float resolution of each operation.

The mode belongs to a CPU thread: :class:`DenormalFlush` sets it on the calling thread (where
Lightning trains on a CPU and where autograd runs a CPU backward) and on the threads started from it
afterwards; intra-op threads torch started earlier keep their own. GPUs handle denormals in
hardware: the setting changes nothing there. CPUs without the modes (``torch.set_flush_denormal``
returns False) are left as they are.

Example:
    >>> from lightning_marglik.denormals import DenormalFlush, flushing_denormals
    >>> before = flushing_denormals()
    >>> with DenormalFlush():  # on a CPU with the modes (x86 with SSE3, ARM64)
    ...     flushing_denormals()
    True
    >>> flushing_denormals() == before
    True
"""
from __future__ import annotations

from types import TracebackType
from typing import Optional, Type

import torch

from lightning_marglik.validators import flag

__all__ = ["DenormalFlush", "flushing_denormals"]

# a float32 denormal (the smallest normal float32 is 1.18e-38); kept unless the thread flushes
_DENORMAL = 1e-40


def flushing_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes denormal floats to zero now.

    torch can set the mode but not read it, so this reads it off one multiplication: a denormal
    operand survives ``x * 1`` unless the thread flushes (or treats denormal inputs as zero).
    """
    return torch.full((1,), _DENORMAL, dtype=torch.float32).mul(1.0).item() == 0.0


class DenormalFlush:
    """Flush denormal floats to zero on this thread, then restore the setting found before.

    A context manager (``with DenormalFlush(): ...``, e.g. around a plain PyTorch training loop), or
    :meth:`start` and :meth:`stop` from hooks that open and close a span (``MargLikCallback`` starts
    it in ``on_fit_start`` and stops it in ``teardown`` and ``on_exception``). Calls nest harmlessly: a
    second :meth:`start` keeps the first's saved setting, and :meth:`stop` without a start does nothing.

    Args:
        enabled: False makes it do nothing (the option that turns the flush off).

    Raises:
        ValueError: On an ``enabled`` that is not a bool (``"no"`` or ``0`` would read as a condition).

    Example:
        >>> flush = DenormalFlush()
        >>> flush.start()
        >>> (torch.full((1,), 1e-40) * 1.0).item()  # a float32 denormal, flushed
        0.0
        >>> flush.stop()
        >>> flush.active
        False
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = flag(enabled, "enabled", "of DenormalFlush")
        self._restore: Optional[bool] = None  # the setting found at start, while this flush holds the thread

    @property
    def active(self) -> bool:
        """Whether this object has set the mode and not yet restored it."""
        return self._restore is not None

    def start(self) -> None:
        """Set the mode on this thread, remembering the setting found (no-op if disabled or active)."""
        if not self.enabled or self.active:
            return
        before = flushing_denormals()
        if torch.set_flush_denormal(True):  # False: this CPU has no such mode, nothing was changed
            self._restore = before

    def stop(self) -> None:
        """Restore the setting :meth:`start` found (no-op if not active)."""
        if self._restore is not None:
            torch.set_flush_denormal(self._restore)
            self._restore = None

    def __enter__(self) -> "DenormalFlush":
        self.start()
        return self

    def __exit__(
        self, kind: Optional[Type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType],
    ) -> None:
        self.stop()
