"""The selection driver: train every candidate with ``MargLikCallback`` and rank them by evidence."""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
import torchmetrics
from torch.utils.data import DataLoader

from ..callbacks import MargLikCallback, find_hyperparameters
from ..callbacks.output_layer import output_layer_learned
from ..curvature import APPROXIMATIONS, CurvatureOptions, eval_mode
from ..curvature.batches import call_model
from ..curvature.structures import structures_with
from ..curvature.structures.full import FullStructure
from ..diagnostics import EF_RATIO_THRESHOLD, ef_ratio_of, ef_unreliable_message
from ..folding import Folded
from ..validators import choice, flag, keywords
from .comparability import (
    mixed_normalization_message, non_finite_message, normalization_layers, unequal_epochs_message,
)
from .metrics import MetricsCheck, evaluate_metrics
from .prepass import build, survey
from .results import RESULTS_JSON, CandidateResult, load_results, run_lock, save_results
from .trainer_arguments import check_trainer_arguments

__all__ = [
    "AUTO_FALLBACK", "AUTO_FULL", "AUTO_FULL_MAX_DIRECTIONS", "AUTO_FULL_MAX_MEMORY", "AUTO_SAFE", "DEFAULT_RANK_BY",
    "DEFAULT_RANK_OUTPUT_LAYER", "RANK_OUTPUT_LAYER",
    "PREDICTIVES", "check_callback_arguments", "check_candidates", "check_fold_batchnorm", "check_rank_by",
    "full_ggn_refusal", "quiet_lightning", "rank_by_choices",
    "resolve_auto", "select_models",
]

PREDICTIVES = ("map", "probit")
DEFAULT_RANK_BY = "auto"
#: ``rank_output_layer``: the ranking evidence learns the output layer's precision that training holds
#: (``MargLikCallback(output_layer="fixed")``, the default), or holds it as trained. Learned ranked the
#: ranking study better (``benchmarks/results/default_ranking.md``, issue 52).
RANK_OUTPUT_LAYER, DEFAULT_RANK_OUTPUT_LAYER = ("learn", "fixed"), "learn"
#: What ``rank_by="auto"`` resolves to, one choice for all candidates: the exact full GGN where every
#: candidate affords it (small regression networks: ``examples/results/toy_depth.md``, where the
#: block-diagonal evidences pick another depth); else the Kronecker empirical Fisher, which ranked
#: MLPs and CNNs best in the ranking study (``examples/results/ranking_study.md``), unless the EF
#: check flags a candidate (its curvature ratio below ``EF_RATIO_THRESHOLD``: it fits its training set
#: and its EF evidence is inflated, ``benchmarks/results/ef_interpolation.md``); then the Kronecker GGN
#: for all (``benchmarks/results/default_ranking.md``).
AUTO_FULL, AUTO_FALLBACK, AUTO_SAFE = "full-ggn", "kron-ef", "kron-ggn"
#: ``rank_by="auto"``'s limits on the exact full GGN of one candidate, read when it is resolved (a test or
#: a user may change them here). ``R = min(N C, P)`` is the size of the matrix ``full`` factorises: the
#: ``R x R`` determinant-lemma matrix (and one ``R x R`` row Gram per tensor) when ``N C < P``, else the
#: ``P x P`` Gram. Measured on one CPU thread (evidence pass and Newton re-optimisation, layerwise prior,
#: MLPs of 6-18 tensors): R = 500: 0.6 s; 1000: 1-9 s; 1500: 11 s; 2000: 4-50 s (the low-rank form's
#: Newton steps grow as ``T R^3``); kron-ef: under 0.2 s for all of them.
AUTO_FULL_MAX_DIRECTIONS = 1000
#: Bytes ``full`` may hold for ``rank_by="auto"``, estimated as ``8 (R P + T R^2)`` (float64 ``R x P``
#: Jacobian rows or ``P x P`` Gram, and with ``N C < P`` the ``T`` row Grams, ``T`` prior tensors); the
#: peak memory measured with the estimates above was 2-3 times the estimate. ``full``'s own limit,
#: ``CurvatureOptions.max_memory`` for its ``P x P`` matrices, applies as well.
AUTO_FULL_MAX_MEMORY = 256 * 2**20


