"""Layer rules: the registry, HF ``Conv1D``, position indices shared by the batch, and rows without
a loss term (padding) kept out of the Kronecker input factor.

Float64 against the dense reference (tests/reference.py) and against equivalent problems:

* a user's own layer registered with ``register_layer_rule`` takes the hook path and equals the
  reference's exact diagonal; a subclass that keeps its base's forward takes its base's rule;
* HF ``Conv1D`` (weight ``(in, out)``) gives the same evidence as the equivalent ``nn.Linear``;
* tiny HF GPT-2 and BERT (built from configs, attention masks and padding, ignored positions):
  every Linear/Conv1D/Embedding/LayerNorm takes the hook path (position embeddings included) and
  diag/kron equal the reference;
* padding content (zeros, unit noise, noise x10 at ignored positions) leaves the evidence
  unchanged under diag, kron and full; a position-wise network on ``(B, T, C)`` equals the
  flattened problem on its kept positions under kron.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_marglik import CategoricalLikelihood, LayerRule, register_layer_rule
from lightning_marglik.curvature.layers import _RULES, KronShape, hook_reason, layer_rule
from lightning_marglik.curvature.rows import contributing_rows
from tests.real_networks import batches
from tests.reference import graph_problem, hyper, reference_env, rel_err  # noqa: F401 (reference_env: autouse)
from tests.test_real_networks_reference import check_against_reference, check_same_evidence, fit, hyperparameters

IGNORE = -100


# --- the registry ------------------------------------------------------------------------------


class Scale(nn.Module):
    """``y = w * x`` elementwise over the last dimension: a layer the library has no rule for."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return self.weight * x


class ScaleRule(LayerRule):
    def diagonal(self, module, a, g):
        k, b = g.shape[:2]
        return {"weight": (g * a).reshape(k, b, -1, a.shape[-1]).sum(2).pow(2).sum((0, 1))}


class ScaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.scale = Scale(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(self.fc(x))))


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_registered_user_layer_takes_the_hook_path_and_equals_the_reference(structure):
    model = ScaleNet().double()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    assert "no hook rule" in hook_reason(model.scale) and "register_layer_rule" in hook_reason(model.scale)
    prior, lik = hyperparameters(model, "regression")
    ref = graph_problem(model, x, y, "regression").reference(structure, "ggn")
    before = fit(model, batches(x, y, 8), lik, prior, structure)
    assert "scale" in before.slow
    register_layer_rule(Scale, ScaleRule())
    try:
        ev = fit(model, batches(x, y, 8), lik, prior, structure)
        assert ev.slow == {}
        check_against_reference(ev, ref, prior, lik)
        check_same_evidence(ev, before)  # the exact path and the rule agree
    finally:
        _RULES.pop(Scale)


def test_subclasses_take_their_base_rule_and_bad_registrations_are_refused():
    class MyLinear(nn.Linear):
        pass

    assert layer_rule(MyLinear(2, 3)) is layer_rule(nn.Linear(2, 3))
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_layer_rule(object, ScaleRule())
    with pytest.raises(TypeError, match="LayerRule instance"):
        register_layer_rule(Scale, ScaleRule)


class DiagonalOnlyKronRule(ScaleRule):
    """``kron = True`` without ``kron_shape`` or ``kron_sums``: only ``structure="diag"`` can take it."""

    kron = True


class KronShapeOnlyRule(DiagonalOnlyKronRule):
    """A layout that fits the weight (4 outputs, one input each), but no ``kron_sums``."""

    def kron_shape(self, module):
        return KronShape(out=4, inp=1)


@pytest.mark.parametrize("structure", ["diag", "kron", "ekfac"])
@pytest.mark.parametrize("rule, missing", [(DiagonalOnlyKronRule(), r"kron_shape\(\) or kron_sums\(\)"),
                                           (KronShapeOnlyRule(), r"kron_sums\(\)")], ids=["no_methods", "no_sums"])
