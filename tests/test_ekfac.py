"""structure="ekfac" (eigenvalue-corrected Kronecker) against dense references in float64.

For every Kronecker block the structure's second moments must equal ``diag(U^T C U)`` of the dense
curvature block ``C`` built from explicit per-datum Jacobians (tests/reference.py), with ``U`` the
structure's basis, and that basis must diagonalize the reference's own Kronecker block (it is the
Kronecker eigenbasis). The log-determinant, its closed-form derivatives and the predictive
covariance follow from the same dense quantities.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback
from lightning_marglik.curvature.structures import EKFACStructure
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    GraphProblem, curvature_scale, hyper, kron, loader, reference_env, rel_err, setup,
)
from tests.test_derivatives import check_against, closed_form, flat_objective

TOL = 1e-8


def grouped_cnn(out: int = 3) -> nn.Sequential:
    """Conv groups, stride, padding and a Linear without bias: every layout the structure handles."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(16, out, bias=False),
    )


def problem_of(model_name: str, kind: str):
    if model_name != "grouped_cnn":
        return setup(model_name, kind)
    torch.manual_seed(0)
    model = grouped_cnn().double()
    x = torch.randn(30, 2, 6, 6)
    y = torch.randint(0, 3, (30,)) if kind == "classification" else torch.randn(30, 3)
    names = [n for n, _ in model.named_parameters()]
    return model, x, y, GraphProblem(model, names, x, y, kind)