def rank_by_choices() -> Tuple[str, ...]:
    """What may rank the candidates: ``"auto"`` (the default: :func:`resolve_auto`), ``"online"`` (the
    callback's final evidence) or ``"<structure>-<approx>"`` re-estimated at the final weights, for
    every registered structure that offers ``rank_by`` (:func:`..curvature.structures.structures_with`).

    Example:
        >>> rank_by_choices()[:3]
        ('auto', 'online', 'full-ggn')
    """
    return ("auto", "online") + tuple(f"{s}-{a}" for s in structures_with("rank_by") for a in APPROXIMATIONS)


def full_ggn_refusal(n_rows: int, n_params: int, n_tensors: int) -> Optional[str]:
    """Why ``rank_by="auto"`` would not rank a candidate of this size by the exact full GGN.

    The limits are :data:`AUTO_FULL_MAX_DIRECTIONS` on ``R = min(N C, P)``,
    :data:`AUTO_FULL_MAX_MEMORY` on the estimate ``8 (R P + T R^2)`` bytes (``T R^2`` only when
    ``N C < P``) and the ``full`` structure's own limit on its ``P x P`` matrices.

    Args:
        n_rows: ``N C``: the evidence's data terms times the network's outputs per term (the rows of
            the GGN's Jacobian).
        n_params: ``P``: the parameters the prior covers.
        n_tensors: ``T``: the prior's parameter tensors.

    Returns:
        ``None`` where the exact full GGN is within the limits, else a sentence naming the limit it
        exceeds.

    Example:
        >>> full_ggn_refusal(100 * 1, 7801, 10) is None  # examples/toy_depth.py: N = 100, C = 1, 4 hidden layers
        True
        >>> full_ggn_refusal(60000 * 10, 100_000, 8)  # doctest: +ELLIPSIS
        'min(N C, P) = min(600,000, 100,000) = 100,000 is above AUTO_FULL_MAX_DIRECTIONS = 1,000'
    """
    directions = min(n_rows, n_params)
    if directions > AUTO_FULL_MAX_DIRECTIONS:
        return (f"min(N C, P) = min({n_rows:,}, {n_params:,}) = {directions:,} is above "
                f"AUTO_FULL_MAX_DIRECTIONS = {AUTO_FULL_MAX_DIRECTIONS:,}")
    memory = 8 * (directions * n_params + (n_tensors * directions**2 if n_rows < n_params else 0))
    if memory > AUTO_FULL_MAX_MEMORY:
        return (f"full would hold about {memory / 2**20:,.0f} MiB for N C = {n_rows:,}, P = {n_params:,} and "
                f"{n_tensors} tensors, above AUTO_FULL_MAX_MEMORY = {AUTO_FULL_MAX_MEMORY / 2**20:,.0f} MiB")
    try:  # the structure's own limit (its P x P matrices), as it would refuse rank_by="full-ggn"
        FullStructure([0], [n_params], "layerwise", CurvatureOptions().max_memory)
    except ValueError as err:
        return str(err)
    return None