def test_a_kron_rule_without_its_kronecker_methods_is_refused_only_where_they_are_called(structure, rule, missing):
    """``structure="diag"`` calls only ``diagonal()``: the rule's Kronecker half was checked all the same, with an
    empty NotImplementedError; ``kron`` and ``ekfac`` failed with the same, deep in building a structure."""
    model = ScaleNet().double()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    prior, lik = hyperparameters(model, "regression")
    register_layer_rule(Scale, rule)
    try:
        if structure != "diag":
            name = type(rule).__name__
            match = (rf"^Layer rule {name} for module 'scale' \(Scale\): kron = True, but the rule does not "
                     rf"implement {missing},.*set kron = False")
            if structure == "ekfac" and "kron_shape" not in missing:  # its layout read: ekfac names its rows first
                match = rf"^structure='ekfac': the layer rule of 'scale' \({name}\).*input_rows/grad_rows"
            with pytest.raises(ValueError, match=match):
                fit(model, batches(x, y, 8), lik, prior, structure)
            return
        ev = fit(model, batches(x, y, 8), lik, prior, structure)
        assert ev.slow == {}
        check_against_reference(ev, graph_problem(model, x, y, "regression").reference("diag", "ggn"), prior, lik)
    finally:
        _RULES.pop(Scale)


class NegativeRule(ScaleRule):
    """The squares summed with a minus sign: an indefinite ``H``, a NaN or a plausible wrong evidence."""

    def diagonal(self, module, a, g):
        return {"weight": -super().diagonal(module, a, g)["weight"]}


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_rule_whose_diagonal_is_negative_is_refused_naming_the_rule_and_the_fix(structure):
    model = ScaleNet().double()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    prior, lik = hyperparameters(model, "regression")
    register_layer_rule(Scale, NegativeRule())
    try:
        with pytest.raises(ValueError, match=r"^Layer rule NegativeRule for module 'scale' \(Scale\): diagonal\(\) "
                                             r"returned 'weight' with negative entries \(min -.*square each "
                                             r"per-example gradient, then sum\.$"):
            fit(model, batches(x, y, 8), lik, prior, structure)
    finally:
        _RULES.pop(Scale)


# --- HF Conv1D ----------------------------------------------------------------------------------


def _conv1d_and_linear():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    conv = nn.Sequential(Conv1D(5, 3), nn.Tanh(), Conv1D(2, 5)).double()
    with torch.no_grad():
        for c, lin in zip(conv[::2], linear[::2]):
            c.weight.copy_(lin.weight.T)
            c.bias.copy_(lin.bias)
    return conv, linear


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("sequence", [False, True])
def test_hf_conv1d_equals_the_equivalent_linear(structure, sequence):
    pytest.importorskip("transformers")
    conv, linear = _conv1d_and_linear()
    x = torch.randn((16, 4, 3) if sequence else (16, 3))
    y = torch.randn((16, 4, 2) if sequence else (16, 2))
    evs = []
    for model in (conv, linear):
        prior, lik = hyperparameters(model, "regression")
        evs.append(fit(model, batches(x, y, 6), lik, prior, structure))
    assert evs[0].slow == {}  # Conv1D takes the hook path, with Kronecker blocks under kron
    check_same_evidence(*evs)
    prior, lik = hyperparameters(conv, "regression")
    check_against_reference(evs[0], graph_problem(conv, x, y, "regression").reference(structure, "ggn"), prior, lik)


# --- tiny Hugging Face models -------------------------------------------------------------------


