"""Step 2 of the method: train candidate models with ``MargLikCallback`` and rank them by evidence.

From Python::

    results = select_models({"mlp": make_mlp, "cnn": make_cnn}, datamodule=data,
                            callback={"structure": "diag", "approx": "ef"},
                            trainer={"max_epochs": 30}, output_dir="selection")

From the command line, over a YAML file (``class_path``/``init_args`` as in LightningCLI)::

    marglik-select candidates.yaml            # or: python -m lightning_marglik.selection ...
    marglik-select candidates.yaml --trainer.max_epochs=5 --callback.structure=kron --seed=1
    marglik-select candidates.yaml --quick    # 1 epoch of 2 batches per candidate: a smoke test
    marglik-select candidates.yaml --print_config     # the configuration after all overrides

    seed: 0
    output_dir: selection
    trainer: {max_epochs: 30}
    callback: {structure: diag, approx: ef}
    data: {class_path: mypackage.Data, init_args: {batch_size: 64}}
    candidates:
      mlp: {class_path: mypackage.MLP, init_args: {width: 100}}
      cnn: {class_path: mypackage.CNN, init_args: {channels: 16}}

A candidate class whose ``__init__`` takes ``n_data`` gets the training set size when the YAML
does not set it. A YAML file imports the modules it names (as LightningCLI's do): use only
files from a trusted source. ``data`` must name a ``LightningDataModule`` subclass and every
candidate a ``LightningModule`` subclass; anything else is refused before it is called.

Results are written after every candidate; a re-run with the same settings reuses the
candidates that finished (``--rerun`` trains them all again). The results of candidates a run
does not name are kept; an unreadable ``results.json`` is moved aside with a warning; a second
run into a directory in use is refused, naming the process that holds it (``results.lock``).

Trainer arguments are checked against ``pl.Trainer``'s signature (names and types) before
anything is built. Test metrics read batches as the evidence does (``marglik_batch``) and score
the positions the likelihood counts (classes last in ``(B, ..., C)``, ``ignore_index`` left out);
the first test batch goes through them when training starts, so that a mismatch costs no training.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import importlib
import inspect
import itertools
import json
import logging
import math
import os
import re
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor
from torch.utils.data import DataLoader

from .callbacks import MargLikCallback, find_hyperparameters
from .curvature import CurvatureOptions, check_model
from .curvature.batches import call_model, move, split_batch
from .evidence import LaplaceEvidence
from .hyperparameters import CategoricalLikelihood
from .predictive import predict_classification

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CandidateResult",
    "NegativeLogLikelihood",
    "default_metrics",
    "select_models",
    "select_from_config",
    "check_config",
    "check_trainer_arguments",
    "resolve_class",
    "instantiate",
    "load_results",
    "save_results",
    "label_points",
    "quiet_lightning",
    "run_command_line",
    "main",
]

PREDICTIVES = ("map", "probit")
# what ranks the candidates: the callback's final evidence, or "<structure>-<approx>" re-estimated at the final weights
RANK_BY = ("online",) + tuple(f"{s}-{a}" for s in ("kron", "ekfac", "diag", "full") for a in ("ef", "ggn"))
DEFAULT_RANK_BY = "kron-ef"
RESULTS_JSON = "results.json"
LOCK_FILE = "results.lock"
# Small models on a shared CPU: with other jobs on the 2 cores (load 9-11), `marglik-select
# configs/digits_selection.yaml --trainer.max_epochs=5` took 153 s wall clock (65 s training) with
# 1 thread against 357 s (305 s) with 2; the toy regression example (300 epochs, load 3-5) trained
# in 3.0-4.3 s against 25-51 s (README, "Threads").
DEFAULT_THREADS = 1
# What `--quick` means: one epoch of two batches and one cheap estimate per candidate. The
# evidence pass still sees the whole training set, so a quick run exercises everything.
QUICK_OVERRIDES = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--callback.frequency=1",
    "--callback.steps=5",
)


@dataclass
class CandidateResult:
    """One trained candidate: its evidence, size, cost and test metrics.

    ``settings`` describe how it was trained (trainer, callback, seed, predictive and, from a
    YAML, its ``class_path``/``init_args`` and the data); a re-run reuses the result only if they
    are unchanged. ``metrics_error`` says why the test metrics failed after training (the result
    is kept for its evidence and trained again by the next run).
    """

    name: str
    marglik: float  # log evidence per datum by which the candidates are ranked (higher is better)
    n_params: int
    train_seconds: float
    epochs: int
    hyperparameters: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    settings: Dict[str, Any] = field(default_factory=dict)
    metrics_error: Optional[str] = None
    online_marglik: Optional[float] = None  # the callback's final evidence (= marglik with rank_by="online")


class NegativeLogLikelihood(torchmetrics.Metric):
    """Mean negative log-likelihood of integer labels under predicted class probabilities.

    Example:
        >>> metric = NegativeLogLikelihood()
        >>> metric.update(torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.tensor([0, 1]))
        >>> round(metric.compute().item(), 4)  # -(log 0.5 + log 0.75) / 2
        0.4904
    """

    higher_is_better = False
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: Tensor, target: Tensor) -> None:
        picked = probs.gather(1, target.unsqueeze(1)).squeeze(1).clamp_min(1e-12)
        self.total += -picked.log().sum().double()
        self.count += target.numel()

    def compute(self) -> Tensor:
        return self.total / self.count


def default_metrics(n_classes: int) -> Dict[str, torchmetrics.Metric]:
    """Accuracy, NLL and expected calibration error (15 bins) for ``n_classes`` classes.

    Example:
        >>> sorted(default_metrics(3))
        ['accuracy', 'ece', 'nll']
    """
    return {
        "accuracy": torchmetrics.classification.MulticlassAccuracy(n_classes, average="micro"),
        "nll": NegativeLogLikelihood(),
        "ece": torchmetrics.classification.MulticlassCalibrationError(n_classes, n_bins=15, norm="l1"),
    }


def _predictions(
    module: pl.LightningModule, evidence: Optional[LaplaceEvidence], batch: Any, predictive: str
) -> Tuple[Tensor, Tensor]:
    """What the test metrics see of one batch: ``(predictions, targets)`` on the CPU.

    The batch is read as the evidence reads it (``marglik_batch`` or ``(inputs, targets)``).
    Under a categorical likelihood the predictions are class probabilities ``(n, C)`` of the
    positions the likelihood counts: classes on the last dimension of ``(B, ..., C)`` outputs,
    positions labelled ``ignore_index`` left out. Other likelihoods get the raw outputs.
    """
    _, likelihood = find_hyperparameters(module)
    inputs, target = split_batch(batch, getattr(module, "marglik_batch", None))
    weight = next(module.parameters())
    inputs = move(inputs, weight.device, weight.dtype)
    if predictive == "probit":
        if not isinstance(likelihood, CategoricalLikelihood) or not isinstance(inputs, Tensor):
            raise ValueError(
                "predictive='probit' needs a CategoricalLikelihood and tensor inputs; use predictive='map' "
                f"(got {type(likelihood).__name__} and {type(inputs).__name__} inputs)."
            )
        if evidence is None:  # the check before training: the network's output shape is all it needs
            with torch.no_grad():
                output = call_model(module, inputs)
            if output.dim() != 2:
                raise ValueError(f"predictive='probit' needs (batch, classes) outputs, got {tuple(output.shape)}; "
                                 "use predictive='map' for sequence outputs.")
            output = output.softmax(-1)
        else:
            output = predict_classification(evidence, module, inputs, "probit")
    else:
        with torch.no_grad():
            output = call_model(module, inputs)
        if isinstance(likelihood, CategoricalLikelihood):
            output = output.softmax(-1)
    output, target = output.detach(), target.to(output.device)
    if isinstance(likelihood, CategoricalLikelihood):
        probs, labels, kept = likelihood.terms(output, target)
        output, target = probs[kept], labels[kept]
    return (output.float() if output.is_floating_point() else output).cpu(), target.cpu()


def _test_metrics(
    module: pl.LightningModule,
    evidence: Optional[LaplaceEvidence],
    loader: Any,
    metrics: Mapping[str, torchmetrics.Metric],
    predictive: str,
    batches: Optional[int] = None,
) -> Dict[str, float]:
    """The ``metrics`` over the first ``batches`` (default all) batches of ``loader``, in eval mode."""
    was_training = module.training
    module.eval()
    try:
        for batch in itertools.islice(loader, batches):
            predictions, target = _predictions(module, evidence, batch, predictive)
            for metric in metrics.values():
                metric.update(predictions, target)
        return {name: float(metric.compute()) for name, metric in metrics.items()}
    finally:
        module.train(was_training)
        for metric in metrics.values():
            metric.reset()


class _TestMetricsCheck(pl.Callback):
    """Runs the first test batch through the metrics when training starts (after the module's set-up
    hooks), so that a batch, shape or metric mistake costs no training; keeps the metrics."""

    def __init__(
        self, loader: Any, metrics: Optional[Callable[[], Mapping[str, torchmetrics.Metric]]], predictive: str
    ) -> None:
        self.loader, self.factory, self.predictive = loader, metrics, predictive
        self.metrics: Dict[str, torchmetrics.Metric] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.factory is not None:
            self.metrics = dict(self.factory())
        elif isinstance(find_hyperparameters(pl_module)[1], CategoricalLikelihood):
            module_mode = pl_module.training
            pl_module.eval()
            try:
                predictions, _ = _predictions(pl_module, None, next(iter(self.loader)), "map")
            finally:
                pl_module.train(module_mode)
            self.metrics = default_metrics(predictions.shape[-1])
        _test_metrics(pl_module, None, self.loader, self.metrics, self.predictive, batches=1)


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

    Which evidence to rank by (measured in ``examples/results/ranking_study.md``: 22 MLPs, CNNs and
    ResNets on MNIST-5k, 3 seeds): the Kronecker empirical Fisher re-estimated at the final weights,
    ``rank_by="kron-ef"`` (the default). Among the 16 MLPs and CNNs its Spearman rho(evidence, test
    accuracy) was 0.78, against 0.51 for kron-GGN (the callback's own estimate, ``rank_by="online"``
    with the defaults) and negative for ``diag``; ekfac-EF tied it (0.76) at about twice the cost.
    Across families it failed: the BatchNorm ResNets tested as well as the best CNNs, yet every
    approximation ranked them last (rho over all 22: 0.27 with kron-EF, 0.00 with kron-GGN), so do not
    compare networks with and without normalization layers by their evidence. Compare candidates at
    the same fraction of training, at least ~30 %. For small regression networks of different depths
    use ``callback={"structure": "full"}`` and ``rank_by="full-ggn"`` (``kron`` and ``diag``, EF or GGN,
    are biased against depth, ``examples/results/toy_depth.md``). The evidence prefers the smaller of
    two near-equal models and judges under-trained candidates by where they are.

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
        rank_by: The evidence that ranks the candidates: ``"<structure>-<approx>"`` (e.g.
            ``"kron-ef"``, the default) re-estimated at the final weights, one more evidence pass
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
    rank_options = _check_rank_by(rank_by)
    trainer = check_trainer_arguments(trainer or {})
    if test_dataloader is None and datamodule is not None and _has_test_data(datamodule):
        datamodule.setup("test")
        test_dataloader = datamodule.test_dataloader()
    wanted = {
        name: _jsonable({"candidate": (settings or {}).get(name), "trainer": trainer, "callback": callback or {},
                         "seed": seed, "predictive": predictive, "rank_by": rank_by})
        for name in candidates
    }
    with _run_lock(output_dir):
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
            check = _TestMetricsCheck(test_dataloader, metrics, predictive) if test_dataloader is not None else None
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
            scores: Dict[str, float] = {}
            failure: Optional[Exception] = None
            if check is not None and check.metrics:
                directions.update({k: bool(m.higher_is_better) for k, m in check.metrics.items()
                                   if m.higher_is_better is not None})
                try:
                    scores = _test_metrics(module, cb.evidence, test_dataloader, check.metrics, predictive)
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
    return _ranked(results)


def _check_rank_by(rank_by: Any) -> Optional[CurvatureOptions]:
    """Validate ``rank_by``: the curvature it re-estimates with (``None`` for ``"online"``)."""
    if not isinstance(rank_by, str) or rank_by not in RANK_BY:
        raise ValueError(f"`rank_by` must be one of {RANK_BY}, got {rank_by!r}.")
    if rank_by == "online":
        return None
    structure, approx = rank_by.split("-")
    return CurvatureOptions(structure, approx, 0)


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


def load_results(output_dir: str) -> Dict[str, CandidateResult]:
    """The results stored in ``output_dir/results.json`` by name (empty if there are none).

    A file that cannot be read as results (truncated by a full disk, edited by hand) is moved
    aside to ``results.json.corrupt-<time>`` with a warning, and its candidates count as not trained.
    """
    path = os.path.join(output_dir, RESULTS_JSON)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise TypeError(f"expected a list of results, got {type(rows).__name__}")
        return {result.name: result for result in map(_result_from_row, rows)}
    except (ValueError, TypeError, UnicodeDecodeError) as error:  # json.JSONDecodeError is a ValueError
        aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(path, aside)
        warnings.warn(f"{path} cannot be read ({error}); moved it to {aside}: its candidates will be trained again.",
                      stacklevel=2)
        return {}


def _result_from_row(row: Any) -> CandidateResult:
    """A ``CandidateResult`` from one row of ``results.json``; TypeError on a field of the wrong type."""
    required = {"name": str, "marglik": (int, float), "n_params": int, "train_seconds": (int, float), "epochs": int}
    types = {**required, "hyperparameters": dict, "metrics": dict, "settings": dict, "metrics_error": (str, type(None)),
             "online_marglik": (int, float, type(None))}
    if not isinstance(row, dict) or not all(k in row for k in required):
        raise TypeError(f"a result must be an object with {', '.join(required)}, got {row!r:.200}")
    for key, expected in types.items():
        if key in row and (not isinstance(row[key], expected) or isinstance(row[key], bool)):
            raise TypeError(f"result {row.get('name')!r}: {key} has the wrong type ({type(row[key]).__name__})")
    return CandidateResult(**{k: v for k, v in row.items() if k in types})


def save_results(
    results: Sequence[CandidateResult],
    output_dir: str,
    plot: bool = True,
    higher_is_better: Optional[Mapping[str, bool]] = None,
) -> None:
    """Write ``results.json``, ``results.csv`` and, with ``plot`` and matplotlib, ``evidence.png``.

    The files are replaced atomically, so a run killed while writing leaves the previous ones.

    Args:
        results: The results, best first.
        output_dir: Directory (created if missing).
        plot: Whether to draw ``evidence.png`` (evidence against the first test metric).
        higher_is_better: Direction of each metric, for the plot's axis label.
    """
    os.makedirs(output_dir, exist_ok=True)
    nested = ("metrics", "hyperparameters", "settings", "metrics_error")
    rows = [{**{k: v for k, v in asdict(r).items() if k not in nested}, **r.metrics} for r in results]
    _write_atomic(os.path.join(output_dir, RESULTS_JSON), lambda f: json.dump([asdict(r) for r in results], f, indent=2))

    def write_csv(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)

    _write_atomic(os.path.join(output_dir, "results.csv"), write_csv)
    if plot and results[0].metrics:
        _plot_evidence(results, os.path.join(output_dir, "evidence.png"), higher_is_better or {})


def _write_atomic(path: str, write: Callable[[Any], None]) -> None:
    partial = f"{path}.{os.getpid()}.partial"  # never another process's temporary file
    with open(partial, "w", newline="") as f:
        write(f)
    os.replace(partial, path)


@contextlib.contextmanager
def _run_lock(output_dir: Optional[str]) -> Iterator[None]:
    """Hold ``output_dir/results.lock`` (created with the directory) for one run.

    A second run into the same directory is refused with an error naming the process that holds
    it. The lock is the system's ``flock``, which ends with its process: a run that was killed
    leaves no stale lock. Without ``fcntl`` (Windows) runs are not locked against each other.
    """
    if output_dir is None:
        yield
        return
    os.makedirs(output_dir, exist_ok=True)
    if fcntl is None:
        yield
        return
    path = os.path.join(output_dir, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by another process (other OSErrors are raised as they are)
            owner = os.read(fd, 4096).decode(errors="replace").strip() or "a process that is just starting"
            os.close(fd)
            raise RuntimeError(
                f"{output_dir} is in use by another model-selection run ({owner}). Wait for it to finish, or "
                "write to another directory (--output_dir); two runs into one directory would overwrite each "
                "other's results."
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # a finishing run removed the file we opened: lock the current one
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                 f"{' '.join(sys.argv)}".encode())
    try:
        yield
    finally:
        os.unlink(path)  # before unlocking: a run that opened this file sees it is gone and retries
        os.close(fd)


def _plot_evidence(results: Sequence[CandidateResult], path: str, higher_is_better: Mapping[str, bool]) -> None:
    """Evidence against the first test metric; marker size by parameter count, colour by class."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is an extra: pip install lightning_marglik[examples]
        return
    metric = next(iter(results[0].metrics))
    shown = [r for r in results if metric in r.metrics and math.isfinite(r.marglik)]
    if not shown:
        return
    biggest = max(r.n_params for r in shown)
    kinds = [str((r.settings.get("candidate") or {}).get("class_path", "")).rpartition(".")[2] for r in shown]
    sizes = [20 + 200 * r.n_params / biggest for r in shown]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for i, kind in enumerate(dict.fromkeys(kinds)):
        group = [(r, size) for r, k, size in zip(shown, kinds, sizes) if k == kind]
        ax.scatter([r.marglik for r, _ in group], [r.metrics[metric] for r, _ in group], s=[s for _, s in group],
                   color=f"C{i}", alpha=0.7, label=kind or None)
    if any(kinds):
        ax.legend(fontsize=8, title="class", title_fontsize=8)
    known = {name: m.higher_is_better for name, m in default_metrics(2).items()}  # e.g. all candidates reused
    better = higher_is_better.get(metric, known.get(metric))
    direction = {True: " (higher is better)", False: " (lower is better)"}.get(better, "")
    ax.set_xlabel("log evidence / N, training data only (higher is better)")
    ax.set_ylabel(f"test {metric}{direction}")
    ax.set_title("Model selection by the evidence (marker size: #params)")
    ax.margins(0.15)
    fig.tight_layout()
    label_points(ax, [(r.marglik, r.metrics[metric]) for r in shown], [r.name for r in shown], sizes)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def label_points(ax: Any, points: Sequence[Tuple[float, float]], labels: Sequence[str], sizes: Sequence[float]) -> None:
    """Label scatter points so that no label covers another label or a marker.

    Greedy: each label tries offsets in 8 directions at growing distances and takes the first
    free place (or, if there is none, the least covered one); labels away from their point get a
    thin leader line.

    Args:
        ax: A matplotlib ``Axes`` with the points already drawn and its limits set.
        points: Data coordinates of the points.
        labels: One label per point.
        sizes: Marker areas in points² (``scatter``'s ``s``).
    """
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()  # settles the axis limits, so that data map to their final pixels
    renderer = fig.canvas.get_renderer()
    pixels = fig.dpi / 72.0
    radii = [math.sqrt(s) / 2 for s in sizes]  # marker radius in points
    markers = [Bbox.from_bounds(x - r * pixels, y - r * pixels, 2 * r * pixels, 2 * r * pixels)
               for (x, y), r in zip(ax.transData.transform(points), radii)]
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    placed: List[Any] = [legend.get_window_extent(renderer)] if legend is not None else []

    def cost(box: Any) -> float:
        # Covering another label is worst, then leaving the axes, then covering a marker.
        return (100 * sum(_overlap(box, other) for other in placed)
                + 3 * (box.width * box.height - _overlap(box, frame))
                + sum(_overlap(box, other) for other in markers))

    directions = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
    order = sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0]), reverse=True)
    for i in order:
        best: Optional[Tuple[float, Any, Any]] = None
        for distance in (3, 10, 18, 28, 40, 55):
            for dx, dy in directions:
                offset = (dx * (distance + radii[i]), dy * (distance + radii[i]))
                text = ax.annotate(
                    labels[i], points[i], xytext=offset, textcoords="offset points", fontsize=7,
                    ha={1: "left", -1: "right", 0: "center"}[dx], va={1: "bottom", -1: "top", 0: "center"}[dy],
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkB=radii[i]) if distance > 3 else None,
                )
                text.update_positions(renderer)
                box = Text.get_window_extent(text, renderer).expanded(1.05, 1.2)  # the text, not its leader line
                score = cost(box)
                if best is None or score < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (score, text, box)
                else:
                    text.remove()
                if score == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        placed.append(best[2])


