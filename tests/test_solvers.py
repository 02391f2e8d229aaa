"""``lightning_marglik.solvers``: Adam and Newton inner solvers on synthetic objectives and on the
real Laplace evidence of a tiny float64 MLP.

Synthetic: a coupled concave quadratic (Newton exact in one step), Rosenbrock in plain and log
coordinates, an objective whose Cholesky fails beyond a threshold, one that is nan in a region,
a float32 one. Real: every structure x prior structure (regression, plus one classification case),
Newton against 1,000 Adam steps; Adam at lr=10; the diagonal-Hessian path for large dimensions.
Property: from any start in [-20, 20]^d both solvers return a finite point no worse than the start.
"""
from __future__ import annotations

import doctest
import math
import warnings
from typing import Callable, Dict, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, solvers
from lightning_marglik.solvers import adam, newton
from tests.reference import loader, reference_env  # noqa: F401 (reference_env: autouse fixture, one thread)

N = 40


def evidence_objective(evidence: LaplaceEvidence) -> Tuple[Callable[[Dict[str, Tensor]], Tensor], Dict[str, Tensor]]:
    """The solver's view of an evidence: (objective, initial), as ``LaplaceEvidence.optimize`` builds
    it. The ONE place that reads the engine's API, so a change there changes only this function."""
    current = {n: t.detach().to(torch.float64) for n, t in evidence.hyperparameters().items()}
    initial = {n: current[n].clone() for n in evidence.learnable()}
    return (lambda values: evidence.log_marglik_at({**current, **values})), initial


_NETS: dict = {}


def trained_net(kind: str) -> Tuple[nn.Module, Tensor, Tensor]:
    """A 3-5-C tanh MLP trained briefly on N=40 points (cached: do not modify)."""
    if kind not in _NETS:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
        torch.manual_seed(0)
        if kind == "regression":
            y = torch.sin(x @ torch.tensor([[1.0, 0.5], [-1.0, 0.3], [0.5, -2.0]], dtype=torch.float64))
            y = y + 0.2 * torch.randn(N, 2, generator=gen, dtype=torch.float64)
            model, loss = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double(), nn.MSELoss()
        else:
            y = (x[:, 0] + x[:, 1] ** 2 > 1).long() + (x[:, 2] > 0.5).long()
            model, loss = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double(), nn.CrossEntropyLoss()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(200):
            opt.zero_grad()
            (loss(model(x), y) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()
            opt.step()
        for p in model.parameters():
            p.grad = None
        _NETS[kind] = (model, x, y)
    return _NETS[kind]


def evidence(kind: str, structure: str, prior_structure: str, precision: float = 1.0) -> LaplaceEvidence:
    """Evidence with the prior precision (and sigma, for regression) learnable, temperature fixed."""
    model, x, y = trained_net(kind)
    prior = GaussianPrior(model, precision=precision, structure=prior_structure)
    lik = GaussianLikelihood(sigma=0.5) if kind == "regression" else CategoricalLikelihood()
    return LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure)


CASES = [
    (kind, structure, prior)
    for kind in ("regression", "classification")
    for structure in ("diag", "kron", "full")
    for prior in ("scalar", "layerwise", "diagonal")
    if not (structure == "kron" and prior == "diagonal")
]


def caught(fn: Callable, *args, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in record]


def check_solution(solution: solvers.Solution, initial: Dict[str, Tensor]) -> None:
    """Invariants of every solve from a finite start."""
    assert set(solution.values) == set(initial)
    for name, tensor in initial.items():
        assert solution.values[name].shape == tensor.shape and solution.values[name].dtype == tensor.dtype
        assert not solution.values[name].requires_grad
        assert torch.isfinite(solution.values[name]).all()
    assert solution.value.dim() == 0 and math.isfinite(solution.value.item())
    assert solution.value.item() >= solution.start.item()
    assert solution.trace[0] == solution.start.item()


# --- synthetic objectives ------------------------------------------------------------------------


def test_docstring_examples():
    assert doctest.testmod(solvers, raise_on_error=False).failed == 0


A = torch.tensor([[3.0, 1.0, 0.5], [1.0, 2.0, 0.2], [0.5, 0.2, 1.0]], dtype=torch.float64)
PEAK = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)


