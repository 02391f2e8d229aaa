"""``LaplaceEvidence.optimize``: Adam or Newton on the log hyperparameters reusing the cached curvature.

Monotone traces on a well-behaved toy regression, convergence to a stationary point from very
different prior precisions (checked against the dense reference's gradient too), ``optimize``
writing nothing and ``set_hyperparameters`` writing the solution, fixed hyperparameters left alone.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_marglik import GaussianLikelihood, GaussianPrior, LaplaceEvidence
from tests.reference import Problem, hyper, loader, reference_env, setup  # noqa: F401 (reference_env: autouse fixture)

_TOY: dict = {}


def toy_regression():
    """A small tanh MLP fitted (MSE) to noisy linear data: the evidence is well-behaved."""
    if not _TOY:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3 * torch.randn(
            40, 1, generator=gen, dtype=torch.float64
        )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(300):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        for p in model.parameters():
            p.grad = None
        _TOY.update(model=model, x=x, y=y)
    return _TOY["model"], _TOY["x"], _TOY["y"]


def grad_norm(grads: dict) -> float:
    return float(torch.cat([g.reshape(-1) for g in grads.values()]).norm())


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("approx,precision,lr", [("ggn", 1e2, 0.05), ("ef", 1e-3, 0.02)])
def test_trace_is_monotone(structure, approx, precision, lr):
    model, x, y = toy_regression()
    prior, lik = GaussianPrior(model, precision=precision), GaussianLikelihood()
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx=approx)
    start = ev.log_marglik().item()
    solution = ev.optimize(steps=200, lr=lr, solver="adam")
    trace = torch.tensor(solution.trace)
    assert len(trace) == 201
    assert trace[0].item() == pytest.approx(start, rel=1e-14)
    assert trace[-1].item() == pytest.approx(solution.value.item(), rel=1e-14)
    steps = trace.diff()
    assert (steps >= -1e-12 * trace[:-1].abs()).all(), steps.min()
    assert trace[-1] > trace[0] + 10.0  # it really moved


@pytest.mark.parametrize("solver", ["adam", "newton"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_converges_to_a_stationary_point(structure, solver):
    """From precisions 1e-3, 1 and 1e2 to the same stationary point of the (reference) evidence."""
    model, x, y = toy_regression()
    n = len(x)
    problem = Problem(model, [name for name, _ in model.named_parameters()], x, y, "regression")
    ref = problem.reference(structure, "ggn")
    finals = []
    for precision in (1e-3, 1.0, 1e2):
        prior, lik = GaussianPrior(model, precision=precision), GaussianLikelihood()
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure)
        if solver == "adam":
            ev.set_hyperparameters(ev.optimize(steps=250, lr=0.05, solver="adam").values)
            ev.set_hyperparameters(ev.optimize(steps=150, lr=0.05, solver="adam").values)  # a fresh Adam: forgets early gradients
        else:
            solution = ev.optimize(solver="newton")
            assert solution.converged and solution.evaluations <= 20
            ev.set_hyperparameters(solution.values)
        assert grad_norm(ev.gradient()) < 1e-3 * n
        expected = ref.gradient(prior, lik)  # stationary for the reference too
        assert grad_norm({k: expected[k] for k in ("log_precision", "log_sigma")}) < 1e-3 * n
        finals.append((ev.log_marglik().item(), lik.log_sigma.item()))
    # the same optimum (the evidence is flat along a large bias precision: compare values, not argmax)
    for value, log_sigma in finals[1:]:
        assert value == pytest.approx(finals[0][0], rel=1e-6)
        assert log_sigma == pytest.approx(finals[0][1], abs=1e-3)


def test_optimize_writes_nothing_and_set_hyperparameters_writes_the_solution():
    model, x, y, problem = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification", "layerwise", learn=True)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    before = {"p": prior.log_precision.clone(), "t": lik.log_temperature.clone()}
    solution = ev.optimize(steps=20, lr=0.1)
    assert torch.equal(prior.log_precision, before["p"]) and torch.equal(lik.log_temperature, before["t"])
    final = solution.value
    ev.set_hyperparameters(solution.values)
    assert not torch.allclose(prior.log_precision, before["p"])
    assert not torch.allclose(lik.log_temperature, before["t"])
    assert not prior.log_precision.requires_grad and not lik.log_temperature.requires_grad
    # the written-back values are the ones the evidence now reads, and the reference agrees
    assert ev.log_marglik().item() == pytest.approx(final.item(), rel=1e-14)
    assert ev.log_marglik().item() == pytest.approx(
        problem.reference("kron", "ggn").evaluate(prior, lik)["log_marglik"].item(), rel=1e-8
    )
    # a second call continues from there
    assert ev.optimize(steps=5, lr=0.1).trace[0] == pytest.approx(final.item(), rel=1e-14)
    # a non-finite value is refused and nothing is written
    with pytest.raises(ValueError, match="non-finite"):
        ev.set_hyperparameters({"log_precision": torch.full_like(prior.log_precision, float("nan"))})
    assert ev.log_marglik().item() == pytest.approx(final.item(), rel=1e-14)


@pytest.mark.parametrize("fixed", ["prior", "sigma", "temperature"])
def test_fixed_hyperparameters_are_untouched(fixed):
    model, x, y = toy_regression()
    prior = GaussianPrior(model, precision=0.5, structure="layerwise", learn=fixed != "prior")
    lik = GaussianLikelihood(
        sigma=0.8, temperature=1.2, learn_sigma=fixed != "sigma", learn_temperature=fixed != "temperature"
    )
    buffers = {"prior": prior.log_precision, "sigma": lik.log_sigma, "temperature": lik.log_temperature}
    before = {k: v.clone() for k, v in buffers.items()}
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="diag")
    ev.set_hyperparameters(ev.optimize(steps=30, lr=0.05).values)
    for name, buf in buffers.items():
        if name == fixed:
            assert torch.equal(buf, before[name]), name
        else:
            assert not torch.allclose(buf, before[name]), name


def test_default_learn_flags():
    """Defaults: prior precision and sigma learned, temperature fixed."""
    model, x, y = toy_regression()
    prior, lik = GaussianPrior(model), GaussianLikelihood()
    t0 = lik.log_temperature.clone()
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    assert set(ev.gradient()) == {"log_precision", "log_sigma"}
    solution = ev.optimize(steps=10, lr=0.05)
    assert set(solution.values) == {"log_precision", "log_sigma"}
    ev.set_hyperparameters(solution.values)
    assert torch.equal(lik.log_temperature, t0)
    assert not torch.allclose(lik.log_sigma, torch.zeros(()))


def test_nothing_learnable_and_zero_steps():
    model, x, y = toy_regression()
    prior = GaussianPrior(model, precision=0.5, learn=False)
    lik = GaussianLikelihood(sigma=0.8, learn_sigma=False)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="diag")
    value = ev.log_marglik().item()
    before = [prior.log_precision.clone(), lik.log_sigma.clone(), lik.log_temperature.clone()]
    out = ev.optimize(steps=10, lr=0.1, solver="adam")
    assert out.value.item() == pytest.approx(value, rel=1e-14) and out.values == {}
    assert out.trace == [pytest.approx(value, rel=1e-14)]
    prior.learn = True
    out = ev.optimize(steps=0, lr=0.1, solver="adam")
    assert torch.equal(out.values["log_precision"], before[0]) and len(out.trace) == 1


@pytest.mark.parametrize(
    "kwargs", [{"steps": -1}, {"steps": 1.5}, {"lr": 0.0}, {"lr": -0.1}, {"lr": float("nan")}, {"solver": "lbfgs"}]
)
def test_bad_optimize_arguments(kwargs):
    model, x, y = toy_regression()
    ev = LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model), structure="diag")
    with pytest.raises(ValueError):
        ev.optimize(**{"steps": 5, "lr": 0.1, "solver": "adam", **kwargs})


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_newton_starts_where_the_closed_form_derivatives_underflow_but_the_objective_is_finite(structure):
    """From log sigma = 180 the closed-form Hessian row of log sigma is 0/0 (its curvature scale squared underflows)
    while the objective, its gradient and autograd's Hessian are finite: Newton returned the start unchanged
    (diverged, no warning). The point is taken by autograd, as one where the closed form raises."""
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = torch.sin(2 * x[:, :1]) + 0.1 * torch.randn(40, 1)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))
    solutions = []
    for log_sigma in (150.0, 180.0):
        likelihood, prior = GaussianLikelihood(sigma=math.exp(log_sigma)), GaussianPrior(net, structure="layerwise")
        evidence = LaplaceEvidence.fit(net, [(x, y)], likelihood, prior, structure=structure, mc_samples=0)
        solutions.append(evidence.optimize(max_evaluations=100))
    for solution in solutions:
        assert solution.converged and not solution.diverged
    assert torch.allclose(solutions[1].values["log_sigma"], solutions[0].values["log_sigma"], atol=1e-4)
    assert solutions[1].value.item() == pytest.approx(solutions[0].value.item(), abs=1e-5)
