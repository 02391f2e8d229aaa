"""The mode-corrected evidence (lightning_marglik.mode_correction) against closed forms in float64: exact for a linear
model with a Gaussian likelihood at ANY weights (the plain Laplace evidence only at the mode), its closed-form
gradient and Newton Hessian against finite differences of its value, and the guard's fold gradients against the
whole data's gradient they stand in for."""
import math

import pytest
import torch
from torch import nn

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.guard import fold_calls, fold_gradients
from lightning_marglik.mode_correction import ModeCorrectedEvidence

SIGMA = 0.7


def _gradient(net: nn.Module, likelihood, batches) -> torch.Tensor:
    """The tempered negative log likelihood's gradient, by autograd over the whole data."""
    loss = sum(likelihood.nll(net(x), y).sum() for x, y in batches) / likelihood.temperature.detach()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(net.parameters()))])


def _exact(x: torch.Tensor, y: torch.Tensor, delta: float) -> float:
    """``log N(y; 0, sigma^2 I + X X^T / delta)`` of Bayesian linear regression."""
    cov = SIGMA ** 2 * torch.eye(len(y), dtype=torch.float64) + x @ x.T / delta
    return float(torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=torch.float64), cov).log_prob(y))


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_the_corrected_evidence_is_exact_at_any_weights_of_a_linear_gaussian_model(structure):
    torch.manual_seed(0)
    x = torch.randn(19, 4, dtype=torch.float64)
    if structure == "diag":  # the diagonal is the exact GGN only where the inputs' second moments are diagonal
        x = torch.linalg.qr(x)[0] * torch.tensor([3.0, 2.0, 1.5, 0.5], dtype=torch.float64)
    y = (x @ torch.randn(4, dtype=torch.float64) + SIGMA * torch.randn(19, dtype=torch.float64))[:, None]
    net = nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        net.weight.normal_()  # far from the mode of any prior
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]
    likelihood = GaussianLikelihood(sigma=SIGMA, learn_sigma=False)
    evidence = LaplaceEvidence.fit(net, batches, likelihood, GaussianPrior(net), structure=structure, mc_samples=0)
    corrected = ModeCorrectedEvidence(evidence, _gradient(net, likelihood, batches))
    for delta in (0.1, 1.0, 7.0):
        values = {**evidence._current(), "log_precision": torch.full((1,), math.log(delta), dtype=torch.float64)}
        exact = _exact(x, y[:, 0], delta)
        assert float(corrected.log_marglik_at(values)) == pytest.approx(exact, rel=1e-10)
        assert abs(float(evidence.log_marglik_at(values)) - exact) > 1e-3  # not the mode: the plain one is off
    # its maximum is the exact evidence's (a grid of 801 points), the plain evidence's is not
    grid = torch.linspace(-4, 4, 801, dtype=torch.float64)
    best = float(grid[torch.tensor([_exact(x, y[:, 0], float(g.exp())) for g in grid]).argmax()])
    assert float(corrected.maximize(tol=1e-12).values["log_precision"]) == pytest.approx(best, abs=0.011)


def _classifier(structure: str, seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,))
    batches = [(x[:25], y[:25]), (x[25:], y[25:])]
    prior = GaussianPrior(net, precision=0.7, fixed=["2.bias"])  # a tensor the evidence does not learn
    likelihood = CategoricalLikelihood(temperature=0.5)
    evidence = LaplaceEvidence.fit(net, batches, likelihood, prior, structure=structure, mc_samples=0)
    return net, batches, evidence, ModeCorrectedEvidence(evidence, _gradient(net, likelihood, batches))


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_the_newton_derivatives_match_finite_differences_of_the_corrected_evidence(structure):
    _, _, evidence, corrected = _classifier(structure)
    current, learned = corrected._current(), evidence.prior.learned_groups()
    start = torch.tensor([0.4, -0.8, 1.3], dtype=torch.float64)  # the learned groups

    def value(rho: torch.Tensor) -> float:
        return float(corrected.log_marglik_at(corrected._with_fixed(current, {"log_precision": rho})))

    point = corrected._second_order(current, learned, {"log_precision": start})
    hessian = point.rows if point.dense.numel() else torch.diag(point.diagonal)
    assert float(point.value) == pytest.approx(value(start), rel=1e-12)
    h, eye = 1e-4, torch.eye(3, dtype=torch.float64)
    for k in range(3):
        slope = (value(start + h * eye[k]) - value(start - h * eye[k])) / (2 * h)
        assert float(point.gradient[k]) == pytest.approx(slope, rel=1e-6, abs=1e-8)
        for j in range(3):
            mixed = (value(start + h * (eye[k] + eye[j])) - value(start + h * (eye[k] - eye[j]))
                     - value(start - h * (eye[k] - eye[j])) + value(start - h * (eye[k] + eye[j]))) / (4 * h * h)
            assert float(hessian[k, j]) == pytest.approx(mixed, rel=1e-4, abs=1e-5)
    # the correction moves the optimum: Newton on it ends elsewhere than on the plain evidence
    plain = evidence.optimize(max_evaluations=100)
    ours = corrected.maximize()
    assert not torch.allclose(ours.values["log_precision"], plain.values["log_precision"], atol=1e-3)
    assert float(ours.value) == pytest.approx(value(ours.values["log_precision"][learned]), rel=1e-12)


def test_bad_input_is_refused_by_name():
    net = nn.Linear(3, 2)
    x, y = torch.randn(10, 3), torch.arange(10) % 2
    likelihood = CategoricalLikelihood()
    diagonal = LaplaceEvidence.fit(net, [(x, y)], likelihood, GaussianPrior(net, structure="diagonal"),
                                   structure="diag", mc_samples=0)
    with pytest.raises(ValueError, match="diagonal prior"):
        ModeCorrectedEvidence(diagonal, torch.zeros(8))
    evidence = LaplaceEvidence.fit(net, [(x, y)], likelihood, GaussianPrior(net), mc_samples=0)
    with pytest.raises(ValueError, match=r"one entry per prior parameter \(8\), got 6"):
        ModeCorrectedEvidence(evidence, torch.zeros(6))


def test_the_folds_gradients_sum_to_the_whole_datas_tempered_gradient():
    net, batches, evidence, _ = _classifier("kron", seed=1)
    rows = fold_gradients(evidence, net, fold_calls(batches, 5))
    assert rows.shape == (5, evidence.prior.n_params)
    torch.testing.assert_close(rows.sum(0), _gradient(net, evidence.likelihood, batches), rtol=1e-12, atol=1e-12)