def _overlap(a: Any, b: Any) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0


# --- command line ---------------------------------------------------------------------------


def resolve_class(class_path: str, expected: type) -> type:
    """Import ``class_path`` and check that it is a subclass of ``expected`` (nothing is called).

    Example:
        >>> resolve_class("os.system", pl.LightningModule)
        Traceback (most recent call last):
        ...
        ValueError: class_path 'os.system' is a builtin_function_or_method, not a subclass of pytorch_lightning.LightningModule: refused.

    Raises:
        ValueError: If it cannot be imported or is not such a class (the message names both).
    """
    wanted = f"{expected.__module__.split('.')[0]}.{expected.__qualname__}"
    module_name, _, attr = str(class_path).rpartition(".")
    if not module_name:
        raise ValueError(f"class_path {class_path!r} must be a dotted path module.Class of a {wanted} subclass.")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"class_path {class_path!r} (expected a {wanted} subclass) cannot be imported: {error}") from error
    if not (inspect.isclass(found) and issubclass(found, expected)):
        kind = f"class {found.__module__}.{found.__qualname__}" if inspect.isclass(found) else type(found).__name__
        raise ValueError(f"class_path {class_path!r} is a {kind}, not a subclass of {wanted}: refused.")
    return found


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

    Every ``class_path`` must resolve to the expected kind of class, the trainer arguments must
    fit ``pl.Trainer``'s signature (names and types) and the callback arguments must be valid.

    Raises:
        ValueError: On the first problem found (the message names the key or class_path).
    """
    for key in ("data", "candidates"):
        if not config.get(key):
            raise ValueError(f"The configuration needs a `{key}` section (see `marglik-select --help`).")
    resolve_class(_class_path(config["data"], "data"), pl.LightningDataModule)
    for name, spec in config["candidates"].items():
        resolve_class(_class_path(spec, f"candidates.{name}"), pl.LightningModule)
    check_trainer_arguments(config.get("trainer") or {})
    MargLikCallback(**(config.get("callback") or {}))  # raises ValueError naming a bad argument
    _check_rank_by(config.get("rank_by", DEFAULT_RANK_BY))


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


def _class_path(spec: Any, where: str) -> str:
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        raise ValueError(f"`{where}` must be a mapping with `class_path` (and `init_args`), got {spec!r}.")
    return spec["class_path"]


def select_from_config(config: Mapping[str, Any], resume: bool = False, verbose: bool = True) -> List[CandidateResult]:
    """Run :func:`select_models` from a parsed YAML configuration (see the module docstring).

    Every ``class_path`` is checked (:func:`check_config`) before any of them is called.

    Args:
        config: ``data``, ``candidates`` and optionally ``trainer``, ``callback``, ``seed``,
            ``predictive``, ``rank_by``, ``output_dir``.
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
        output_dir=config.get("output_dir"),
        seed=config.get("seed", 0),
        verbose=verbose,
        resume=resume,
        settings={name: {**spec, "data": config["data"]} for name, spec in config["candidates"].items()},
    )


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup, for ``--help`` (docstrings are written for the docs).

    Example:
        >>> plain_text('``"newton"`` (see :mod:`lightning_marglik.solvers`, :func:`~torch.manual_seed`)')
        '"newton" (see lightning_marglik.solvers, manual_seed)'
    """
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~[\w.]*?(\w+)`", r"\1", text)  # :func:`~a.b` -> b
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`([^`]+)`", r"\1", text)  # :mod:`a.b` -> a.b
    text = re.sub(r"`([^`<]+?)\s*<[^`>]+>`_", r"\1", text)  # `label <url>`_ -> label
    return re.sub(r"``(.+?)``", r"\1", text)


def _help_formatter() -> type:
    from jsonargparse import DefaultHelpFormatter

    class PlainHelpFormatter(DefaultHelpFormatter):
        """jsonargparse's help (types and defaults) in plain text: no docstring markup."""

        def _get_help_string(self, action: Any) -> str:
            return plain_text(super()._get_help_string(action))

        def start_section(self, heading: Optional[str]) -> None:
            super().start_section(plain_text(heading) if heading else heading)

        def add_text(self, text: Optional[str]) -> None:
            super().add_text(plain_text(text) if text else text)

    return PlainHelpFormatter