def block_bases(structure: EKFACStructure, j: int, role: str) -> torch.Tensor:
    """The structure's basis of layer ``j``'s ``role`` in ``param.flatten()`` order (``None``: the identity of a
    diagonal output-side factor)."""
    basis = structure.bases[j]
    out = structure.shapes[j].out
    if role == "bias":
        return basis["bias"] if basis["bias"] is not None else torch.eye(out)
    groups = len(basis["a"])
    return torch.block_diag(*[kron(u_g if u_g is not None else torch.eye(out // groups), u_a)
                              for u_g, u_a in zip(basis["g"], basis["a"])])


def ekfac_of(ev: LaplaceEvidence) -> EKFACStructure:
    (structure,) = [s for s in ev.structures if isinstance(s, EKFACStructure)]
    return structure


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("model_name", ["mlp_deep", "cnn", "grouped_cnn"])
def test_moments_are_the_dense_block_in_the_kronecker_eigenbasis(model_name, kind, approx):
    model, x, y, problem = problem_of(model_name, kind)
    prior, lik = hyper(model, kind)
    ev = LaplaceEvidence.fit(model, loader(x, y, 7), lik, prior, structure="ekfac", approx=approx)
    assert check_moments_against_reference(ev, problem, kind, approx) == len(prior.param_sizes)  # every tensor


def check_moments_against_reference(ev: LaplaceEvidence, problem, kind: str, approx: str, kron_blocks=None) -> int:
    """EKFAC's second moments, log-determinant and covariance against the dense reference (the module
    docstring); returns the number of tensors in eigenvalue-corrected blocks (the rest: exact diagonals).
    ``kron_blocks``: the reference's Kronecker blocks the basis must diagonalize (default: as they are)."""
    prior, lik = ev.prior, ev.likelihood
    ref_kron, ref_full = problem.reference("kron", approx), problem.reference("full", approx).full
    blocks = ref_kron.blocks if kron_blocks is None else kron_blocks(ref_kron)
    structure = ekfac_of(ev)
    offsets = torch.tensor([0] + prior.param_sizes).cumsum(0).tolist()
    log_delta, log_sigma, log_t = ref_kron.hyper_from(prior, lik)
    scale = curvature_scale(kind, approx, log_sigma, log_t)
    expected_log_det, covariance = 0.0, 0.0
    jac = problem.jac
    checked = 0
    for j, layer in enumerate(structure.layers):
        for role, t in layer.roles.items():
            lo, hi = offsets[t], offsets[t + 1]
            u = block_bases(structure, j, role)
            moments = torch.diagonal(u.T @ ref_full[lo:hi, lo:hi] @ u)
            got = structure.state(f"{j}.s" if role == "weight" else f"{j}.s_bias").reshape(-1)
            assert rel_err(got, moments) <= TOL, (layer.name, role)
            # the basis is the eigenbasis of the reference's own Kronecker block
            (block,) = [b for b in blocks if int(b.index[0]) == lo and len(b.index) == hi - lo]
            rotated = u.T @ block.matrix @ u
            off_diagonal = rotated - torch.diag(torch.diagonal(rotated))
            assert off_diagonal.abs().max() <= 1e-10 * block.matrix.abs().max(), (layer.name, role)
            delta = log_delta[lo:hi].exp()
            expected_log_det = expected_log_det + torch.log(scale * moments + delta).sum()
            j_t = jac[:, :, lo:hi] @ u
            covariance = covariance + torch.einsum("ncp,p,ndp->ncd", j_t, 1 / (scale * moments + delta), j_t)
            checked += 1
    for block in ref_kron.blocks:  # the exact diagonal blocks of the other tensors
        if block.kind == "diag":
            precision = scale * torch.diagonal(block.matrix) + log_delta[block.index].exp()
            expected_log_det = expected_log_det + torch.log(precision).sum()
            j_b = jac[:, :, block.index]
            covariance = covariance + torch.einsum("ncp,p,ndp->ncd", j_b, 1 / precision, j_b)
    assert rel_err(ev.log_det(), expected_log_det) <= TOL
    assert rel_err(ev.jacobian_covariance(jac), covariance) <= TOL
    return checked


def test_ekfac_is_exact_for_a_linear_layer_on_one_datum_and_between_kron_and_full():
    """One datum: the per-example gradient is one outer product, so kron is exact and EKFAC equals it;
    on many data EKFAC's log-det (a diagonal in the right basis of each block) is at least the block's."""
    model, x, y, problem = setup("mlp_small", "classification", n=1)
    prior, lik = hyper(model, "classification")
    args = (model, loader(x, y), lik, prior)
    ekfac, kron_ = (LaplaceEvidence.fit(*args, structure=s).log_det() for s in ("ekfac", "kron"))
    assert rel_err(ekfac, kron_) <= 1e-10
    model, x, y, problem = setup("mlp_deep", "classification")
    prior, lik = hyper(model, "classification")
    blocks = problem.reference("kron", "ggn")
    log_delta, _, log_t = blocks.hyper_from(prior, lik)
    dense = problem.reference("full", "ggn").full
    exact_blocks = sum(
        torch.logdet(dense[b.index][:, b.index] * log_t.neg().exp() + torch.diag(log_delta[b.index].exp()))
        for b in blocks.blocks
    )
    ekfac = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="ekfac").log_det()
    assert ekfac >= exact_blocks - 1e-9  # Hadamard: a diagonal in any basis bounds the block's log-det from above


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_closed_form_derivatives_match_autograd(kind):
    model, x, y, _ = setup("cnn", kind)
    prior, lik = hyper(model, kind, learn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="ekfac")
    objective, start, unflatten = flat_objective(ev)
    so = closed_form(ev, start, unflatten)
    check_against(so, objective(start), torch.autograd.functional.jacobian(objective, start),
                  torch.autograd.functional.hessian(objective, start), rtol=1e-12)


def test_embedding_moments_match_the_dense_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()
    x, y = torch.randint(0, 7, (25, 4)), torch.randint(0, 3, (25,))
    names = [n for n, _ in model.named_parameters()]
    problem = GraphProblem(model, names, x, y, "classification")
    prior, lik = hyper(model, "classification")
    ev = LaplaceEvidence.fit(model, loader(x, y, 9), lik, prior, structure="ekfac")
    structure, dense = ekfac_of(ev), problem.reference("full", "ggn").full
    u_g = structure.bases[0]["g"][0]
    u = kron(torch.eye(7), u_g)  # weight (vocabulary, dim): basis I (x) U_G
    assert rel_err(structure.state("0.s").reshape(-1), torch.diagonal(u.T @ dense[:21, :21] @ u)) <= TOL


def test_refusals_name_the_fix():
    model, x, y, _ = setup("mlp_small", "classification")
    lik = CategoricalLikelihood()
    with pytest.raises(ValueError, match="re-iterable"):
        LaplaceEvidence.fit(model, iter(loader(x, y)), lik, GaussianPrior(model), structure="ekfac")
    with pytest.raises(ValueError, match="diagonal prior"):
        LaplaceEvidence.fit(model, loader(x, y), lik, GaussianPrior(model, structure="diagonal"), structure="ekfac")
    pytest.importorskip("backpack")
    with pytest.raises(ValueError, match="structure='ekfac' has no BackPACK"):
        LaplaceEvidence.fit(model, loader(x, y), lik, GaussianPrior(model), structure="ekfac", backend="backpack")


def test_callback_accepts_ekfac():
    assert MargLikCallback(structure="ekfac").options.structure == "ekfac"
    with pytest.raises(ValueError, match="ekfac"):
        MargLikCallback(structure="ekfak")


def test_callback_trains_with_ekfac_and_its_evidence_is_the_post_hoc_one():
    """A real Trainer: the callback's evidence pass reads its loader twice; at the final weights its
    log-determinant equals LaplaceEvidence.fit(structure="ekfac") at the same hyperparameters."""
    from lightning_marglik.selection import quiet_lightning
    from tests.lightning_models import Regressor, regression_data, trainer

    torch.manual_seed(0)
    data = regression_data()
    module = Regressor().double()
    data = TensorDataset(*(t.double() for t in data.tensors))
    callback = MargLikCallback(settle=None, structure="ekfac", frequency=1, dataloader=DataLoader(data, batch_size=16))
    with quiet_lightning():
        trainer([callback], max_epochs=2).fit(module, DataLoader(data, batch_size=16))
    assert len(callback.history) == 2 and all(math.isfinite(h["marglik"]) for h in callback.history)
    post_hoc = LaplaceEvidence.fit(module, DataLoader(data, batch_size=16), module.likelihood, module.prior,
                                   structure="ekfac")
    assert rel_err(callback.evidence.log_det(), post_hoc.log_det()) <= 1e-10


def test_callback_refuses_ekfac_across_processes_before_training():
    import pytorch_lightning as pl

    from lightning_marglik import MargLikConfigurationError
    from lightning_marglik.selection import quiet_lightning
    from tests.lightning_models import Regressor

    with quiet_lightning():
        ddp = pl.Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False)  # not launched: set-up only
    with pytest.raises(MargLikConfigurationError, match="structure='kron'"):
        MargLikCallback(structure="ekfac").setup(ddp, Regressor(), "fit")


