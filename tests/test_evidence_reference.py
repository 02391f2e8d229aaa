"""The evidence and its pieces against dense brute-force references (tests/reference.py).

Every structure (diag, kron, full) x approximation (ggn, ef) x likelihood (Gaussian, categorical)
on two MLPs and a small CNN, at non-trivial hyperparameters (sigma != 1, T != 1, distinct
per-layer precisions), in float64: agreement to 1e-8 relative.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from tests.reference import Problem, hyper, loader, reference_env, rel_err, setup  # noqa: F401 (reference_env: autouse fixture)

TOL = 1e-8


def check_all_pieces(ev, ref, prior, lik, n):
    expected = ref.evaluate(prior, lik)
    assert ev.n_data == n
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL
    assert rel_err(ev.log_prior(), expected["log_prior"]) <= TOL
    assert rel_err(ev.log_likelihood(), expected["log_likelihood"]) <= TOL


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("model_name", ["mlp_small", "mlp_deep", "cnn"])
def test_evidence_matches_dense_reference(model_name, kind, structure, approx):
    model, x, y, problem = setup(model_name, kind)
    prior, lik = hyper(model, kind)
    ev = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure=structure, approx=approx)
    check_all_pieces(ev, problem.reference(structure, approx), prior, lik, len(x))


@pytest.mark.parametrize("n,batch_size", [(6, 1), (6, 6), (40, 7), (40, 40)])
@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_full_both_regimes(kind, approx, n, batch_size):
    """Few rows (N*k < P: determinant lemma) and many rows (N*k > P: dense Gram), any batching."""
    model, x, y, problem = setup("mlp_small", kind, n=n, n_out=2)
    prior, lik = hyper(model, kind)
    rows = n * (1 if approx == "ef" else 2)
    assert (rows < prior.n_params) == (n == 6)  # the two regimes really are both exercised
    ev = LaplaceEvidence.fit(model, loader(x, y, batch_size), lik, prior, structure="full", approx=approx)
    check_all_pieces(ev, problem.reference("full", approx), prior, lik, n)


@pytest.mark.parametrize("approx", ["ggn", "ef"])
def test_full_cnn_both_regimes(approx):
    """CNN (P=116): GGN with 3 classes has 120 rows > P, the EF 40 rows < P."""
    model, x, y, problem = setup("cnn", "classification")
    prior, lik = hyper(model, "classification")
    assert (len(x) * (3 if approx == "ggn" else 1) > prior.n_params) == (approx == "ggn")
    ev = LaplaceEvidence.fit(model, loader(x, y, 16), lik, prior, structure="full", approx=approx)
    check_all_pieces(ev, problem.reference("full", approx), prior, lik, len(x))


@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diagonal"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_prior_structures(prior_structure, structure):
    model, x, y, problem = setup("mlp_deep", "regression")
    prior, lik = hyper(model, "regression", prior_structure)
    if structure == "kron" and prior_structure == "diagonal":
        with pytest.raises(ValueError):
            LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure)
        return
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure)
    check_all_pieces(ev, problem.reference(structure, "ggn"), prior, lik, len(x))


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_single_output_regression_with_flat_targets(structure):
    """Gaussian targets of shape (B,) for a single-output network."""
    model, x, y, problem = setup("mlp_small", "regression", n_out=1)
    assert y.dim() == 1
    prior, lik = hyper(model, "regression")
    for approx in ("ggn", "ef"):
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx=approx)
        check_all_pieces(ev, problem.reference(structure, approx), prior, lik, len(x))


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_regression_ef_is_outer_product_of_the_score(structure):
    """The regression EF scales with 1/(sigma^4 T), not 1/(sigma^2 T) (nor laplace-torch's 2/sigma^2)."""
    model, x, y, problem = setup("mlp_small", "regression")
    sigma, temperature = 0.6, 1.7
    prior, lik = hyper(model, "regression", sigma=sigma, temperature=temperature)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, approx="ef")
    ref = problem.reference(structure, "ef")
    log_delta, log_sigma, log_t = ref.hyper_from(prior, lik)
    delta = log_delta.exp()
    if structure == "full":  # fully explicit: sum_n g_n g_n^T with g_n = J_n^T (y_n - f_n) / sigma^2
        scores = torch.einsum("ncp,nc->np", problem.jac, y - problem.f) / sigma**2
        expected = torch.logdet(scores.T @ scores / temperature + torch.diag(delta))
        assert rel_err(ref.log_det(log_delta, log_sigma, log_t), expected) <= 1e-12
    else:
        expected = ref.log_det(log_delta, log_sigma, log_t)
    assert rel_err(ev.log_det(), expected) <= TOL
    # the wrong scalings are far off, so the test can tell them apart:
    # 1/(sigma^2 T) (GGN-like), 2/sigma^2 (laplace-torch), 1/sigma^4 (temperature ignored)
    for wrong in (1 / (sigma**2 * temperature), 2 / sigma**2, 1 / sigma**4):
        assert rel_err(ev.log_det(), ref.log_det_at_scale(torch.tensor(wrong), delta)) > 1e-3


