"""linearized_evidence against closed forms from explicit Jacobians (tests/reference.py), float64.

Gaussian likelihood: the linear model's MAP is a ridge regression in the Jacobian features,
``(s J^T J + Delta) theta = s J^T (y - f* + J theta*)``, and its Laplace evidence (``full``) is
``log p(y | f_lin)/T + log N(theta_lin; 0, Delta^-1) + P/2 log 2 pi - 1/2 log|s J^T J + Delta|``.
Categorical: no closed form; the optimum is where the dense gradient of the linear objective
vanishes. Preconditioning (``precondition=True``, the default) must reach the same optimum as plain
L-BFGS, with the evidence's own posterior precision ``s C + diag(delta)`` as its preconditioner (the
structures' ``inverse``, tested in tests/test_structure_inverse.py), in fewer iterations where the problem
is ill-conditioned.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from lightning_marglik import LaplaceEvidence
from lightning_marglik.linearized import linearized_evidence
from tests.real_networks import batches, make_case
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    expand_log_precision, graph_jacobians, hyper, loader, reference_env, rel_err, setup, tempered_log_likelihood,
    unit_log_likelihood,
)


def flat(params):
    return torch.cat([p.reshape(-1) for p in params])


def linear_gradient(jac, f_star, theta_star, theta, y, kind, prior, lik):
    """The dense gradient of the linear objective ``-log p(y | f* + J (theta - theta*)) / T + 1/2 theta^T Delta theta``
    (``jac`` ``(N, C, P)``, ``f_star`` ``(N, C)``)."""
    f_lin = f_star + torch.einsum("ncp,p->nc", jac, theta - theta_star)
    if kind == "classification":
        residual = f_lin.softmax(1) - torch.nn.functional.one_hot(y, f_lin.shape[1]).to(f_lin.dtype)
    else:
        residual = (f_lin - y) * torch.exp(-2 * lik.log_sigma.detach())
    delta = expand_log_precision(prior.log_precision.detach(), prior.structure, prior.param_sizes).exp()
    return torch.einsum("ncp,nc->p", jac, residual) / lik.temperature.detach() + delta * theta


def bn_case(kind):
    """The conv + BatchNorm residual network (tests/real_networks.py), its data and its dense Jacobians."""
    model, x, y = make_case("cnn_bn_res", kind, n=40)
    names = [name for name, _ in model.named_parameters()]
    f_star, jac = graph_jacobians(model, names, x)
    return model, x, y, f_star, jac


def spread_precisions(prior, spread):
    """Layerwise log precisions spread evenly over ``spread`` nats around 0 (an ill-conditioned prior)."""
    with torch.no_grad():
        prior.log_precision.copy_(torch.linspace(-spread / 2, spread / 2, prior.log_precision.numel()))


@pytest.mark.parametrize("precondition", [False, True])
@pytest.mark.parametrize("prior_structure", ["layerwise", "scalar", "diagonal"])
def test_gaussian_optimum_and_evidence_are_the_ridge_regression_closed_form(prior_structure, precondition):
    model, x, y, problem = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", prior_structure=prior_structure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        result = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="full", steps=400,
                                     precondition=precondition)
    if precondition:  # the full GGN plus the prior is this quadratic's exact Hessian: one Newton step
        assert result.iterations == 1
    jac, f_star, theta_star = problem.jac.reshape(-1, problem.theta.numel()), problem.f.reshape(-1), problem.theta
    log_delta = expand_log_precision(prior.log_precision.detach(), prior.structure, problem.sizes)
    s = torch.exp(-2 * lik.log_sigma - lik.log_temperature).detach()
    precision = s * jac.T @ jac + torch.diag(log_delta.exp())
    theta_lin = torch.linalg.solve(precision, s * jac.T @ (y.reshape(-1) - f_star + jac @ theta_star))
    assert rel_err(flat(result.params), theta_lin) <= 1e-6
    assert rel_err(flat(result.params), theta_star) > 1e-2  # the trained weights are not the linear optimum
    f_lin = (f_star + jac @ (theta_lin - theta_star)).reshape(problem.f.shape)
    loglik = tempered_log_likelihood(unit_log_likelihood(f_lin, y, "regression"), "regression",
                                     lik.log_sigma.detach(), lik.log_temperature.detach())
    expected = (loglik - 0.5 * (log_delta.exp() * theta_lin**2).sum() + 0.5 * log_delta.sum()
                - 0.5 * torch.logdet(precision))
    assert rel_err(result.evidence.log_marglik(), expected) <= 1e-9
    assert result.objective[1] < result.objective[0]
    # the network's weights and the prior are left as they were
    assert torch.equal(flat([p.detach() for p in prior.params]), theta_star)


@pytest.mark.parametrize("precondition", [False, True])
def test_categorical_optimum_zeroes_the_dense_gradient_of_the_linear_objective(precondition):
    model, x, y, problem = setup("cnn", "classification")
    prior, lik = hyper(model, "classification")
    result = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=300,
                                 precondition=precondition)
    jac, theta_star = problem.jac, problem.theta
    log_delta = expand_log_precision(prior.log_precision.detach(), prior.structure, problem.sizes)
    theta = flat(result.params)
    f_lin = problem.f + torch.einsum("ncp,p->nc", jac, theta - theta_star)
    gradient = linear_gradient(jac, problem.f, theta_star, theta, y, "classification", prior, lik)
    at_star = linear_gradient(jac, problem.f, theta_star, theta_star, y, "classification", prior, lik)
    assert gradient.abs().max() <= 1e-6 * at_star.abs().max()
    # the evidence is the network's kron evidence with the data fit and the prior term at theta_lin
    plain = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="kron")
    loglik = unit_log_likelihood(f_lin, y, "classification")["loglik"] / lik.temperature.detach()
    assert rel_err(result.evidence.log_likelihood(), loglik) <= 1e-10
    assert rel_err(result.evidence.log_det(), plain.log_det()) <= 1e-12
    assert rel_err(result.evidence.log_prior(), 0.5 * log_delta.sum() - 0.5 * (log_delta.exp() * theta**2).sum()
                   - 0.5 * theta.numel() * torch.log(torch.tensor(2 * torch.pi))) <= 1e-10
    assert result.evidence.log_marglik() > plain.log_marglik()  # the linear optimum fits its own objective better


def test_zero_steps_is_the_evidence_at_the_trained_weights_and_bad_steps_are_refused():
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification")
    result = linearized_evidence(model, loader(x, y), lik, prior, structure="diag", steps=0)
    plain = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="diag")
    assert rel_err(result.evidence.log_marglik(), plain.log_marglik()) <= 1e-12
    for steps in (-1, 2.5, True):
        with pytest.raises(ValueError, match="steps"):
            linearized_evidence(model, loader(x, y), lik, prior, steps=steps)


def test_a_tolerance_runs_the_linear_model_to_its_optimum_and_says_so():
    model, x, y, problem = setup("cnn", "classification")
    prior, lik = hyper(model, "classification")
    result = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=500, tol=1e-7)
    assert result.converged and 0 < result.iterations < 500
    start = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=0, tol=1e-7)
    assert not start.converged and start.iterations == 0
    assert result.gradient_norm <= 1e-7 * start.gradient_norm
    short = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=2, tol=1e-7)
    assert not short.converged and 1 <= short.iterations <= 2  # the budget (2 iterations, 2 evaluations) ran out
    assert short.gradient_norm > result.gradient_norm
    for tol in (0.0, 1.0, -1e-3, float("nan"), "1e-6"):
        with pytest.raises(ValueError, match="tol"):
            linearized_evidence(model, loader(x, y), lik, prior, tol=tol)
    for history in (0, 2.5, None):
        with pytest.raises(ValueError, match="history"):
            linearized_evidence(model, loader(x, y), lik, prior, history=history)
    longer = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=500, tol=1e-7, history=50)
    assert longer.converged and rel_err(flat(longer.params), flat(result.params)) <= 1e-4  # the same optimum


@pytest.mark.parametrize("kind", ["classification", "regression"])
@pytest.mark.parametrize("structure", ["kron", "ekfac", "diag"])
def test_preconditioned_and_plain_iterations_reach_the_same_optimum_of_a_batchnorm_network(structure, kind):
    model, x, y, f_star, jac = bn_case(kind)
    prior, lik = hyper(model, kind)
    theta_star = flat([p.detach() for p in prior.params])
    plain, preconditioned = (linearized_evidence(model, batches(x, y, 16), lik, prior, structure=structure, steps=1000,
                                                 tol=1e-7, precondition=p) for p in (False, True))
    assert plain.converged and preconditioned.converged
    assert rel_err(flat(preconditioned.params), flat(plain.params)) <= 1e-5
    assert rel_err(flat(preconditioned.params), theta_star) > 1e-2  # it moved
    gradient = linear_gradient(jac, f_star, theta_star, flat(preconditioned.params), y, kind, prior, lik)
    at_star = linear_gradient(jac, f_star, theta_star, theta_star, y, kind, prior, lik)
    assert gradient.abs().max() <= 1e-6 * at_star.abs().max()
    assert rel_err(preconditioned.evidence.log_marglik(), plain.evidence.log_marglik()) <= 1e-9
    # converged, gradient_norm and tol in the original coordinates: the dense gradient's max-norm
    assert rel_err(preconditioned.gradient_norm, gradient.abs().max()) <= 1e-6
    assert preconditioned.gradient_norm <= 1e-7 * float(at_star.abs().max())


def test_preconditioning_takes_fewer_iterations_on_an_ill_conditioned_network():
    # precisions spread over e^8 (the ranking study's learned layerwise ones span e^6.6): plain L-BFGS needs ~350
    # iterations, the posterior precision as the preconditioner ~40; an identity in its place needs ~370
    model, x, y, f_star, jac = bn_case("classification")
    prior, lik = hyper(model, "classification")
    spread_precisions(prior, 8.0)
    plain, preconditioned = (linearized_evidence(model, batches(x, y, 16), lik, prior, structure="kron", steps=1000,
                                                 tol=1e-6, history=20, precondition=p) for p in (False, True))
    assert plain.converged and preconditioned.converged
    assert 3 * preconditioned.iterations < plain.iterations
    assert rel_err(flat(preconditioned.params), flat(plain.params)) <= 1e-4


def test_a_precondition_that_is_not_a_bool_is_refused():
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification")
    for precondition in (1, 0, None, "yes", 1.0):
        with pytest.raises(ValueError, match="`precondition` must be True or False"):
            linearized_evidence(model, loader(x, y), lik, prior, precondition=precondition)


class KeywordInputs(torch.nn.Module):
    """A network whose forward takes its input by keyword (batches of ``({"x": x}, y)``)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_inputs_given_by_keyword_reach_the_linear_model_as_forward_takes_them():
    """Batches of dict inputs go to ``forward`` as keywords (the forward-mode product was once given the dict as a
    positional argument too): the same optimum and evidence as the same network called with tensors."""
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification")
    plain = linearized_evidence(model, loader(x, y, 16), lik, prior, structure="kron", steps=5)
    wrapped = KeywordInputs(model)
    keyword_batches = [({"x": xb}, yb) for xb, yb in loader(x, y, 16)]
    keyword = linearized_evidence(wrapped, keyword_batches, lik, prior, structure="kron", steps=5)
    assert plain.iterations == keyword.iterations > 0 and plain.objective[1] < plain.objective[0]  # the steps moved
    assert rel_err(flat(keyword.params), flat(plain.params)) <= 1e-12
    assert rel_err(keyword.evidence.log_marglik(), plain.evidence.log_marglik()) <= 1e-12