def resolve_auto(
    refusals: Mapping[str, Optional[str]], ef_ratios: Optional[Mapping[str, Optional[float]]] = None,
) -> Tuple[str, str]:
    """What ``rank_by="auto"`` ranks candidates by, one evidence for all of them: :data:`AUTO_FULL`
    (``"full-ggn"``) if the exact full GGN of every candidate is within the limits; else
    :data:`AUTO_FALLBACK` (``"kron-ef"``) unless the empirical Fisher's check flags a candidate
    (its :func:`~lightning_marglik.diagnostics.ef_curvature_ratio` below
    :data:`~lightning_marglik.diagnostics.EF_RATIO_THRESHOLD`: it fits its training set, and its EF
    evidence over-rates it), then :data:`AUTO_SAFE` (``"kron-ggn"``).

    Args:
        refusals: Every candidate's name to its :func:`full_ggn_refusal`.
        ef_ratios: Candidate names to their EF curvature ratio at the final weights (``None``: not
            measured, e.g. a likelihood without the traces; such a candidate is not flagged).

    Returns:
        The ``rank_by`` choice and why, in words.

    Example:
        >>> resolve_auto({"1 layer": None, "2 layers": None})[0]
        'full-ggn'
        >>> resolve_auto({"1 layer": None, "wide": full_ggn_refusal(5000, 20000, 4)})[0]
        'kron-ef'
        >>> resolve_auto({"mlp": "too large", "cnn": "too large"}, {"mlp": 0.08, "cnn": 0.32})[0]  # 'mlp' flagged
        'kron-ggn'
    """
    refused = {name: why for name, why in refusals.items() if why is not None}
    if not refused:
        return AUTO_FULL, (f"the exact full GGN is within auto's limits for every candidate (min(N C, P) <= "
                           f"{AUTO_FULL_MAX_DIRECTIONS:,}, about {AUTO_FULL_MAX_MEMORY / 2**20:,.0f} MiB at most)")
    name, why = next(iter(refused.items()))
    others = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    too_large = f"the exact full GGN is too large for candidate {name!r}{others}: {why}"
    flagged = {name: ratio for name, ratio in (ef_ratios or {}).items()
               if ratio is not None and ratio < EF_RATIO_THRESHOLD}
    if not flagged:
        return AUTO_FALLBACK, too_large
    listed = ", ".join(f"{name!r} ({ratio:.3g})" for name, ratio in flagged.items())
    one = len(flagged) == 1
    return AUTO_SAFE, (
        f"{too_large}; and the empirical Fisher's check flags candidate{'' if one else 's'} {listed} (tr EF / tr GGN "
        f"below {EF_RATIO_THRESHOLD:g}): {'it fits its' if one else 'they fit their'} training set, so "
        f"{'its' if one else 'their'} {AUTO_FALLBACK} evidence would over-rate {'it' if one else 'them'}"
    )


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
    fold_batchnorm: bool = True,
    rank_output_layer: str = DEFAULT_RANK_OUTPUT_LAYER,
) -> List[CandidateResult]:
    """Train every candidate with ``MargLikCallback`` and rank them by their evidence at the final weights.

    With ``output_dir``, ``results.json`` and ``results.csv`` are rewritten after every candidate
    (ranked so far, with the stored results of candidates this run does not name), so a killed
    run loses at most the candidate in training; ``evidence.png`` follows at the end. The
    directory is locked for the run (:func:`load_results` says what happens to an unreadable file).

    Which evidence to rank by: the default ``rank_by="auto"`` ranks every candidate by the same
    evidence re-estimated at the final weights, decided once after training (:func:`resolve_auto`):
    the exact full GGN (``"full-ggn"``) where it is affordable for every candidate
    (``min(N C, P) <= AUTO_FULL_MAX_DIRECTIONS`` and within ``AUTO_FULL_MAX_MEMORY``; small
    regression networks, where ``kron`` and ``diag`` are biased against depth,
    ``examples/results/toy_depth.md``); else the Kronecker empirical Fisher (``"kron-ef"``, e.g. for
    image classifiers), which ranked MLPs and CNNs best in the ranking study
    (``examples/results/ranking_study.md``, whose figures the documentation's results page
    carries), unless the EF's own check flags a candidate (it fits its training set, and its EF
    evidence over-rates it: ``benchmarks/results/ef_interpolation.md``); then the Kronecker GGN
    (``"kron-ggn"``) for all. So the default never ranks by an evidence its check flags; a
    ``rank_by`` given explicitly is used as given, with the check's warning. A candidate's
    BatchNorms are folded into the layers before them for that evidence (``fold_batchnorm``): the
    test-time function ranked as a network without normalization, the best-ranking evidence of the
    study at the cost of one forward pass. Do not compare networks with and without normalization
    layers by their evidence all the same: every approximation, folded or not, ranked the BatchNorm
    ResNets there last; such a run warns, naming them (:mod:`.comparability`). Compare candidates at
    the same fraction of training (candidates trained for different numbers of epochs are ranked with a
    warning). For small regression networks of different depths train with
    ``callback={"structure": "full"}`` too. The evidence prefers the smaller of two near-equal
    models and judges under-trained candidates by where they are.

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
            predictive, ``rank_by`` (``"auto"`` as asked, with its two limits), the metrics' names and the
            network (its ``n_params`` and :func:`.prepass.architecture`) are always part of it: a result
            stored without them (an older version) is trained again.
        rank_by: The evidence that ranks the candidates (:func:`rank_by_choices`, matched
            case-insensitively): ``"<structure>-<approx>"`` (e.g. ``"kron-ef"``) re-estimated at
            the final weights, one more evidence pass per candidate with its hyperparameters
            re-optimised by Newton (:meth:`MargLikCallback.evidence_with`); ``"auto"`` (the
            default), ``"full-ggn"``, ``"kron-ef"`` or ``"kron-ggn"`` for all candidates as above:
            it computes ``kron-ef`` and ``kron-ggn`` for every candidate and ``full-ggn`` for those
            within its limits, and ranks by ``full-ggn`` only if that is all of them, by
            ``kron-ggn`` if the EF check flags any of them (printed with ``verbose``; every
            result's ``rank_by`` names the choice and ``rank_by_reason`` why, its ``evidences``
            hold them all); or ``"online"``, the callback's final estimate. Either way
            ``online_marglik`` of a result holds the callback's.
        fold_batchnorm: Re-estimate the evidence of each trained candidate with its BatchNorms folded
            into the layers before them (:meth:`MargLikCallback.fold_batchnorm`; its ``folded``
            names them; no effect on a network without BatchNorm, nor on ``rank_by="online"``). A
            candidate whose forward does not allow it is ranked as trained, with a warning.
        rank_output_layer: ``"learn"`` (the default): the re-estimated evidence learns the output
            layer's precision that the callback holds in training (``output_layer="fixed"``, its
            default; training still holds it, and nothing learned is written back); ``"fixed"``:
            the ranking evidence holds it as trained. Where it is learned only for the ranking,
            each result's ``rank_output_layer`` says so (``None``: ranked as trained; always with
            ``rank_by="online"``). Learned ranked the ranking study better
            (``benchmarks/results/default_ranking.md``).

    Returns:
        The results, best evidence first.

    Raises:
        ValueError: On no candidates, a candidate that is not a factory (e.g. a module instance),
            ``callback`` arguments ``MargLikCallback`` does not take or refuses, no training data, an
            unknown ``predictive``, ``rank_by`` or ``rank_output_layer``, a ``fold_batchnorm`` that
            is not a bool, ``trainer`` arguments that do not fit ``pl.Trainer``, or (when training
            starts) test data and metrics that do not fit the candidate. Before any candidate
            trains, every one is built and checked (:func:`.prepass.survey`), refused with a
            ``MargLikConfigurationError`` naming it: a factory that raises or returns no fresh
            LightningModule, a prior the callback or ``rank_by`` cannot take (with ``"auto"``, its
            fallback ``"kron-ef"``, e.g. a diagonal prior), a likelihood ``predictive`` cannot
            take, or candidates of different likelihoods.
        RuntimeError: If ``output_dir`` is in use by another run, or the test metrics fail
            after training (the trained result is saved first).
    """
    check_candidates(candidates)
    callback = check_callback_arguments(callback or {})
    if (train_dataloader is None) == (datamodule is None):
        raise ValueError("Give exactly one of `train_dataloader` and `datamodule`.")
    predictive = choice(predictive, PREDICTIVES, "predictive")
    rank_by, rank_options = check_rank_by(rank_by)
    rank_output_layer = choice(rank_output_layer, RANK_OUTPUT_LAYER, "rank_output_layer")
    learn_output = rank_output_layer == "learn" and rank_by != "online"  # "online" ranks by the estimate as trained
    fold = check_fold_batchnorm(fold_batchnorm) and rank_by != "online"  # the online evidence is the callback's own
    auto = rank_by == "auto"
    check_options = check_rank_by(AUTO_FALLBACK)[1] if auto else rank_options  # auto may fall back to it
    trainer = check_trainer_arguments(trainer or {})
    if test_dataloader is None and datamodule is not None and _has_test_data(datamodule):
        datamodule.setup("test")
        test_dataloader = datamodule.test_dataloader()
    networks = survey(candidates, seed, MargLikCallback(**callback).options, rank_by, check_options,
                      predictive if test_dataloader is not None else None)
    scored = None if test_dataloader is None else sorted(metrics()) if metrics is not None else "default"
    # "auto" is stored as asked (a re-run resolves it again over its candidates), with the limits that decide it
    limits = {"auto_limits": {"max_directions": AUTO_FULL_MAX_DIRECTIONS, "max_memory": AUTO_FULL_MAX_MEMORY}}
    wanted = {
        name: _jsonable({"candidate": (settings or {}).get(name), "trainer": trainer, "callback": callback,
                         "seed": seed, "predictive": predictive, "rank_by": rank_by, "fold_batchnorm": fold,
                         "rank_output_layer": rank_output_layer, "network": networks[name], "metrics": scored,
                         **(limits if auto else {})})
        for name in candidates
    }
    with run_lock(output_dir):
        stored = load_results(output_dir) if output_dir else {}
        others = [result for name, result in stored.items() if name not in candidates]  # kept, never dropped
        reusable = {name for name in candidates if resume and name in stored and stored[name].settings == wanted[name]
                    and stored[name].metrics_error is None and _finite(stored[name])
                    and (not auto or _has_auto_evidences(stored[name]))}
        results: List[CandidateResult] = []
        built: Dict[int, Tuple["weakref.ref[Any]", str]] = {}  # the modules the factories returned (build)
        directions: Dict[str, bool] = {}
        start, trained, training_seconds = time.perf_counter(), 0, 0.0
        for index, (name, factory) in enumerate(candidates.items(), 1):
            if name in reusable:
                results.append(stored[name])
                if auto:
                    _resolve(results)
                else:  # same settings: the same rank_by (None in older files)
                    stored[name].rank_by, stored[name].rank_by_reason = rank_by, _given(rank_by)
                if verbose:
                    print(f"[{index}/{len(candidates)}] {name}: marglik={stored[name].marglik:.4f}"
                          f"{_shown_auto(stored[name])} (finished in an earlier run with the same settings: reused)",
                          flush=True)
                continue
            candidate_start = time.perf_counter()
            pl.seed_everything(seed, verbose=False)
            module = build(name, factory, built)
            prior, _ = find_hyperparameters(module)
            cb = MargLikCallback(**callback)
            check = MetricsCheck(test_dataloader, metrics, predictive) if test_dataloader is not None else None
            kwargs = dict(logger=False, enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
            kwargs.update(trainer)
            own = kwargs.pop("callbacks", None) or []
            own = [own] if isinstance(own, pl.Callback) else list(own)
            fit_trainer = pl.Trainer(callbacks=[cb, *own, *([check] if check else [])], **kwargs)
            fit_start = time.perf_counter()
            try:
                fit_trainer.fit(module, train_dataloaders=train_dataloader, datamodule=datamodule)
            except Exception as error:
                if hasattr(error, "add_note"):  # Python 3.11: the traceback names the candidate
                    kept = f"kept in {output_dir}" if output_dir else "not kept (no output_dir)"
                    error.add_note(f"select_models: raised while training candidate {name!r} ({index} of "
                                   f"{len(candidates)}); the results of those before it are {kept}.")
                raise
            evidences: Dict[str, float] = {}
            refused: Optional[str] = None
            folded = _folded(cb, fit_trainer, module, name) if fold else None
            ranked_prior = cb.prior if folded is None else folded.prior  # the folded copy's carries the treatments
            learned = output_layer_learned(ranked_prior) if learn_output else contextlib.nullcontext()
            with learned as output_learned:
                if auto:
                    evidences, refused = _auto_evidences(cb, fit_trainer, module, folded)
                    marglik = evidences[AUTO_FALLBACK]  # until resolved over the candidates (_resolve)
                elif rank_options is None:
                    marglik = cb.final_marglik
                else:
                    marglik = cb.evidence_with(fit_trainer, module, rank_options.structure, rank_options.approx,
                                               folded)
            seconds = time.perf_counter() - fit_start
            ranked_by = cb.options.approx if rank_options is None else rank_options.approx
            # the EF's curvature check at the final weights, from the last estimate's own sums (no pass): where the
            # ranking evidence is the EF's, and with "auto", which decides by it
            ef_ratio = ef_ratio_of(cb.evidence) if (auto or ranked_by == "ef") and cb.evidence is not None else None
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
                rank_by=rank_by,
                rank_by_reason=None if auto else _given(rank_by),
                evidences=evidences,
                full_ggn_refused=refused,
                folded=dict(folded.folded) if folded is not None else {},
                normalization=normalization_layers(module),
                rank_output_layer=output_learned,
            ))
            if auto:  # over the candidates so far; the last candidate's decides for all
                _resolve(results)
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
                left = _clock(training_seconds / trained * to_train)
                print(f"[{index}/{len(candidates)}] {name}: marglik={results[-1].marglik:.4f}"
                      f"{_shown_auto(results[-1])} params={prior.n_params} time={seconds:.1f}s {shown} | "
                      f"elapsed {_clock(time.perf_counter() - start)}, about {left} left", flush=True)
        if auto:
            chosen, why = _resolve(results)
            if verbose:
                print(f"rank_by='auto' ranks all {len(results)} candidates by {chosen!r}: {why}.", flush=True)
        overruled = [r for r in results if r.rank_output_layer]
        if verbose and overruled:
            print(f"select_models ranks {len(overruled)} of {len(results)} candidates with "
                  f"{overruled[0].rank_output_layer}; rank_output_layer='fixed' ranks as trained.", flush=True)
        if output_dir:
            save_results(_ranked(results + others), output_dir, higher_is_better=directions)
    # the EF's check where the ranking evidence was asked to be the EF's ("auto" heeds it: it ranks by kron-ef
    # only where no candidate is flagged)
    ef_message = "" if auto else ef_unreliable_message({r.name: r.ef_curvature_ratio for r in results
                                                         if r.ef_curvature_ratio is not None})
    for message in (ef_message, mixed_normalization_message({r.name: r.normalization for r in results}),
                    non_finite_message({r.name: r.marglik for r in results}),
                    unequal_epochs_message({r.name: r.epochs for r in results})):
        if message:
            warnings.warn(message, stacklevel=2)
    return _ranked(results)


