"""Remedies for learned precisions that run away (issue 23), in the engine, in float64.

1. A hyperprior on the log precisions (type-II MAP): its term in the reported evidence and in the
   closed-form derivatives Newton uses, against hand computations, autograd and finite differences;
   it makes the optimum of a zero-norm group finite, where without it the optimum runs away.
2. A bounded move per solve (``optimize(max_step=r)``): the box solution against the clipped
   separable optimum and the projected-gradient optimality condition.
3. Decoupled / fixed treatments for a named reason, and the structural no-weight-decay tensors.
4. The settle rule of the first estimate.
"""
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, MargLikConfigurationError, map_loss, solvers,
)
from lightning_marglik.hyperparameters import (
    BIAS_NORMALIZATION, SCALE_INVARIANT, GammaHyperprior, Hyperprior, LogNormalHyperprior, no_decay_names,
)
from lightning_marglik.schedule_rules import loss_has_settled
from tests.lightning_models import Classifier, blobs
from tests.lightning_models import loader as lightning_loader
from tests.lightning_models import trainer as lightning_trainer
from tests.test_derivatives import check_against, closed_form, evidence, flat_objective

HYPERPRIORS = [LogNormalHyperprior(scale=2.0), LogNormalHyperprior(scale=0.7, loc=0.3), GammaHyperprior(1.0),
               GammaHyperprior(concentration=2.5, rate=0.4)]


def with_hyperprior(hyperprior, kind="regression", structure="kron", prior_structure="layerwise", n=40,
                    temperature=True, fixed=None) -> LaplaceEvidence:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # learn_temperature's warning
        ev = evidence(kind, structure, prior_structure, n, temperature, fixed=fixed)
    ev.prior.hyperprior = hyperprior
    return ev


# --- 1. the hyperprior ------------------------------------------------------------------------------


def test_hyperprior_log_densities_by_hand():
    rho = torch.tensor([-1.0, 0.5, 3.0], dtype=torch.float64)
    by_hand = [-0.5 * ((r - 0.3) / 0.7) ** 2 - math.log(0.7) - 0.5 * math.log(2 * math.pi) for r in rho.tolist()]
    assert torch.allclose(LogNormalHyperprior(0.7, loc=0.3).log_density(rho, 5.0), torch.tensor(by_hand, dtype=torch.float64))
    # loc=None: centred at the prior's initial log precision
    assert torch.allclose(LogNormalHyperprior(0.7).log_density(rho, 0.3), torch.tensor(by_hand, dtype=torch.float64))
    # Gamma(a, b) on delta, as a density of rho = log delta: a rho - b e^rho + a log b - lgamma(a)
    a, b = 2.5, 0.4
    by_hand = [a * r - b * math.exp(r) + a * math.log(b) - math.lgamma(a) for r in rho.tolist()]
    assert torch.allclose(GammaHyperprior(a, b).log_density(rho, 7.0), torch.tensor(by_hand, dtype=torch.float64))
    # it integrates to one over rho (the Jacobian is in): trapezoid on a wide grid
    grid = torch.linspace(-30, 6, 200001, dtype=torch.float64)
    assert abs(torch.trapezoid(GammaHyperprior(a, b).log_density(grid, 0.0).exp(), grid).item() - 1) < 1e-8
    # rate=None puts the mode a / b at the initial precision
    mode = grid[GammaHyperprior(a).log_density(grid, math.log(3.0)).argmax()]
    assert abs(mode.item() - math.log(3.0)) < 1e-3


@pytest.mark.parametrize("hyperprior", HYPERPRIORS, ids=repr)
def test_hyperprior_term_in_the_reported_evidence(hyperprior):
    ev = with_hyperprior(None, fixed=["0.bias"])
    plain = ev.log_marglik().item()
    ev.prior.hyperprior = hyperprior
    rho = ev.prior.log_precision.tolist()
    initial = math.log(ev.prior.initial_precision)
    # the fixed group 0.bias (index 1) has no density: its precision is not estimated
    by_hand = sum(hyperprior.log_density(torch.tensor(r, dtype=torch.float64), initial).item()
                  for i, r in enumerate(rho) if i != 1)
    assert abs(ev.log_hyperprior().item() - by_hand) < 1e-12
    assert abs(ev.log_marglik().item() - (plain + by_hand)) < 1e-10
    values = ev._current()
    assert abs(ev.log_marglik_at(values).item() - (plain + by_hand)) < 1e-10


