"""MargLikCallback(output_layer=...): the layer found, its treatment, and its equality with the prior's own
``fixed=`` (the form issue 42's study measured); the layer found in the networks people use (issue 51)."""
from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import TensorDataset

from lightning_marglik import GaussianPrior, MargLikCallback
from lightning_marglik.callbacks.output_layer import OUTPUT_LAYER, OutputLayer, find_output_layer, treat_output_layer
from tests.lightning_models import Classifier, blobs, loader, trainer
from tests.test_integrations import Logits, Module


class Wrapped(nn.Module):
    """The network in a LightningModule-like shell, its output possibly reshaped or transformed."""

    def __init__(self, net: nn.Module, after=lambda out: out) -> None:
        super().__init__()
        self.net, self.after = net, after

    def forward(self, x):
        return self.after(self.net(x))


class Head(nn.Module):  # the output Linear inside a module without parameters of its own
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def forward(self, x):
        return self.proj(x)


class Tied(nn.Module):  # a language-model head that reuses the embedding's weight
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(6, 4), nn.LayerNorm(4)

    def forward(self, tokens):
        return F.linear(self.norm(self.emb(tokens)), self.emb.weight)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("after, found", [
    (lambda out: out, ["net.2.weight", "net.2.bias"]),
    (lambda out: out.reshape(-1), ["net.2.weight", "net.2.bias"]),  # a view of the layer's output
    (lambda out: out[:, :1].squeeze(-1), ["net.2.weight", "net.2.bias"]),
    (lambda out: out.softmax(-1), ["net.2.weight", "net.2.bias"]),  # a function after the last layer passes through
    (lambda out: 2 * out, ["net.2.weight", "net.2.bias"]),
    (lambda out: out.detach(), []),  # an output that depends on no trainable tensor
])
def test_the_output_layer_is_the_layer_whose_output_the_network_returns(after, found):
    assert find_output_layer(Wrapped(mlp(), after), torch.randn(5, 3)).names == tuple(found)


def test_nested_compiled_frozen_and_tied_output_layers():
    nested = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), Head()))
    assert find_output_layer(nested, torch.randn(5, 3)).names == ("net.2.proj.weight", "net.2.proj.bias")
    compiled = Wrapped(torch.compile(mlp(), backend="eager"))
    compiled(torch.randn(5, 3))  # compiled before the hooks are added
    assert find_output_layer(compiled, torch.randn(5, 3)).names == ("net._orig_mod.2.weight", "net._orig_mod.2.bias")
    frozen = Wrapped(mlp())
    frozen.net[2].requires_grad_(False)  # no trainable output layer: the layer before does not make the output
    assert find_output_layer(frozen, torch.randn(5, 3)) == OutputLayer(("net.2",), (), (), ())
    # the output computed from the embedding's weight in the root's forward: the embedding is not the output layer
    assert find_output_layer(Tied(), torch.tensor([[0, 1, 2]])) == OutputLayer((), (), (), ("emb.weight",))
    tied_head = Tied()
    tied_head.head = nn.Linear(4, 6)
    tied_head.head.weight = tied_head.emb.weight  # a head tied to the embedding (GPT-2's lm_head): its bias alone
    tied_head.forward = lambda tokens: tied_head.head(tied_head.norm(tied_head.emb(tokens)))
    assert find_output_layer(tied_head, torch.tensor([[0, 1, 2]])) == OutputLayer(
        ("head",), ("head.bias",), (("head.weight", "emb"),), ())
    bias_only = Wrapped(nn.Sequential(nn.Linear(3, 2)))
    bias_only.net[0].weight.requires_grad_(False)
    assert find_output_layer(bias_only, torch.randn(5, 3)).names == ("net.0.bias",)


class RegisteredTwice(nn.Module):
    """Hugging Face's MLM head: the decoder's bias is also the head's own ``bias``
    (``self.decoder.bias = self.bias``)."""

    def __init__(self, also_outside: bool = False) -> None:
        super().__init__()
        self.decoder, self.also_outside = nn.Linear(4, 3, bias=False), also_outside
        self.bias = nn.Parameter(torch.zeros(3))
        self.decoder.bias = self.bias

    def forward(self, x):
        return self.decoder(x) + self.bias if self.also_outside else self.decoder(x)


def test_a_tensor_its_parent_registers_too_is_the_layers_own_unless_used_elsewhere():
    """BERT's MLM head: the bias was called tied to the head around it, and not held, though only the decoder uses
    it; used once more by the parent, it is tied."""
    head = Wrapped(RegisteredTwice())
    assert find_output_layer(head, torch.randn(5, 4)) == OutputLayer(
        ("net.decoder",), ("net.bias", "net.decoder.weight"), (), ())
    twice = Wrapped(RegisteredTwice(also_outside=True))
    assert find_output_layer(twice, torch.randn(5, 4)) == OutputLayer(
        ("net.decoder",), ("net.decoder.weight",), (("net.decoder.bias", "net"),), ())