def check_candidates(candidates: Any) -> None:
    """Refuse, before anything is trained, candidates that are not factories of a fresh module.

    ``select_models`` seeds, then builds each candidate (so that every candidate starts from the
    same random state) and trains it once: a candidate is a LightningModule class or a function
    that returns a new module. An instance (callable too, as every ``nn.Module``) would be called
    as its own forward.

    Example:
        >>> check_candidates({"mlp": torch.nn.Linear(2, 2)})
        Traceback (most recent call last):
        ...
        ValueError: select_models: candidate 'mlp' is a Linear instance, not a factory: give a class or a function that returns a fresh module, e.g. {'mlp': Linear} or {'mlp': lambda: Linear(...)}; each candidate is built after seeding and trained once.

    Raises:
        ValueError: On no candidates, a name that is not a non-empty string, or a candidate that is a module
            instance or not callable.
    """
    if not isinstance(candidates, Mapping) or not candidates:
        raise ValueError(f"`candidates` must be a non-empty mapping name -> factory, got {candidates!r}.")
    for name, factory in candidates.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"select_models: candidate names must be non-empty strings (they name the results kept "
                             f"in output_dir), got {name!r} ({type(name).__name__}); e.g. {{{str(name)!r}: ...}}.")
        if isinstance(factory, torch.nn.Module) or not callable(factory):
            kind = type(factory).__name__
            raise ValueError(
                f"select_models: candidate {name!r} is a {kind} instance, not a factory: give a class or a function "
                f"that returns a fresh module, e.g. {{{name!r}: {kind}}} or {{{name!r}: lambda: {kind}(...)}}; each "
                "candidate is built after seeding and trained once."
            )