@pytest.mark.parametrize("hyperprior", HYPERPRIORS[::2], ids=repr)
@pytest.mark.parametrize("structure,prior_structure", [("kron", "layerwise"), ("diag", "layerwise"), ("full", "layerwise"),
                                                       ("diag", "diagonal"), ("full", "scalar")])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_hyperprior_closed_form_matches_autograd(hyperprior, structure, prior_structure, kind):
    """Every learned hyperparameter: the precisions, sigma (regression) and the temperature."""
    ev = with_hyperprior(hyperprior, kind, structure, prior_structure)
    objective, start, unflatten = flat_objective(ev)
    assert len(start) == ev.prior.log_precision.numel() + (2 if kind == "regression" else 1)
    check_against(closed_form(ev, start, unflatten), objective(start), torch.autograd.functional.jacobian(objective, start),
                  torch.autograd.functional.hessian(objective, start), rtol=1e-12)


@pytest.mark.parametrize("hyperprior", HYPERPRIORS[1:3], ids=repr)
@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_hyperprior_derivatives_match_finite_differences(hyperprior, structure):
    """Central differences of the value give the gradient, of the gradient the Hessian (precisions, sigma, T)."""
    ev = with_hyperprior(hyperprior, "regression", structure)
    objective, start, unflatten = flat_objective(ev)
    so = closed_form(ev, start, unflatten)
    h = 1e-5
    hessian = torch.zeros(len(start), len(start), dtype=torch.float64)
    for i in range(len(start)):
        e = torch.zeros_like(start)
        e[i] = h
        up, down = closed_form(ev, start + e, unflatten), closed_form(ev, start - e, unflatten)
        assert abs((objective(start + e) - objective(start - e)).item() / (2 * h) - so.gradient[i].item()) < 1e-6
        hessian[:, i] = (up.gradient - down.gradient) / (2 * h)
    assert torch.allclose(hessian, hessian.T, atol=1e-6)
    check_against(so, objective(start), so.gradient, hessian, rtol=1e-6)