def build_parser() -> Any:
    """The ``marglik-select`` parser (jsonargparse, as LightningCLI): YAML plus dotted overrides."""
    from typing import Literal

    from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser

    parser = ArgumentParser(
        prog="marglik-select",
        formatter_class=_help_formatter(),
        usage="marglik-select CONFIG.yaml [--trainer.KEY=VALUE] [--callback.KEY=VALUE] [--data.KEY=VALUE] "
              "[--seed=N] [--output_dir=DIR] [--quick] [--rerun] [--threads=N]",
        description="Train every candidate of CONFIG.yaml with MargLikCallback and rank them by their "
                    "Laplace evidence (log marginal likelihood / N; higher is better).",
        epilog="The YAML imports the modules it names (as LightningCLI's): use only files from a trusted source.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="The YAML file (also the first positional argument).")
    parser.add_argument("--seed", type=int, default=0, help="Seed set before every candidate.")
    parser.add_argument("--output_dir", "--output-dir", type=Optional[str], default=None,
                        help="Where results.json, results.csv and evidence.png go.")
    parser.add_argument("--predictive", type=Literal["map", "probit"], default="map",
                        help="Predictive of the test metrics (never used to select).")
    parser.add_argument("--rank_by", "--rank-by", type=Literal[RANK_BY], default=DEFAULT_RANK_BY,
                        help="The evidence that ranks the candidates: STRUCTURE-APPROX re-estimated at the final "
                             "weights (hyperparameters re-optimised), or 'online' (the callback's final estimate).")
    parser.add_argument("--trainer", type=Dict[str, Any], default={},
                        help="pl.Trainer arguments, e.g. --trainer.max_epochs=5; names and types are checked "
                             "against pl.Trainer's signature before anything is built. Defaults here: "
                             "accelerator=cpu, logger=False, enable_checkpointing=False, enable_model_summary=False.")
    parser.add_class_arguments(MargLikCallback, "callback")
    parser.groups["callback"].title = "MargLikCallback arguments (--callback.KEY=VALUE)"
    parser.add_subclass_arguments(pl.LightningDataModule, "data", required=True)
    # Lightning's docstring would title this group with half a sentence
    parser.groups["data"].title = "The data: a LightningDataModule subclass (--data.KEY=VALUE sets its init_args)"
    parser.add_argument("--candidates", type=Dict[str, Dict[str, Any]], required=True,
                        help="Name to {class_path: a LightningModule subclass, init_args: {...}}.")
    parser.add_argument("--quick", action=ActionYesNo(yes_prefix="", no_prefix=None), default=False,
                        help="Smoke test: " + " ".join(QUICK_OVERRIDES) + " (later overrides win); "
                             "writes to OUTPUT_DIR/quick and trains every candidate again.")
    parser.add_argument("--rerun", action=ActionYesNo(yes_prefix="", no_prefix=None), default=False,
                        help="Train every candidate again instead of reusing finished ones from results.json.")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="torch.set_num_threads: 1 is fastest for small models on a shared CPU.")
    return parser