def check_callback_arguments(callback: Mapping[str, Any]) -> Dict[str, Any]:
    """Check ``select_models``' ``callback`` (the keyword arguments of ``MargLikCallback``) before training.

    Returns:
        The arguments as a dict.

    Raises:
        ValueError: On a key ``MargLikCallback`` does not take (with "did you mean" for a near miss)
            or a value it refuses (the message names it).
    """
    if not isinstance(callback, Mapping):
        raise ValueError(f"`callback` must be a mapping of MargLikCallback arguments, got {callback!r}.")
    keywords(callback, list(inspect.signature(MargLikCallback).parameters), "callback", "MargLikCallback")
    MargLikCallback(**callback)  # its own checks of every value
    return dict(callback)


def check_rank_by(rank_by: Any) -> Tuple[str, Optional[CurvatureOptions]]:
    """Validate ``rank_by``: its canonical spelling and the curvature it re-estimates with.

    Example:
        >>> check_rank_by("KRON-EF")[0]
        'kron-ef'
        >>> check_rank_by("Auto")
        ('auto', None)

    Returns:
        The canonical spelling and the curvature options; ``None`` for ``"online"`` (no
        re-estimate) and for ``"auto"`` (``"full-ggn"`` or ``"kron-ef"``, decided after training by
        :func:`resolve_auto`).

    Raises:
        ValueError: Naming the choices, with a "did you mean" for a near miss.
    """
    rank_by = choice(rank_by, rank_by_choices(), "rank_by")
    if rank_by in ("online", "auto"):
        return rank_by, None
    structure, approx = rank_by.rsplit("-", 1)  # a registered name may hold a hyphen itself
    return rank_by, CurvatureOptions(structure, approx, 0)


