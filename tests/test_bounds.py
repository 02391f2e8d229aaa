"""The evidence bounds (lightning_marglik.bounds) against dense brute-force computations, float64.

Dense references (tests/reference.py): per-datum Jacobians J (jacrev), loss Hessians Lambda,
explicit per-batch curvatures and Kronecker blocks, dense logdet; the NTK kernel
K = s Lambda^1/2 J D^-1 J^T Lambda^1/2 of the whole data and its diagonal blocks.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_marglik import LaplaceEvidence
from lightning_marglik.bounds import BoundOptimizer, EvidenceBound
from lightning_marglik.hyperparameters import learnable_values
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    Problem,
    curvature_scale,
    expand_log_precision,
    hyper,
    loader,
    reference_env,
    rel_err,
    setup,
    tempered_log_likelihood,
    unit_log_likelihood,
)

TOL = 1e-8


def _hyper(problem: Problem, prior, lik):
    log_delta = expand_log_precision(prior.log_precision.detach(), prior.structure, problem.sizes)
    log_sigma = lik.log_sigma.detach() if problem.kind == "regression" else None
    return log_delta, log_sigma, lik.log_temperature.detach()


def _batch_curvature(problem: Problem, idx: torch.Tensor, structure: str, approx: str) -> torch.Tensor:
    """The unit-scale curvature of the examples ``idx`` as a dense P x P matrix of the structure."""
    lam = problem.lambdas(approx)[idx]
    if structure == "kron":
        sub = Problem(problem.model, problem.names, problem.x[idx], problem.y[idx], problem.kind)
        dense = torch.zeros(problem.theta.numel(), problem.theta.numel())
        for block in sub.curvature_blocks(lam):
            dense[block.index.unsqueeze(1), block.index.unsqueeze(0)] += block.matrix
        return dense
    full = torch.einsum("ncp,ncd,ndq->pq", problem.jac[idx], lam, problem.jac[idx])
    return torch.diag(torch.diagonal(full)) if structure == "diag" else full


def dense_evidence(problem: Problem, curvature: torch.Tensor, idx: torch.Tensor, prior, lik, approx: str) -> torch.Tensor:
    """log p(D_idx)/T - q/2 + 1/2 log|D| - 1/2 log|s C + D| with the given dense curvature."""
    log_delta, log_sigma, log_t = _hyper(problem, prior, lik)
    scale = curvature_scale(problem.kind, approx, log_sigma, log_t)
    stats = unit_log_likelihood(problem.f[idx], problem.y[idx], problem.kind)
    loglik = tempered_log_likelihood(stats, problem.kind, log_sigma, log_t)
    quadratic = (log_delta.exp() * problem.theta**2).sum()
    return loglik - 0.5 * quadratic + 0.5 * log_delta.sum() - 0.5 * torch.logdet(scale * curvature + torch.diag(log_delta.exp()))


def dense_parametric_bound(problem: Problem, batch_size: int, structure: str, approx: str, prior, lik) -> torch.Tensor:
    """sum_m E_m + (M - 1) q / 2 with E_m the dense evidence of batch m's curvature of the structure."""
    parts = torch.arange(problem.n_data).split(batch_size)
    log_delta = _hyper(problem, prior, lik)[0]
    quadratic = (log_delta.exp() * problem.theta**2).sum()
    total = sum(dense_evidence(problem, _batch_curvature(problem, idx, structure, approx), idx, prior, lik, approx) for idx in parts)
    return total + 0.5 * (len(parts) - 1) * quadratic


