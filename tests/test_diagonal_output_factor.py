"""A diagonal output-side Kronecker factor above ``max_output_factor`` outputs (issue 54), in float64 against
dense brute force.

A layer with more outputs than the limit holds ``diag(G)`` in place of ``G``: its weight block is
``kron(diag(G), A)`` (per conv group; ``kron(A, diag(G))`` for an Embedding's or an HF Conv1D's layout) and
its bias block ``diag(G)``. The dense reference is the exact Kronecker block built from explicit per-datum
Jacobians (tests/reference.py) with the entries between different output units set to zero
(:func:`tests.reference.diagonal_output_blocks`); ``H = s C + diag(delta)`` then gives the log-determinant,
its derivatives (autograd and finite differences), ``H^-1`` and the covariance ``J H^-1 J^T``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from lightning_marglik import LaplaceEvidence, LayerRule, register_layer_rule
from lightning_marglik.curvature import CurvatureOptions
from lightning_marglik.curvature.layers import _RULES, layer_rule
from lightning_marglik.curvature.structures import EKFACStructure, KronStructure
from lightning_marglik.linearized import _structure_delta
from tests.real_networks import batches
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    GraphProblem, curvature_scale, diagonal_output_blocks, expand_log_precision, graph_problem, hyper, reference_env,
    rel_err,
)
from tests.test_derivatives import check_against, closed_form, flat_objective
from tests.test_ekfac import check_moments_against_reference, problem_of
from tests.test_structure_inverse import case, operator_matrix

TOL = 1e-10


def mlp(outputs: int = 7) -> nn.Module:
    """4-5-``outputs``: with the limit at 6 the output layer (7) holds diag(G), the hidden one (5) G."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, outputs))


def pruned() -> nn.Module:
    """Whole output rows of the weight pruned (its masks scale diag(G)) and single bias entries."""
    net = mlp()
    prune.ln_structured(net[2], "weight", amount=2, n=1, dim=0)
    prune.random_unstructured(net[2], "bias", amount=2)
    return net


def small_case(build, kind: str = "classification", n: int = 20):
    model = build().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen)
    y = torch.randint(0, 7, (n,), generator=gen) if kind == "classification" else torch.randn(n, 7, generator=gen)
    return model, x, y, graph_problem(model, x, y, kind)


def kron_of(evidence: LaplaceEvidence) -> KronStructure:
    (structure,) = [s for s in evidence.structures if isinstance(s, KronStructure)]
    return structure


def dense_curvature(problem: GraphProblem, limit: int, approx: str = "ggn") -> torch.Tensor:
    """The unit-scale curvature of ``kron`` with diag(G) above ``limit`` outputs, as one dense matrix."""
    ref = problem.reference("kron", approx)
    dense = torch.zeros_like(ref.full)
    for block in diagonal_output_blocks(problem.model, ref.blocks, limit):
        dense[block.index[:, None], block.index] = block.matrix
    return dense


def dense_log_marglik(problem: GraphProblem, curvature: torch.Tensor, log_delta, log_sigma, log_t) -> torch.Tensor:
    """The Laplace evidence of ``H = s C + diag(delta)`` from first principles (tests/reference.py's conventions)."""
    ref = problem.reference("full", "ggn")  # its likelihood statistics and weights
    scale = curvature_scale(problem.kind, "ggn", log_sigma, log_t)
    log_det = torch.logdet(scale * curvature + torch.diag(log_delta.exp()))
    return (ref.log_likelihood(log_sigma, log_t) - 0.5 * (log_delta.exp() * ref.theta ** 2).sum()
            + 0.5 * log_delta.sum() - 0.5 * log_det)