def check_fold_batchnorm(fold_batchnorm: Any) -> bool:
    """Validate ``select_models``' ``fold_batchnorm``.

    Raises:
        ValueError: If it is not a bool (e.g. the string ``"false"``, which would count as true).
    """
    return flag(fold_batchnorm, "fold_batchnorm", what="fold each candidate's BatchNorms before ranking it")


def _folded(cb: MargLikCallback, trainer: pl.Trainer, module: pl.LightningModule, name: str) -> Optional[Folded]:
    """:meth:`MargLikCallback.fold_batchnorm` of a trained candidate; ``None``, with a warning, where its
    forward does not allow it (the candidate is then ranked as trained)."""
    try:
        return cb.fold_batchnorm(trainer, module)
    except (ValueError, RuntimeError) as err:
        warnings.warn(f"select_models(fold_batchnorm=True): candidate {name!r} is ranked by the evidence of the "
                      f"network as trained, its BatchNorms not folded: {err}", stacklevel=3)
        return None


def _auto_evidences(
    cb: MargLikCallback, trainer: pl.Trainer, module: pl.LightningModule, folded: Optional[Folded]
) -> Tuple[Dict[str, float], Optional[str]]:
    """``rank_by="auto"``'s evidences of a trained candidate (or its ``folded`` copy): ``kron-ef`` and
    ``kron-ggn``, and ``full-ggn`` unless :func:`full_ggn_refusal` (or the full evidence pass itself)
    refuses it, with that reason."""
    prior = cb.prior if folded is None else folded.prior
    assert prior is not None

    def evidence(rank_by: str) -> float:  # spelled as rank_by: check_rank_by parses it, as for any rank_by
        options = check_rank_by(rank_by)[1]
        return cb.evidence_with(trainer, module, options.structure, options.approx, folded)

    evidences = {choice: evidence(choice) for choice in (AUTO_FALLBACK, AUTO_SAFE)}
    refused = full_ggn_refusal(int(prior.n_data) * _outputs_per_datum(cb, trainer, module), prior.n_params,
                               len(prior.param_sizes))
    if refused is None:
        try:
            evidences[AUTO_FULL] = evidence(AUTO_FULL)
        except (ValueError, RuntimeError) as err:  # e.g. a forward torch.func cannot take, or out of memory
            refused = f"the full GGN evidence pass failed: {type(err).__name__}: {err}"
    return evidences, refused


