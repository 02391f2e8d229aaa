"""Scale-invariant tensors found from the graph, checked against the function itself, and their treatment.

The structural analysis (``find_scale_invariant``) is compared with brute force: scale a layer's
trainable parameters by a factor and see whether the training-mode output changes (float64, norm
``eps`` set to ~0 so that invariance is exact).
"""
from __future__ import annotations

import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss
from lightning_marglik.curvature.scale_invariance import LINEAR_LAYERS, NORMS, find_scale_invariant, training_modes
from tests.lightning_models import trainer
from tests.real_networks import NETWORKS, make_case
from tests.reference import call


def found_params(model, inputs):
    return {p for layer in find_scale_invariant(model, inputs) for p in layer.params}


def numerically_invariant(model: nn.Module, inputs, factor: float = 2.5) -> set:
    """Parameter names of every linear layer whose joint scaling leaves the training-mode output unchanged."""
    for module in model.modules():
        if isinstance(module, NORMS):
            module.eps = 1e-30
    model.train()
    with torch.no_grad():
        reference = call(model, inputs)
        invariant = set()
        for name, module in model.named_modules():
            own = [(role, p) for role, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not isinstance(module, LINEAR_LAYERS) or not own:
                continue
            for _, p in own:
                p.mul_(factor)
            if torch.allclose(call(model, inputs), reference, rtol=1e-9, atol=1e-11):
                invariant |= {f"{name}.{role}" for role, _ in own}
            for _, p in own:
                p.div_(factor)
    return invariant


# --- networks ---------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out
                         else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.shortcut(x))