def zero_bias_evidence(hyperprior, structure="kron"):
    """A classifier whose last bias is exactly zero: the evidence rises with its precision for ever."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        net[2].bias.zero_()
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 3, (30,))
    prior = GaussianPrior(net, precision=1.0, hyperprior=hyperprior)
    return LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=30), CategoricalLikelihood(), prior,
                               structure=structure)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_zero_norm_group_runs_away_without_hyperprior_and_is_bounded_with_it(structure):
    ev = zero_bias_evidence(None, structure)
    free = ev.optimize(solver="newton", tol=1e-12, max_evaluations=200)
    # the gradient in the bias's log precision is 1/2 sum_i s l_i / (s l_i + delta) > 0 everywhere: no maximum
    assert free.values["log_precision"][3] > 12
    far = {**ev._current(), "log_precision": free.values["log_precision"].clone()}
    far["log_precision"][3] = 20.0
    leaf = far["log_precision"].requires_grad_(True)
    (gradient,) = torch.autograd.grad(ev.log_marglik_at(far), leaf)
    assert 0 < gradient[3] < 1e-6

    scale = 2.0
    ev.prior.hyperprior = LogNormalHyperprior(scale=scale)
    bounded = ev.optimize(solver="newton", tol=1e-12, max_evaluations=200)
    assert bounded.converged
    rho = bounded.values["log_precision"][3].item()
    # the pull -(rho - loc) / s^2 must balance a rise of at most P_g / 2: rho* <= loc + s^2 P_g / 2
    assert 0 < rho <= scale**2 * 3 / 2
    at = {**ev._current(), **bounded.values}
    top = ev.log_marglik_at(at).item()
    for far_rho in (rho + 5, 30.0, 60.0):
        at["log_precision"] = bounded.values["log_precision"].clone()
        at["log_precision"][3] = far_rho
        assert ev.log_marglik_at(at).item() < top
    assert ev.log_marglik_at(at).item() < top - 100  # falls without bound as log delta -> inf

    ev.prior.hyperprior = GammaHyperprior(concentration=1.0)  # rate 1 / precision: delta* <= (a + P_g/2) / b
    gamma = ev.optimize(solver="newton", tol=1e-12, max_evaluations=200)
    assert gamma.converged and math.exp(gamma.values["log_precision"][3].item()) <= (1.0 + 3 / 2) / 1.0


def test_adam_sees_the_hyperprior():
    ev = zero_bias_evidence(LogNormalHyperprior(scale=1.0))
    newton = ev.optimize(solver="newton", tol=1e-12)
    adam = ev.optimize(solver="adam", steps=1500, lr=0.05)
    assert torch.allclose(adam.values["log_precision"], newton.values["log_precision"], atol=1e-3)


def test_hyperprior_is_checked_and_shown():
    net = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="`hyperprior` must be None or a Hyperprior.*got 2.0"):
        GaussianPrior(net, hyperprior=2.0)
    with pytest.raises(ValueError, match="`scale` must be a finite number in \\[1e-150, 1e\\+150\\].*got 0"):
        LogNormalHyperprior(scale=0)
    with pytest.raises(ValueError, match="`loc`.*got nan"):
        LogNormalHyperprior(loc=float("nan"))
    with pytest.raises(ValueError, match="`rate`.*got -1"):
        GammaHyperprior(rate=-1)
    with pytest.raises(ValueError, match="`concentration`.*got True"):
        GammaHyperprior(concentration=True)
    assert "hyperprior=LogNormalHyperprior(scale=3, loc=None)" in repr(GaussianPrior(net, hyperprior=LogNormalHyperprior(3)))


def test_the_bare_hyperprior_base_and_an_incomplete_subclass_cannot_be_built():
    """GaussianPrior took Hyperprior() itself, and its first evidence failed with an empty NotImplementedError."""
    with pytest.raises(TypeError, match=r"^Hyperprior is the abstract base.*use GammaHyperprior\(\.\.\.\) or "
                                        r"LogNormalHyperprior\(\.\.\.\)"):
        GaussianPrior(nn.Linear(2, 1), hyperprior=Hyperprior())

    class DensityOnly(Hyperprior):
        def log_density(self, log_precision, initial_log_precision):
            return -log_precision**2

    with pytest.raises(TypeError, match="abstract.*derivatives"):
        DensityOnly()


# --- 2. a bounded move per solve ------------------------------------------------------------------


def separable_evidence(structure="kron"):
    """Classification without a learned temperature: the log evidence is a sum of concave functions,
    one per layerwise log precision (kron, diag), so the box optimum is the clipped free optimum."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return evidence("classification", structure, "layerwise", 40, False)


