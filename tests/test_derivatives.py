"""Closed-form gradient and Hessian of the evidence in its log hyperparameters (the Newton solver's
input) against autograd and finite differences of ``log_marglik_at``, in float64."""
import itertools
import warnings
from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.solvers import SecondOrder

CASES = [
    (kind, structure, prior)
    for kind, structure, prior in itertools.product(
        ["regression", "classification"], ["diag", "kron", "full"], ["scalar", "layerwise", "diagonal"]
    )
    if not (structure == "kron" and prior == "diagonal")
]


def evidence(kind: str, structure: str, prior_structure: str, n: int, temperature: bool, fixed=None) -> LaplaceEvidence:
    """A tanh MLP 4-6-C at random weights, random (non-equal) log precisions, T = 0.8."""
    torch.manual_seed(0)
    x = torch.randn(n, 4, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2 if kind == "regression" else 3)).double()
    if kind == "regression":
        y = torch.randn(n, 2, dtype=torch.float64)
        lik: nn.Module = GaussianLikelihood(sigma=0.7, temperature=0.8, learn_temperature=temperature)
    else:
        y = torch.randint(0, 3, (n,))
        lik = CategoricalLikelihood(temperature=0.8, learn_temperature=temperature)
    prior = GaussianPrior(net, precision=0.5, structure=prior_structure, fixed=fixed)
    with torch.no_grad():
        prior.log_precision.copy_(0.5 * torch.randn(prior.log_precision.shape, dtype=torch.float64))
    return LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=n // 2), lik, prior, structure=structure)


def flat_objective(ev: LaplaceEvidence) -> Tuple[Callable[[Tensor], Tensor], Tensor, Callable[[Tensor], Dict[str, Tensor]]]:
    """``log_marglik_at`` as a function of the flat learnable vector, the start, and the unflattening."""
    current, initial = ev._current(), ev._learnable_values()
    names, shapes = list(initial), [t.shape for t in initial.values()]

    def unflatten(vector: Tensor) -> Dict[str, Tensor]:
        parts = torch.split(vector, [s.numel() for s in shapes])
        return {n: p.reshape(s) for n, p, s in zip(names, parts, shapes)}

    return (lambda v: ev.log_marglik_at(ev._with_fixed(current, unflatten(v))),
            torch.cat([t.reshape(-1) for t in initial.values()]), unflatten)


def closed_form(ev: LaplaceEvidence, vector: Tensor, unflatten) -> SecondOrder:
    return ev._second_order(ev._current(), ev.prior.learned_groups(), unflatten(vector))


def check_against(so: SecondOrder, value: Tensor, grad: Tensor, hessian: Tensor, rtol: float) -> None:
    scale = max(1.0, hessian.abs().max().item(), grad.abs().max().item())
    rest = torch.ones(len(grad), dtype=torch.bool)
    rest[so.dense] = False
    assert torch.allclose(so.value, value, rtol=1e-13, atol=1e-12)
    assert torch.allclose(so.gradient, grad, rtol=0, atol=rtol * scale)
    assert torch.allclose(so.rows, hessian[so.dense], rtol=0, atol=rtol * scale)
    assert torch.allclose(so.diagonal, torch.diagonal(hessian)[rest], rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("temperature", [False, True])
@pytest.mark.parametrize("n", [10, 40])  # the full curvature in its low-rank form (rows < P) and as a Gram matrix
@pytest.mark.parametrize("kind,structure,prior_structure", CASES)
def test_closed_form_matches_autograd(kind, structure, prior_structure, n, temperature):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # learn_temperature's warning
        ev = evidence(kind, structure, prior_structure, n, temperature)
    objective, start, unflatten = flat_objective(ev)
    so = closed_form(ev, start, unflatten)
    grad = torch.autograd.functional.jacobian(objective, start)
    hessian = torch.autograd.functional.hessian(objective, start)
    check_against(so, objective(start), grad, hessian, rtol=1e-12)
    if structure != "full":
        assert len(so.diagonal) == int(ev.prior.learned_groups().sum())  # arrowhead: precisions on the diagonal


@pytest.mark.parametrize("form", ["woodbury", "grams"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_both_low_rank_forms_of_the_full_structure_match_autograd(kind, form, monkeypatch):
    """The full structure's low-rank derivatives (rows < P) by either way to the traces."""
    from lightning_marglik.curvature.structures.full import FullStructure

    monkeypatch.setattr(FullStructure, "_low_rank_form", lambda self: form)
    ev = evidence(kind, "full", "layerwise", 10, temperature=False)
    (structure,) = ev.structures
    assert structure.rows.shape[0] < structure.n_params  # the low-rank form
    objective, start, unflatten = flat_objective(ev)
    so = closed_form(ev, start, unflatten)
    grad = torch.autograd.functional.jacobian(objective, start)
    hessian = torch.autograd.functional.hessian(objective, start)
    check_against(so, objective(start), grad, hessian, rtol=1e-12)


@pytest.mark.parametrize("kind,structure", [("regression", "kron"), ("classification", "full"), ("regression", "diag")])
def test_closed_form_matches_finite_differences(kind, structure):
    """Central differences of the closed-form gradient give its Hessian (and of the value, its gradient)."""
    ev = evidence(kind, structure, "layerwise", 40, False)
    objective, start, unflatten = flat_objective(ev)
    so = closed_form(ev, start, unflatten)
    h = 1e-5
    for i in range(len(start)):
        e = torch.zeros_like(start)
        e[i] = h
        up, down = closed_form(ev, start + e, unflatten), closed_form(ev, start - e, unflatten)
        assert abs((up.value - down.value).item() / (2 * h) - so.gradient[i].item()) < 1e-6 * max(1, abs(so.gradient[i].item()))
        column = (up.gradient - down.gradient) / (2 * h)
        dense = so.dense.tolist()
        if i in dense:
            assert torch.allclose(so.rows[dense.index(i)], column, atol=1e-5, rtol=1e-6)
        else:
            assert abs(column[i] - so.diagonal[i - sum(d < i for d in dense)]) < 1e-5 * max(1, abs(column[i].item()))


def test_fixed_groups_are_left_out():
    ev = evidence("regression", "kron", "layerwise", 40, False, fixed=["0.bias"])
    objective, start, unflatten = flat_objective(ev)
    assert len(start) == 4  # three learned precisions and log sigma
    check_against(closed_form(ev, start, unflatten), objective(start), torch.autograd.functional.jacobian(objective, start),
                  torch.autograd.functional.hessian(objective, start), rtol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_newton_with_closed_form_reaches_the_autograd_optimum(structure):
    """The default solve (closed form) ends where Newton on autograd derivatives ends."""
    from lightning_marglik import solvers

    ev = evidence("regression", structure, "layerwise", 40, False)
    closed = ev.optimize(solver="newton", tol=1e-10, max_evaluations=100)
    initial = ev._learnable_values()
    reference = solvers.newton(lambda v: ev.log_marglik_at(ev._with_fixed(ev._current(), v)), initial, tol=1e-10,
                               max_evaluations=100)
    assert closed.converged and reference.converged
    assert abs(closed.value.item() - reference.value.item()) < 1e-8
    for name in initial:
        assert torch.allclose(closed.values[name], reference.values[name], atol=1e-5)