def quadratic(values: Dict[str, Tensor]) -> Tensor:
    """Concave quadratic with peak 5 at PEAK, over a (2,) and a () tensor (coupled)."""
    x = torch.cat([values["a"], values["b"].reshape(1)]) - PEAK
    return 5.0 - 0.5 * x @ A @ x


def test_newton_on_a_concave_quadratic_is_exact_in_one_step():
    initial = {"a": torch.zeros(2), "b": torch.tensor(0.0)}
    solution = newton(quadratic, initial)
    check_solution(solution, initial)
    assert solution.evaluations == 2 and len(solution.trace) == 2
    assert solution.converged and not solution.diverged and solution.state == {}
    torch.testing.assert_close(solution.values["a"], PEAK[:2], rtol=0, atol=1e-12)
    assert solution.values["b"].item() == pytest.approx(2.0, abs=1e-12)
    assert solution.value.item() == pytest.approx(5.0, abs=1e-12)
    assert initial["a"].eq(0).all()  # inputs untouched


def test_newton_trust_region_limits_the_first_step():
    """From 10 units away the step is damped to change no coordinate by more than 4."""
    initial = {"a": PEAK[:2] + 10.0, "b": PEAK[2] + 10.0}
    solution = newton(quadratic, initial)
    assert solution.converged and solution.value.item() == pytest.approx(5.0, abs=1e-9)
    assert solution.trace == sorted(solution.trace)


def test_adam_on_a_concave_quadratic():
    initial = {"a": torch.zeros(2), "b": torch.tensor(0.0)}
    solution = adam(quadratic, initial, steps=600, lr=0.05)
    check_solution(solution, initial)
    assert len(solution.trace) == 601 and solution.evaluations == 601
    assert solution.value.item() == max(solution.trace)
    assert solution.value.item() == pytest.approx(5.0, abs=1e-8)
    assert not solution.diverged and set(solution.state) == {"state", "param_groups"}
    assert solution.state["param_groups"][0]["param_names"] == ["a", "b"]


def test_adam_state_continues_the_moments():
    """Two calls of 50 steps with the state in between are one call of 100 steps."""
    initial = {"a": torch.zeros(2), "b": torch.tensor(0.0)}
    once = adam(quadratic, initial, steps=100, lr=0.02)
    first = adam(quadratic, initial, steps=50, lr=0.02)
    # continue from the last iterate (here also the best: the trace is still rising)
    assert first.value.item() == first.trace[-1]
    second = adam(quadratic, first.values, steps=50, lr=0.02, state=first.state)
    assert second.trace == pytest.approx(once.trace[50:], rel=1e-13)
    fresh = adam(quadratic, first.values, steps=50, lr=0.02)
    assert fresh.trace[-1] != pytest.approx(once.trace[-1], rel=1e-6)


def rosenbrock(values: Dict[str, Tensor]) -> Tensor:
    a, b = values["a"], values["b"]
    return -((1 - a) ** 2 + 100 * (b - a**2) ** 2)


@pytest.mark.parametrize("log_space", [False, True])
def test_newton_on_rosenbrock(log_space):
    if log_space:  # the same valley in log coordinates: a = e^u, b = e^w (optimum at u = w = 0)
        objective = lambda v: rosenbrock({"a": v["u"].exp(), "b": v["w"].exp()})  # noqa: E731
        initial = {"u": torch.tensor(-2.0), "w": torch.tensor(1.0)}
    else:
        objective, initial = rosenbrock, {"a": torch.tensor(-1.2), "b": torch.tensor(1.0)}
    solution = newton(objective, initial, max_evaluations=60)
    check_solution(solution, initial)
    assert solution.converged and solution.evaluations <= 40
    assert solution.value.item() > -1e-7
    assert solution.trace == sorted(solution.trace)  # every accepted step rises
    optimum = 0.0 if log_space else 1.0
    assert all(abs(v.item() - optimum) < 1e-3 for v in solution.values.values())
    # a small budget stops early, still never below the start
    short = newton(objective, initial, max_evaluations=3)
    assert short.evaluations == 3 and not short.converged and short.value.item() > short.start.item()


def cholesky_barrier(values: Dict[str, Tensor]) -> Tensor:
    """log|[[1, x], [x, 1]]| + 3x by Cholesky: raises LinAlgError for |x| >= 1; peak at x* = (sqrt(10) - 1) / 3."""
    x = values["x"]
    one = torch.ones((), dtype=x.dtype)
    matrix = torch.stack([torch.stack([one, x]), torch.stack([x, one])])
    return 2 * torch.log(torch.diagonal(torch.linalg.cholesky(matrix))).sum() + 3 * x