@pytest.mark.parametrize("solver", ["newton", "adam"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_max_step_clips_a_separable_optimum(structure, solver):
    ev = separable_evidence(structure)
    start = ev.prior.log_precision.detach().clone()
    free = ev.optimize(solver="newton", tol=1e-12, max_evaluations=100)
    moves = (free.values["log_precision"] - start).abs()
    radius = 0.5 * moves.max().item()
    assert (moves > radius).any() and (moves < radius).any()  # some coordinates outside the box, some inside
    options = {"tol": 1e-12, "max_evaluations": 100} if solver == "newton" else {"steps": 2000, "lr": 0.02}
    boxed = ev.optimize(solver=solver, max_step=radius, **options)
    rho = boxed.values["log_precision"]
    assert ((rho - start).abs() <= radius * (1 + 1e-12)).all()
    expected = torch.minimum(torch.maximum(free.values["log_precision"], start - radius), start + radius)
    assert torch.allclose(rho, expected, atol=1e-9 if solver == "newton" else 2e-3)
    if solver == "newton":
        assert boxed.converged and bool(((rho - start).abs() == radius).any())  # on the face, exactly


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_max_step_newton_is_optimal_in_the_box(structure):
    """Coupled coordinates (sigma, T; the full curvature): the projected gradient vanishes at the box solution."""
    ev = with_hyperprior(LogNormalHyperprior(scale=1.0), "regression", structure)
    start = ev.prior.log_precision.detach().clone()
    free = ev.optimize(solver="newton", tol=1e-12, max_evaluations=100)
    radius = (free.values["log_precision"] - start).abs().median().item()
    boxed = ev.optimize(solver="newton", max_step=radius, tol=1e-12, max_evaluations=100)
    assert boxed.converged and boxed.value <= free.value
    rho = boxed.values["log_precision"]
    at_upper, at_lower = rho >= start + radius, rho <= start - radius
    assert (at_upper | at_lower).any() and ((rho - start).abs() <= radius * (1 + 1e-12)).all()
    clipped = {**free.values, "log_precision": torch.minimum(torch.maximum(free.values["log_precision"], start - radius),
                                                             start + radius)}
    assert boxed.value >= ev.log_marglik_at({**ev._current(), **clipped})  # at least as good as a feasible guess
    ev.set_hyperparameters(boxed.values)  # the gradient at the box solution
    gradient = ev.gradient()
    g = gradient["log_precision"]
    assert (g[at_upper] > 0).all() and (g[at_lower] < 0).all()  # pushing out of the box: the face holds them
    inside = ~(at_upper | at_lower)
    assert (g[inside].abs() < 1e-5).all() and all(gradient[n].abs() < 1e-5 for n in gradient if n != "log_precision")


@pytest.mark.parametrize("solver", ["newton", "adam"])
def test_max_step_equals_the_free_solution_when_it_lies_inside(solver):
    ev = separable_evidence("kron")
    start = ev.prior.log_precision.detach().clone()
    options = {"tol": 1e-12, "max_evaluations": 100} if solver == "newton" else {"steps": 300, "lr": 0.05}
    free = ev.optimize(solver=solver, **options)
    radius = (free.values["log_precision"] - start).abs().max().item() + 0.5
    boxed = ev.optimize(solver=solver, max_step=radius, **options)
    # the same optimum (an early iterate of the free solve may have left the box: the paths differ)
    assert torch.allclose(boxed.values["log_precision"], free.values["log_precision"], rtol=0, atol=1e-7)
    assert abs(boxed.value.item() - free.value.item()) < 1e-10


def test_max_step_is_checked():
    ev = separable_evidence("kron")
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="`max_step` must be a finite number in \\(0, inf\\)"):
            ev.optimize(max_step=bad)
    with pytest.raises(ValueError, match="does not contain the initial point"):
        solvers.newton(lambda v: -(v["x"] ** 2).sum(), {"x": torch.zeros(2, dtype=torch.float64)},
                       box={"x": (torch.ones(2, dtype=torch.float64), 2 * torch.ones(2, dtype=torch.float64))})
    with pytest.raises(ValueError, match="bounds of shapes \\(3,\\) and \\(\\) do not fit 'x' of shape \\(2,\\)"):
        solvers.newton(lambda v: -(v["x"] ** 2).sum(), {"x": torch.zeros(2, dtype=torch.float64)},
                       box={"x": (-torch.ones(3, dtype=torch.float64), torch.tensor(1.0))})
    with pytest.raises(ValueError, match="'y', which is not among"):
        solvers.adam(lambda v: -(v["x"] ** 2).sum(), {"x": torch.zeros(2, dtype=torch.float64)},
                     box={"y": (torch.zeros(2), torch.ones(2))})


# --- 3. decoupled and fixed treatments for a named reason ---------------------------------------------


class Fixup(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, bias=False)
        self.norm = nn.BatchNorm2d(3)
        self.bias1 = nn.Parameter(torch.zeros(()))  # a Fixup scalar
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(3, 2)


def test_no_decay_names_follow_timm():
    model = Fixup()
    prior = GaussianPrior(model)
    expected = [n for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(".bias")]
    assert no_decay_names(prior) == expected == ["bias1", "scale", "norm.weight", "norm.bias", "head.bias"]
    # only the tensors the prior covers
    model.head.bias.requires_grad_(False)
    assert no_decay_names(GaussianPrior(model)) == ["bias1", "scale", "norm.weight", "norm.bias"]


def test_bias_treatments_in_the_map_loss_and_the_evidence():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    prior = GaussianPrior(net, precision=2.0)
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    data = DataLoader(TensorDataset(x, y), batch_size=20)
    names = no_decay_names(prior)
    assert names == ["0.bias", "1.weight", "1.bias", "3.bias"]
    prior.treat(names, "decoupled", BIAS_NORMALIZATION)
    assert prior.learned_groups().all() and prior.treated("decoupled") == names
    ev = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), prior)
    ev.set_hyperparameters(ev.optimize().values)
    learned = prior.log_precision.clone()
    assert (learned[[1, 2, 3, 5]] - math.log(2.0)).abs().min() > 1e-3  # the evidence learned them ...
    wd = prior.weight_decay_log_precision()
    assert torch.allclose(wd[[1, 2, 3, 5]], torch.full((4,), math.log(2.0), dtype=wd.dtype))  # ... the MAP loss did not
    assert torch.equal(wd[[0, 4]], learned[[0, 4]])
    out = net(x)
    sq = prior.group_sq_norms()
    expected = CategoricalLikelihood().nll(out, y).mean() + 0.5 * (wd.exp() * sq).sum() / 20
    assert torch.allclose(map_loss(out, y, CategoricalLikelihood(), prior), expected)

    prior.treat(names, "fixed", BIAS_NORMALIZATION)  # replaces the declaration of that reason
    assert prior.learned_groups().tolist() == [True, False, False, False, True, False]
    assert prior.learned_names() == ["0.weight", "3.weight"] and prior.treated("decoupled") == []
    prior.treat(names, "learn", BIAS_NORMALIZATION)
    assert prior.learned_groups().all() and torch.equal(prior.weight_decay_log_precision(), prior.log_precision)