def _lambda_sqrt(lam: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(lam)
    return vectors @ torch.diag_embed(values.clamp(min=0).sqrt()) @ vectors.transpose(1, 2)


def dense_kernel(problem: Problem, approx: str, prior, lik) -> torch.Tensor:
    """K = s Lambda^1/2 J D^-1 J^T Lambda^1/2 over all N C outputs (example-major)."""
    log_delta, log_sigma, log_t = _hyper(problem, prior, lik)
    scale = curvature_scale(problem.kind, approx, log_sigma, log_t)
    n, c, p = problem.jac.shape
    rows = torch.einsum("nde,nep->ndp", _lambda_sqrt(problem.lambdas(approx)), problem.jac).reshape(n * c, p)
    return scale * (rows * torch.exp(-log_delta)) @ rows.T


# --- the parametric bound -----------------------------------------------------------------------


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("model_name", ["mlp_small", "cnn"])
def test_parametric_bound_matches_dense_and_bounds(model_name, kind, structure, approx):
    """The bound equals its dense computation, lies below the evidence of sum_m C_m, and (diag, full)
    below the exact full-data evidence with the dense GGN/EF."""
    model, x, y, problem = setup(model_name, kind)
    prior, lik = hyper(model, kind)
    bound = EvidenceBound.fit(model, loader(x, y, 7), lik, prior, bound="parametric", structure=structure, approx=approx)
    assert bound.n_partitions == math.ceil(len(x) / 7) and bound.n_seen == len(x)
    value = bound.log_marglik()
    assert rel_err(value, dense_parametric_bound(problem, 7, structure, approx, prior, lik)) <= TOL
    everything = torch.arange(len(x))
    summed = sum(_batch_curvature(problem, idx, structure, approx) for idx in everything.split(7))
    assert value < dense_evidence(problem, summed, everything, prior, lik, approx)  # strict: M = 6 parts
    exact = dense_evidence(problem, _batch_curvature(problem, everything, "full", approx), everything, prior, lik, approx)
    if structure != "kron":  # kron bounds the evidence of the summed Kronecker products, not the exact one
        assert value < exact


@pytest.mark.parametrize("bound,structure", [("parametric", "kron"), ("parametric", "diag"), ("parametric", "full"), ("ntk", "full")])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_one_part_is_the_evidence(bound, structure, kind):
    """M = 1: the bound is the Laplace evidence of the structure (ntk: of the full curvature)."""
    model, x, y, problem = setup("mlp_deep", kind)
    prior, lik = hyper(model, kind)
    everything = [(x, y)]
    value = EvidenceBound.fit(model, everything, lik, prior, bound=bound, structure=structure).log_marglik()
    expected = LaplaceEvidence.fit(model, everything, lik, prior, structure=structure).log_marglik()
    assert rel_err(value, expected) <= TOL
    assert rel_err(value, problem.reference(structure, "ggn").evaluate(prior, lik)["log_marglik"]) <= TOL


# --- the NTK subset bound -----------------------------------------------------------------------


@pytest.mark.parametrize("subset_size", [1, 4, 13, 40])
@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_ntk_bound_is_the_block_diagonal_kernel(kind, approx, subset_size):
    """log|I + K| of the full kernel replaced by the sum over its subset blocks (Fischer), with a
    loader batch (16) that subsets do not divide; below the exact evidence unless one block."""
    model, x, y, problem = setup("mlp_small", kind)
    prior, lik = hyper(model, kind)
    bound = EvidenceBound.fit(model, loader(x, y, 16), lik, prior, bound="ntk", approx=approx, subset_size=subset_size)
    kernel = dense_kernel(problem, approx, prior, lik)
    c = problem.jac.shape[1]
    outputs = torch.arange(len(x) * c).reshape(len(x), c)
    blocks = [outputs[idx].reshape(-1) for batch in torch.arange(len(x)).split(16) for idx in batch.split(subset_size)]
    block_log_det = sum(torch.logdet(torch.eye(len(b)) + kernel[b][:, b]) for b in blocks)
    log_delta, log_sigma, log_t = _hyper(problem, prior, lik)
    stats = unit_log_likelihood(problem.f, problem.y, problem.kind)
    fit_term = tempered_log_likelihood(stats, problem.kind, log_sigma, log_t) - 0.5 * (log_delta.exp() * problem.theta**2).sum()
    assert bound.n_partitions == len(blocks)
    # a layerwise prior reads the per-tensor Gram matrices only: the R x P rows are not kept
    assert all(s.rows.shape[1] == 0 for part in bound.parts for s in part.structures if s.gram is None)
    assert rel_err(bound.log_marglik(), fit_term - 0.5 * block_log_det) <= TOL
    exact = fit_term - 0.5 * torch.logdet(torch.eye(len(kernel)) + kernel)
    assert bound.log_marglik() < exact


# --- gradients, the stochastic estimate, the optimizer --------------------------------------------


@pytest.mark.parametrize("bound,structure,prior_structure", [
    ("parametric", "kron", "layerwise"), ("parametric", "diag", "diagonal"), ("ntk", "full", "layerwise"), ("ntk", "full", "diagonal"),
])
def test_gradient_matches_finite_differences(bound, structure, prior_structure):
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", prior_structure=prior_structure, learn=True)
    fitted = EvidenceBound.fit(model, loader(x, y, 16), lik, prior, bound=bound, structure=structure, subset_size=5 if bound == "ntk" else None)
    gradient = fitted.gradient()
    assert set(gradient) == {"log_precision", "log_sigma", "log_temperature"}
    part = fitted.parts[0]
    base = part._learnable_values()
    for name, value in base.items():
        flat = value.reshape(-1)
        for i in range(min(flat.numel(), 4)):
            step = torch.zeros_like(flat)
            step[i] = 1e-5
            ups, downs = dict(base), dict(base)
            ups[name], downs[name] = (flat + step).reshape(value.shape), (flat - step).reshape(value.shape)
            up = fitted.log_marglik_at(part._with_fixed(part._current(), ups))
            down = fitted.log_marglik_at(part._with_fixed(part._current(), downs))
            numeric = (up - down) / 2e-5
            assert abs(float(gradient[name].reshape(-1)[i] - numeric)) <= 1e-6 * max(1.0, abs(float(numeric)))


@pytest.mark.parametrize("bound", ["parametric", "ntk"])
def test_stochastic_estimate_averages_to_the_bound(bound):
    """(N/n) sum_m (E_m + q/2) - q/2 on one batch of an equal partition: its mean over the
    batches is the deterministic bound."""
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = hyper(model, "classification")
    batches = list(loader(x, y, 8))
    options = dict(bound=bound, structure="kron" if bound == "parametric" else "full", subset_size=4 if bound == "ntk" else None)
    whole = EvidenceBound.fit(model, batches, lik, prior, **options).log_marglik()
    estimates = [EvidenceBound.fit(model, [b], lik, prior, n_data=len(x), **options).log_marglik() for b in batches]
    assert rel_err(torch.stack(estimates).mean(), whole) <= TOL


@pytest.mark.parametrize("classes,resolved", [(3, 0), (12, 1)])
def test_ntk_mc_samples_auto_takes_the_evidence_estimator(classes, resolved):
    """mc_samples="auto" on the NTK bound is the count every evidence pass takes (curvature.estimator: the exact
    GGN up to 10 columns, one sample beyond): the bound and an optimizer step equal that count's, same draws."""
    model, x, y, _ = setup("mlp_small", "classification", n_out=classes)
    prior, lik = hyper(model, "classification")
    bounds = [
        EvidenceBound.fit(model, [(x, y)], lik, prior, bound="ntk", mc_samples=mc_samples, subset_size=8,
                          generator=torch.Generator().manual_seed(0)).log_marglik()
        for mc_samples in ("auto", resolved, 1 - resolved)
    ]
    assert torch.equal(bounds[0], bounds[1]) and not torch.equal(bounds[0], bounds[2])
    steps = []
    for mc_samples in ("auto", resolved):
        prior, lik = hyper(model, "classification", learn=True)
        optimizer = BoundOptimizer(lik, prior, n_data=len(x), bound="ntk", mc_samples=mc_samples)
        steps.append((optimizer.step(model, (x, y), torch.Generator().manual_seed(0)), prior.log_precision.clone()))
    assert steps[0][0] == steps[1][0] and torch.equal(steps[0][1], steps[1][1])


def test_optimizer_step_is_adam_on_the_summed_bound():
    """One step with a simulated second process (its pieces added by ``all_reduce``): the returned
    value is the two-batch estimate per datum, and Adam's first step moves every learned log
    hyperparameter by lr along the sign of that estimate's gradient."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    prior.record_n_data(len(x))
    first, second = list(loader(x, y, 10))[:2]
    expected = EvidenceBound.fit(model, [first, second], lik, prior, structure="kron", n_data=len(x))
    gradient, target = expected.gradient(), expected.log_marglik() / len(x)
    before = {n: t.clone() for n, t in expected.hyperparameters().items()}
    other = BoundOptimizer(lik, prior, structure="kron")
    leaves = other._leaves_for({n: t.to(torch.float64) for n, t in expected.parts[0]._learnable_values().items()})
    pieces, _ = other._local_pieces(model, second, leaves, None)
    optimizer = BoundOptimizer(lik, prior, structure="kron", lr=0.05)
    value = optimizer.step(model, first, all_reduce=lambda t: t + torch.cat([pieces, t.new_zeros(1)]))
    assert rel_err(torch.tensor(value), target) <= TOL
    for name, grad in gradient.items():
        moved = lik.hyperparameters()[name] if name != "log_precision" else prior.log_precision
        assert torch.allclose(moved - before[name], 0.05 * grad.sign(), atol=1e-7)
    assert optimizer.state_dict()["state"]  # Adam's moments, for a checkpoint


def test_optimizer_state_continues():
    model, x, y, _ = setup("mlp_small", "regression")
    batch = (x[:10], y[:10])
    runs = []
    for resume in (False, True):
        prior, lik = hyper(model, "regression", learn=True)
        optimizer = BoundOptimizer(lik, prior, n_data=len(x), structure="diag", lr=0.05)
        optimizer.step(model, batch)
        if resume:
            state = optimizer.state_dict()
            optimizer = BoundOptimizer(lik, prior, n_data=len(x), structure="diag", lr=0.05)
            optimizer.load_state_dict(state)
        optimizer.step(model, batch)
        runs.append(prior.log_precision.clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("state,match", [
    ({"foo": 1}, r"not an optimizer state: it lacks 'state' and 'param_groups' \(keys \['foo'\]\)"),
    ({"state": {}}, r"not an optimizer state: it lacks 'param_groups'"),
    ([1], r"must be BoundOptimizer.state_dict\(\)'s dict"),
])
def test_a_state_that_is_not_an_optimizer_state_is_refused(state, match):
    """Refused when loaded, naming what it lacks, not with a KeyError at the next step; {} still starts afresh."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    optimizer = BoundOptimizer(lik, prior, n_data=len(x), structure="diag")
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(state)
    optimizer.load_state_dict({})
    assert math.isfinite(optimizer.step(model, (x[:10], y[:10]))) and optimizer.state_dict()["state"]


def test_non_finite_bound_leaves_hyperparameters():
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    before = prior.log_precision.clone()
    optimizer = BoundOptimizer(lik, prior, n_data=len(x), structure="diag")
    with pytest.warns(UserWarning, match="not finite"):
        value = optimizer.step(model, (x[:10], torch.full_like(y[:10], float("nan"))))
    assert math.isnan(value) and torch.equal(prior.log_precision, before)


# --- options and bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(bound="ntk-full"), "`bound` must be one of"),
    (dict(structure="ekfac"), "bound='parametric' takes structure"),
    (dict(subset_size=4), "`subset_size` splits batches for bound='ntk'"),
    (dict(bound="ntk", subset_size=0), "`subset_size` must be an int >= 1"),
    (dict(bound="ntk", structure="diag"), "structure='diag' would be ignored; `structure` applies to bound='parametric'"),
    (dict(lr=0.0), r"`lr` must be a finite number in \(0, inf\)"),
    (dict(approx="fisher"), "`approx` must be one of"),
    (dict(n_data=0), "`n_data` must be an int >= 1"),
    (dict(bound="ntk", backend="backpack"), "computes its Jacobians with torch.func, so backend='backpack'"),
])
def test_bad_options_are_named(kwargs, match):
    model, _, _, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression")
    with pytest.raises(ValueError, match=match):
        BoundOptimizer(lik, prior, **kwargs)


