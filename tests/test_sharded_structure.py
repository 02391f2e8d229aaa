"""The layer-owned Kronecker structure (``curvature/structures/sharded.py``) within one process.

Its 2-process behaviour under FSDP (ownership, summed evidence, failures) is in ``tests/test_fsdp.py``; here one
process owns every layer (a world of one: the reduce is the identity), so the sharded evidence must equal the plain
``kron`` one exactly: value, autograd gradient through the summed log-determinant, Newton's closed-form steps.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import GaussianLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.curvature import collect_statistics
from lightning_marglik.curvature.options import CurvatureOptions
from lightning_marglik.curvature.exchange import Exchange, balanced_owners
from lightning_marglik.curvature.structures.sharded import ShardedStructure


def _evidences(max_output_factor=4096, net=None, n=23, sum_dtypes=None):
    torch.manual_seed(0)
    net = net or nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    dtype = next(net.parameters()).dtype
    x = torch.randn(n, net[0].in_features, dtype=dtype)
    data = DataLoader(TensorDataset(x, torch.sin(x[:, :net[-1].out_features])), batch_size=5)
    out = []
    for exchange in (None, Exchange(0, 1, lambda tensor, dst: None, lambda flat: flat)):
        prior, likelihood = GaussianPrior(net, precision=2.0), GaussianLikelihood(sigma=0.7)
        options = CurvatureOptions("kron", max_output_factor=max_output_factor)
        stats = collect_statistics(net, data, likelihood, prior, options=options, exchange=exchange)
        if sum_dtypes is not None:  # the summed factors, before the evidence decomposes and frees them
            sum_dtypes.append({v.dtype for s in stats.structures for v in getattr(s, "share", s).states().values()})
        out.append(LaplaceEvidence.from_statistics(stats, likelihood, prior))
    return out


@pytest.mark.parametrize("max_output_factor", [4096, 4])  # 4: the 6- and 5-output layers hold diag(G) (issue 54)
def test_one_owner_gives_the_plain_kron_evidence_and_gradient(max_output_factor):
    plain, sharded = _evidences(max_output_factor)
    assert [type(s) for s in sharded.structures] == [ShardedStructure]
    assert len(sharded.structures[0].share.layers) == 3 and sharded.structures[0].share.states() == {}  # freed
    assert sharded.structures[0].share.diagonal == plain.structures[0].diagonal == [max_output_factor < 6,
                                                                                     max_output_factor < 5, False]
    assert sharded.estimator == plain.estimator
    point = {k: v.detach().clone() for k, v in plain.hyperparameters().items()}
    point["log_precision"] = point["log_precision"] + torch.linspace(-1, 1, point["log_precision"].numel(),
                                                                     dtype=point["log_precision"].dtype)
    grads = []
    for evidence in (plain, sharded):
        leaves = {k: v.clone().requires_grad_(True) for k, v in point.items()}
        value = evidence.log_marglik_at(leaves)
        value.backward()
        grads.append((value.item(), [leaves[k].grad.clone() for k in sorted(leaves)]))
    (v0, g0), (v1, g1) = grads
    assert v1 == pytest.approx(v0, rel=1e-13)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    newton = [e.optimize(solver="newton", max_evaluations=20) for e in (plain, sharded)]
    assert newton[1].value.item() == pytest.approx(newton[0].value.item(), rel=1e-12)
    for name in newton[0].values:
        torch.testing.assert_close(newton[1].values[name], newton[0].values[name], rtol=1e-9, atol=1e-9)


def test_the_summed_log_determinant_refuses_a_second_derivative_and_the_posterior():
    _, sharded = _evidences()
    log_precision = sharded.prior.log_precision.detach().double().clone().requires_grad_(True)
    point = {**{k: v.detach() for k, v in sharded.hyperparameters().items()}, "log_precision": log_precision}
    with pytest.raises(RuntimeError, match="differentiable once"):  # not a Hessian without the log-determinant
        torch.autograd.grad(sharded.log_marglik_at(point), log_precision, create_graph=True)
    with pytest.raises(RuntimeError, match="needs every layer's curvature in one process"):
        sharded.jacobian_covariance(torch.zeros(1, 2, sharded.prior.n_params, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rescale them before"):
        sharded.structures[0].rescale(0.5)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(1, 10**6), min_size=0, max_size=12), world=st.integers(1, 5))
def test_balanced_owners_give_every_item_one_rank_within_one_item_of_balance(costs, world):
    owners = balanced_owners(costs, world)
    assert len(owners) == len(costs) and all(0 <= o < world for o in owners)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
    if costs:  # greedy largest-first: no rank exceeds another's load by more than one item
        assert max(loads) - min(loads) <= max(costs)
    assert owners == balanced_owners(list(costs), world)  # a function of the costs: the same on every rank


@pytest.mark.parametrize("rank,world,match", [(2, 2, "rank=2"), (-1, 2, "rank=-1"), (0, 0, "world_size=0"),
                                              (0.0, 1, "rank=0.0")])
def test_an_exchange_names_a_rank_outside_its_world(rank, world, match):
    with pytest.raises(ValueError, match=match):
        Exchange(rank, world, lambda tensor, dst: None, lambda flat: flat)


def test_an_exchange_without_its_collectives_is_refused():
    with pytest.raises(TypeError, match="callables"):
        Exchange(0, 1, None, lambda flat: flat)


def test_a_pass_refuses_an_exchange_that_is_not_one():
    net = nn.Linear(2, 1).double()
    data = DataLoader(TensorDataset(torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)))
    with pytest.raises(TypeError, match="`exchange` must be an Exchange"):
        collect_statistics(net, data, GaussianLikelihood(), GaussianPrior(net), exchange=True)


def test_a_float32_models_sharded_factors_are_summed_in_float32_and_move_the_evidence_by_under_1e_4():
    """Issue 54 item 2: a rank's owned factors in float32 (half the memory), decomposed in float64."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 3)).float()
    sum_dtypes = []
    plain, sharded = _evidences(net=net, n=400, sum_dtypes=sum_dtypes)
    assert sum_dtypes == [{torch.float64, torch.int64}, {torch.float32, torch.int64}]
    assert sharded.structures[0].sum_dtype == torch.float32 and sharded.structures[0].share.states() == {}
    for log_precision in (-4.0, 0.0, 3.0):  # a weak prior leans on the smallest eigenvalues
        point = {k: v.detach().clone() for k, v in plain.hyperparameters().items()}
        point["log_precision"] = torch.full_like(point["log_precision"], log_precision)
        values = [e.log_marglik_at(point).item() for e in (plain, sharded)]
        assert values[1] == pytest.approx(values[0], rel=1e-4)
        assert values[1] != values[0]  # summed in float32 indeed


def test_a_float64_models_sharded_factors_stay_float64():
    sum_dtypes = []
    _evidences(sum_dtypes=sum_dtypes)
    assert sum_dtypes == [{torch.float64, torch.int64}] * 2
