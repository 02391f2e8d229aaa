"""The g-prior evidence against dense references from explicit Jacobians (tests/reference.py), float64.

The equivalence checked: prior precision ``delta_g c_p`` on ``theta_p`` (``c = diag(C)``) has the
same Laplace evidence as the rescaled-Jacobian model ``J~ = J S^-1``, ``theta~ = S theta``
(``S = diag(sqrt(c))``) with the single precision ``delta_g`` -- the reference below builds the latter
densely, the library computes the former.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_marglik import GaussianPrior, LaplaceEvidence
from lightning_marglik.gprior import curvature_diagonal, g_prior_offsets, optimize_g_prior
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    curvature_scale, expand_log_precision, hyper, loader, reference_env, rel_err, setup,
)


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_per_parameter_g_prior_is_the_rescaled_jacobian_model(kind):
    model, x, y, problem = setup("mlp_small", kind)
    prior, lik = hyper(model, kind, prior_structure="diagonal")
    diagonal = curvature_diagonal(model, loader(x, y, 16), lik, prior)
    ref = problem.reference("full", "ggn")
    c = torch.diagonal(ref.full)
    assert rel_err(torch.cat([d.reshape(-1) for d in diagonal]), c) <= 1e-10
    ev = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="full")
    solution = optimize_g_prior(ev, diagonal, tol=1e-12)
    _, log_sigma, log_t = ref.hyper_from(prior, lik)
    scale = curvature_scale(kind, "ggn", log_sigma, log_t)
    root = c.sqrt()
    rescaled_curvature = ref.full / root.unsqueeze(0) / root.unsqueeze(1)  # S^-1 C S^-1 = J~^T Lambda J~
    theta_rescaled = root * ref.theta

    def rescaled_evidence(log_scale: torch.Tensor) -> torch.Tensor:
        p = theta_rescaled.numel()
        return (ref.log_likelihood(log_sigma, log_t) - 0.5 * log_scale.exp() * theta_rescaled.pow(2).sum()
                + 0.5 * p * log_scale - 0.5 * torch.logdet(scale * rescaled_curvature + log_scale.exp() * torch.eye(p)))

    u = solution.log_scale.detach().clone().requires_grad_(True)
    value = rescaled_evidence(u)
    assert rel_err(solution.value, value) <= 1e-10
    (slope,) = torch.autograd.grad(value, u)
    assert abs(float(slope)) <= 1e-5  # the optimum of the rescaled model's evidence in delta_g
    assert rel_err(solution.values["log_precision"], solution.log_scale + c.log()) <= 1e-12


@pytest.mark.parametrize("structure", ["kron", "ekfac", "diag"])
def test_per_tensor_g_prior_is_the_layerwise_evidence_at_scaled_precisions(structure):
    model, x, y, problem = setup("cnn", "classification")
    prior, lik = hyper(model, "classification")
    diagonal = curvature_diagonal(model, loader(x, y, 16), lik, prior)
    ev = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure=structure)
    solution = optimize_g_prior(ev, diagonal, tol=1e-12)
    c = torch.diagonal(problem.reference("full", "ggn").full)
    means = torch.stack([part.mean() for part in torch.split(c, prior.param_sizes)])
    assert rel_err(g_prior_offsets(diagonal, prior), means.log()) <= 1e-10
    values = {**{n: t.detach() for n, t in ev.hyperparameters().items()},
              "log_precision": solution.log_scale + means.log()}
    assert rel_err(solution.value, ev.log_marglik_at(values)) <= 1e-10
    if structure == "kron":  # and that is the dense Kronecker reference at those precisions
        ref = problem.reference("kron", "ggn")
        _, _, log_t = ref.hyper_from(prior, lik)
        log_delta = expand_log_precision(values["log_precision"], "layerwise", problem.sizes)
        assert rel_err(solution.value, ref.log_marglik(log_delta, None, log_t)) <= 1e-8
    u = solution.log_scale.detach().clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(ev.log_marglik_at({**values, "log_precision": u + means.log()}), u)
    assert abs(float(slope)) <= 1e-5
    assert solution.converged


def test_scalar_prior_and_wrong_diagonal_are_refused():
    model, x, y, _ = setup("mlp_small", "classification")
    _, lik = hyper(model, "classification")
    scalar = GaussianPrior(model, structure="scalar")
    diagonal = curvature_diagonal(model, loader(x, y), lik, scalar)
    with pytest.raises(ValueError, match="layerwise"):
        g_prior_offsets(diagonal, scalar)
    with pytest.raises(ValueError, match="sizes"):
        g_prior_offsets(diagonal[:-1], GaussianPrior(model))
    zero = [torch.zeros_like(d) for d in diagonal]
    with pytest.raises(ValueError, match="zero"):
        g_prior_offsets(zero, GaussianPrior(model))
    dead = [d.clone() for d in diagonal]
    dead[0][0] = 0.0  # a parameter no datum informs: floored, finite
    assert math.isfinite(float(g_prior_offsets(dead, GaussianPrior(model, structure="diagonal")).min()))