def test_the_forward_that_finds_it_leaves_modes_and_weights_alone():
    module = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    before = [p.clone() for p in module.parameters()]
    module.train()
    assert find_output_layer(module, torch.randn(5, 3)).names == ("net.2.weight", "net.2.bias")
    assert module.training and all(m.training for m in module.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert all(p.grad is None for p in module.parameters())  # its graph is never run backwards
    assert not any(m._forward_hooks for m in module.modules())  # its hooks removed


def test_treatments_recorded_on_the_prior_with_the_reason():
    module = Wrapped(mlp())
    prior = GaussianPrior(module.net)
    decided = treat_output_layer(module, prior, find_output_layer(module, torch.randn(5, 3)), "fixed")
    assert decided == {"names": ["2.weight", "2.bias"], "treatment": "fixed",
                       "reason": "output layer `net.2`: held at the declared precision"}
    assert prior.treatments[OUTPUT_LAYER] == (["2.weight", "2.bias"], "fixed")
    assert prior.fixed_names() == ["2.weight", "2.bias"]
    scalar = GaussianPrior(module.net, structure="scalar")  # one precision: nothing can be held apart
    decided = treat_output_layer(module, scalar, find_output_layer(module, torch.randn(5, 3)), "fixed")
    assert decided["treatment"] == "learn" and "scalar" in decided["reason"] and scalar.fixed_names() == []
    user = GaussianPrior(module.net, fixed=["2.bias"])  # the user's fixed= is theirs; the weight is ours
    treat_output_layer(module, user, find_output_layer(module, torch.randn(5, 3)), "decoupled")
    assert user.treatments[OUTPUT_LAYER] == (["2.weight"], "decoupled") and user.fixed == ["2.bias"]
    tied = Tied()
    decided = treat_output_layer(tied, GaussianPrior(tied), find_output_layer(tied, torch.tensor([[0, 1, 2]])), "fixed")
    assert decided == {"names": [], "treatment": "learn", "reason": (
        "nothing treated: the output is computed from `emb.weight` outside the module that owns it (tied weights or a "
        "functional call), not by a layer of its own")}
    # inputs where the layer found belongs (this function's signature before issue 55) are named, not an AttributeError
    with pytest.raises(TypeError, match="takes the OutputLayer that find_output_layer.* got Tensor"):
        treat_output_layer(module, GaussianPrior(module.net), torch.randn(5, 3), "fixed")


def test_set_up_checks_the_targets_and_finds_the_output_layer_in_one_forward():
    """Set-up's analysis sends its batch through ``forward`` once for the target check and the output layer's
    search together (issue 55: one forward fewer), once for the scale-invariance check in training modes, and
    then through the evidence pass (its first batch's layout check on two examples included; and, where set-up
    finds the estimate costly, the cost check's timed passes)."""
    torch.manual_seed(0)
    module = Classifier(n_data=64)
    calls = []
    forward = module.forward

    def counted(*args, **kwargs):
        files = [frame.filename for frame in traceback.extract_stack()]
        passes = ("curvature/hooks.py", "curvature/__init__.py", "callbacks/cost.py")  # the pass; the cost's timing
        if any(f.endswith("callbacks/setup_analysis.py") for f in files) and not any(f.endswith(passes) for f in files):
            calls.append("train" if module.training else "eval")
        return forward(*args, **kwargs)

    module.forward = counted
    callback = MargLikCallback(frequency=1)
    x, y = blobs(64, 0).tensors
    trainer([callback], max_epochs=1).fit(module, loader(TensorDataset(x.double(), y)))
    assert calls == ["eval", "train"]
    assert callback.output_decision == {"names": ["2.weight", "2.bias"], "treatment": "fixed",
                                        "reason": "output layer `net.2`: held at the declared precision"}


@pytest.mark.parametrize("bad, message", [("hold", "output_layer"), (None, "output_layer"), (True, "output_layer")])
def test_a_hurried_output_layer_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        MargLikCallback(output_layer=bad)
    assert MargLikCallback(output_layer=" Fixed").output_layer == "fixed"


def _fit(callback: MargLikCallback, fixed=None) -> Classifier:
    torch.manual_seed(0)
    module = Classifier(n_data=60)
    module.prior = GaussianPrior(module.net, fixed=fixed)
    x, y = blobs(60, 0).tensors
    trainer([callback], max_epochs=2).fit(module, loader(TensorDataset(x.double(), y), batch_size=20))
    return module


def test_held_output_layer_equals_the_priors_own_fixed_and_keeps_the_declared_precision():
    """What issue 42's study ran (``GaussianPrior(fixed=[the last Linear])``) is what ``output_layer='fixed'`` does:
    the same learned precisions to the last bit."""
    options = dict(frequency=1, steps=20)
    held = _fit(callback := MargLikCallback(output_layer="fixed", **options))
    same = _fit(MargLikCallback(output_layer="learn", **options), fixed=["2.weight", "2.bias"])
    learned = _fit(MargLikCallback(output_layer="learn", **options))
    assert torch.equal(held.prior.log_precision, same.prior.log_precision)
    names = held.prior.param_names
    out = [names.index("2.weight"), names.index("2.bias")]
    assert torch.all(held.prior.log_precision[out] == 0.0)  # the declared precision 1
    assert torch.all(learned.prior.log_precision[out] != 0.0)  # which the plain evidence moves
    assert callback.output_decision == {"names": ["2.weight", "2.bias"], "treatment": "fixed",
                                        "reason": "output layer `net.2`: held at the declared precision"}


# --- the layer found in the networks people use (issue 51) ---------------------------------------------------------


class RootTensors(nn.Module):
    """A root with tensors of its own (a position table, an input scale, a temperature) around a body and a
    Linear head; ``last`` is what the root does with the head's output."""

    def __init__(self, last) -> None:
        super().__init__()
        self.pos, self.scale = nn.Parameter(0.1 * torch.randn(4, 3)), nn.Parameter(torch.ones(3))
        self.temperature, self.mix = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.eye(2))
        self.body, self.head = nn.Linear(3, 8), nn.Linear(8, 2)
        self.last = last

    def forward(self, x):  # (B, 4 positions, 3)
        return self.last(self, self.head(torch.tanh(self.body(x * self.scale + self.pos))))