class HFTokens(nn.Module):
    """A HF token-classification model returning its logits ``(B, T, C)``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, attention_mask):
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


def tiny_gpt2(n_layer: int) -> nn.Module:
    from transformers import GPT2Config, GPT2ForTokenClassification

    config = GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=n_layer, n_head=2, num_labels=3,
                        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return HFTokens(GPT2ForTokenClassification(config))


def tiny_bert(n_layer: int) -> nn.Module:
    from transformers import BertConfig, BertForTokenClassification

    config = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=n_layer, num_attention_heads=2,
                        intermediate_size=12, max_position_embeddings=8, num_labels=3, pad_token_id=0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return HFTokens(BertForTokenClassification(config))


def token_batch(n: int = 10, t: int = 6, seed: int = 1):
    """Padded ids with an attention mask; labels ignored at padding and at ~20% of the rest."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 20, (n, t), generator=gen) * mask
    y = torch.randint(0, 3, (n, t), generator=gen)
    y = torch.where((mask == 0) | (torch.rand(n, t, generator=gen) < 0.2), torch.full_like(y, IGNORE), y)
    return {"input_ids": ids, "attention_mask": mask}, y


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("build,n_layer", [(tiny_gpt2, 1), (tiny_gpt2, 2), (tiny_bert, 1)])
def test_tiny_hf_models_take_the_hook_path_and_equal_the_reference(build, n_layer, structure):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build(n_layer).double().eval()
    inputs, y = token_batch()
    prior, lik = hyperparameters(model, "classification", sequence=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*exact per-example path.*")
        ev = fit(model, batches(inputs, y, 4), lik, prior, structure)  # 10 = 4 + 4 + 2
    assert ev.slow == {}, ev.slow  # position embeddings and Conv1D included: no torch.func
    hooked = {type(m).__name__ for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    assert hooked <= {"Linear", "Conv1D", "Embedding", "LayerNorm"}, hooked
    problem = graph_problem(model, inputs, y, "classification")
    check_against_reference(ev, problem.reference(structure, "ggn"), prior, lik)


def test_positions_shared_by_the_batch_equal_explicit_per_example_positions():
    """An Embedding of ``arange(T)[None]`` (1, T) broadcast onto (B, T, D) equals the same network
    with positions expanded to (B, T) by hand, under kron; a first batch of one example too."""

    class Positional(nn.Module):
        def __init__(self, shared: bool) -> None:
            super().__init__()
            self.shared = shared
            self.tokens, self.positions, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 3)

        def forward(self, ids):
            steps = torch.arange(ids.shape[1])[None]
            positions = self.positions(steps if self.shared else steps.expand_as(ids))
            return self.head(torch.tanh(self.tokens(ids) + positions).mean(1))

    torch.manual_seed(0)
    shared, explicit = Positional(True).double(), Positional(False).double()
    explicit.load_state_dict(shared.state_dict())
    ids, y = torch.randint(0, 7, (13, 5)), torch.randint(0, 3, (13,))
    for sizes in ([6, 6, 1], [1, 6, 6]):
        data = [(ids[lo:lo + s], y[lo:lo + s]) for lo, s in zip([0, sizes[0], sizes[0] + sizes[1]], sizes)]
        evs = []
        for model in (shared, explicit):
            prior, lik = hyperparameters(model, "classification")
            evs.append(fit(model, data, lik, prior, "kron"))
        assert evs[0].slow == {}
        check_same_evidence(*evs)


# --- rows without a loss term -------------------------------------------------------------------


class PositionWise(nn.Module):
    """An MLP applied to every position of ``(B, T, C_in)`` alike."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))

    def forward(self, x):
        return self.net(x)


def _sequence_data(n: int = 12, t: int = 4, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, 3, generator=gen)
    y = torch.randint(0, 4, (n, t), generator=gen)
    ignored = torch.rand(n, t, generator=gen) < 0.25
    return x, torch.where(ignored, torch.full_like(y, IGNORE), y), ignored


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_padding_content_does_not_change_the_evidence(structure):
    torch.manual_seed(0)
    model = PositionWise().double()
    x, y, ignored = _sequence_data()
    values = []
    for scale in (0.0, 1.0, 10.0):
        noise = scale * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        padded = torch.where(ignored[..., None], noise, x)
        prior, lik = hyperparameters(model, "classification", sequence=True)
        values.append(fit(model, batches(padded, y, 5), lik, prior, structure))
    for other in values[1:]:
        check_same_evidence(values[0], other)
    if structure == "kron":  # and the reference (A over kept rows) agrees
        prior, lik = hyperparameters(model, "classification", sequence=True)
        check_against_reference(values[0], graph_problem(model, x, y, "classification").reference("kron", "ggn"), prior, lik)


@pytest.mark.parametrize("approx", ["ggn", "ef"])
def test_position_wise_network_equals_the_flattened_problem_on_kept_positions(approx):
    torch.manual_seed(0)
    model = PositionWise().double()
    x, y, ignored = _sequence_data()
    kept = ~ignored
    prior, lik = hyperparameters(model, "classification", sequence=True)
    sequence = fit(model, batches(x, y, 5), lik, prior, "kron", approx)
    flat_prior, _ = hyperparameters(model, "classification")
    flat_lik = CategoricalLikelihood(temperature=0.8, learn_temperature=True)
    flat = fit(model, batches(x[kept], y[kept], 7), flat_lik, flat_prior, "kron", approx)
    assert sequence.n_data == flat.n_data == int(kept.sum())
    check_same_evidence(sequence, flat)


def test_a_shared_input_whose_expansion_changes_the_output_stays_on_the_exact_path():
    """Class embeddings looked up as one (1, C) table and used as a matrix: one copy per example
    would change the output's shape, so the check refuses the expansion and the exact path is right."""

    class ClassTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.classes = nn.Linear(3, 4), nn.Embedding(5, 4)

        def forward(self, x):
            table = self.classes(torch.arange(5)[None]).reshape(-1, 4)  # (C, D) only if not expanded
            return torch.tanh(self.fc(x)) @ table.T

    torch.manual_seed(0)
    model = ClassTable().double()
    x, y = torch.randn(12, 3), torch.randint(0, 5, (12,))
    prior, lik = hyperparameters(model, "classification")
    ev = fit(model, batches(x, y, 5), lik, prior, "diag")
    assert "does not lead with the batch dimension" in ev.slow["classes"]
    check_against_reference(ev, graph_problem(model, x, y, "classification").reference("diag", "ggn"), prior, lik)


def test_a_layout_that_only_looks_batch_first_on_the_first_batch_takes_the_exact_path():
    """Sequence-first Linear calls (T, B, C): with B == T on the first batch the rows look like
    examples; a forward of two examples shows they are not. The exact path, as for any other
    batching (before, only a later batch of another size showed it, refused; batches all of size T
    were silently wrong)."""

    class SequenceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # x (B, T, 3)
            return self.fc(x.transpose(0, 1)).mean(0)  # (B, 2)

    torch.manual_seed(0)
    model = SequenceFirst().double()
    x, y = torch.randn(7, 4, 3), torch.randn(7, 2)
    prior, lik = hyperparameters(model, "regression")
    as_long = fit(model, batches(x, y, 4), lik, prior, "kron")  # batches of 4 (= T) and 3
    other = fit(model, batches(x, y, 3), lik, prior, "kron")
    assert "fc" in as_long.slow
    check_same_evidence(as_long, other)


# --- in-place operations after a hooked layer ---------------------------------------------------


class InPlaceNet(nn.Module):
    """timm/torchvision style: ``ReLU(inplace=True)`` on hooked outputs and ``+=`` of a shortcut onto a
    BatchNorm output; ``inplace=False`` is the same function written out of place."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc = nn.Linear(3, 4)
        self.act = nn.ReLU(inplace=inplace)
        self.inner = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.act(self.fc(x))
        out = self.bn(self.inner(h))
        if self.inplace:
            out += h
        else:
            out = out + h
        return self.head(self.act(out))


def _in_place_twins():
    torch.manual_seed(0)
    plain = InPlaceNet(inplace=False).double()
    plain.bn.running_mean.normal_()
    plain.bn.running_var.uniform_(0.5, 2.0)
    twin = InPlaceNet(inplace=True).double()
    twin.load_state_dict(plain.state_dict())
    return plain.eval(), twin.eval()


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_in_place_operations_after_hooked_layers_change_nothing(structure):
    plain, twin = _in_place_twins()
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    prior, lik = hyperparameters(twin, "classification")
    ev = fit(twin, batches(x, y, 8), lik, prior, structure)
    assert ev.slow == {}  # every layer stays on the hook path
    if structure == "diag":  # the reference's kron eligibility runs under torch.func, which refuses in-place ops
        check_against_reference(ev, graph_problem(twin, x, y, "classification").reference(structure, "ggn"), prior, lik)
    plain_prior, plain_lik = hyperparameters(plain, "classification")
    check_same_evidence(ev, fit(plain, batches(x, y, 8), plain_lik, plain_prior, structure))


def test_contributing_rows_are_the_rows_with_a_non_zero_gradient_in_some_column_and_feature():
    g = torch.zeros(3, 4, 5, 6)  # (factor columns K, examples B, rows R, features)
    g[2, 0, 1, 5] = 1e-40  # a denormal in the last column and feature still counts
    g[0, 3, 4, 0] = -2.0
    g[1, 2, 2, 3] = -0.0  # a negative zero does not
    g[:, 1, 3] = float("nan")  # nor is a NaN row left out (the evidence then refuses it, naming it)
    expected = torch.zeros(4, 5, dtype=torch.bool)
    expected[0, 1] = expected[3, 4] = expected[1, 3] = True
    assert torch.equal(contributing_rows(g), expected)
    conv_rows = torch.randn(3, 4, 6, 5).transpose(2, 3)  # a conv layer's rows are a transposed view
    conv_rows[:, 2, 1] = 0.0
    assert torch.equal(contributing_rows(conv_rows), torch.ones(4, 5, dtype=torch.bool).index_put_(
        (torch.tensor([2]), torch.tensor([1])), torch.tensor(False)))