def run_command_line(argv: Optional[Sequence[str]] = None) -> Tuple[List[CandidateResult], Dict[str, Any]]:
    """What ``marglik-select`` does, for a script: returns the results and the configuration used.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``): ``CONFIG.yaml`` and overrides.

    Returns:
        The results (best evidence first) and the configuration after all overrides (as given to
        :func:`select_from_config`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--config", args[0], *args[1:]]
    if "--quick" in args:  # right after the YAML, so that the user's own overrides win
        at = 2 if args[:1] == ["--config"] else 1 if args[:1] and args[0].startswith("--config=") else 0
        args[at:at] = QUICK_OVERRIDES
    sys.path.insert(0, os.getcwd())  # class paths of the user's own modules, as with `python -m`
    parser = build_parser()
    cfg = parser.parse_args(args)
    torch.set_num_threads(cfg.threads)
    config = {
        "seed": cfg.seed,
        "output_dir": cfg.output_dir,
        "predictive": cfg.predictive,
        "rank_by": cfg.rank_by,
        "trainer": dict(cfg.trainer),
        "callback": cfg.callback.as_dict(),
        "data": cfg.data.as_dict(),
        "candidates": cfg.candidates,
    }
    if cfg.quick and config["output_dir"]:
        config["output_dir"] = os.path.join(config["output_dir"], "quick")  # never mixed with real results
    try:
        check_config(config)
    except ValueError as error:
        parser.error(str(error))
    with quiet_lightning():
        if cfg.quick:  # it trains on 2 batches on purpose; the evidence still covers all the data
            warnings.filterwarnings("ignore", message=".*limit_train_batches.*")
        results = select_from_config(config, resume=not (cfg.rerun or cfg.quick))
    width = max(len(r.name) for r in results)
    print(f"{'rank':>4}  {'candidate':<{width}}  {'marglik':>9}  {'params':>8}  metrics")
    for rank, r in enumerate(results, 1):
        shown = " ".join(f"{k}={v:.4f}" for k, v in r.metrics.items())
        print(f"{rank:>4}  {r.name:<{width}}  {r.marglik:>9.4f}  {r.n_params:>8}  {shown}")
    if config["output_dir"]:
        print(f"results in {config['output_dir']}/ (results.csv, results.json, evidence.png)")
    return results, config


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``marglik-select CONFIG.yaml [overrides]``: rank the configured candidates by evidence."""
    run_command_line(argv)


if __name__ == "__main__":
    main()
