"""``select_models``' pre-pass: every candidate built, and checked as far as its module alone allows, before the first
one trains (a mistake in the last candidate costs no training), and what of each network its result remembers
(``tests/test_selection_edges.py`` runs it through ``select_models``)."""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import pytorch_lightning as pl
import torch

from ..callbacks import MargLikConfigurationError, find_hyperparameters
from ..curvature import CurvatureOptions, check_model
from .comparability import mixed_likelihood_message
from .metrics import check_predictive

__all__ = ["architecture", "build", "survey"]


def survey(
    candidates: Mapping[str, Callable[[], pl.LightningModule]],
    seed: int,
    training: CurvatureOptions,
    rank_by: str,
    ranking: Optional[CurvatureOptions],
    predictive: Optional[str] = None,
) -> Dict[str, Dict[str, Any]]:
    """Seed and build every candidate as ``select_models`` will, check what needs only its module, and discard it.

    Args:
        candidates: Name to factory (checked by ``check_candidates``).
        seed: The seed set before each build.
        training: The callback's curvature options, which train every candidate.
        rank_by: ``select_models``' ``rank_by`` as asked (canonical spelling), for the messages.
        ranking: The curvature the ranking evidence re-estimates with (with ``"auto"``, its fallback ``kron-ef``);
            ``None``: none (``"online"``).
        predictive: The test metrics' predictive; ``None``: no test data.

    Returns:
        Name to ``{"n_params": ..., "architecture": ...}`` (:func:`architecture`): the network a stored result
        was trained as, compared on resume.

    Raises:
        MargLikConfigurationError: Naming the candidate: its factory raises or returns no fresh LightningModule, its
            module holds not one prior and one likelihood, a parameter the prior should cover and does not (or
            covers and is frozen), a prior the callback's or the ranking's curvature cannot take, a likelihood
            ``predictive`` cannot take; or candidates of different likelihoods (naming each group).
    """
    built: Dict[int, Tuple["weakref.ref[Any]", str]] = {}
    networks: Dict[str, Dict[str, Any]] = {}
    likelihoods: Dict[str, str] = {}
    for name, factory in candidates.items():
        pl.seed_everything(seed, verbose=False)
        module = build(name, factory, built)
        try:
            prior, likelihood = find_hyperparameters(module)
        except ValueError as err:
            raise MargLikConfigurationError(f"select_models: candidate {name!r}: {err}") from err
        try:
            check_model(module, prior, training)
        except ValueError as err:
            raise MargLikConfigurationError(f"select_models: MargLikCallback cannot train candidate {name!r}: "
                                            f"{err}") from err
        if ranking is not None:  # e.g. a diagonal prior with "kron-ef", "full-ggn" too large
            shown = f"{ranking.structure}-{ranking.approx}"
            try:
                check_model(module, prior, ranking)
            except ValueError as err:
                auto = rank_by == "auto"
                fallback = (f"rank_by='auto' falls back to rank_by={shown!r} when the exact full GGN of a candidate is "
                            "too large, and " if auto else "")
                hint = " Give rank_by='full-ggn' (small problems) or another rank_by." if auto else ""
                raise MargLikConfigurationError(
                    f"{fallback}rank_by={shown!r} cannot score candidate {name!r}: {err}{hint}") from err
        if predictive is not None:
            try:
                check_predictive(likelihood, predictive)
            except ValueError as err:
                raise MargLikConfigurationError(f"select_models: candidate {name!r}: {err}") from err
        likelihoods[name] = type(likelihood).__name__
        networks[name] = {"n_params": prior.n_params, "architecture": architecture(module)}
    message = mixed_likelihood_message(likelihoods)
    if message:
        raise MargLikConfigurationError(message)
    return networks


def build(name: str, factory: Callable[[], pl.LightningModule],
          built: Dict[int, Tuple["weakref.ref[Any]", str]]) -> pl.LightningModule:
    """Candidate ``name``'s fresh module from its factory; ``built``: id -> (a weak reference, the candidate's name)
    of the modules earlier candidates' factories returned, to which it is added.

    Raises:
        MargLikConfigurationError: If the factory raises, returns something other than a
            ``pytorch_lightning.LightningModule``, or a module an earlier candidate's factory returned (it would
            start from that candidate's training).
    """
    try:
        module = factory()
    except Exception as err:  # a constructor's own refusal of its arguments: which candidate, before any training
        raise MargLikConfigurationError(f"select_models: building candidate {name!r} raised {type(err).__name__}: "
                                        f"{err}; fix its arguments or its class.") from err
    if not isinstance(module, pl.LightningModule):
        raise MargLikConfigurationError(
            f"select_models: candidate {name!r}'s factory returned a {type(module).__name__}, not a "
            "pytorch_lightning.LightningModule (with a GaussianPrior and a likelihood).")
    reference, earlier = built.get(id(module), (None, ""))
    if reference is not None and reference() is module:  # an id alone may be a freed module's, reused
        raise MargLikConfigurationError(
            f"select_models: the factory of candidate {name!r} returned the module that the factory of candidate "
            f"{earlier!r} returned, which that candidate trains: each factory must build a fresh module, e.g. "
            "lambda: Net(...), not lambda: net.")
    built[id(module)] = (weakref.ref(module), name)
    return module


def architecture(module: torch.nn.Module) -> str:
    """A short fingerprint of a network: a hash of its ``repr`` (layers and their arguments) and of its parameters'
    names and shapes, which a changed width or depth changes (and retraining to other weights does not).

    Example:
        >>> architecture(torch.nn.Linear(2, 3)) == architecture(torch.nn.Linear(2, 3)) != architecture(
        ...     torch.nn.Linear(2, 4))
        True
    """
    shapes = [(name, tuple(p.shape)) for name, p in module.named_parameters()]
    return hashlib.sha256(f"{module!r}\n{shapes}".encode()).hexdigest()[:16]