def test_treatments_of_several_reasons_combine_strongest_first():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    prior = GaussianPrior(net, fixed=["2.bias"])
    prior.treat_scale_invariant(["0.weight", "0.bias"], "decoupled")
    prior.treat(no_decay_names(prior), "fixed", BIAS_NORMALIZATION)
    assert prior.scale_invariant == ["0.weight", "0.bias"] and prior.scale_invariant_treatment == "decoupled"
    assert prior.treated("fixed") == ["0.bias", "1.weight", "1.bias"]  # 2.bias keeps GaussianPrior(fixed=...)
    assert prior.treated("decoupled") == ["0.weight"]
    assert prior.fixed_names() == ["2.bias", "0.bias", "1.weight", "1.bias"]
    prior.treat(no_decay_names(prior), "learn", BIAS_NORMALIZATION)
    assert prior.treated("decoupled") == ["0.weight", "0.bias"] and prior.fixed_names() == ["2.bias"]
    assert set(prior.treatments) == {SCALE_INVARIANT, BIAS_NORMALIZATION}


def test_treat_is_checked():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    prior = GaussianPrior(net)
    with pytest.raises(ValueError, match="`treatment` must be one of .*got 'decouple' \\(did you mean 'decoupled'\\?\\)"):
        prior.treat(["0.bias"], "decouple", BIAS_NORMALIZATION)
    with pytest.raises(ValueError, match="\\['nope'\\] are not parameters the prior covers"):
        prior.treat(["nope"], "fixed", BIAS_NORMALIZATION)
    with pytest.raises(ValueError, match="`reason` must be a non-empty string"):
        prior.treat(["0.bias"], "fixed", "")
    with pytest.raises(ValueError, match="bias/normalization tensors needs one precision per tensor, the prior is scalar"):
        GaussianPrior(net, structure="scalar").treat(["0.bias"], "decoupled", BIAS_NORMALIZATION)
    GaussianPrior(net, structure="scalar").treat(["0.bias"], "learn", BIAS_NORMALIZATION)  # nothing apart: allowed


