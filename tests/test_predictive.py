"""The linearized-Laplace predictive against a dense reference (explicit Jacobians, explicit H^-1)."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    predict_classification,
    predict_regression,
)
from tests.reference import Problem, cnn, curvature_scale, jacobians, loader, make_data, mlp_deep, rel_err


def dense_precision(ref, prior, likelihood) -> torch.Tensor:
    """The posterior precision H of the reference, as a dense P x P matrix, per structure."""
    log_delta, log_sigma, log_t = ref.hyper_from(prior, likelihood)
    scale = curvature_scale(ref.kind, ref.approx, log_sigma, log_t)
    delta = log_delta.exp()
    if ref.structure == "full":
        return scale * ref.full + torch.diag(delta)
    if ref.structure == "diag":
        return torch.diag(scale * torch.diagonal(ref.full) + delta)
    h = torch.zeros_like(ref.full)
    for block in ref.blocks:
        h[block.index[:, None], block.index[None, :]] = scale * block.matrix + torch.diag(delta[block.index])
    return h


def reference_covariance(model, prior, likelihood, x, y, x_test, kind, structure, approx):
    names = prior.param_names
    ref = Problem(model, names, x, y, kind).reference(structure, approx)
    _, jac = jacobians(model, names, x_test)
    cov = jac @ torch.linalg.inv(dense_precision(ref, prior, likelihood)) @ jac.transpose(1, 2)
    return cov


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize("n", [40, 5])  # 5 x 2 outputs < P: the full structure's low-rank (Woodbury) form
def test_regression_predictive_matches_dense_reference(structure, n):
    torch.manual_seed(0)
    model = mlp_deep(2).double()
    x, y = make_data(model, n, "regression", 2, seed=1)
    x_test = torch.randn(7, 4)
    prior = GaussianPrior(model, structure="layerwise")
    with torch.no_grad():
        prior.log_precision.copy_(torch.linspace(-1.0, 1.0, prior.log_precision.numel()))
    lik = GaussianLikelihood(sigma=0.6, temperature=0.9)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure)
    pred = predict_regression(ev, model, x_test)
    cov = reference_covariance(model, prior, lik, x, y, x_test, "regression", structure, "ggn")
    with torch.no_grad():
        mean = model(x_test)
    assert rel_err(pred.mean, mean) <= 1e-12
    assert rel_err(pred.model_variance, torch.diagonal(cov, dim1=1, dim2=2)) <= 1e-8
    assert torch.allclose(pred.noise_variance, torch.full_like(mean, 0.36))
    assert torch.allclose(pred.variance, pred.model_variance + 0.36)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_classification_predictive_matches_dense_reference(structure):
    torch.manual_seed(0)
    model = cnn(3).double()
    x, y = make_data(model, 30, "classification", 3, seed=1)
    x_test = torch.randn(6, 1, 6, 6)
    prior = GaussianPrior(model, precision=2.0, structure="scalar")
    lik = CategoricalLikelihood()
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure, "ggn")
    cov = reference_covariance(model, prior, lik, x, y, x_test, "classification", structure, "ggn")
    with torch.no_grad():
        logits = model(x_test)
    probit = torch.softmax(logits / torch.sqrt(1 + math.pi / 8 * torch.diagonal(cov, dim1=1, dim2=2)), 1)
    assert rel_err(predict_classification(ev, model, x_test, "probit"), probit) <= 1e-8
    # Monte Carlo: the average of softmax over draws from N(f, cov), same draws as the reference
    draws = 4000
    gen = torch.Generator().manual_seed(3)
    mc = predict_classification(ev, model, x_test, "mc", samples=draws, generator=gen)
    noise = torch.randn(draws, 6, 3, generator=torch.Generator().manual_seed(3))
    chol = torch.linalg.cholesky(cov + 1e-10 * torch.eye(3))
    expected = torch.softmax(logits + torch.einsum("bcd,sbd->sbc", chol, noise), 2).mean(0)
    assert rel_err(mc, expected) <= 1e-6
    assert torch.allclose(mc.sum(1), torch.ones(6))
    # and the MC estimate is close to the probit approximation, not to the plain softmax
    assert (mc - probit).abs().max() < (mc - torch.softmax(logits, 1)).abs().max() + 0.02


def test_predictive_rejects_wrong_likelihood_and_options():
    model = mlp_deep(2).double()
    x, y = make_data(model, 10, "regression", 2)
    ev = LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model), "diag")
    with pytest.raises(TypeError, match="CategoricalLikelihood"):
        predict_classification(ev, model, x)
    xc, yc = make_data(model, 10, "classification", 2)
    evc = LaplaceEvidence.fit(model, loader(xc, yc), CategoricalLikelihood(), GaussianPrior(model), "diag")
    with pytest.raises(ValueError, match="method.*'sampling'"):
        predict_classification(evc, model, xc, method="sampling")
    with pytest.raises(ValueError, match="samples.*0"):
        predict_classification(evc, model, xc, method="mc", samples=0)
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        predict_regression(evc, model, xc)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_predictive_of_a_non_finite_evidence_is_refused_with_its_cause(structure):
    """A diverged run (NaN weights) gives a NaN evidence; predicting with it names that, under every structure
    (kron's eigen-solve of a NaN factor failed with LAPACK's 'failed to converge' before)."""
    model = mlp_deep(2).double()
    x, y = make_data(model, 10, "classification", 2)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    ev = LaplaceEvidence.fit(model, loader(x, y), CategoricalLikelihood(), GaussianPrior(model), structure)
    for predict in (lambda: predict_classification(ev, model, x), lambda: predict_regression(ev, model, x)):
        with pytest.raises((ValueError, TypeError), match="not finite|GaussianLikelihood"):
            predict()
    with pytest.raises(ValueError, match="evidence is not finite at these weights.*diverged"):
        predict_classification(ev, model, x)


class _Tokens(torch.nn.Module):
    """Linears on token positions, as inputs (B, T, in) and as rows (B T, in), one on (B, in) called twice, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Linear(3, 4)
        self.rows = torch.nn.Linear(3, 4)
        self.shared = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # x (B, T, 3)
        b, t, _ = x.shape
        h = torch.tanh(self.positions(x)).mean(1) + torch.tanh(self.rows(x.reshape(b * t, 3))).reshape(b, t, 4).mean(1)
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(h)))))


