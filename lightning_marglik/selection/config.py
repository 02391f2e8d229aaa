"""A selection configuration (the YAML's ``data``, ``candidates``, ``trainer``, ``callback``, ...):
its classes resolved and checked before any is called, then :func:`.select_models`."""
from __future__ import annotations

import importlib
import inspect
import numbers
import os
from typing import Any, List, Mapping, Optional

import pytorch_lightning as pl

from ..validators import choice, suggestion
from .driver import (
    DEFAULT_RANK_BY,
    DEFAULT_RANK_OUTPUT_LAYER,
    RANK_OUTPUT_LAYER,
    check_callback_arguments,
    check_fold_batchnorm,
    check_rank_by,
    select_models,
)
from .results import CandidateResult
from .trainer_arguments import check_trainer_arguments

__all__ = ["check_config", "instantiate", "missing_module_fix", "resolve_class", "select_from_config"]


def resolve_class(class_path: str, expected: type) -> type:
    """Import ``class_path`` and check that it is a subclass of ``expected`` (nothing is called).

    Example:
        >>> resolve_class("os.system", pl.LightningModule)
        Traceback (most recent call last):
        ...
        ValueError: class_path 'os.system' is a builtin_function_or_method, not a subclass of pytorch_lightning.LightningModule: refused.

    Raises:
        ValueError: If it cannot be imported (naming the fix where its module is not on the
            Python path: :func:`missing_module_fix`) or is not such a class (the message names both).
    """
    wanted = f"{expected.__module__.split('.')[0]}.{expected.__qualname__}"
    module_name, _, attr = str(class_path).rpartition(".")
    if not module_name:
        raise ValueError(f"class_path {class_path!r} must be a dotted path module.Class of a {wanted} subclass.")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        fix = missing_module_fix(class_path, getattr(error, "name", None)) if isinstance(error, ImportError) else None
        raise ValueError(
            f"class_path {class_path!r} (expected a {wanted} subclass) cannot be imported: {error}{'. ' + fix if fix else ''}"
        ) from error
    if not (inspect.isclass(found) and issubclass(found, expected)):
        kind = f"class {found.__module__}.{found.__qualname__}" if inspect.isclass(found) else type(found).__name__
        raise ValueError(f"class_path {class_path!r} is a {kind}, not a subclass of {wanted}: refused.")
    return found


def missing_module_fix(class_path: str, missing: Optional[str], directory: Optional[str] = None) -> Optional[str]:
    """How to put the module of ``class_path`` on the Python path, where ``missing`` (the module an
    ``ImportError`` names) is that module or a package above it.

    A YAML's own modules (e.g. ``digits_models`` of ``configs/digits_selection.yaml``, in
    ``examples/``) are found only in the working directory and on ``PYTHONPATH``; a subdirectory
    of the working directory that holds the module is named in the fix.

    Args:
        class_path: The ``module.Class`` that failed to import.
        missing: The module the ``ImportError`` names (its ``name``).
        directory: The working directory the command was started in (default: the current one;
            jsonargparse changes to the YAML's directory while it parses).

    Returns:
        The fix in one sentence, or ``None`` for another missing module (a dependency of the
        user's module, whose own error says what to install).
    """
    module = str(class_path).rpartition(".")[0]
    if not missing or not (module == missing or module.startswith(missing + ".")):
        return None
    top = missing.split(".")[0]
    cwd = directory or os.getcwd()
    holders = [name for name in sorted(os.listdir(cwd)) if not name.startswith(".")
               and (os.path.isfile(os.path.join(cwd, name, f"{top}.py")) or os.path.isdir(os.path.join(cwd, name, top)))]
    where = f"set PYTHONPATH={holders[0]}" if holders else "add the directory that holds it to PYTHONPATH"
    return (f"Modules named by class_path are found in the working directory ({cwd}) and on PYTHONPATH, and "
            f"{top!r} is in neither: run marglik-select from the directory that holds {top}.py, or {where} "
            f"(e.g. PYTHONPATH={holders[0] if holders else 'examples'} marglik-select CONFIG.yaml).")