def _outputs_per_datum(cb: MargLikCallback, trainer: pl.Trainer, module: pl.LightningModule) -> int:
    """``C``: the last dimension of the trained network's output on one evidence batch."""
    with eval_mode(module), torch.no_grad():
        output = call_model(module, cb.example_inputs(trainer, module))
    return int(output.shape[-1]) if output.dim() > 1 else 1


def _has_auto_evidences(result: CandidateResult) -> bool:
    """Whether a stored result holds what ``rank_by="auto"`` may rank it by, whichever way it resolves."""
    return ({AUTO_FALLBACK, AUTO_SAFE} <= set(result.evidences)
            and (result.full_ggn_refused is not None or AUTO_FULL in result.evidences))


def _finite(result: CandidateResult) -> bool:
    """Whether a stored result's evidences are all finite (one that is not is trained again, not reused)."""
    return all(math.isfinite(value) for value in (result.marglik, *result.evidences.values()))


def _resolve(results: Sequence[CandidateResult]) -> Tuple[str, str]:
    """``rank_by="auto"`` resolved over ``results`` (:func:`resolve_auto`), written into each."""
    chosen, why = resolve_auto({r.name: r.full_ggn_refused for r in results},
                               {r.name: r.ef_curvature_ratio for r in results})
    for r in results:
        r.marglik, r.rank_by, r.rank_by_reason = r.evidences[chosen], chosen, why
    return chosen, why


def _given(rank_by: str) -> str:
    """A result's ``rank_by_reason`` where ``rank_by`` was not ``"auto"``."""
    return f"rank_by={rank_by!r} was asked for"


def _shown_auto(result: CandidateResult) -> str:
    """For a ``rank_by="auto"`` result: `` (full-ggn so far; kron-ef=-0.6610)`` after its marglik."""
    if not result.evidences:
        return ""
    others = "".join(f"; {name}={value:.4f}" for name, value in result.evidences.items() if name != result.rank_by)
    too_large = f"; {AUTO_FULL} too large" if result.full_ggn_refused is not None else ""
    return f" ({result.rank_by} so far{others}{too_large})"


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