def test_hf_conv1d_weight_stored_in_out_moments_and_covariance():
    """Hugging Face's Conv1D stores its weight (in, out): the basis is U_A (x) U_G in weight.flatten() order."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = nn.Sequential(conv1d(4, 3), nn.Tanh(), nn.Linear(4, 3)).double()  # Conv1D(nf=out, nx=in)
    x, y = torch.randn(25, 3), torch.randint(0, 3, (25,))
    problem = GraphProblem(model, [n for n, _ in model.named_parameters()], x, y, "classification")
    prior, lik = hyper(model, "classification")
    ev = LaplaceEvidence.fit(model, loader(x, y, 9), lik, prior, structure="ekfac")
    structure, dense = ekfac_of(ev), problem.reference("full", "ggn").full
    basis = structure.bases[0]
    u = kron(basis["a"][0], basis["g"][0])
    moments = torch.diagonal(u.T @ dense[:12, :12] @ u)  # (in, out) order
    assert rel_err(structure.state("0.s")[0].T.reshape(-1), moments) <= TOL
    log_delta = problem.reference("kron", "ggn").hyper_from(prior, lik)[0]
    scale = lik.log_temperature.detach().neg().exp()
    j_w = problem.jac[:, :, :12] @ u
    expected = torch.einsum("ncp,p,ndp->ncd", j_w, 1 / (scale * moments + log_delta[:12].exp()), j_w)
    only_weight = problem.jac.clone()
    only_weight[:, :, 12:] = 0  # the other tensors' terms are checked by the tests above
    assert rel_err(ev.jacobian_covariance(only_weight), expected) <= TOL