def instantiate(spec: Mapping[str, Any], expected: type, **defaults: Any) -> Any:
    """Build ``class_path(**init_args)`` after checking that ``class_path`` is a subclass of ``expected``.

    ``defaults`` fill constructor arguments that the spec leaves out and the class accepts.

    Raises:
        ValueError: If ``spec`` has no ``class_path`` or it is not an ``expected`` subclass.
    """
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        raise ValueError(f"Expected a mapping with `class_path` (and `init_args`), got {spec!r}.")
    cls = resolve_class(spec["class_path"], expected)
    kwargs = dict(spec.get("init_args") or {})
    accepted = inspect.signature(cls).parameters
    kwargs.update({k: v for k, v in defaults.items() if k in accepted and k not in kwargs})
    return cls(**kwargs)


def check_config(config: Mapping[str, Any]) -> None:
    """Check a selection configuration without training anything.

    Every ``class_path`` must resolve to the expected kind of class, each candidate's ``init_args`` must fit its
    constructor (names, the required ones, numbers and flags where its defaults are), the trainer arguments must
    fit ``pl.Trainer``'s signature (names and types), the callback arguments must be valid and ``output_dir``, if
    given, must be a directory that can be written.

    Raises:
        ValueError: On the first problem found (the message names the key or class_path).
    """
    for key in ("data", "candidates"):
        if config.get(key) is None:
            raise ValueError(f"The configuration needs a `{key}` section (see `marglik-select --help`).")
        if not config[key]:
            raise ValueError(f"The configuration's `{key}` section is empty (see `marglik-select --help`).")
    data = resolve_class(_class_path(config["data"], "data"), pl.LightningDataModule)
    for name, spec in config["candidates"].items():
        cls = resolve_class(_class_path(spec, f"candidates.{name}"), pl.LightningModule)
        _check_init_args(cls, spec.get("init_args") or {}, f"candidates.{name}.init_args")
        _check_loader_method((config.get("callback") or {}).get("dataloader"), data, cls, name)
    _check_output_dir(config.get("output_dir"))
    check_trainer_arguments(config.get("trainer") or {})
    check_callback_arguments(config.get("callback") or {})
    check_rank_by(config.get("rank_by", DEFAULT_RANK_BY))
    check_fold_batchnorm(config.get("fold_batchnorm", True))
    choice(config.get("rank_output_layer", DEFAULT_RANK_OUTPUT_LAYER), RANK_OUTPUT_LAYER, "rank_output_layer")


def _check_loader_method(dataloader: Any, data: type, cls: type, name: str) -> None:
    """Refuse a ``callback.dataloader`` method name that neither the data's class nor candidate ``name``'s class
    defines: the callback would find it missing only at that candidate's set-up, after those before it trained."""
    if not isinstance(dataloader, str) or any(callable(getattr(c, dataloader, None)) for c in (data, cls)):
        return
    methods = sorted({m for c in (data, cls) for m in dir(c) if m.endswith("dataloader") and not m.startswith("_")})
    raise ValueError(f"`callback.dataloader` = {dataloader!r}: neither {data.__name__} nor candidate {name!r}'s "
                     f"{cls.__name__} defines such a method{suggestion(dataloader, methods)}; name one that returns "
                     f"the evidence DataLoader ({', '.join(methods)}).")