def test_kron_conv_expand_factors_scale():
    """Library conv KFAC blocks: expand convention, trace within [0.5, 2] of the exact GGN block.

    The trace of every curvature block is read from the library through the public API:
    with a layerwise prior at a huge precision delta, d log|H| / d log delta_g = P_g - s tr(C_g)/delta
    + O(delta^-2), so tr(C_g) = (P_g - grad_g) delta / s.
    """
    model, x, y, problem = setup("cnn", "classification")
    prior, lik = hyper(model, "classification", temperature=1.0)
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    big = 1e7
    with torch.no_grad():
        prior.log_precision.fill_(math.log(big))
    prior.log_precision.requires_grad_(True)
    try:
        grad = torch.autograd.grad(ev.log_det(), prior.log_precision)[0]
    finally:
        prior.log_precision.requires_grad_(False)
    lib_traces = (torch.tensor(prior.param_sizes, dtype=grad.dtype) - grad) * big

    ref = problem.reference("kron", "ggn")
    ref_traces = {b.name: torch.trace(b.matrix) for b in ref.blocks}
    exact = ref.full
    offsets = torch.cumsum(torch.tensor([0] + prior.param_sizes), 0)
    conv_weights = [i for i, n in enumerate(prior.param_names) if n in ("0.weight", "2.weight")]
    assert len(conv_weights) == 2
    for i, name in enumerate(prior.param_names):
        assert abs(lib_traces[i] / ref_traces[name] - 1) < 1e-4, name  # library factors = my expand factors
    for i in conv_weights:
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        exact_trace = torch.trace(exact[lo:hi, lo:hi])
        ratio = float(lib_traces[i] / exact_trace)
        assert 0.5 <= ratio <= 2.0, (prior.param_names[i], ratio)
    # the Linear bias block is exact (no weight sharing)
    i = prior.param_names.index("5.bias")
    lo, hi = int(offsets[i]), int(offsets[i + 1])
    assert abs(float(lib_traces[i] / torch.trace(exact[lo:hi, lo:hi])) - 1) < 1e-4


def test_kron_factors_of_linear_layers_are_exact_for_single_datum():
    """With one datum, KFAC of a Linear layer is exact: kron block = dense GGN block."""
    model, x, y, problem = setup("mlp_deep", "classification", n=1)
    ref = problem.reference("kron", "ggn")
    offsets = torch.cumsum(torch.tensor([0] + problem.sizes), 0)
    for i, block in enumerate(ref.blocks):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        assert torch.allclose(block.matrix, ref.full[lo:hi, lo:hi], atol=1e-12)
    prior, lik = hyper(model, "classification")
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    check_all_pieces(ev, ref, prior, lik, 1)


@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_mc_ggn_is_unbiased(kind, structure):
    """The Monte-Carlo GGN's trace (read off log|H| at a huge precision) averages to the exact one."""
    model, x, y, problem = setup("mlp_small", kind)
    prior = GaussianPrior(model, precision=1e6, structure="scalar")
    lik = GaussianLikelihood() if kind == "regression" else CategoricalLikelihood()
    ref = problem.reference(structure, "ggn")
    exact = float(sum(torch.trace(b.matrix) for b in ref.blocks)) if structure == "kron" else float(torch.trace(ref.full))
    estimates = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure, mc_samples=40, generator=gen)
        estimates.append(float(ev.log_det() - prior.n_params * math.log(1e6)) * 1e6)
    estimates = torch.tensor(estimates)
    assert estimates.std() > 1e-6 * exact  # it really is random
    assert abs(estimates.mean() / exact - 1) < 0.05, (estimates.mean(), exact)