def resnet() -> nn.Module:
    """The ranking study's ResNet family: stem conv-BN-ReLU, basic blocks, global pool, Linear head."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), BasicBlock(4, 4, 1),
                         BasicBlock(4, 8, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


class Attention(nn.Module):
    def __init__(self, d: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.q_norm, self.k_norm = (nn.LayerNorm(d), nn.LayerNorm(d)) if qk_norm else (nn.Identity(), nn.Identity())

    def forward(self, h):
        q, k = self.q_norm(self.q(h)), self.k_norm(self.k(h))
        return self.out((q @ k.transpose(1, 2) / math.sqrt(h.shape[-1])).softmax(-1) @ self.v(h))


class TransformerBlock(nn.Module):
    """Pre-LN ``x + attn(LN(x)); x + MLP(LN(x))`` or post-LN ``LN(x + attn(x)); LN(x + MLP(x))``."""

    def __init__(self, d: int = 6, pre: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        self.pre, self.attn, self.ln1, self.ln2 = pre, Attention(d, qk_norm), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def mlp(self, h):
        return self.ff2(F.gelu(self.ff1(h)))

    def forward(self, x):
        if self.pre:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Transformer(nn.Module):
    def __init__(self, pre: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.block = TransformerBlock(6, pre, qk_norm)
        self.ln, self.head = nn.LayerNorm(6), nn.Linear(6, 2)

    def forward(self, ids):
        return self.head(self.ln(self.block(self.embed(ids))).mean(1))


class Chain(nn.Module):
    """``layer -> between -> norm -> tanh -> head`` on (B, 3, 5, 5) images."""

    def __init__(self, between, norm=None, bias: bool = True) -> None:
        super().__init__()
        self.conv, self.between = nn.Conv2d(3, 8, 3, padding=1, bias=bias), between
        self.norm = norm if norm is not None else nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.between(self.conv(x), x))).mean((2, 3)))


class FrozenBatchNorm(nn.BatchNorm2d):
    """A BatchNorm kept in eval mode (running statistics) whatever ``train()`` says, as detection code does."""

    def train(self, mode: bool = True):
        return super().train(False)


@pytest.fixture
def images():
    return torch.randn(6, 3, 5, 5)


@pytest.fixture
def tokens():
    return torch.randint(0, 9, (5, 7))


# --- the analysis against brute force --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_found_exactly_where_scaling_leaves_the_training_function_unchanged(name):
    """On every network of the reference zoo (BatchNorm, LayerNorm, GroupNorm through a transpose, LoRA,
    frozen and shared weights), the structural answer equals the numerical one."""
    model, inputs, _ = make_case(name, "classification", n=12)
    found = found_params(model, inputs)
    assert found == numerically_invariant(model, inputs)
    expected = {"cnn_bn_res": 4, "mlp_ln": 4, "tokens_gn": 2, "tokens_ln": 2, "seq_out": 2, "tokens_dict": 2,
                "tokens_twin": 2}.get(name, 0)
    assert len(found) == expected  # the zoo does exercise both answers


def test_resnet_every_convolution_before_a_batchnorm_and_nothing_else():
    model = resnet()
    found = found_params(model, torch.randn(4, 1, 8, 8))
    assert found == {"0.weight", "3.conv1.weight", "3.conv2.weight", "4.conv1.weight", "4.conv2.weight",
                     "4.shortcut.0.weight"}
    assert found == numerically_invariant(model, torch.randn(4, 1, 8, 8))


@pytest.mark.parametrize("pre", [True, False], ids=["pre-LN", "post-LN"])
def test_transformer_blocks_residual_adds_are_not_invariant_qk_norm_is(pre, tokens):
    assert found_params(Transformer(pre), tokens) == set()  # every Linear feeds an add, a softmax or the head
    found = found_params(Transformer(pre, qk_norm=True), tokens)
    assert found == {f"block.attn.{p}.{r}" for p in "qk" for r in ("weight", "bias")}
    assert found == numerically_invariant(Transformer(pre, qk_norm=True), tokens)


def test_torch_transformer_encoder_layers_have_no_invariant_tensor():
    for norm_first in (True, False):
        layer = nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True, norm_first=norm_first)
        assert find_scale_invariant(layer, torch.randn(3, 4, 6)) == []


@pytest.mark.parametrize("groups", [4, 8])
def test_group_norm_weight_and_bias_and_when_the_bias_has_no_effect(groups, images):
    model = Chain(lambda y, x: y, nn.GroupNorm(groups, 8))
    (layer,) = find_scale_invariant(model, images)
    assert layer.params == ("conv.weight", "conv.bias") and layer.norm == "norm"
    assert set(layer.params) == numerically_invariant(model, images)
    bias_free = groups == 8  # one channel per group: the per-channel mean removes the bias
    assert ("bias also has no effect" in layer.reason) is bias_free
    model.train()
    before = model(images)
    with torch.no_grad():
        model.conv.bias.add_(torch.randn(8))
    assert torch.allclose(model(images), before, atol=1e-8) is bias_free


def test_the_modes_training_uses_decide_a_batchnorm_frozen_in_eval_mode_rules_its_layer_out(images):
    """A fine-tuning recipe that keeps a BatchNorm in eval mode trains on its running statistics: the
    conv before it is then not scale-invariant (checked numerically in those modes)."""
    model = Chain(lambda y, x: y)
    assert found_params(model, images) == {"conv.weight", "conv.bias"}  # default: every module in training mode
    model.train()
    model.norm.eval()  # what the recipe's on_train_epoch_start does
    modes = training_modes(model)
    assert modes["norm"] is False and modes["conv"] is True
    model.eval()  # the analysis uses the modes given, not the ones the model is in now
    assert find_scale_invariant(model, images, modes) == []
    assert not model.training and not model.norm.training  # and leaves the model's modes as they were
    with torch.no_grad():
        model.train()
        model.norm.eval()
        before = model(images)
        model.conv.weight.mul_(2.5)
        model.conv.bias.mul_(2.5)
        assert not torch.allclose(model(images), before, atol=1e-6)  # scaling does change the function


def test_linear_bias_into_layer_norm_is_scaled_with_the_weight():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2))
    (layer,) = find_scale_invariant(model, torch.randn(5, 4))
    assert layer.params == ("0.weight", "0.bias") and "LayerNorm '1'" in layer.reason
    assert "bias also has no effect" not in layer.reason


class KeywordNorm(nn.Module):
    """``Linear -> LayerNorm -> tanh -> head``, the norm called by keyword: ``self.norm(input=h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(input=self.lin(x))))


def test_a_norm_called_by_keyword_is_found_as_one_called_positionally():
    model, x = KeywordNorm(), torch.randn(5, 4)
    found = found_params(model, x)
    assert found == {"lin.weight", "lin.bias"}
    assert found == numerically_invariant(model, x)