def _check_init_args(cls: type, init_args: Any, where: str) -> None:
    """Refuse ``init_args`` the constructor of ``cls`` cannot take, before any candidate trains: an unknown name (with
    a "did you mean"), a required argument left out (``n_data`` aside: the data give it), and a value that is not a
    number or a flag where the argument's default is one."""
    if not isinstance(init_args, Mapping):
        raise ValueError(f"`{where}` must be a mapping of {cls.__name__}'s arguments, got {init_args!r}.")
    parameters = inspect.signature(cls).parameters
    named = {n: p for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        for key in init_args:
            if key not in named:
                raise ValueError(f"`{where}.{key}` is not an argument of {cls.__name__}{suggestion(key, list(named))}; "
                                 f"it takes {', '.join(named)}.")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in init_args and n != "n_data"]
    if missing:
        raise ValueError(f"`{where}` leaves out {cls.__name__}'s required {', '.join(map(repr, missing))}.")
    for key, value in init_args.items():
        expected = _scalar_kind(named[key]) if key in named else None
        if expected == "flag" and not isinstance(value, bool):
            raise ValueError(f"`{where}.{key}` = {value!r}: {cls.__name__}'s `{key}` is a flag (True or False).")
        if expected == "number" and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"`{where}.{key}` = {value!r}: {cls.__name__}'s `{key}` takes a number.")
        if expected == "int" and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"`{where}.{key}` = {value!r}: {cls.__name__}'s `{key}` takes an int (annotated int).")


# a parameter annotated by one of these takes that kind of value (the names: annotations postponed as strings)
_SCALAR_KINDS = {bool: "flag", "bool": "flag", int: "int", "int": "int", float: "number", "float": "number"}


def _scalar_kind(parameter: inspect.Parameter) -> Optional[str]:
    """``"flag"``, ``"int"`` or ``"number"`` where a parameter takes only that (by its annotation; else ``"flag"`` or
    ``"number"`` by its default's type: a default of 0 may stand for a float), ``None`` where it may take more
    (``Optional[int]``, a ``Union``, no default)."""
    if parameter.annotation is not parameter.empty:
        return _SCALAR_KINDS.get(parameter.annotation)
    default = parameter.default
    return "flag" if isinstance(default, bool) else "number" if isinstance(default, numbers.Real) else None


def _check_output_dir(output_dir: Any) -> None:
    """Refuse an ``output_dir`` that is a file, or that cannot be created or written, before anything trains."""
    if output_dir is None:
        return
    path = os.path.abspath(os.fspath(output_dir))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"`output_dir` {output_dir!r}: {existing} is a file, not a directory; name a directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ValueError(f"`output_dir` {output_dir!r} {what}; name a directory you can write.")


def _class_path(spec: Any, where: str) -> str:
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        raise ValueError(f"`{where}` must be a mapping with `class_path` (and `init_args`), got {spec!r}.")
    return spec["class_path"]


def select_from_config(config: Mapping[str, Any], resume: bool = False, verbose: bool = True) -> List[CandidateResult]:
    """Run :func:`select_models` from a parsed YAML configuration (see the module docstring).

    Every ``class_path`` is checked (:func:`check_config`) before any of them is called.

    Args:
        config: ``data``, ``candidates`` and optionally ``trainer``, ``callback``, ``seed``,
            ``predictive``, ``rank_by``, ``fold_batchnorm``, ``rank_output_layer``, ``output_dir``.
        resume: Reuse results in ``output_dir`` of candidates trained with the same settings.
        verbose: Print one line per candidate.

    Raises:
        ValueError: On an invalid configuration, e.g. a ``class_path`` of the wrong kind.
    """
    check_config(config)
    datamodule = instantiate(config["data"], pl.LightningDataModule)
    datamodule.setup("fit")
    n_data = len(datamodule.train_dataloader().dataset)
    candidates = {
        name: (lambda spec=spec: instantiate(spec, pl.LightningModule, n_data=n_data))
        for name, spec in config["candidates"].items()
    }
    return select_models(
        candidates,
        datamodule=datamodule,
        callback=config.get("callback"),
        trainer=config.get("trainer"),
        predictive=config.get("predictive", "map"),
        rank_by=config.get("rank_by", DEFAULT_RANK_BY),
        fold_batchnorm=config.get("fold_batchnorm", True),
        rank_output_layer=config.get("rank_output_layer", DEFAULT_RANK_OUTPUT_LAYER),
        output_dir=config.get("output_dir"),
        seed=config.get("seed", 0),
        verbose=verbose,
        resume=resume,
        settings={name: {**spec, "data": config["data"]} for name, spec in config["candidates"].items()},
    )
