"""MargLikCallback(output_layer=...): the layer found, its treatment, and its equality with the prior's own
``fixed=`` (the form issue 42's study measured)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_marglik import GaussianPrior, MargLikCallback
from lightning_marglik.callbacks.output_layer import OUTPUT_LAYER, find_output_layer, treat_output_layer
from tests.lightning_models import Classifier, blobs, loader, trainer


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
    (lambda out: out.softmax(-1), []),  # a new tensor after the last layer
    (lambda out: 2 * out, []),
])
def test_the_output_layer_is_the_layer_whose_output_the_network_returns(after, found):
    assert find_output_layer(Wrapped(mlp(), after), torch.randn(5, 3)) == found


def test_nested_frozen_and_tied_output_layers():
    nested = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), Head()))
    assert find_output_layer(nested, torch.randn(5, 3)) == ["net.2.proj.weight", "net.2.proj.bias"]
    frozen = Wrapped(mlp())
    frozen.net[2].requires_grad_(False)  # no trainable output layer: the layer before does not make the output
    assert find_output_layer(frozen, torch.randn(5, 3)) == []
    assert find_output_layer(Tied(), torch.tensor([[0, 1, 2]])) == []
    tied_head = Tied()
    tied_head.head = nn.Linear(4, 6)
    tied_head.head.weight = tied_head.emb.weight  # a head tied to the embedding (GPT-2's lm_head): its bias alone
    tied_head.forward = lambda tokens: tied_head.head(tied_head.norm(tied_head.emb(tokens)))
    assert find_output_layer(tied_head, torch.tensor([[0, 1, 2]])) == ["head.bias"]
    bias_only = Wrapped(nn.Sequential(nn.Linear(3, 2)))
    bias_only.net[0].weight.requires_grad_(False)
    assert find_output_layer(bias_only, torch.randn(5, 3)) == ["net.0.bias"]


def test_the_forward_that_finds_it_leaves_modes_and_weights_alone():
    module = Wrapped(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    before = [p.clone() for p in module.parameters()]
    module.train()
    assert find_output_layer(module, torch.randn(5, 3)) == ["net.2.weight", "net.2.bias"]
    assert module.training and all(m.training for m in module.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert not any(m._forward_hooks for m in module.modules())  # its hooks removed


def test_treatments_recorded_on_the_prior_with_the_reason():
    module = Wrapped(mlp())
    prior = GaussianPrior(module.net)
    decided = treat_output_layer(module, prior, torch.randn(5, 3), "fixed")
    assert decided == {"names": ["2.weight", "2.bias"], "treatment": "fixed", "reason": "held at the declared precision"}
    assert prior.treatments[OUTPUT_LAYER] == (["2.weight", "2.bias"], "fixed")
    assert prior.fixed_names() == ["2.weight", "2.bias"]
    scalar = GaussianPrior(module.net, structure="scalar")  # one precision: nothing can be held apart
    decided = treat_output_layer(module, scalar, torch.randn(5, 3), "fixed")
    assert decided["treatment"] == "learn" and "scalar" in decided["reason"] and scalar.fixed_names() == []
    user = GaussianPrior(module.net, fixed=["2.bias"])  # the user's fixed= is theirs; the weight is ours
    treat_output_layer(module, user, torch.randn(5, 3), "decoupled")
    assert user.treatments[OUTPUT_LAYER] == (["2.weight"], "decoupled") and user.fixed == ["2.bias"]
    tied = Tied()
    decided = treat_output_layer(tied, GaussianPrior(tied), torch.tensor([[0, 1, 2]]), "fixed")
    assert decided["names"] == [] and decided["treatment"] == "learn" and "nothing treated" in decided["reason"]


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
                                        "reason": "held at the declared precision"}