def test_treatments_are_declarations_not_state():
    """The state dict (checkpoints) is unchanged by a treatment: a restored prior gets it declared again,
    as MargLikCallback re-derives the scale-invariant tensors when training starts, and then has
    the same MAP loss."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    prior = GaussianPrior(net, precision=0.5)
    before = set(prior.state_dict())
    prior.treat(no_decay_names(prior), "decoupled", BIAS_NORMALIZATION)
    with torch.no_grad():
        prior.log_precision.copy_(torch.tensor([0.1, 3.0, -0.2, 4.0]))
    assert set(prior.state_dict()) == before
    restored = GaussianPrior(net, precision=0.5)
    restored.load_state_dict(prior.state_dict())
    assert not torch.equal(restored.penalty(), prior.penalty())  # undeclared: the learned bias precisions act
    restored.treat(no_decay_names(restored), "decoupled", BIAS_NORMALIZATION)
    assert torch.equal(restored.penalty(), prior.penalty())


# --- 4. the settle rule -----------------------------------------------------------------------------


def test_loss_has_settled():
    history = [2.3, 1.2, 0.9, 0.80, 0.78, 0.775]
    assert not loss_has_settled(history[:2], window=2, rel_tol=0.05)  # not enough epochs yet
    assert not loss_has_settled(history[:4], window=2, rel_tol=0.05)  # 0.9 -> 0.80: 11 %
    assert not loss_has_settled(history[:5], window=2, rel_tol=0.05)  # 0.9 -> 0.78: 13 %
    assert loss_has_settled(history, window=2, rel_tol=0.05)  # 0.80 -> 0.775: 3.1 %
    assert not loss_has_settled(history, window=2, rel_tol=0.01)
    assert not loss_has_settled([1.0, float("nan"), 1.0], window=2, rel_tol=0.5)
    assert loss_has_settled([2.0, 1.0, 1.5, 1.04], window=2, rel_tol=0.05)  # only the ends of the window count
    # a plateau at the start is not settled training: flat, but not yet below its first epoch's loss
    assert not loss_has_settled([2.30, 2.30, 2.29], window=2, rel_tol=0.05)
    assert not loss_has_settled([2.3, 2.25, 2.21, 2.2], window=2, rel_tol=0.05)  # 2.2 > 0.95 * 2.3
    assert loss_has_settled([2.3, 2.2, 2.17, 2.18], window=2, rel_tol=0.05)  # 2.18 <= 2.185
    assert not loss_has_settled([float("nan"), 1.0, 1.0], window=2, rel_tol=0.05)
    # negative losses (a Gaussian likelihood with a small sigma): fallen means below the start, by |start|
    assert not loss_has_settled([-1.0, -1.0, -1.02], window=2, rel_tol=0.05)  # flat at a negative start
    assert loss_has_settled([-1.0, -2.0, -2.02, -2.05], window=2, rel_tol=0.05)
    for bad, match in ((0, "`window` must be an int >= 1"), (1.0, "`window`")):
        with pytest.raises(ValueError, match=match):
            loss_has_settled(history, window=bad, rel_tol=0.1)
    with pytest.raises(ValueError, match="`rel_tol` must be a finite number in \\(0, inf\\)"):
        loss_has_settled(history, window=1, rel_tol=0)


# --- through a real Trainer (the callback solves on the user's prior) ------------------------------


class ZeroBiasClassifier(Classifier):
    """The blob classifier with every bias started at zero: the output bias is the group that runs away."""

    def __init__(self, hyperprior=None, biases=None):
        torch.manual_seed(0)  # the same weights in every test
        super().__init__(60, width=8)
        with torch.no_grad():
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    layer.bias.zero_()
        self.prior = GaussianPrior(self.net, hyperprior=hyperprior)
        if biases is not None:  # declared at construction: a module restored from a checkpoint declares it again
            self.prior.treat(no_decay_names(self.prior), biases, BIAS_NORMALIZATION)


def blob_data() -> TensorDataset:
    x, y = blobs(60, 0).tensors
    return TensorDataset(x.double(), y)  # the tests' default dtype


def fit_blobs(model, epochs=8, **callback):
    """Algorithm 1 with every learned weight decay fed back (``guard=False``): the treatments are what is tested."""
    pl.seed_everything(0, verbose=False)
    marglik = MargLikCallback(output_layer="learn", frequency=1, settle=None, guard=False, **callback)
    fitted = lightning_trainer([marglik], epochs)
    fitted.fit(model, lightning_loader(blob_data(), 20))
    return marglik, fitted


def test_trainer_hyperprior_bounds_a_bias_that_starts_at_zero():
    # biases="learn", max_step=None: the learned precision fed back and every solve converged (the callback's
    # defaults decouple biases and bound each move, the other two remedies)
    plain, _ = fit_blobs(ZeroBiasClassifier(), biases="learn", max_step=None)
    assert plain.prior.log_precision[3] > 6 and plain.prior.group_sq_norms()[3] < 1e-3  # the feedback loop
    scale = 2.0
    marglik, _ = fit_blobs(ZeroBiasClassifier(LogNormalHyperprior(scale=scale)), biases="learn", max_step=None)
    prior = marglik.prior
    # the learned log precision of a group of P_g = 3 cannot exceed loc + s^2 P_g / 2 (its pull beats the evidence's)
    assert prior.log_precision[3] < min(scale**2 * 3 / 2, plain.prior.log_precision[3].item() - 3)
    assert prior.group_sq_norms()[3] > 10 * plain.prior.group_sq_norms()[3]
    # the logged evidence is the type-II MAP objective: the hyperprior's term is in it
    evidence = marglik.evidence
    assert evidence.log_hyperprior() < 0
    assert abs(marglik.last_marglik - evidence.log_marglik().item() / evidence.n_data) < 1e-9


def test_trainer_bias_treatment_declared_on_the_prior_survives_a_checkpoint(tmp_path):
    model = ZeroBiasClassifier(biases="decoupled")
    marglik, fitted = fit_blobs(model)
    prior = model.prior
    biases = [1, 3]
    assert (prior.log_precision[biases] != 0).all()  # the evidence learned the bias precisions ...
    assert torch.equal(prior.weight_decay_log_precision()[biases], torch.zeros(2))  # ... the MAP loss kept delta_0
    path = tmp_path / "blobs.ckpt"
    fitted.save_checkpoint(path)
    restored = ZeroBiasClassifier.load_from_checkpoint(path, biases="decoupled")
    assert torch.equal(restored.prior.log_precision, prior.log_precision)
    x, y = blob_data().tensors
    assert torch.equal(restored.prior.weight_decay_log_precision(), prior.weight_decay_log_precision())
    assert torch.equal(map_loss(restored(x), y, restored.likelihood, restored.prior),
                       map_loss(model(x), y, model.likelihood, model.prior))


class Recorder(pl.Callback):
    """The prior's log precisions after every epoch (after MargLikCallback's estimate: listed after it)."""

    def __init__(self):
        self.log_precisions = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.log_precisions.append(pl_module.prior.log_precision.detach().clone())


@pytest.mark.parametrize("solver", ["newton", "adam"])
def test_trainer_max_step_bounds_each_estimates_move(solver):
    moves = {}
    for max_step in (None, 0.3):
        pl.seed_everything(0, verbose=False)
        model, recorder = ZeroBiasClassifier(), Recorder()
        lightning_trainer([MargLikCallback(output_layer="learn", frequency=1, solver=solver, lr=0.5, max_step=max_step), recorder], 6).fit(
            model, lightning_loader(blob_data(), 20))
        path = torch.stack([torch.zeros(4)] + recorder.log_precisions)  # the prior starts at precision 1
        moves[max_step] = path.diff(dim=0).abs().max().item()
    assert moves[None] > 1.0  # unbounded, an estimate moves a precision by more than e
    assert 0.3 - 1e-9 < moves[0.3] <= 0.3 + 1e-12  # bounded: some estimate uses the whole radius, none more


def test_trainer_biases_decoupled_and_fixed():
    marglik, _ = fit_blobs(ZeroBiasClassifier(), biases="decoupled")
    prior = marglik.prior
    assert prior.treated("decoupled") == ["0.bias", "2.bias"] and (prior.log_precision != 0).all()
    assert torch.equal(prior.weight_decay_log_precision()[[1, 3]], torch.zeros(2))
    plain, _ = fit_blobs(ZeroBiasClassifier(), biases="learn")
    fixed, _ = fit_blobs(ZeroBiasClassifier(), biases="fixed")
    assert torch.equal(fixed.prior.log_precision[[1, 3]], torch.zeros(2)) and (fixed.prior.log_precision[[0, 2]] != 0).all()
    assert fixed.prior.group_sq_norms()[3] > 100 * plain.prior.group_sq_norms()[3]  # the output bias is not switched off
    # None leaves the prior's own declaration; a string overrides it
    declared, _ = fit_blobs(ZeroBiasClassifier(biases="fixed"))
    assert declared.prior.treated("fixed") == ["0.bias", "2.bias"]
    overridden, _ = fit_blobs(ZeroBiasClassifier(biases="fixed"), biases="learn")
    assert overridden.prior.treated("fixed") == [] and (overridden.prior.log_precision != 0).all()


def test_trainer_remedy_options_are_checked():
    with pytest.raises(ValueError, match="`biases` must be one of .*got 'decouple' \\(did you mean 'decoupled'\\?\\)"):
        MargLikCallback(biases="decouple")
    with pytest.raises(ValueError, match="`max_step` must be a finite number in \\(0, inf\\).*got 0"):
        MargLikCallback(max_step=0)
    model = ZeroBiasClassifier()
    model.prior = GaussianPrior(model.net, structure="scalar")
    with pytest.raises(MargLikConfigurationError, match="MargLikCallback\\(biases='fixed'\\): .*the prior is scalar"):
        fit_blobs(model, epochs=1, biases="fixed")


def test_trainer_biases_treatment_is_declared_again_on_resume(tmp_path):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    pl.seed_everything(0, verbose=False)
    first = lightning_trainer([MargLikCallback(output_layer="learn", settle=None, frequency=1, biases="decoupled", guard=False), checkpoint], 3)
    first.fit(ZeroBiasClassifier(), lightning_loader(blob_data(), 20))
    model, marglik = ZeroBiasClassifier(), MargLikCallback(output_layer="learn", settle=None, frequency=1, biases="decoupled", guard=False)
    lightning_trainer([marglik, pl.callbacks.ModelCheckpoint(dirpath=tmp_path)], 5).fit(
        model, lightning_loader(blob_data(), 20), ckpt_path=checkpoint.last_model_path)
    assert marglik.estimations == 5 and model.prior.treated("decoupled") == ["0.bias", "2.bias"]
    assert (model.prior.log_precision[[1, 3]] != 0).all()
    assert torch.equal(model.prior.weight_decay_log_precision()[[1, 3]], torch.zeros(2))


def test_the_callback_default_decouples_biases_and_normalization_unless_the_prior_says_otherwise():
    """``biases=None`` (the default): the no-decay tensors (``no_decay_names``) keep the initial precision
    as weight decay while the evidence learns theirs; a treatment the prior declares itself wins, and
    a scalar prior learns its one precision."""
    class Net(pl.LightningModule):
        def __init__(self, structure="layerwise", declare=None):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2))
            self.prior = GaussianPrior(self.net, structure=structure)
            if declare is not None:
                self.prior.treat(no_decay_names(self.prior), declare, BIAS_NORMALIZATION)
            self.likelihood = CategoricalLikelihood()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(40, 3, generator=g), torch.randint(0, 2, (40,), generator=g)), batch_size=10)

    def fit(**kwargs):
        model = Net(**kwargs)
        pl.Trainer(max_epochs=2, callbacks=[MargLikCallback(output_layer="learn", frequency=1, steps=10, guard=False)], logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False).fit(model, data)
        return model.prior

    prior = fit()
    names = no_decay_names(prior)
    assert names == ["0.bias", "1.weight", "1.bias", "3.bias"]
    held = torch.tensor([n in names for n in prior.param_names])
    assert torch.equal(prior.weight_decay_log_precision()[held], torch.zeros(int(held.sum())))
    assert (prior.log_precision[held] != 0).all()  # the evidence still learned them
    assert prior.scale_invariant == ["0.weight", "0.bias"]  # Linear -> LayerNorm: decoupled as scale-invariant already
    rest = ~held & torch.tensor([n not in prior.scale_invariant for n in prior.param_names])
    assert torch.equal(prior.weight_decay_log_precision()[rest], prior.log_precision[rest])  # 3.weight learned
    learned = fit(declare="learn")  # the prior's own declaration wins
    assert torch.equal(learned.weight_decay_log_precision()[2:], learned.log_precision[2:])  # past 0.*: scale-invariant
    scalar = fit(structure="scalar")
    assert BIAS_NORMALIZATION not in scalar.treatments