def nan_region(values: Dict[str, Tensor]) -> Tensor:
    """log x - x: nan for x < 0, peak -1 at x = 1."""
    return torch.log(values["x"]) - values["x"]


X_BARRIER = (math.sqrt(10) - 1) / 3


@pytest.mark.parametrize("objective,start,peak", [(cholesky_barrier, 0.0, X_BARRIER), (nan_region, 3.0, 1.0)])
def test_newton_rejects_failing_trial_points(objective, start, peak):
    """The first (trust-region) Newton step lands where the objective fails; the line search backs off."""
    initial = {"x": torch.tensor(start)}
    solution, messages = caught(newton, objective, initial, tol=1e-13)
    check_solution(solution, initial)
    assert messages == []
    assert solution.converged and solution.evaluations <= 12
    assert solution.values["x"].item() == pytest.approx(peak, abs=1e-6)
    assert solution.evaluations > len(solution.trace)  # some trials were rejected


@pytest.mark.parametrize("objective,start,lr", [(cholesky_barrier, 0.0, 1.0), (nan_region, 3.0, 5.0)])
def test_adam_stops_at_a_failing_point_and_keeps_the_best(objective, start, lr):
    initial = {"x": torch.tensor(start)}
    solution, messages = caught(adam, objective, initial, steps=50, lr=lr)
    check_solution(solution, initial)
    assert solution.diverged and not solution.converged
    assert len(solution.trace) < 51 and solution.evaluations == len(solution.trace) + 1
    assert solution.value.item() == max(solution.trace)
    assert len(messages) == 1 and "non-finite" in messages[0] and f"lr={min(lr / 10, 0.5):g}" in messages[0]


def test_adam_oscillating_keeps_the_best_and_warns():
    steep = lambda v: -50.0 * (v["x"] - 0.3).pow(2).sum()  # noqa: E731
    initial = {"x": torch.zeros(3)}
    solution, messages = caught(adam, steep, initial, steps=40, lr=3.0)
    check_solution(solution, initial)
    assert solution.value.item() == max(solution.trace) > solution.trace[-1]
    assert solution.diverged and len(messages) == 1
    assert "below its best value" in messages[0] and "try lr=0.3 or smaller" in messages[0]


def test_non_finite_start_is_returned_unchanged():
    initial = {"x": torch.tensor(-1.0)}
    for solve in (adam, newton):
        solution, messages = caught(solve, nan_region, initial)
        assert len(messages) == 1 and "initial point" in messages[0]
        assert solution.diverged and not solution.converged and solution.evaluations == 1
        assert solution.values["x"].item() == -1.0 and solution.value.item() == -math.inf


def test_nothing_to_optimize():
    for solve in (adam, newton):
        solution = solve(lambda v: torch.tensor(-3.0), {})
        assert solution.values == {} and solution.value.item() == -3.0 and solution.evaluations == 1


def test_float32_objective_converges_at_its_rounding_level():
    """In float32 the objective cannot resolve 1e-6 nats at |f| ~ 1e4: Newton stops at that level."""
    objective = lambda v: 1e4 + 100.0 * (torch.log(v["x"]) - v["x"]).sum()  # noqa: E731
    initial = {"x": torch.full((3,), 2.5, dtype=torch.float32)}
    solution = newton(objective, initial)
    check_solution(solution, initial)
    assert solution.converged and solution.evaluations <= 10
    rounding = 16 * torch.finfo(torch.float32).eps * 1e4  # the stopping level: 0.02 nats
    assert 1e4 - 300.0 - solution.value.item() <= rounding
    torch.testing.assert_close(solution.values["x"], torch.ones(3, dtype=torch.float32), rtol=0, atol=0.05)


