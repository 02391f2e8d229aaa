"""Fixup scalars (``FixupBias``, ``FixupScale``) on the hook path, against the dense reference.

Float64, on a small Fixup residual block network (stem conv -> [FixupBias -> conv -> FixupBias ->
relu -> FixupBias -> conv -> FixupScale -> FixupBias] + shortcut of the first FixupBias's output ->
relu -> pool -> FixupBias -> Linear head), every scalar at a non-default value:

* the hook path takes every Fixup module (no module on the exact per-example path, no exact
  columns in any structure) under diag, kron and ekfac;
* log|H|, the log marglik and its gradients equal the general-graph dense reference
  (tests/reference.py: explicit Jacobians) under diag, kron (the scalars exact diagonal blocks
  beside the conv/linear Kronecker blocks) and full, for ggn and ef, Gaussian and categorical; the
  scalars' curvature diagonal equals the dense one entry by entry;
* the rules equal the exact path (the same network whose Fixup modules override ``forward``, which
  takes them off the hook path) and per-example autograd gradients, and hold to ``check_rule``'s contract;
* ``no_decay_names`` counts the 0-dim scalars as no-decay tensors.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_marglik import FixupBias, FixupScale, GaussianPrior, no_decay_names
from lightning_marglik.curvature import layers
from lightning_marglik.curvature.layers import hook_reason, layer_diagonal, layer_rule
from lightning_marglik.curvature.rule_checks import check_rule
from lightning_marglik.curvature.structures import DiagStructure
from tests.real_networks import N_OUT, batches
from tests.reference import graph_problem, reference_env, rel_err  # noqa: F401 (reference_env: autouse)
from tests.test_real_networks_reference import check_against_reference, check_same_evidence, fit, hyperparameters

N, BATCH = 20, 8  # 20 = 8 + 8 + 4: unequal batches
FIXUP = ("block_in", "bias1", "bias2a", "scale", "bias2b", "head_bias")


class FixupNet(nn.Module):
    """1x5x5 -> 3x5x5 -> one Fixup basic block -> 3x2x2 (avg pool) -> out."""

    def __init__(self, n_out: int, bias=FixupBias, scale=FixupScale) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 3, 3, padding=1)
        self.block_in, self.bias1, self.bias2a, self.bias2b, self.head_bias = (bias() for _ in range(5))
        self.scale = scale()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.head = nn.Linear(12, n_out)
        with torch.no_grad():  # non-default scalars, so that each one matters
            for module, value in zip([getattr(self, name) for name in FIXUP], [0.3, -0.2, 0.15, 0.7, -0.25, 0.1]):
                next(module.parameters()).fill_(value)

    def forward(self, x):
        x = self.block_in(torch.tanh(self.stem(x)))  # its output feeds the branch and the shortcut
        h = F.relu(self.bias1(self.conv1(x)))
        h = self.bias2b(self.scale(self.conv2(self.bias2a(h))))
        h = F.relu(h + x)
        return self.head(self.head_bias(F.avg_pool2d(h, 2).flatten(1)))


class ExactBias(FixupBias):
    """The same function; overriding ``forward`` takes it off the hook path (the exact path instead)."""

    def forward(self, x):
        return x + self.bias


class ExactScale(FixupScale):
    def forward(self, x):
        return x * self.weight


_CASES: dict = {}


def case(kind: str):
    """(model, x, y, GraphProblem), cached: the dense Jacobians do not depend on the structure."""
    if kind not in _CASES:
        torch.manual_seed(0)
        model = FixupNet(N_OUT[kind]).double().eval()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(N, 1, 5, 5, generator=gen)
        with torch.no_grad():
            f = model(x)
        if kind == "regression":
            y = f + 0.8 * torch.randn(f.shape, generator=gen)
        else:
            y = torch.randint(0, f.shape[-1], f.shape[:-1], generator=gen)
        _CASES[kind] = (model, x, y, graph_problem(model, x, y, kind))
    return _CASES[kind]


def exact_twin(model: FixupNet) -> FixupNet:
    twin = FixupNet(model.head.out_features, ExactBias, ExactScale).double().eval()
    twin.load_state_dict(model.state_dict())
    return twin


def fixup_params(prior) -> dict:
    """Prior index -> name of the Fixup scalars."""
    return {i: n for i, n in enumerate(prior.param_names) if n.split(".")[0] in FIXUP}


def scalar_diagonals(ev) -> dict:
    """Prior index -> curvature diagonal, from the diagonal structure holding the Fixup scalars."""
    [diag] = [s for s in ev.structures if isinstance(s, DiagStructure)]
    return diag.diagonal()


# --- the hook path ----------------------------------------------------------------------------


def test_fixup_modules_have_hook_rules_for_their_scalar():
    bias, scale = FixupBias(), FixupScale()
    assert hook_reason(bias, ["bias"]) is None and hook_reason(scale, ["weight"]) is None
    assert layer_rule(bias).roles == ("bias",) and layer_rule(scale).roles == ("weight",)
    assert not layer_rule(bias).kron and not layer_rule(scale).kron  # exact diagonal blocks under kron
    assert bias.bias.shape == scale.weight.shape == torch.Size([])
    assert float(bias.bias) == 0.0 and float(scale.weight) == 1.0
    assert "overrides the forward" in hook_reason(ExactBias(), ["bias"])


@pytest.mark.parametrize("structure", ["diag", "kron", "ekfac"])
def test_the_hook_path_takes_every_fixup_module(structure):
    model, x, y, _ = case("classification")
    prior, lik = hyperparameters(model, "classification")
    ev = fit(model, batches(x, y, BATCH), lik, prior, structure)
    assert ev.slow == {}
    [diag] = [s for s in ev.structures if isinstance(s, DiagStructure)]
    assert diag.exact == []  # no parameter's rows on the exact path
    if structure == "diag":  # every layer's exact diagonal
        assert {layer.name for layer in diag.layers} == set(FIXUP) | {"stem", "conv1", "conv2", "head"}
    else:  # the scalars exact diagonal blocks, the conv and linear layers Kronecker blocks
        assert {layer.name for layer in diag.layers} == set(FIXUP)
        assert set(diag.indices) == set(fixup_params(prior))
    # the exact-path twin does take them off the hook path, with the reason
    twin = exact_twin(model)
    twin_prior, twin_lik = hyperparameters(twin, "classification")
    with pytest.warns(UserWarning, match="exact per-example path"):
        slow = fit(twin, batches(x, y, BATCH), twin_lik, twin_prior, structure).slow
    assert set(slow) == set(FIXUP) and all("overrides the forward" in why for why in slow.values())


# --- against the dense reference ----------------------------------------------------------------


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_fixup_network_matches_reference(kind, structure, approx):
    model, x, y, problem = case(kind)
    prior, lik = hyperparameters(model, kind)
    assert prior.param_names == problem.names
    ev = fit(model, batches(x, y, BATCH), lik, prior, structure, approx)
    ref = problem.reference(structure, approx)
    check_against_reference(ev, ref, prior, lik)
    if structure == "full":
        return
    assert ev.slow == {}
    dense = torch.diagonal(ref.full)  # unit-scale C, one entry per scalar: the Fixup ones are 0-dim tensors
    offsets = torch.tensor([0] + problem.sizes).cumsum(0)
    for index, value in scalar_diagonals(ev).items():
        assert rel_err(value, dense[offsets[index]:offsets[index + 1]]) <= 1e-10, prior.param_names[index]
    if structure == "kron":  # the scalars are exact diagonal blocks of the reference too
        kinds = {block.name: block.kind for block in ref.blocks}
        assert all(kinds[name] == "diag" for name in fixup_params(prior).values())


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_hook_rules_equal_the_exact_path(structure, approx):
    model, x, y, _ = case("regression")
    twin = exact_twin(model)
    prior, lik = hyperparameters(model, "regression")
    twin_prior, twin_lik = hyperparameters(twin, "regression")
    ev = fit(model, batches(x, y, BATCH), lik, prior, structure, approx)
    with pytest.warns(UserWarning, match="exact per-example path"):
        exact = fit(twin, batches(x, y, BATCH), twin_lik, twin_prior, structure, approx)
    assert ev.slow == {} and set(exact.slow) == set(FIXUP)
    check_same_evidence(ev, exact)
    hooked, rows = scalar_diagonals(ev), scalar_diagonals(exact)
    for index in fixup_params(prior):
        assert rel_err(hooked[index], rows[index]) <= 1e-12


# --- the rules on their own -----------------------------------------------------------------------


@pytest.mark.parametrize("module", [FixupBias(), FixupScale()], ids=["bias", "scale"])
@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (4, 7), (4, 2, 3)])
def test_rule_equals_per_example_autograd_and_passes_check_rule(module, shape, monkeypatch):
    module = module.double()
    with torch.no_grad():
        next(module.parameters()).fill_(0.6)
    k = 3
    a, g = torch.randn(shape), torch.randn(k, *shape)
    [(role, param)] = module.named_parameters()
    expected = torch.zeros(())
    for j in range(k):
        for n in range(shape[0]):
            (grad,) = torch.autograd.grad((module(a[n : n + 1]) * g[j, n : n + 1]).sum(), param)
            expected = expected + grad**2
    diagonal = layer_diagonal(module, a, g)
    assert set(diagonal) == {role} and diagonal[role].shape == param.shape
    assert rel_err(diagonal[role], expected) <= 1e-12
    monkeypatch.setattr(layers, "_BUILT_IN", set())  # built-in rules are not re-checked: check this one
    check_rule("fixup", module, a, g)


def test_no_decay_names_counts_the_fixup_scalars():
    model, _, _, _ = case("classification")
    names = no_decay_names(GaussianPrior(model))
    assert set(fixup_params(GaussianPrior(model)).values()) <= set(names)
    assert "stem.weight" not in names and "conv1.weight" not in names