@pytest.mark.parametrize("backend,match", [
    ("backpack", "bound='ntk' computes its Jacobians with torch.func, so backend='backpack' would be ignored"),
    ("bogus", "`backend` must be one of"),
])
def test_ntk_bound_refuses_a_backend(backend, match):
    """The NTK bound's Jacobians are torch.func's: a backend would be ignored, as MargLikBoundCallback says."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression")
    with pytest.raises(ValueError, match=match):
        EvidenceBound.fit(model, [(x[:10], y[:10])], lik, prior, bound="ntk", backend=backend)


def test_unknown_n_data_is_named():
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    with pytest.raises(ValueError, match="number of training data N: pass `n_data=`"):
        BoundOptimizer(lik, prior).step(model, (x[:10], y[:10]))


def test_n_data_below_the_batch_is_refused():
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression")
    with pytest.raises(ValueError, match="below the 10 data of the parts"):
        EvidenceBound.fit(model, [(x[:10], y[:10])], lik, prior, n_data=5)


@pytest.mark.parametrize("n_data", [64.7, 64.0, "100", True])
def test_n_data_that_is_not_an_int_is_refused(n_data):
    """As BoundOptimizer refuses it: int() would truncate 64.7 to 64 and read '100' as 100."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression")
    with pytest.raises(ValueError, match=r"`n_data` must be an int >= 1, got"):
        EvidenceBound.fit(model, [(x[:10], y[:10])], lik, prior, n_data=n_data)
    parts = EvidenceBound.fit(model, [(x[:10], y[:10])], lik, prior).parts
    with pytest.raises(ValueError, match=r"`n_data` must be an int >= 1, got"):
        EvidenceBound(parts, n_data=n_data)