@pytest.mark.parametrize("last", [
    lambda net, out: out,  # the root returns its head's output
    lambda net, out: out[:, 0],  # the first position's logits
    lambda net, out: out / net.temperature,  # a learned temperature
])
def test_a_roots_own_tensors_are_never_held_for_its_head(last):
    found = find_output_layer(RootTensors(last), torch.randn(5, 4, 3))
    assert found == OutputLayer(("head",), ("head.weight", "head.bias"), (), ())


def test_an_output_made_by_elementwise_tensors_alone_holds_nothing_and_says_so():
    net = RootTensors(lambda net, out: out)
    net.forward = lambda x: (x * net.scale).sum(-1)  # the root's input scale alone: no weight matrix applied
    assert find_output_layer(net, torch.randn(5, 4, 3)) == OutputLayer((), (), (), ())
    assert treat_output_layer(net, GaussianPrior(net), find_output_layer(net, torch.randn(5, 4, 3)), "fixed")["reason"] == (
        "nothing treated: no layer with a weight matrix (a trainable tensor of two or more dimensions) makes the "
        "network's output")


def test_a_root_that_applies_its_own_matrix_last_is_the_output_layer_with_that_matrix_alone():
    found = find_output_layer(RootTensors(lambda net, out: out @ net.mix), torch.randn(5, 4, 3))
    assert found == OutputLayer(("",), ("mix",), (), ())  # not its position table, scale or temperature
    net = RootTensors(lambda net, out: out @ net.mix)
    decided = treat_output_layer(net, GaussianPrior(net), found, "fixed")
    assert decided["reason"] == "output layer the root module: held at the declared precision"


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return torch.cat([self.a(h), self.b(h)], dim=-1)


def test_heads_joined_by_cat_a_norm_after_the_head_and_a_parametrized_head():
    assert find_output_layer(TwoHeads(), torch.randn(5, 3)) == OutputLayer(
        ("a", "b"), ("a.weight", "a.bias", "b.weight", "b.bias"), (), ())
    normed = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2))))
    assert find_output_layer(normed, torch.randn(5, 3)) == OutputLayer(
        ("net.2.0",), ("net.2.0.weight", "net.2.0.bias"), (), ())  # the LayerNorm's affine passes through
    weight_normed = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), weight_norm(nn.Linear(4, 2))))
    assert find_output_layer(weight_normed, torch.randn(5, 3)).names == (
        "net.2.bias", "net.2.parametrizations.weight.original0", "net.2.parametrizations.weight.original1")