def test_state_for_other_tensors_is_refused():
    initial = {"log_precision": torch.zeros(4), "log_sigma": torch.tensor(0.0)}
    state = adam(quadratic, {"a": torch.zeros(2), "b": torch.tensor(0.0)}, steps=2).state
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*\['log_precision', 'log_sigma'\]"):
        adam(lambda v: -v["log_precision"].pow(2).sum(), initial, steps=1, state=state)
    three = adam(lambda v: -sum(t.pow(2).sum() for t in v.values()), {**initial, "t": torch.tensor(1.0)}, steps=2).state
    with pytest.raises(ValueError, match="3 tensors.*has 2"):
        adam(lambda v: -v["log_precision"].pow(2).sum(), initial, steps=1, state=three)
    other = adam(lambda v: -sum(t.pow(2).sum() for t in v.values()), {**initial, "log_precision": torch.zeros(3)},
                 steps=2).state
    with pytest.raises(ValueError, match=r"shape \(3,\) for 'log_precision'.*\(4,\)"):
        adam(lambda v: -v["log_precision"].pow(2).sum(), initial, steps=1, state=other)
    # a plain torch Adam's state (no parameter names, e.g. saved before the solvers existed) is checked by shape
    plain = torch.optim.Adam([torch.zeros(3, requires_grad=True), torch.zeros((), requires_grad=True)])
    plain.param_groups[0]["params"][0].grad = torch.ones(3)
    plain.param_groups[0]["params"][1].grad = torch.ones(())
    plain.step()
    with pytest.raises(ValueError, match="'log_precision'"):
        adam(lambda v: -v["log_precision"].pow(2).sum(), initial, steps=1, state=plain.state_dict())
    with pytest.raises(ValueError, match="state_dict"):
        adam(lambda v: -v["log_precision"].pow(2).sum(), initial, steps=1, state={"momentum": 1})


def test_state_of_a_plain_adam_with_matching_shapes_is_continued():
    """A state without parameter names (a plain ``torch.optim.Adam``'s) continues by position."""
    leaves = [torch.zeros(2, requires_grad=True), torch.zeros((), requires_grad=True)]
    plain = torch.optim.Adam(leaves, lr=0.02)
    for _ in range(50):
        plain.zero_grad()
        (-quadratic({"a": leaves[0], "b": leaves[1]})).backward()
        plain.step()
    values = {"a": leaves[0].detach().clone(), "b": leaves[1].detach().clone()}
    continued = adam(quadratic, values, steps=50, lr=0.02, state=plain.state_dict())
    once = adam(quadratic, {"a": torch.zeros(2), "b": torch.tensor(0.0)}, steps=100, lr=0.02)
    assert continued.trace == pytest.approx(once.trace[50:], rel=1e-13)


@pytest.mark.parametrize(
    "solve,kwargs,bad",
    [
        (adam, {"steps": -1}, "-1"),
        (adam, {"steps": 1.5}, "1.5"),
        (adam, {"steps": True}, "True"),
        (adam, {"lr": 0.0}, "0.0"),
        (adam, {"lr": -0.1}, "-0.1"),
        (adam, {"lr": math.nan}, "nan"),
        (adam, {"lr": math.inf}, "inf"),
        (newton, {"tol": -1.0}, "-1.0"),
        (newton, {"tol": math.nan}, "nan"),
        (newton, {"max_evaluations": 0}, "0"),
        (newton, {"max_evaluations": 2.0}, "2.0"),
    ],
)
def test_bad_arguments(solve, kwargs, bad):
    with pytest.raises(ValueError, match=f"`{next(iter(kwargs))}`.*got {bad}"):
        solve(quadratic, {"a": torch.zeros(2), "b": torch.tensor(0.0)}, **kwargs)


def test_non_scalar_objective():
    with pytest.raises(ValueError, match="scalar"):
        newton(lambda v: v["x"] * 2, {"x": torch.zeros(2)})


# --- the real evidence ---------------------------------------------------------------------------


# every structure x prior for regression (prior and sigma learned), one classification case (time);
# benchmarks/investigations/solver.py covers all of CASES
COMPARED = [c for c in CASES if c[0] == "regression"] + [("classification", "kron", "layerwise")]


@pytest.mark.parametrize("kind,structure,prior_structure", COMPARED)
def test_newton_reaches_1000_adam_steps_within_20_evaluations(kind, structure, prior_structure):
    objective, initial = evidence_objective(evidence(kind, structure, prior_structure))
    reference = adam(objective, initial, steps=1000, lr=0.1)
    solution = newton(objective, initial, max_evaluations=20)
    check_solution(solution, initial)
    assert solution.converged and solution.evaluations <= 20
    assert (reference.value.item() - solution.value.item()) / N <= 1e-4
    assert solution.value.item() > solution.start.item() + 1.0  # it really moved
    # a stationary point of the evidence (tol = 1e-6 nats allows gradients ~ sqrt(2 tol |Hessian|))
    leaves = {n: t.clone().requires_grad_(True) for n, t in solution.values.items()}
    grads = torch.autograd.grad(objective(leaves), list(leaves.values()))
    assert max(g.abs().max().item() for g in grads) < 0.05