CASES = {  # name: (model, inputs, targets, problem), limit
    "mlp, output layer only": (lambda: small_case(mlp), 6),
    "pruned output layer": (lambda: small_case(pruned), 6),
    "conv, batchnorm, residual": (lambda: case("cnn_bn_res"), 0),
    "conv groups": (lambda: case("conv2d_grouped"), 0),
    "embedding, groupnorm": (lambda: case("tokens_gn"), 0),
    "hf conv1d (in, out)": (lambda: case("hf_conv1d"), 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_log_det_inverse_and_covariance_are_the_dense_ones(name):
    build, limit = CASES[name]
    model, x, y, problem = build()
    prior, lik = hyper(model, "classification")
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, mc_samples=0, max_output_factor=limit)
    assert any(kron_of(evidence).diagonal)
    curvature = dense_curvature(problem, limit)
    exact = dense_curvature(problem, 10**9)
    assert rel_err(curvature, exact) > 1e-3  # the references differ: the test can tell them apart
    log_delta, log_sigma, log_t = problem.reference("kron", "ggn").hyper_from(prior, lik)
    scale = curvature_scale("classification", "ggn", log_sigma, log_t)
    precision = scale * curvature + torch.diag(log_delta.exp())
    assert rel_err(evidence.log_det(), torch.logdet(precision)) <= TOL
    assert rel_err(evidence.log_marglik(), dense_log_marglik(problem, curvature, log_delta, log_sigma, log_t)) <= TOL
    inverse = torch.linalg.inv(precision)
    assert rel_err(operator_matrix(evidence, scale, _structure_delta(prior)), inverse) <= TOL
    jac = problem.jac
    assert rel_err(evidence.jacobian_covariance(jac), jac @ inverse @ jac.transpose(1, 2)) <= TOL


@pytest.mark.parametrize("name", ["mlp, output layer only", "embedding, groupnorm", "conv groups"])
def test_an_inverse_solved_a_few_rows_at_a_time_is_the_dense_one(name, monkeypatch):
    """Where a block's left basis is the identity (diag(G), an Embedding's I (x) U_G) its rows are solved a few at
    a time: at one row per piece, still the dense inverse."""
    from lightning_marglik.curvature.structures import kron as kron_module

    build, limit = CASES[name]
    model, x, y, problem = build()
    prior, lik = hyper(model, "classification")
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, mc_samples=0, max_output_factor=limit)
    monkeypatch.setattr(kron_module, "_TERMS", 1)
    log_delta, log_sigma, log_t = problem.reference("kron", "ggn").hyper_from(prior, lik)
    scale = curvature_scale("classification", "ggn", log_sigma, log_t)
    precision = scale * dense_curvature(problem, limit) + torch.diag(log_delta.exp())
    assert rel_err(operator_matrix(evidence, scale, _structure_delta(prior)), torch.linalg.inv(precision)) <= TOL


def test_the_limit_selects_the_layers_by_their_outputs_and_the_record_says_why():
    model, x, y, _ = small_case(mlp)
    data = batches(x, y, 8)
    fits = {}
    for limit in (None, 7, 6):
        prior, lik = hyper(model, "classification")
        fits[limit] = LaplaceEvidence.fit(model, data, lik, prior, mc_samples=0, max_output_factor=limit)
    assert kron_of(fits[6]).diagonal == [False, True]
    assert kron_of(fits[7]).diagonal == kron_of(fits[None]).diagonal == [False, False]
    assert kron_of(fits[6]).state("1.g").shape == (7,) and kron_of(fits[6]).state("0.g").shape == (5, 5)
    # the layer below the limit keeps its exact factors; the one above holds G's diagonal
    torch.testing.assert_close(kron_of(fits[6]).state("0.g"), kron_of(fits[None]).state("0.g"), rtol=0, atol=0)
    torch.testing.assert_close(kron_of(fits[6]).state("1.g"), torch.diagonal(kron_of(fits[None]).state("1.g")))
    assert fits[6].estimator == (
        "as set: the exact GGN; kron: the diagonal of the output-side Kronecker factor of '2' (7 outputs), more "
        "outputs than max_output_factor=6 (an exact 7 x 7 factor takes 0 MB in float64 and an eigendecomposition "
        "of about 7^3 flops)"
    )
    assert fits[7].estimator == fits[None].estimator == "as set: the exact GGN"
    assert CurvatureOptions().max_output_factor == 4096


@pytest.mark.parametrize("bad", [-1, 2.5, "4096", True])
def test_max_output_factor_refuses_what_is_not_a_count_of_outputs(bad):
    with pytest.raises(ValueError, match=r"`max_output_factor` must be an int >= 0 .*got"):
        CurvatureOptions(max_output_factor=bad)


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_closed_form_derivatives_are_those_of_the_dense_evidence(kind):
    """Every learned hyperparameter (each tensor's log delta, log sigma, log T): the closed-form gradient against
    central differences of the dense evidence, gradient and Hessian against its autograd derivatives."""
    model, x, y, problem = small_case(mlp, kind)
    with pytest.warns(UserWarning, match="learn_temperature"):
        prior, lik = hyper(model, kind, learn=True)
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, mc_samples=0, max_output_factor=6)
    objective, start, unflatten = flat_objective(evidence)
    curvature = dense_curvature(problem, 6)

    def dense(vector: torch.Tensor) -> torch.Tensor:
        values = unflatten(vector)
        log_delta = expand_log_precision(values["log_precision"], prior.structure, problem.sizes)
        return dense_log_marglik(problem, curvature, log_delta, values.get("log_sigma"), values["log_temperature"])

    assert len(start) == len(prior.param_sizes) + (2 if kind == "regression" else 1)  # every hyperparameter learned
    so = closed_form(evidence, start, unflatten)
    h = 1e-5
    for i in range(len(start)):
        step = torch.zeros_like(start)
        step[i] = h
        difference = (dense(start + step) - dense(start - step)) / (2 * h)
        assert abs(difference - so.gradient[i]) <= 1e-7 * max(1.0, abs(float(so.gradient[i])))
    check_against(so, dense(start), torch.autograd.functional.jacobian(dense, start),
                  torch.autograd.functional.hessian(dense, start), rtol=1e-10)
    check_against(so, objective(start), torch.autograd.functional.jacobian(objective, start),
                  torch.autograd.functional.hessian(objective, start), rtol=1e-12)