class HubRMSNorm(nn.Module):
    """An RMSNorm written as Hugging Face writes its own (``LlamaRMSNorm``, ``Qwen3RMSNorm``): no torch norm class."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(size)), eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class ScaleNorm(nn.Module):
    """Named a norm, but only a learned scale: not invariant to its input's scale."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), 0.5))

    def forward(self, x):
        return self.weight * x


class QKNormAttention(nn.Module):
    """Queries and keys each through their own norm after a head split (Qwen3's q_norm / k_norm), values not."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.q_norm, self.k_norm, self.head = norm(4), norm(4), nn.Linear(8, 3)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, 2, 4)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, 2, 4)).transpose(1, 2)
        v = self.v(x).view(b, t, 2, 4).transpose(1, 2)
        mixed = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.head(mixed.transpose(1, 2).reshape(b, t, 8).mean(1))


def test_another_packages_norm_counts_where_scaling_its_input_leaves_its_output():
    torch.manual_seed(0)
    x = torch.randn(5, 6, 8)
    model = QKNormAttention(HubRMSNorm)
    found = found_params(model, x)
    assert found == {"q.weight", "q.bias", "k.weight", "k.bias"}
    for norm in (model.q_norm, model.k_norm):
        norm.variance_epsilon = 1e-30  # the brute force's exact invariance
    assert found == numerically_invariant(model, x)
    (layer, _) = find_scale_invariant(model, x)
    assert "HubRMSNorm 'q_norm', which gave the same output for its input scaled by 2 and by 1/2" in layer.reason


def test_a_module_only_named_a_norm_is_not_taken_for_one():
    model = QKNormAttention(ScaleNorm)
    x = torch.randn(5, 6, 8)
    assert find_scale_invariant(model, x) == [] == sorted(numerically_invariant(model, x))



@pytest.mark.parametrize(
    "between, norm",
    [
        (lambda y, x: torch.relu(y), None),  # an activation, even a positively homogeneous one
        (lambda y, x: y + x.repeat(1, 3, 1, 1)[:, :8], None),  # a residual add
        (lambda y, x: y * 1.0, None),  # any other operation
        (lambda y, x: y, lambda: FrozenBatchNorm(8)),  # running statistics
    ],
    ids=["relu", "residual-add", "other-op", "running-statistics"],
)
def test_negatives(between, norm, images):
    assert find_scale_invariant(Chain(between, norm and norm()), images) == []


def test_negative_output_used_twice_and_layer_called_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.shared, self.ln2 = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4)

        def forward(self, x):
            y = self.fc(x)
            h = self.ln(y) + y  # y also goes around the norm
            return self.ln2(self.shared(self.shared(h)))  # called twice

    assert find_scale_invariant(Twice(), torch.randn(5, 4)) == []


def test_the_analysis_has_no_side_effects():
    model = resnet().eval()
    model[3].train()  # mixed modes are restored per module
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    x = torch.randn(4, 1, 8, 8)
    rng = torch.get_rng_state()
    assert len(find_scale_invariant(nn.Sequential(model, nn.Dropout(0.5)), x)) == 6
    assert all(torch.equal(buffers[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes and True in modes and False in modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


# --- the prior's treatments -------------------------------------------------------------------------


def test_prior_treatments_fixed_decoupled_learn():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    prior = GaussianPrior(net, precision=2.0)
    with torch.no_grad():
        prior.log_precision.copy_(torch.arange(6.0))
    sq = prior.group_sq_norms()
    prior.treat_scale_invariant(["0.weight", "0.bias"], "decoupled")
    assert prior.learned_groups().all()
    expected = torch.tensor([math.log(2.0)] * 2 + [2.0, 3.0, 4.0, 5.0])
    assert torch.allclose(prior.weight_decay_log_precision(), expected)
    assert torch.allclose(prior.penalty(), 0.5 * (expected.exp() * sq).sum())
    prior.treat_scale_invariant(["0.weight", "0.bias"], "fixed")
    assert prior.learned_groups().tolist() == [False, False, True, True, True, True]
    assert torch.allclose(prior.penalty(), 0.5 * (prior.precision * sq).sum())
    prior.treat_scale_invariant(["0.weight", "0.bias"], "learn")
    assert prior.learned_groups().all() and torch.allclose(prior.penalty(), 0.5 * (prior.precision * sq).sum())


def test_prior_user_fixed_wins_and_bad_values_are_named():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    prior = GaussianPrior(net, fixed=["0.bias"])
    prior.treat_scale_invariant(["0.weight", "0.bias"], "decoupled")
    assert prior.scale_invariant == ["0.weight"] and not prior.learned_groups()[1]
    with pytest.raises(ValueError, match="'fix'"):
        prior.treat_scale_invariant(["0.weight"], "fix")
    with pytest.raises(ValueError, match="nope"):
        prior.treat_scale_invariant(["nope"], "fixed")
    with pytest.raises(ValueError, match="scalar"):
        GaussianPrior(net, structure="scalar").treat_scale_invariant(["0.weight"], "fixed")
    with pytest.raises(ValueError, match="'fixd'"):
        MargLikCallback(scale_invariant="fixd")


def test_diagonal_prior_decoupled_per_scalar():
    net = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    prior = GaussianPrior(net, precision=0.5, structure="diagonal")
    with torch.no_grad():
        prior.log_precision.fill_(3.0)
    prior.treat_scale_invariant(["0.bias"], "decoupled")
    wd = prior.weight_decay_log_precision()
    assert torch.allclose(wd[6:9], torch.full((3,), math.log(0.5))) and torch.allclose(wd[:6], torch.full((6,), 3.0))


# --- the callback ---------------------------------------------------------------------------------


class BNClassifier(pl.LightningModule):
    def __init__(self, **prior_kwargs):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(4, 3))
        self.prior = GaussianPrior(self.net, **prior_kwargs)
        self.likelihood = CategoricalLikelihood()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior, 48)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)


def _fit(treatment=None, **prior_kwargs):
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 3, 5, 5, generator=g), torch.randint(0, 3, (48,), generator=g))
    model = BNClassifier(**prior_kwargs)
    kwargs = {} if treatment is None else {"scale_invariant": treatment}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # biases and output layer learned: these tests are about the scale-invariant tensors alone
        trainer([MargLikCallback(frequency=1, steps=20, biases="learn", output_layer="learn", **kwargs)], 2).fit(
            model, DataLoader(data, batch_size=16)
        )
    return model, [str(w.message) for w in caught if "scale" in str(w.message)]


def test_callback_default_decouples_and_warns_once():
    model, messages = _fit()
    prior = model.prior
    assert prior.scale_invariant == ["0.weight", "0.bias"] and prior.scale_invariant_treatment == "decoupled"
    assert len(messages) == 1 and "0.weight, 0.bias -> net.1" in messages[0] and "decoupled" in messages[0]
    assert (prior.log_precision[:2] != 0).all()  # the evidence learned its own precision ...
    assert torch.equal(prior.weight_decay_log_precision()[:2], torch.zeros(2))  # ... the weight decay kept delta_0
    assert torch.equal(prior.weight_decay_log_precision()[2:], prior.log_precision[2:])


def test_callback_fixed_and_learn_and_user_fixed():
    model, messages = _fit("fixed")
    assert torch.equal(model.prior.log_precision[:2], torch.zeros(2)) and (model.prior.log_precision[2:] != 0).all()
    model, messages = _fit("learn")
    assert (model.prior.log_precision != 0).all() and "can grow without bound" in messages[0]
    assert torch.equal(model.prior.weight_decay_log_precision(), model.prior.log_precision)
    model, messages = _fit("decoupled", fixed=["0.bias"])
    assert model.prior.scale_invariant == ["0.weight"] and model.prior.log_precision[1] == 0
    assert "keep GaussianPrior(fixed=...)" in messages[0]


def test_callback_scalar_prior_learns_with_a_warning():
    model, messages = _fit(structure="scalar")
    assert model.prior.scale_invariant_treatment == "learn"
    assert len(messages) == 1 and "the prior is scalar" in messages[0] and "can grow without bound" in messages[0]