@pytest.mark.parametrize("precision", [1e-3, 1e2])
def test_newton_from_far_prior_precisions(precision):
    """The paper's range of initializations reaches the optimum from delta_0 = 1 in <= 20 evaluations."""
    objective, initial = evidence_objective(evidence("regression", "kron", "layerwise", precision))
    target = newton(*evidence_objective(evidence("regression", "kron", "layerwise")))
    solution = newton(objective, initial)
    assert solution.converged and solution.evaluations <= 20
    assert solution.value.item() == pytest.approx(target.value.item(), abs=1e-6 * N)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_newton_with_the_diagonal_hessian_block(monkeypatch, structure):
    """Above DENSE_LIMIT coordinates the diagonal prior gets a Hessian diagonal (exact for diag
    curvature, estimated for full) coupled exactly to sigma; it still converges to the optimum."""
    objective, initial = evidence_objective(evidence("regression", structure, "diagonal"))
    dense = newton(objective, initial)
    monkeypatch.setattr(solvers, "DENSE_LIMIT", 1)
    solution = newton(objective, initial)
    check_solution(solution, initial)
    assert solution.converged and solution.evaluations <= 20
    assert solution.value.item() == pytest.approx(dense.value.item(), abs=1e-6 * N)
    if structure == "diag":  # the Hessian is exactly diagonal in the precisions: the same steps
        assert solution.evaluations == dense.evaluations


@pytest.mark.parametrize("kind,structure,prior_structure", [c for c in CASES if c[0] == "regression"])
def test_adam_with_a_large_learning_rate_warns_and_keeps_the_best(kind, structure, prior_structure):
    objective, initial = evidence_objective(evidence(kind, structure, prior_structure))
    solution, messages = caught(adam, objective, initial, steps=100, lr=10.0)
    check_solution(solution, initial)
    assert solution.value.item() == max(solution.trace) and solution.trace[-1] < solution.value.item()
    assert solution.diverged and len(messages) == 1 and "try lr=0.5 or smaller" in messages[0]


_HYPOTHESIS: dict = {}


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    start=st.lists(st.floats(-20.0, 20.0), min_size=5, max_size=5),
    structure=st.sampled_from(["kron", "full"]),
)
def test_any_start_gives_a_finite_point_no_worse_than_it(start, structure):
    if structure not in _HYPOTHESIS:
        _HYPOTHESIS[structure] = evidence_objective(evidence("regression", structure, "layerwise"))
    objective, template = _HYPOTHESIS[structure]
    initial = {"log_precision": torch.tensor(start[:4]), "log_sigma": torch.tensor(start[4])}
    assert set(initial) == set(template) and initial["log_precision"].shape == template["log_precision"].shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # large steps from extreme starts may warn: the result is what counts
        results = [newton(objective, initial), adam(objective, initial, steps=20, lr=0.5)]
    for solution in results:
        if math.isfinite(solution.start.item()):
            check_solution(solution, initial)
        else:  # the start's Cholesky failed (full structure at extreme values): nothing to improve
            assert all(torch.equal(solution.values[n], initial[n]) for n in initial)


def test_closed_form_newton_falls_back_to_the_objective_where_its_derivatives_fail():
    """A closed form that fails (e.g. a factorisation of its own at extreme hyperparameters) where the
    objective is finite must not reject the point: Newton then takes autograd derivatives there."""

    def objective(p):
        return -((p["x"] - 2.0) ** 2).sum() - (p["x"][0] * p["x"][1]) ** 2

    def failing(p):
        raise torch.linalg.LinAlgError("the closed form's own factorisation failed")

    start = {"x": torch.tensor([0.5, -1.0], dtype=torch.float64)}
    plain = newton(objective, start, max_evaluations=30)
    fallback = newton(objective, start, max_evaluations=30, derivatives=failing)
    assert math.isfinite(fallback.value) and fallback.value >= fallback.start == plain.start
    assert torch.allclose(fallback.values["x"], plain.values["x"], atol=1e-10)
    assert fallback.converged == plain.converged