@pytest.mark.parametrize("model_name", ["mlp_deep", "grouped_cnn"])
def test_ekfac_takes_its_moments_in_the_basis_of_the_diagonal_factor(model_name):
    """EKFAC above the limit: basis ``I (x) U_A``, the moments ``diag(U^T C U)`` of the dense block, a basis that
    diagonalizes the reference's ``kron(diag(G), A)`` (:func:`tests.test_ekfac.check_moments_against_reference`)."""
    model, x, y, problem = problem_of(model_name, "classification")
    prior, lik = hyper(model, "classification")
    evidence = LaplaceEvidence.fit(model, batches(x, y, 7), lik, prior, structure="ekfac", max_output_factor=0)
    structure = next(s for s in evidence.structures if isinstance(s, EKFACStructure))
    assert all(structure.diagonal) and all(u is None for basis in structure.bases for u in basis["g"])
    blocks = lambda ref: diagonal_output_blocks(model, ref.blocks, 0)  # noqa: E731
    assert check_moments_against_reference(evidence, problem, "classification", "ggn", blocks) == len(prior.param_sizes)


class _OwnLinearRule(LayerRule):
    """A registered rule outside the library's own: it sums the whole G, the structure keeps its diagonal."""

    kron = True

    def __init__(self) -> None:
        self.base = layer_rule(nn.Linear(1, 1))

    def diagonal(self, module, a, g):
        return self.base.diagonal(module, a, g)

    def kron_shape(self, module):
        return self.base.kron_shape(module)

    def kron_sums(self, module, a, g):
        return self.base.kron_sums(module, a, g)


class _OwnLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_a_registered_rule_gives_the_diagonal_of_its_whole_factor():
    register_layer_rule(_OwnLinear, _OwnLinearRule())
    try:
        own = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), _OwnLinear(5, 7)).double()
        model, x, y, _ = small_case(mlp)
        own.load_state_dict(model.state_dict())
        log_dets = []
        for net in (model, own):
            prior, lik = hyper(net, "classification")
            fit = LaplaceEvidence.fit(net, batches(x, y, 8), lik, prior, mc_samples=0, max_output_factor=6)
            assert kron_of(fit).diagonal == [False, True]
            log_dets.append(fit.log_det())
        assert rel_err(log_dets[1], log_dets[0]) <= 1e-13
    finally:
        _RULES.pop(_OwnLinear)


def test_a_log_determinant_taken_in_pieces_is_the_whole_ones(monkeypatch):
    """The eigenvalue products are formed a few at a time (their arrays are as large as the weight): the same
    value and closed-form derivatives, exact and diagonal factors alike."""
    from lightning_marglik.curvature.structures import kron as kron_module

    model, x, y, _ = small_case(mlp)
    with pytest.warns(UserWarning, match="learn_temperature"):
        prior, lik = hyper(model, "classification", learn=True)
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, mc_samples=0, max_output_factor=6)
    _, start, unflatten = flat_objective(evidence)
    whole = closed_form(evidence, start, unflatten), evidence.log_marglik()
    monkeypatch.setattr(kron_module, "_TERMS", 3)  # a piece of one row of q: 5 or 7 pieces per layer
    pieces = closed_form(evidence, start, unflatten), evidence.log_marglik()
    assert rel_err(pieces[1], whole[1]) <= 1e-14
    for name in ("value", "gradient", "rows", "diagonal"):
        assert rel_err(getattr(pieces[0], name), getattr(whole[0], name)) <= 1e-13, name


def test_the_callback_holds_the_diagonal_above_the_default_limit_and_its_evidence_says_why():
    """MargLikCallback runs the default limit: a 4,097-class head holds diag(G), named in the estimate's record."""
    from tests.test_output_size import _fit

    callback, _ = _fit(classes=4097)
    (structure,) = [s for s in callback.evidence.structures if isinstance(s, KronStructure)]
    assert structure.diagonal == [False, True] and structure.state("1.g").shape == (4097,)
    assert "'net.2' (4,097 outputs), more outputs than max_output_factor=4096" in callback.evidence.estimator
    assert "max_output_factor=4096" in callback.estimator  # the callback's record, which its set-up line prints
