"""A structure registered from outside the library: one class plus ``register_structure``, nothing else.

The toy structure is the exact diagonal times a constant, ``H = s k diag(C) + diag(delta)``: its
evidence is checked against the dense float64 curvature of tests/reference.py, through
``LaplaceEvidence`` and through a real ``Trainer`` with ``MargLikCallback(structure=<its name>)``.
It is unregistered after each test, so the other test modules see the built-in structures only.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CurvatureOptions, LaplaceEvidence, MargLikCallback
from lightning_marglik.curvature.statistics import Structure
from lightning_marglik.curvature.structures import (
    DiagStructure, register_structure, structure_class, structure_names, structures_with, unregister_structure,
)
from lightning_marglik.linearized import _structure_delta
from lightning_marglik.selection.driver import check_rank_by, rank_by_choices
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    Problem, curvature_scale, hyper, loader, reference_env, rel_err, setup,
)

TOL = 1e-8
FACTOR = 3.0
NAME = "scaled-diag"


class ScaledDiagStructure(DiagStructure):
    """The exact curvature diagonal times ``FACTOR`` (everything else is the diagonal structure's)."""

    name = NAME
    training_statistics = False

    def diagonal(self):
        return {index: FACTOR * block for index, block in super().diagonal().items()}


@pytest.fixture
def toy():
    register_structure(ScaledDiagStructure)
    try:
        yield ScaledDiagStructure
    finally:
        unregister_structure(NAME)


def dense_log_det(problem: Problem, approx: str, prior, lik) -> torch.Tensor:
    """``log|s k diag(C) + diag(delta)|`` from the dense float64 curvature ``C``."""
    ref = problem.reference("diag", approx)
    log_delta, log_sigma, log_temperature = ref.hyper_from(prior, lik)
    scale = curvature_scale(problem.kind, approx, log_sigma, log_temperature)
    return torch.log(FACTOR * scale * torch.diagonal(ref.full) + log_delta.exp()).sum()


def dense_log_marglik(problem: Problem, approx: str, prior, lik) -> torch.Tensor:
    ref = problem.reference("diag", approx)
    log_delta, log_sigma, log_temperature = ref.hyper_from(prior, lik)
    return (ref.log_likelihood(log_sigma, log_temperature) - 0.5 * (log_delta.exp() * ref.theta**2).sum()
            + 0.5 * log_delta.sum() - 0.5 * dense_log_det(problem, approx, prior, lik))


def test_a_name_is_accepted_exactly_while_registered_and_the_registry_lists_capabilities():
    refused = r"`structure` must be one of \('full', 'kron', 'ekfac', 'diag'\), got 'scaled-diag'"
    with pytest.raises(ValueError, match=refused):
        CurvatureOptions(NAME)
    register_structure(ScaledDiagStructure)
    try:
        assert structure_names()[-1] == NAME and structure_class("Scaled-Diag") is ScaledDiagStructure
        assert NAME in structures_with("rank_by") and NAME in structures_with("parametric_bound")
        assert NAME not in structures_with("training_statistics") and NAME not in structures_with("per_tensor_prior")
        assert CurvatureOptions(NAME.upper()).structure == NAME
        assert check_rank_by("Scaled-Diag-EF") == ("scaled-diag-ef", CurvatureOptions(NAME, "ef"))
    finally:
        assert unregister_structure(NAME) is ScaledDiagStructure
    with pytest.raises(ValueError, match=refused):
        CurvatureOptions(NAME)
    assert f"{NAME}-ef" not in rank_by_choices()


def test_registration_refuses_a_taken_or_missing_name(toy):
    class Other(DiagStructure):
        name = "Scaled-Diag"  # differs only in case

    class Unnamed(DiagStructure):
        pass  # inherits "diag": not a name of its own

    with pytest.raises(ValueError, match=r"structure 'Scaled-Diag' is taken by .*ScaledDiagStructure"):
        register_structure(Other)
    with pytest.raises(ValueError, match="Unnamed must declare its own `name"):
        register_structure(Unnamed)
    with pytest.raises(TypeError, match="takes a Structure subclass"):
        register_structure(dict)
    assert register_structure(toy) is toy  # the same class again: nothing changes
    with pytest.raises(ValueError, match=r"`capability` must be one of .* got 'ddp'"):
        structures_with("ddp")


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_laplace_evidence_of_the_toy_matches_the_dense_reference(toy, kind, approx):
    model, x, y, problem = setup("mlp_small", kind)
    prior, lik = hyper(model, kind)
    ev = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure=NAME, approx=approx)
    assert all(type(s) is toy for s in ev.structures)
    assert rel_err(ev.log_det(), dense_log_det(problem, approx, prior, lik)) <= TOL
    assert rel_err(ev.log_marglik(), dense_log_marglik(problem, approx, prior, lik)) <= TOL
    plain = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="diag", approx=approx)
    assert float(ev.log_det()) > float(plain.log_det())  # the factor is there: s k c > s c