def test_optimizer_refuses_n_data_below_the_batches():
    """N below the data of a step's batches (one process's, or every process's together: 10 + 10 > 15) is refused
    as EvidenceBound refuses it, before the hyperparameters move: the weight of q would turn negative."""
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    before = prior.log_precision.clone()
    with pytest.raises(ValueError, match="`n_data` = 5 is below the 10 data of the parts"):
        BoundOptimizer(lik, prior, n_data=5).step(model, (x[:10], y[:10]))
    other = BoundOptimizer(lik, prior, n_data=15)
    leaves = other._leaves_for({n: t.to(torch.float64) for n, t in learnable_values(prior, lik).items()})
    pieces, _ = other._local_pieces(model, (x[10:20], y[10:20]), leaves, None)
    with pytest.raises(ValueError, match="`n_data` = 15 is below the 20 data of the parts"):
        other.step(model, (x[:10], y[:10]), all_reduce=lambda t: t + torch.cat([pieces, t.new_zeros(1)]))
    assert torch.equal(prior.log_precision, before)


def test_wrong_target_shape_is_named():
    model, x, y, _ = setup("mlp_small", "regression")
    prior, lik = hyper(model, "regression", learn=True)
    for bound in ("parametric", "ntk"):
        with pytest.raises(ValueError, match="target shape"):
            BoundOptimizer(lik, prior, n_data=40, bound=bound, structure="diag" if bound == "parametric" else "kron").step(model, (x[:10], y[:10, :1].repeat(1, 3)))


