"""The record of the previous fit, kept through a fit that trains nothing.

Every fit starts its record afresh at ``setup`` (history, last and best evidence, ``final_marglik``, ``summary``).
``trainer.fit`` again on a Trainer that has finished (``max_epochs`` or ``max_steps`` reached) runs
``setup`` and ``teardown`` but trains nothing: without this keeper it would leave ``final_marglik``
NaN (the docs' sign of a diverged evidence), ``best_marglik`` ``-inf`` and ``history`` empty.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .package import Trainer

__all__ = ["FitRecord"]

# what the estimating callbacks hold beyond their checkpoint state
_EXTRA = ("final_marglik", "evidence", "summary")


class FitRecord:
    """Keeps an estimating callback's record from ``setup`` until its fit trains or restores a checkpoint."""

    def __init__(self) -> None:
        self._kept: Optional[Tuple[Dict[str, Any], Dict[str, Any]]] = None

    def keep(self, callback: Any) -> None:
        """At ``setup``, before the record is reset: keep it if it holds an estimate."""
        self._kept = None
        if callback.estimations:
            extra = {name: getattr(callback, name) for name in _EXTRA if hasattr(callback, name)}
            self._kept = (callback.state_dict(), extra)

    def drop(self) -> None:
        """This fit trains (``on_train_start``) or restores a checkpoint's record: the kept one is stale."""
        self._kept = None

    def end(self, callback: Any, trainer: Trainer) -> Optional[str]:
        """At the end of a fit: give a fit that trained nothing the kept record back; returns the warning."""
        if self._kept is None:
            return None
        state, extra = self._kept
        self._kept = None
        callback.load_state_dict(state)
        for name, value in extra.items():
            setattr(callback, name, value)
        return (
            f"{type(callback).__name__}: this fit trained nothing (the Trainer had reached epoch "
            f"{trainer.current_epoch} of max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}): the record "
            f"of the previous fit is kept (final_marglik={callback.final_marglik:.4f}, {len(callback.history)} "
            "estimates in history). To train on, raise max_epochs or fit with a new Trainer."
        )