@pytest.mark.parametrize("case", ["mlp", "mlp, diagonal output factors", "positions and a shared layer"])
def test_a_linear_weights_jacobian_taken_as_its_two_factors_gives_the_whole_jacobians_covariance(case):
    """On inputs (B, in) an nn.Linear weight's Jacobian is g a^T (g the bias's): the predictive takes the factors
    and gives the covariance of the whole Jacobians to 1e-12, exact output factors or their diagonals alike; a Linear
    on positions ((B, T, in) or rows (B T, in)) or called twice keeps the whole Jacobian, and the same covariance."""
    from lightning_marglik.curvature.statistics import RankOneJacobian
    from lightning_marglik.predictive import _jacobian_blocks, linearized_outputs, output_jacobians

    torch.manual_seed(0)
    if case.startswith("mlp"):
        model = mlp_deep(3).double()
        x, y = make_data(model, 40, "classification", 3, seed=1)
        x_test = torch.randn(7, 4, dtype=torch.float64)
    else:
        model = _Tokens().double()
        x, y = torch.randn(40, 5, 3, dtype=torch.float64), torch.randint(0, 3, (40,))
        x_test = torch.randn(7, 5, 3, dtype=torch.float64)
    prior = GaussianPrior(model, structure="layerwise")
    with torch.no_grad():
        prior.log_precision.copy_(torch.linspace(-1.0, 1.0, prior.log_precision.numel()))
    limit = 2 if case == "mlp, diagonal output factors" else None  # every layer's G held as its diagonal
    ev = LaplaceEvidence.fit(model, loader(x, y), CategoricalLikelihood(), prior, "kron", mc_samples=0,
                             max_output_factor=limit)
    assert any(ev.structures[0].diagonal) == (limit is not None)
    _, blocks = _jacobian_blocks(ev, model, x_test)
    factored = [name for name, block in zip(prior.param_names, blocks) if isinstance(block, RankOneJacobian)]
    # the MLP's three weights; of the other, the head only (positions: (B, T, in), rows: (B T, in), shared: twice)
    assert factored == (["0.weight", "2.weight", "4.weight"] if case.startswith("mlp") else ["head.weight"])
    mean, cov = linearized_outputs(ev, model, x_test)
    whole_mean, jac = output_jacobians(prior, model, x_test)
    assert torch.equal(mean, whole_mean)
    assert rel_err(cov, ev.jacobian_covariance(jac)) <= 1e-12