class _TwoInputs(torch.nn.Module):
    """forward(x, shift) with a per-example ``x`` and a shift shared by the batch (not sliced into subsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.net(x + shift)


def test_ntk_subsets_of_tuple_inputs_equal_parametric_full_batches():
    """The NTK subsets of a tuple-input batch (a shared tensor kept whole) equal the full structure
    on batches of the subset size (Sylvester), the last subset short."""
    torch.manual_seed(0)
    model = _TwoInputs()
    prior, lik = hyper(model, "classification")
    x, y, shift = torch.randn(13, 3), torch.randint(0, 2, (13,)), torch.randn(1, 3)
    ntk = EvidenceBound.fit(model, [((x, shift), y)], lik, prior, bound="ntk", subset_size=5)
    batches = [((x[i : i + 5], shift), y[i : i + 5]) for i in range(0, 13, 5)]
    full = EvidenceBound.fit(model, batches, lik, prior, bound="parametric", structure="full")
    assert ntk.n_partitions == 3 and rel_err(ntk.log_marglik(), full.log_marglik()) <= TOL


def test_a_prior_with_a_hyperprior_is_refused_by_the_bound():
    """Each part's evidence holds the hyperprior's term: summed over the parts it would count once per part."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_marglik import GaussianLikelihood, GaussianPrior, LogNormalHyperprior

    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    data = DataLoader(TensorDataset(torch.randn(16, 1), torch.randn(16, 1)), batch_size=8)
    prior = GaussianPrior(net, hyperprior=LogNormalHyperprior(scale=2.0))
    with pytest.raises(ValueError, match=r"does not take a hyperprior.*hyperprior=None"):
        EvidenceBound.fit(net, data, GaussianLikelihood(), prior, bound="parametric", structure="diag")
    with pytest.raises(ValueError, match=r"does not take a hyperprior.*hyperprior=None"):  # when built, not at a step
        BoundOptimizer(GaussianLikelihood(), prior, n_data=16)
