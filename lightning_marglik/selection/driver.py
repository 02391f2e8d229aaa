"""The selection driver: train every candidate with ``MargLikCallback`` and rank them by evidence."""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torchmetrics
from torch.utils.data import DataLoader

from ..callbacks import MargLikCallback, find_hyperparameters
from ..curvature import APPROXIMATIONS, CurvatureOptions, check_model
from ..curvature.structures import structures_with
from ..diagnostics import ef_ratio_of, ef_unreliable_message
from ..validators import choice
from .metrics import MetricsCheck, evaluate_metrics
from .results import RESULTS_JSON, CandidateResult, load_results, run_lock, save_results

__all__ = [
    "DEFAULT_RANK_BY", "PREDICTIVES", "check_rank_by", "check_trainer_arguments", "quiet_lightning", "rank_by_choices",
    "select_models",
]

PREDICTIVES = ("map", "probit")
DEFAULT_RANK_BY = "kron-ef"


def rank_by_choices() -> Tuple[str, ...]:
    """What may rank the candidates: ``"online"`` (the callback's final evidence) or
    ``"<structure>-<approx>"`` re-estimated at the final weights, for every registered structure
    that offers ``rank_by`` (:func:`..curvature.structures.structures_with`).

    Example:
        >>> rank_by_choices()[:3]
        ('online', 'full-ggn', 'full-ef')
    """
    return ("online",) + tuple(f"{s}-{a}" for s in structures_with("rank_by") for a in APPROXIMATIONS)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Keep Lightning's per-``Trainer`` banners and small-data warnings out of the output.

    Every candidate gets a fresh ``Trainer``, and each would print its accelerator banner, a tip
    and warnings about data loader workers and logging intervals; inside this context only
    Lightning's warnings and errors reach the log.

    Example:
        >>> with quiet_lightning():
        ...     trainer = pl.Trainer(max_epochs=1, logger=False, accelerator="cpu")
    """
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*number of training batches.*")
            # Lightning 2.6 on torch >= 2.10 warns about its own use of torch's pytree at every step
            warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def select_models(
    candidates: Mapping[str, Callable[[], pl.LightningModule]],
    train_dataloader: Optional[DataLoader] = None,
    datamodule: Optional[pl.LightningDataModule] = None,
    callback: Optional[Dict[str, Any]] = None,
    trainer: Optional[Dict[str, Any]] = None,
    test_dataloader: Optional[DataLoader] = None,
    metrics: Optional[Callable[[], Mapping[str, torchmetrics.Metric]]] = None,
    predictive: str = "map",
    output_dir: Optional[str] = None,
    seed: int = 0,
    verbose: bool = True,
    resume: bool = False,
    settings: Optional[Mapping[str, Any]] = None,
    rank_by: str = DEFAULT_RANK_BY,
) -> List[CandidateResult]:
    """Train every candidate with ``MargLikCallback`` and rank them by their evidence at the final weights.

    With ``output_dir``, ``results.json`` and ``results.csv`` are rewritten after every candidate
    (ranked so far, with the stored results of candidates this run does not name), so a killed
    run loses at most the candidate in training; ``evidence.png`` follows at the end. The
    directory is locked for the run (:func:`load_results` says what happens to an unreadable file).

    Which evidence to rank by: the Kronecker empirical Fisher re-estimated at the final weights,
    ``rank_by="kron-ef"``, is the default because it ranked MLPs and CNNs best in the ranking study
    (``examples/results/ranking_study.md``, whose figures the documentation's results page
    carries). Do not compare networks with and without normalization layers by their evidence:
    every approximation ranked the BatchNorm ResNets there last. Compare candidates at the same
    fraction of training. For small regression networks of different depths use
    ``callback={"structure": "full"}`` and ``rank_by="full-ggn"`` (``kron`` and ``diag`` are biased
    against depth, ``examples/results/toy_depth.md``). The evidence prefers the smaller of two
    near-equal models and judges under-trained candidates by where they are.

    Args:
        candidates: Name to a factory returning a fresh LightningModule (with prior and likelihood).
        train_dataloader: Training data (or give ``datamodule``).
        datamodule: A DataModule with ``train_dataloader`` (and ``test_dataloader`` for metrics).
        callback: Keyword arguments of ``MargLikCallback``.
        trainer: Keyword arguments of ``pl.Trainer`` (default: CPU, no logger, no checkpoints).
        test_dataloader: Held-out data for the metrics (only reported, never used to select).
        metrics: Factory of named torchmetrics called with (class probabilities, labels);
            default for a categorical likelihood: :func:`default_metrics`.
        predictive: ``"map"`` (softmax of the trained network) or ``"probit"`` (linearized
            Laplace predictive of the evidence's posterior) for the test metrics.
        output_dir: Where to write ``results.csv``, ``results.json`` and ``evidence.png``.
        seed: Seed set before each candidate (``pl.seed_everything``).
        verbose: Print one line per candidate with the elapsed time and an estimate of the rest.
        resume: Reuse a candidate's result from ``output_dir/results.json`` when it was trained
            with the same settings (the data are compared only as far as ``settings`` describe them).
        settings: JSON-able description of each candidate (name to e.g. its class and arguments),
            stored with its result and compared on ``resume``; the trainer, callback, seed,
            predictive and ``rank_by`` are always part of it.
        rank_by: The evidence that ranks the candidates (:func:`rank_by_choices`, matched
            case-insensitively): ``"<structure>-<approx>"`` (e.g. ``"kron-ef"``, the default)
            re-estimated at the final weights, one more evidence pass
            per candidate with its hyperparameters re-optimised by Newton
            (:meth:`MargLikCallback.evidence_with`), or ``"online"``, the callback's final estimate.
            Either way ``online_marglik`` of a result holds the callback's.

    Returns:
        The results, best evidence first.

    Raises:
        ValueError: On no candidates, no training data, an unknown ``predictive`` or ``rank_by``, ``trainer``
            arguments that do not fit ``pl.Trainer``, a candidate ``rank_by`` cannot score (before
            it is trained), or (when training starts) test data and metrics that do not fit the
            candidate.
        RuntimeError: If ``output_dir`` is in use by another run, or the test metrics fail
            after training (the trained result is saved first).
    """
    if not candidates:
        raise ValueError("`candidates` is empty: give at least one name -> factory.")
    if (train_dataloader is None) == (datamodule is None):
        raise ValueError("Give exactly one of `train_dataloader` and `datamodule`.")
    if predictive not in PREDICTIVES:
        raise ValueError(f"`predictive` must be one of {PREDICTIVES}, got {predictive!r}.")
    rank_by, rank_options = check_rank_by(rank_by)
    trainer = check_trainer_arguments(trainer or {})
    if test_dataloader is None and datamodule is not None and _has_test_data(datamodule):
        datamodule.setup("test")
        test_dataloader = datamodule.test_dataloader()
    wanted = {
        name: _jsonable({"candidate": (settings or {}).get(name), "trainer": trainer, "callback": callback or {},
                         "seed": seed, "predictive": predictive, "rank_by": rank_by})
        for name in candidates
    }
    with run_lock(output_dir):
        stored = load_results(output_dir) if output_dir else {}
        others = [result for name, result in stored.items() if name not in candidates]  # kept, never dropped
        reusable = {name for name in candidates if resume and name in stored
                    and stored[name].settings == wanted[name] and stored[name].metrics_error is None}
        results: List[CandidateResult] = []
        directions: Dict[str, bool] = {}
        start, trained, training_seconds = time.perf_counter(), 0, 0.0
        for index, (name, factory) in enumerate(candidates.items(), 1):
            if name in reusable:
                results.append(stored[name])
                if verbose:
                    print(f"[{index}/{len(candidates)}] {name}: marglik={stored[name].marglik:.4f} "
                          f"(finished in an earlier run with the same settings: reused)", flush=True)
                continue
            candidate_start = time.perf_counter()
            pl.seed_everything(seed, verbose=False)
            module = factory()
            prior, _ = find_hyperparameters(module)
            if rank_options is not None:  # e.g. a diagonal prior with "kron-ef", or "full-ggn" too large: before training
                try:
                    check_model(module, prior, rank_options)
                except ValueError as err:
                    raise ValueError(f"rank_by={rank_by!r} cannot score candidate {name!r}: {err}") from err
            cb = MargLikCallback(**(callback or {}))
            check = MetricsCheck(test_dataloader, metrics, predictive) if test_dataloader is not None else None
            kwargs = dict(logger=False, enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
            kwargs.update(trainer)
            own = kwargs.pop("callbacks", None) or []
            own = [own] if isinstance(own, pl.Callback) else list(own)
            fit_trainer = pl.Trainer(callbacks=[cb, *own, *([check] if check else [])], **kwargs)
            fit_start = time.perf_counter()
            fit_trainer.fit(module, train_dataloaders=train_dataloader, datamodule=datamodule)
            if rank_options is None:
                marglik = cb.final_marglik
            else:
                marglik = cb.evidence_with(fit_trainer, module, rank_options.structure, rank_options.approx)
            seconds = time.perf_counter() - fit_start
            ranked_by = cb.options.approx if rank_options is None else rank_options.approx
            # the EF's curvature check at the final weights, from the last estimate's own sums (no pass)
            ef_ratio = ef_ratio_of(cb.evidence) if ranked_by == "ef" and cb.evidence is not None else None
            scores: Dict[str, float] = {}
            failure: Optional[Exception] = None
            if check is not None and check.metrics:
                directions.update({k: bool(m.higher_is_better) for k, m in check.metrics.items()
                                   if m.higher_is_better is not None})
                try:
                    scores = evaluate_metrics(module, cb.evidence, test_dataloader, check.metrics, predictive)
                except Exception as error:  # the trained result is saved first, then the error is raised
                    failure = error
            results.append(CandidateResult(
                name=name,
                marglik=marglik,
                online_marglik=cb.final_marglik,
                n_params=prior.n_params,
                train_seconds=seconds,
                epochs=fit_trainer.current_epoch,
                hyperparameters={k: v for k, v in cb.logged_values(cb.final_marglik).items() if k != "marglik"},
                metrics=scores,
                settings=wanted[name],
                metrics_error=None if failure is None else f"{type(failure).__name__}: {failure}",
                ef_curvature_ratio=ef_ratio,
            ))
            if output_dir:  # after every candidate: a killed run keeps what finished
                save_results(_ranked(results + others), output_dir, plot=False)
            if failure is not None:
                where = f"; its evidence is saved in {os.path.join(output_dir, RESULTS_JSON)}" if output_dir else ""
                raise RuntimeError(
                    f"Candidate {name!r} trained (marglik={results[-1].marglik:.4f}{where}) but its test metrics "
                    f"failed: {results[-1].metrics_error}. Fix the metrics or the test data; a re-run trains it again."
                ) from failure
            trained += 1
            training_seconds += time.perf_counter() - candidate_start
            if verbose:
                to_train = sum(1 for other in list(candidates)[index:] if other not in reusable)
                shown = " ".join(f"{k}={v:.4f}" for k, v in scores.items())
                print(f"[{index}/{len(candidates)}] {name}: marglik={results[-1].marglik:.4f} params={prior.n_params} "
                      f"time={seconds:.1f}s {shown} | elapsed {_clock(time.perf_counter() - start)}, "
                      f"about {_clock(training_seconds / trained * to_train)} left", flush=True)
        if output_dir:
            save_results(_ranked(results + others), output_dir, higher_is_better=directions)
    message = ef_unreliable_message({r.name: r.ef_curvature_ratio for r in results if r.ef_curvature_ratio is not None})
    if message:
        warnings.warn(message, stacklevel=2)
    return _ranked(results)


def check_rank_by(rank_by: Any) -> Tuple[str, Optional[CurvatureOptions]]:
    """Validate ``rank_by``: its canonical spelling and the curvature it re-estimates with
    (``None`` for ``"online"``).

    Example:
        >>> check_rank_by("KRON-EF")[0]
        'kron-ef'

    Raises:
        ValueError: Naming the choices, with a "did you mean" for a near miss.
    """
    rank_by = choice(rank_by, rank_by_choices(), "rank_by")
    if rank_by == "online":
        return rank_by, None
    structure, approx = rank_by.rsplit("-", 1)  # a registered name may hold a hyphen itself
    return rank_by, CurvatureOptions(structure, approx, 0)


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
        ValueError: Naming the keys that are not ``pl.Trainer`` arguments, or the first value
            of the wrong type.
    """
    from jsonargparse import ArgumentError

    parameters = inspect.signature(pl.Trainer).parameters
    unknown = set(trainer) - set(parameters)
    if unknown:
        raise ValueError(f"`trainer` has keys that are not pl.Trainer arguments: {sorted(unknown)}.")
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
    return checked


@functools.lru_cache(maxsize=None)
def _trainer_parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(pl.Trainer)
    return parser


def _ranked(results: Sequence[CandidateResult]) -> List[CandidateResult]:
    return sorted(results, key=lambda r: -r.marglik if math.isfinite(r.marglik) else math.inf)


def _clock(seconds: float) -> str:
    """``1:05`` or ``2:03:07`` for a duration in seconds."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON; objects without a JSON form become their ``repr``
    (which never compares equal across runs for e.g. a DataLoader, so such a run is redone)."""
    return json.loads(json.dumps(value, default=repr, sort_keys=True))


def _has_test_data(datamodule: pl.LightningDataModule) -> bool:
    return type(datamodule).test_dataloader is not pl.LightningDataModule.test_dataloader
