"""Gradients of the log marglik in the log hyperparameters (log delta per group, log sigma, log T).

Checked three ways in float64: autograd through the buffers, ``LaplaceEvidence.gradient()``,
central finite differences of ``log_marglik()`` (1e-5 relative), and the autograd gradient of the
dense reference (1e-8 relative).
"""
from __future__ import annotations

import pytest
import torch

from lightning_marglik import LaplaceEvidence
from tests.reference import hyper, loader, reference_env, rel_err, setup  # noqa: F401 (reference_env: autouse fixture)

FD_STEP = 1e-4
FD_TOL = 1e-5


def buffers_of(prior, lik):
    out = {"log_precision": prior.log_precision, "log_temperature": lik.log_temperature}
    if hasattr(lik, "log_sigma"):
        out["log_sigma"] = lik.log_sigma
    return out


def autograd_through_buffers(ev, buffers):
    for b in buffers.values():
        b.requires_grad_(True)
    try:
        value = ev.log_marglik()
        grads = torch.autograd.grad(value, list(buffers.values()))
    finally:
        for b in buffers.values():
            b.requires_grad_(False)
    return dict(zip(buffers, grads))


def finite_differences(ev, buffers):
    out = {}
    for name, buf in buffers.items():
        flat = buf.view(-1)
        fd = torch.empty_like(flat)
        for i in range(flat.numel()):
            with torch.no_grad():
                orig = flat[i].item()
                flat[i] = orig + FD_STEP
                plus = ev.log_marglik().item()
                flat[i] = orig - FD_STEP
                minus = ev.log_marglik().item()
                flat[i] = orig
            fd[i] = (plus - minus) / (2 * FD_STEP)
        out[name] = fd.reshape(buf.shape)
    return out


def check_gradients(ev, prior, lik, ref):
    buffers = buffers_of(prior, lik)
    before = {n: b.clone() for n, b in buffers.items()}
    auto = autograd_through_buffers(ev, buffers)
    lib = ev.gradient()
    assert set(lib) == set(buffers)  # learn=True everywhere: every hyperparameter is learnable
    fd = finite_differences(ev, buffers)
    expected = ref.gradient(prior, lik)
    for name in buffers:
        assert torch.equal(buffers[name], before[name])  # the checks leave the buffers as they were
        assert torch.allclose(auto[name], lib[name], rtol=1e-12, atol=1e-12), name
        g = auto[name].reshape(-1)
        floor = 1e-2 * g.abs().max().clamp(min=1.0)  # components near 0: relative to the gradient's size
        err = (fd[name].reshape(-1) - g).abs() / torch.maximum(g.abs(), floor)
        assert err.max() <= FD_TOL, (name, err.max().item())
        assert rel_err(auto[name], expected[name]) <= 1e-8, name


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diagonal"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_gradient_mlp(kind, prior_structure, structure, approx):
    model, x, y, problem = setup("mlp_small", kind)
    prior, lik = hyper(model, kind, prior_structure, learn=True)
    if structure == "kron" and prior_structure == "diagonal":
        with pytest.raises(ValueError, match="[Dd]iagonal"):
            LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx=approx)
        return
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx=approx)
    check_gradients(ev, prior, lik, problem.reference(structure, approx))


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_gradient_cnn_regression(structure, approx):
    """Includes d/d log sigma under the Kronecker structure of a conv net."""
    model, x, y, problem = setup("cnn", "regression")
    prior, lik = hyper(model, "regression", "layerwise", learn=True)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx=approx)
    check_gradients(ev, prior, lik, problem.reference(structure, approx))


def test_sigma_gradient_under_kron_is_not_zero():
    """laplace-torch's Kronecker log-det carries no gradient in sigma: make sure this one does,
    and that it includes the log-det's share (not only the log-likelihood's)."""
    model, x, y, problem = setup("mlp_deep", "regression")
    prior, lik = hyper(model, "regression", "layerwise", learn=True)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    lik.log_sigma.requires_grad_(True)
    try:
        (d_logdet,) = torch.autograd.grad(ev.log_det(), lik.log_sigma)
    finally:
        lik.log_sigma.requires_grad_(False)
    ref = problem.reference("kron", "ggn")
    log_delta, log_sigma, log_t = ref.hyper_from(prior, lik)
    log_sigma = log_sigma.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(ref.log_det(log_delta, log_sigma, log_t), log_sigma)
    assert abs(float(d_logdet)) > 1.0
    assert rel_err(d_logdet, expected) <= 1e-8


def test_backward_reaches_the_buffers():
    """log_marglik().backward() populates .grad of buffers that require grad (and only those)."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", "layerwise")
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    prior.log_precision.requires_grad_(True)
    try:
        ev.log_marglik().backward()
        assert prior.log_precision.grad is not None and prior.log_precision.grad.abs().sum() > 0
        assert lik.log_sigma.grad is None and lik.log_temperature.grad is None
        assert all(p.grad is None for p in model.parameters())
    finally:
        prior.log_precision.requires_grad_(False)
        prior.log_precision.grad = None


def test_gradient_only_of_learnable():
    """ev.gradient() covers exactly the learnable hyperparameters."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", "layerwise")  # learn=False everywhere
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="diag")
    assert ev.gradient() == {}
    lik.learn_sigma = True
    assert set(ev.gradient()) == {"log_sigma"}
    prior.learn = True
    assert set(ev.gradient()) == {"log_sigma", "log_precision"}
