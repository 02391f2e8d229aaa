"""Trust, third round (issue 25 items 2, 3, 5): the curvature layer on reparametrized weights,
subclasses that transform their weight in ``forward``, and user layer rules that break their contract.

Float64 against the dense brute-force reference (tests/reference.py) and against equivalent networks:

* after the old ``torch.nn.utils.weight_norm`` (``weight_g``, ``weight_v``) the layer takes the exact
  path and diag/kron/full equal the reference; an all-ones pruning mask (``torch.nn.utils.prune``,
  parameter ``weight_orig``) gives the un-pruned network's evidence under every structure (pruned
  layers against the reference: ``tests/test_trust_round4.py``);
* a subclass of a registered layer whose ``forward`` transforms the weight (a masked Linear, a
  weight-standardised Conv2d, timm's ``StdConv2d``) takes the exact path and equals the reference;
  a subclass that keeps its base's ``forward`` keeps the hook path;
* a registered rule whose diagonal is not shaped like the parameter, or keyed by a role the layer
  does not have, is refused on the first batch with an error naming the rule, the layer and the fix.
"""
from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
import torch.nn.utils.prune  # noqa: F401 (torch.nn.utils.prune is not imported by torch.nn)
from torch import nn
from torch.nn import functional as F

from lightning_marglik import KronShape, KronSums, LaplaceEvidence, LayerRule, register_layer_rule
from lightning_marglik.curvature.layers import _RULES, hook_reason
from tests.real_networks import batches
from tests.reference import graph_problem, reference_env, rel_err  # noqa: F401 (reference_env: autouse)
from tests.test_real_networks_reference import TOL, check_against_reference, fit, hyperparameters


def fit_quietly(model, data, lik, prior, structure, approx):
    """``fit`` without the exact-path and deprecation warnings these networks are expected to raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(model, data, lik, prior, structure, approx)


def reference(model, x, y, kind, structure, approx, exact=()):
    """The dense reference; the modules in ``exact`` get exact diagonal blocks under kron (as the plan gives them)."""
    problem = graph_problem(model, x, y, kind)
    if structure == "kron":
        problem._eligible = {n: m for n, m in problem.eligible.items() if n not in exact}
    return problem.reference(structure, approx)


# --- pruning and old-style reparametrizations ---------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def reparametrized(kind: str, model: Optional[nn.Sequential] = None) -> nn.Sequential:
    model = mlp() if model is None else model
    if kind == "prune_identity":
        torch.nn.utils.prune.identity(model[0], "weight")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old API is deprecated, and still used
            torch.nn.utils.weight_norm(model[0])
    return model


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


_X = torch.randn(20, 3, dtype=torch.float64, generator=_seeded(1))
DATA = {
    "regression": (_X, torch.randn(20, 2, dtype=torch.float64, generator=_seeded(2))),
    "classification": (_X, torch.randint(0, 2, (20,), generator=_seeded(2))),
}


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_old_style_weight_normed_layers_take_the_exact_path_and_equal_the_reference(structure, approx):
    model = reparametrized("weight_norm")
    x, y = DATA["regression"]
    prior, lik = hyperparameters(model, "regression")
    assert any(name.startswith("0.weight_") for name in prior.param_names)
    ev = fit_quietly(model, batches(x, y, 8), lik, prior, structure, approx)
    if structure != "full":
        assert set(ev.slow) == {"0"} and "weight_" in ev.slow["0"], ev.slow
    check_against_reference(ev, reference(model, x, y, "regression", structure, approx, exact={"0"}), prior, lik)


@pytest.mark.parametrize("structure", ["kron", "ekfac"])
def test_a_reparametrized_layer_never_gets_zero_curvature(structure):
    """The issue's symptom: kron/ekfac gave ``weight_orig`` zero curvature (only its prior) without a word.
    A network of one old-style weight-normed layer has exact diagonal blocks only, under kron and ekfac alike
    (a pruned one keeps its Kronecker factors: tests/test_trust_round4.py)."""
    torch.manual_seed(0)
    model = reparametrized("weight_norm", nn.Sequential(nn.Linear(3, 2)).double())
    x, y = DATA["classification"]
    prior, lik = hyperparameters(model, "classification")
    ev = fit_quietly(model, batches(x, y, 8), lik, prior, structure, "ggn")
    check_against_reference(ev, reference(model, x, y, "classification", "kron", "ggn", exact={"0"}), prior, lik)


def _matched_prior(model, reference_prior, lik):
    """A prior on ``model`` with ``reference_prior``'s precision per tensor, matched by name (``_orig`` dropped)."""
    prior, _ = hyperparameters(model, "regression")
    values = dict(zip(reference_prior.param_names, reference_prior.log_precision))
    with torch.no_grad():
        for i, name in enumerate(prior.param_names):
            prior.log_precision[i] = values[name.replace("_orig", "")]
    return prior


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "ekfac", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_an_all_ones_pruning_mask_gives_the_unpruned_evidence(kind, structure, approx):
    x, y = DATA[kind]
    plain = mlp()
    prior, lik = hyperparameters(plain, kind)
    pruned = reparametrized("prune_identity")
    pruned_prior = _matched_prior(pruned, prior, lik)
    assert pruned_prior.param_names != prior.param_names  # the order differs: the match is by name
    ev = fit_quietly(pruned, batches(x, y, 8), lik, pruned_prior, structure, approx)
    want = fit_quietly(plain, batches(x, y, 8), lik, prior, structure, approx)
    assert rel_err(ev.log_det(), want.log_det()) <= TOL and rel_err(ev.log_marglik(), want.log_marglik()) <= TOL
    got, expected = ev.gradient(), want.gradient()
    order = [prior.param_names.index(name.replace("_orig", "")) for name in pruned_prior.param_names]
    got["log_precision"] = got["log_precision"][torch.argsort(torch.tensor(order))]  # back to the plain prior's order
    assert set(got) == set(expected)
    for name in expected:
        assert rel_err(got[name], expected[name]) <= TOL, name


