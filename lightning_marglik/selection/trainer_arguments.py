"""The ``trainer`` arguments of a model selection, checked before anything is built: ``pl.Trainer``'s names and
types, and the settings under which a selection would mislead (nothing trained, several processes)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Mapping

import pytorch_lightning as pl

from ..validators import keywords

__all__ = ["check_trainer_arguments"]


def check_trainer_arguments(trainer: Mapping[str, Any]) -> Dict[str, Any]:
    """Check ``trainer`` against ``pl.Trainer``'s signature (names and types), without building one.

    Example:
        >>> check_trainer_arguments({"max_epochs": "5", "enable_progress_bar": False})
        {'max_epochs': 5, 'enable_progress_bar': False}
        >>> check_trainer_arguments({"max_epochs": "abc"})
        Traceback (most recent call last):
        ...
        ValueError: `trainer.max_epochs` is 'abc' (str), but pl.Trainer takes max_epochs: Optional[int]; give a value of that type (in the YAML or as --trainer.max_epochs=...).

    Returns:
        The arguments, converted where jsonargparse converts them (e.g. ``"5"`` to ``5``).

    Raises:
        ValueError: Naming the keys that are not ``pl.Trainer`` arguments, the first value of the wrong type, a
            setting that trains nothing (candidates would be ranked untrained), or several processes (each would
            run the whole selection again).
    """
    from jsonargparse import ArgumentError

    if not isinstance(trainer, Mapping):
        raise ValueError(f"`trainer` must be a mapping of pl.Trainer's arguments (e.g. {{'max_epochs': 10}}), each "
                         f"candidate gets its own Trainer; got {type(trainer).__name__}.")
    parameters = inspect.signature(pl.Trainer).parameters
    keywords(trainer, list(parameters), "trainer", "pl.Trainer")
    checked = {}
    for key, value in trainer.items():
        try:
            checked[key] = _trainer_parser().parse_object({key: value}, defaults=False)[key]
        except ArgumentError:
            annotation = parameters[key].annotation
            shown = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
            raise ValueError(
                f"`trainer.{key}` is {value!r} ({type(value).__name__}), but pl.Trainer takes {key}: {shown}; give a "
                f"value of that type (in the YAML or as --trainer.{key}=...)."
            ) from None
    for key in ("max_epochs", "max_steps", "limit_train_batches"):
        if checked.get(key) == 0:
            raise ValueError(f"`trainer.{key}` is 0: no candidate would be trained, and untrained networks would be "
                             "ranked by their evidence; give a positive value.")
    several = [f"{key}={checked[key]!r}" for key in ("devices", "num_nodes") if key in checked
               and _processes(checked[key]) not in (0, 1)]  # 0 devices: Lightning's own error
    if several:
        raise ValueError(f"`trainer` asks for several processes ({', '.join(several)}): select_models trains the "
                         "candidates one after another in this process, and Lightning's launcher would run the whole "
                         "selection again in each; train each candidate on one device.")
    return checked


def _processes(value: Any) -> int:
    """How many processes ``pl.Trainer(devices=value)`` asks for (-1: all; ``"auto"`` or ``None``: one on a CPU;
    ``"0,1"``: a list of device ids)."""
    if value is None:
        return 1
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str):
        if "," in value:
            return len([part for part in value.split(",") if part.strip()])
        return int(value) if value.strip().lstrip("-").isdigit() else 1
    return int(value)


@functools.lru_cache(maxsize=None)
def _trainer_parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(pl.Trainer)
    return parser