@pytest.mark.parametrize("prior_structure", ["layerwise", "diagonal"])
def test_the_toy_inverse_and_the_base_class_default_are_the_dense_inverse(toy, prior_structure):
    """The toy inherits the diagonal structure's ``inverse`` (reading its ``diagonal``); the base class's
    default, the dense inverse through ``covariance``, serves a structure without one of its own."""
    model, x, y, problem = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", prior_structure=prior_structure)
    (structure,) = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure=NAME).structures
    ref = problem.reference("diag", "ggn")
    log_delta, log_sigma, log_temperature = ref.hyper_from(prior, lik)
    scale = curvature_scale(problem.kind, "ggn", log_sigma, log_temperature)
    expected = torch.diag(1 / (FACTOR * scale * torch.diagonal(ref.full) + log_delta.exp()))
    for inverse in (structure.inverse, lambda *args: Structure.inverse(structure, *args)):
        apply = inverse(scale, _structure_delta(prior))
        columns = [torch.cat(apply(list(column.split(problem.sizes)))) for column in torch.eye(len(ref.theta))]
        assert rel_err(torch.stack(columns, 1), expected) <= TOL


def test_the_callback_trains_with_the_toy_and_its_evidence_is_the_dense_one(toy):
    """A real Trainer: the callback's curvature is the toy's, and at the final weights and learned
    hyperparameters its log-determinant and evidence are the dense reference's."""
    from lightning_marglik.selection import quiet_lightning
    from tests.lightning_models import Regressor, regression_data, trainer

    torch.manual_seed(0)
    data = TensorDataset(*(t.double() for t in regression_data().tensors))
    module = Regressor().double()
    callback = MargLikCallback(settle=None, structure=NAME, approx="ggn", frequency=1, steps=20)
    with quiet_lightning():
        trainer([callback], max_epochs=3).fit(module, DataLoader(data, batch_size=16))
    assert len(callback.history) == 3 and all(math.isfinite(h["marglik"]) for h in callback.history)
    assert all(type(s) is toy for s in callback.evidence.structures)
    x, y = data.tensors
    names = [name for name, _ in module.net.named_parameters()]
    problem = Problem(module.net, names, x, y, "regression")
    assert rel_err(callback.evidence.log_det(), dense_log_det(problem, "ggn", module.prior, module.likelihood)) <= TOL
    assert rel_err(callback.evidence.log_marglik(),
                   dense_log_marglik(problem, "ggn", module.prior, module.likelihood)) <= TOL


@pytest.mark.parametrize("kwargs, suggested", [
    (dict(structure="kfac"), "structure` must be one of .* got 'kfac' (did you mean 'kron'?)"),
    (dict(structure="diagonal"), "got 'diagonal' (did you mean 'diag'?)"),
    (dict(approx="fisher"), "`approx` must be one of ('ggn', 'ef'), got 'fisher' (did you mean 'ggn'?)"),
    (dict(approx="empirical-fisher"), "got 'empirical-fisher' (did you mean 'ef'?)"),
    (dict(backend="backpak"), "`backend` must be one of ('hooks', 'backpack'), got 'backpak' (did you mean 'backpack'?)"),
])
def test_near_misses_are_refused_with_a_suggestion(kwargs, suggested):
    import re

    for build in (CurvatureOptions, MargLikCallback):
        with pytest.raises(ValueError, match=re.escape(suggested).replace(r"\.\*", ".*")):
            build(**kwargs)


def test_options_are_case_insensitive_and_the_evidence_is_the_canonical_ones():
    options = CurvatureOptions(" KRON", "GGN", backend="Hooks")
    assert (options.structure, options.approx, options.backend) == ("kron", "ggn", "hooks")
    # the callback asks for mc_samples="auto" (decided at set-up); the engine's CurvatureOptions default is exact
    assert MargLikCallback(structure="Diag", approx="EF").options == CurvatureOptions("diag", "ef", "auto")
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification")
    shouted = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="KRON", approx="GGN")
    plain = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="kron", approx="ggn")
    assert shouted.approx == "ggn" and float(shouted.log_marglik()) == float(plain.log_marglik())