def _images(n: int = 2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _tokens():
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0  # padded: GPT-2's classifier reads each sequence's last real token
    return {"input_ids": torch.randint(1, 12, (2, 5), generator=torch.Generator().manual_seed(0)) * mask,
            "attention_mask": mask}


def timm_vit(num_classes: int = 10) -> nn.Module:
    pytest.importorskip("timm", reason="timm is not installed")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)  # vit_tiny_patch16_224's layout (cls token, position table on the root) at 32x32
    return VisionTransformer(img_size=32, patch_size=8, num_classes=num_classes, embed_dim=16, depth=2, num_heads=2)


def hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=16, num_labels=10)
    return Logits(transformers.ViTForImageClassification(config))


def hf_text(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    if kind == "bert":
        return Logits(transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
            max_position_embeddings=5, num_labels=3)))
    config = transformers.GPT2Config(vocab_size=12, n_positions=5, n_embd=8, n_layer=1, n_head=2, num_labels=3,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = {"gpt2": transformers.GPT2ForSequenceClassification, "gpt2-lm": transformers.GPT2LMHeadModel}[kind]
    return Logits(model(config))


def torchvision_net(name: str) -> nn.Module:
    models = pytest.importorskip("torchvision.models", reason="torchvision is not installed")
    return getattr(models, name)(weights=None, num_classes=10)


@pytest.mark.parametrize("make, inputs, layer, names", [
    (timm_vit, _images, "head", ["head.weight", "head.bias"]),
    (hf_vit, lambda: {"pixel_values": _images()}, "model.classifier",
     ["model.classifier.weight", "model.classifier.bias"]),
    (lambda: hf_text("gpt2"), _tokens, "model.score", ["model.score.weight"]),  # logits indexed out of score's
    (lambda: hf_text("bert"), _tokens, "model.classifier", ["model.classifier.weight", "model.classifier.bias"]),
    (lambda: torchvision_net("resnet18"), _images, "fc", ["fc.weight", "fc.bias"]),
    (lambda: torchvision_net("mobilenet_v2"), _images, "classifier.1", ["classifier.1.weight", "classifier.1.bias"]),
    (lambda: torchvision_net("mobilenet_v3_small"), _images, "classifier.3",
     ["classifier.3.weight", "classifier.3.bias"]),
], ids=["timm-vit", "hf-vit", "hf-gpt2-classifier", "hf-bert-classifier", "resnet18", "mobilenet_v2",
        "mobilenet_v3_small"])
def test_the_classifier_of_real_models_is_the_output_layer(make, inputs, layer, names):
    net = make()
    found = find_output_layer(net, inputs())
    assert found == OutputLayer((layer,), tuple(names), (), ())
    prior = GaussianPrior(net)
    decided = treat_output_layer(net, prior, found, "fixed")
    assert decided == {"names": names, "treatment": "fixed", "reason": f"output layer `{layer}`: held at the declared precision"}
    assert prior.fixed_names() == names


def test_a_language_models_head_tied_to_its_embedding_holds_nothing_and_says_so():
    net = hf_text("gpt2-lm")
    assert net.model.lm_head.weight is net.model.transformer.wte.weight
    found = find_output_layer(net, _tokens())
    assert found == OutputLayer(("model.lm_head",), (), (("model.lm_head.weight", "model.transformer.wte"),), ())
    decided = treat_output_layer(net, prior := GaussianPrior(net), found, "fixed")
    assert decided == {"names": [], "treatment": "learn", "reason": (
        "nothing treated: `model.lm_head.weight` is tied to `model.transformer.wte` (a tied tensor is learned with "
        "the module it is shared with)")}
    assert prior.fixed_names() == []


def test_a_fit_holds_a_vits_head_at_the_declared_precision_and_learns_its_root_tensors():
    """The issue's case end to end: a timm ViT in a Trainer with the default ``output_layer="fixed"``."""
    x, y = _images(8), torch.arange(8) % 10
    module = Module(timm_vit(), n_data=8)
    callback = MargLikCallback(frequency=1, steps=5, settle=None)
    trainer([callback], max_epochs=2).fit(module, loader(TensorDataset(x, y), batch_size=4))
    assert callback.output_decision == {"names": ["head.weight", "head.bias"], "treatment": "fixed",
                                        "reason": "output layer `net.head`: held at the declared precision"}
    log_delta = dict(zip(module.prior.param_names, module.prior.log_precision.detach()))
    assert log_delta["head.weight"] == 0.0 and log_delta["head.bias"] == 0.0  # the declared precision 1
    assert log_delta["cls_token"] != 0.0 and log_delta["pos_embed"] != 0.0  # the root's tensors are learned
    assert sum(v != 0.0 for v in log_delta.values()) == len(log_delta) - 2