# --- subclasses that transform their weight in forward ------------------------------------------


class MaskedLinear(nn.Linear):
    """A Linear whose forward multiplies the weight by a fixed mask: it inherits Linear's rule, not its function."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("mask", (torch.arange(n_in * n_out).reshape(n_out, n_in) % 3 != 0).to(self.weight.dtype))

    def forward(self, x):
        return F.linear(x, self.weight * self.mask, self.bias)


class StandardizedConv2d(nn.Conv2d):
    """Weight standardisation in forward (as timm's StdConv2d): each output channel's weight has mean 0, variance 1."""

    def forward(self, x):
        w = self.weight
        flat = w.reshape(w.shape[0], -1)
        std = (flat.var(1, unbiased=False, keepdim=True) + 1e-5).sqrt()
        w = ((flat - flat.mean(1, keepdim=True)) / std).reshape(w.shape)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PlainLinear(nn.Linear):
    """A subclass that keeps Linear's forward: the hook rule applies."""


def masked_mlp(first: type = MaskedLinear) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(first(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def std_cnn(conv: type = StandardizedConv2d) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(conv(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()


def _conv_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1, 6, 6, dtype=torch.float64, generator=g)
    return x, torch.randn(16, 2, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("net", ["masked_linear", "standardized_conv"])
def test_a_subclass_that_transforms_its_weight_takes_the_exact_path_and_equals_the_reference(net, structure, approx):
    model, (x, y) = (masked_mlp(), DATA["regression"]) if net == "masked_linear" else (std_cnn(), _conv_data())
    assert "forward" in hook_reason(model[0])
    prior, lik = hyperparameters(model, "regression")
    ev = fit_quietly(model, batches(x, y, 8), lik, prior, structure, approx)
    assert set(ev.slow) == {"0"} and "forward" in ev.slow["0"], ev.slow
    check_against_reference(ev, reference(model, x, y, "regression", structure, approx, exact={"0"}), prior, lik)


def test_timm_std_conv2d_takes_the_exact_path_and_equals_the_reference():
    timm_layers = pytest.importorskip("timm.layers", reason="timm is not installed")
    model, (x, y) = std_cnn(lambda i, o, k: timm_layers.StdConv2d(i, o, k, padding=0).double()), _conv_data()
    prior, lik = hyperparameters(model, "regression")
    ev = fit_quietly(model, batches(x, y, 8), lik, prior, "diag", "ef")
    assert set(ev.slow) == {"0"}, ev.slow
    check_against_reference(ev, reference(model, x, y, "regression", "diag", "ef"), prior, lik)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_subclass_that_keeps_its_base_forward_keeps_the_hook_path(structure):
    model, (x, y) = masked_mlp(PlainLinear), DATA["regression"]
    assert hook_reason(model[0]) is None
    prior, lik = hyperparameters(model, "regression")
    ev = fit_quietly(model, batches(x, y, 8), lik, prior, structure, "ggn")
    assert ev.slow == {}
    check_against_reference(ev, reference(model, x, y, "regression", structure, "ggn"), prior, lik)


def test_an_explicit_registration_puts_a_subclass_back_on_the_hook_path():
    """Registering the subclass itself is the user's word that the rule fits its forward."""

    class ScaledLinear(nn.Linear):  # forward is Linear's function: the Linear rule is right for it
        def forward(self, x):
            return super().forward(x)

    assert "forward" in hook_reason(ScaledLinear(2, 3))
    register_layer_rule(ScaledLinear, _RULES[nn.Linear])
    try:
        assert hook_reason(ScaledLinear(2, 3)) is None
    finally:
        _RULES.pop(ScaledLinear)


# --- register_layer_rule: the rule's contract, checked on the first batch -----------------------


class Scale(nn.Module):
    """``y = w * x + b`` elementwise on inputs ``(B, 2, 3)``, ``w`` and ``b`` of shape ``(2, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, 6).reshape(2, 3))
        self.bias = nn.Parameter(torch.zeros(2, 3))

    def forward(self, x):
        return self.weight * x + self.bias


def _scale_diagonal(a, g):
    return (g * a).pow(2).sum((0, 1)), g.pow(2).sum((0, 1))


class GoodRule(LayerRule):
    def diagonal(self, module, a, g):
        weight, bias = _scale_diagonal(a, g)
        return {"weight": weight, "bias": bias}


class TransposedRule(LayerRule):
    def diagonal(self, module, a, g):
        weight, bias = _scale_diagonal(a, g)
        return {"weight": weight.T, "bias": bias}


class MisnamedRule(LayerRule):
    def diagonal(self, module, a, g):
        weight, bias = _scale_diagonal(a, g)
        return {"weights": weight, "bias": bias}


class BadKronShapeRule(GoodRule):
    kron = True

    def kron_shape(self, module):
        return KronShape(out=3, inp=3)


class BadKronSumsRule(GoodRule):
    kron = True

    def kron_shape(self, module):  # every scalar its own output: G is 6 x 6, A is 1 x 1
        return KronShape(out=6, inp=1)

    def kron_sums(self, module, a, g):  # the input factor without its group dimension
        g_rows = g.reshape(-1, 6)
        return KronSums(g_rows.T @ g_rows, a.new_ones(1, 1), torch.tensor(a.shape[0]))


def scale_net() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(2, 6), nn.Unflatten(1, (2, 3)), Scale(), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_rule_that_keeps_its_contract_equals_the_reference(structure):
    model, (x, y) = scale_net(), DATA["regression"]
    x = x[:, :2]
    register_layer_rule(Scale, GoodRule())
    try:
        prior, lik = hyperparameters(model, "regression")
        ev = fit_quietly(model, batches(x, y, 8), lik, prior, structure, "ggn")
        assert ev.slow == {}
        check_against_reference(ev, reference(model, x, y, "regression", structure, "ggn"), prior, lik)
    finally:
        _RULES.pop(Scale)


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize(
    "rule, match",
    [
        (TransposedRule(), r"TransposedRule.*'2'.*'weight'.*\(3, 2\).*\(2, 3\).*shaped like"),
        (MisnamedRule(), r"MisnamedRule.*'2'.*'weights'.*weight.*bias"),
        (BadKronShapeRule(), r"BadKronShapeRule.*'2'.*kron_shape.*3 x 3.*6"),
        (BadKronSumsRule(), r"BadKronSumsRule.*'2'.*kron_sums.*\(1, 1\).*\(1, 1, 1\)"),
    ],
)
def test_a_rule_that_breaks_its_contract_is_refused_naming_the_rule_the_layer_and_the_fix(rule, match, structure):
    if rule.kron and structure == "diag":
        pytest.skip("the Kronecker layout is read only by kron")
    model, (x, y) = scale_net(), DATA["regression"]
    register_layer_rule(Scale, rule)
    try:
        prior, lik = hyperparameters(model, "regression")
        with pytest.raises(ValueError, match=match):
            fit_quietly(model, batches(x[:, :2], y, 8), lik, prior, structure, "ggn")
    finally:
        _RULES.pop(Scale)


# --- the BackPACK backend maps exact layer types and the weight/bias roles ------------------------


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("net, match", [("pruned", r"'0\.weight_orig' is not a layer's weight or bias"),
                                         ("masked", r"'0' \(MaskedLinear\) is not one of")])
def test_backpack_refuses_reparametrized_layers_and_subclasses_naming_the_parameter(net, match, structure):
    pytest.importorskip("backpack", reason="BackPACK is not installed")
    model = reparametrized("prune_identity") if net == "pruned" else masked_mlp()
    x, y = DATA["regression"]
    prior, lik = hyperparameters(model, "regression")
    with pytest.raises(ValueError, match=rf"backend='backpack' cannot take this model: .*{match}.*backend='hooks'"):
        LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, structure=structure, backend="backpack")


# --- issue 26 item 5: the exact path takes one normalized batch ----------------------------------


@pytest.mark.parametrize("branch", [False, True])
def test_the_exact_path_reads_one_normalized_batch_and_never_returns_to_the_batch_adapter(branch):
    """Calls from curvature/functional.py into curvature/batches.py during one batch's exact rows: one
    (the normalization), whether vmap runs (``branch=False``) or the per-example loop (``branch=True``)."""
    import sys

    from lightning_marglik.curvature import batches as batches_module, functional
    from lightning_marglik.curvature.functional import ExactPath
    from tests.test_vmap_fallback import Tokens, token_batches

    torch.manual_seed(0)
    model = Tokens(branch=branch)
    inputs, _, _ = token_batches(n=6)
    factor = torch.randn(6, 3, 2)
    names = ["scale.weight", "head.weight"]
    path = ExactPath(model, names, [dict(model.named_parameters())[n] for n in names])
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == batches_module.__file__:
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename == functional.__file__:
                calls.append(frame.f_code.co_name)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.setprofile(profile)
        try:
            rows = path.rows(inputs, factor)
        finally:
            sys.setprofile(None)
    assert rows.shape == (6 * 2, 4 + 3 * 4)
    assert (path.refusal is not None) == branch  # the loop ran where vmap refuses the forward
    assert calls == ["model_batch"], calls
