"""Edges of the evidence pass against the dense brute-force reference (tests/reference.py).

Model inputs that do not lead with the batch (a shared ``(1, T)`` first input works, sequence-first inputs are
refused by name), embeddings with ``scale_grad_by_freq`` (the same function, so the same evidence and Jacobians) and
hooked layers called with their input as a keyword.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_marglik import GaussianPrior, LaplaceEvidence, LayerRule, register_layer_rule
from lightning_marglik.linearized import linearized_evidence
from lightning_marglik.predictive import output_jacobians, predict_classification
from tests.reference import (  # noqa: F401 (reference_env: autouse)
    Problem, graph_jacobians, graph_problem, hyper, reference_env, rel_err,
)

TOL = 1e-8


def fitted(model, batches, kind, structure, **fit):
    prior, lik = hyper(model, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exact path's notice for the modules that take it
        return LaplaceEvidence.fit(model, batches, lik, prior, structure=structure, mc_samples=0, **fit), prior, lik


def reference_marglik(model, inputs, y, kind, structure, prior, lik):
    return graph_problem(model, inputs, y, kind).reference(structure, "ggn").evaluate(prior, lik)["log_marglik"]


def in_batches(inputs, y, size):
    return [(inputs[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


# --- 1. model inputs that do not lead with the batch ------------------------------------------------------------------


class SharedFirst(nn.Module):
    """Position indices ``(1, T)`` shared by the batch as the first input, features ``(B, T, F)`` after them."""

    def __init__(self):
        super().__init__()
        self.pos, self.a, self.b = nn.Embedding(4, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, pos, x):
        return self.b(torch.tanh(self.a(x + self.pos(pos))).mean(1))


class SharedLast(SharedFirst):
    """The same function with the batch's features first: the reference reads the batch from the first input."""

    def forward(self, x, pos):
        return super().forward(pos, x)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_shared_first_input_matches_dense_reference(structure):
    model, twin = SharedFirst(), SharedLast()
    twin.load_state_dict(model.state_dict())
    x, y, pos = torch.randn(12, 4, 3), torch.randn(12, 2), torch.arange(4)[None]
    batches = [((pos, x[i:i + 4]), y[i:i + 4]) for i in range(0, 12, 4)]
    ev, prior, lik = fitted(model, batches, "regression", structure)
    assert ev.n_data == 12
    # the twin's parameters are the model's, in the same order: the model's prior reads as its own
    assert rel_err(ev.log_marglik(), reference_marglik(twin, (x, pos), y, "regression", structure, prior, lik)) <= TOL


class SeqFirst(nn.Module):
    """Sequence-first inputs ``(T, B, F)`` to outputs ``(B, C)``; ``batch_first`` reads ``(B, T, F)``."""

    def __init__(self, batch_first=False):
        super().__init__()
        self.inp, self.head, self.batch_first = nn.Linear(3, 4), nn.Linear(4, 2), batch_first

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x))).mean(1 if self.batch_first else 0)


@pytest.mark.parametrize("steps", [5, 6], ids=["T!=B", "T==B"])
@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_sequence_first_inputs_refused_and_the_fix_matches_dense_reference(structure, steps):
    """Rows of the hook path would be time steps (silently wrong diag), the exact path's vmap crashed; ``T == B``
    is caught by the output of a slice of the batch (hooks) or of one example (the exact path)."""
    model, twin = SeqFirst(), SeqFirst(batch_first=True)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(18, steps, 3), torch.randn(18, 2)
    with pytest.raises(ValueError, match="batch_first=True"):
        fitted(model, in_batches(x, y, 6), "regression", structure, batch_fn=lambda b: (b[0].transpose(0, 1), b[1]))
    ev, prior, lik = fitted(twin, in_batches(x, y, 6), "regression", structure)
    assert rel_err(ev.log_marglik(), reference_marglik(twin, x, y, "regression", structure, prior, lik)) <= TOL


# --- 2. embeddings with scale_grad_by_freq ---------------------------------------------------------------------------


class Tokens(nn.Module):
    def __init__(self, bag=False, freq=False):
        super().__init__()
        self.bag = bag
        self.emb = (nn.EmbeddingBag(6, 3, mode="sum", scale_grad_by_freq=freq) if bag
                    else nn.Embedding(6, 3, scale_grad_by_freq=freq))
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        hidden = self.emb(ids) if self.bag else self.emb(ids).mean(1)
        return self.head(torch.tanh(hidden))


def token_twins(bag):
    """A network with the flag, the same one without it (the same function) and ids repeated within examples."""
    model, twin = Tokens(bag, freq=True), Tokens(bag)
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 6, (16, 4))
    ids[:, 1] = ids[:, 0]
    return model, twin, ids


@pytest.mark.parametrize("structure,bag", [("full", False), ("diag", False), ("kron", False), ("full", True),
                                           ("diag", True)])  # the reference has no kron of an EmbeddingBag
def test_scale_grad_by_freq_matches_dense_reference(structure, bag):
    """The flag scales the backward, not the function: the reference is taken of the network without it (jacrev
    through the flag's backward would scale it too)."""
    model, twin, ids = token_twins(bag)
    y = torch.randn(16, 2)
    ev, prior, lik = fitted(model, in_batches(ids, y, 4), "regression", structure)
    assert rel_err(ev.log_marglik(), reference_marglik(twin, ids, y, "regression", structure, prior, lik)) <= TOL
    assert model.emb.scale_grad_by_freq  # restored


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_scale_grad_by_freq_predictive_jacobians_match_dense_reference(bag):
    model, twin, ids = token_twins(bag)
    _, jacobians = output_jacobians(GaussianPrior(model), model, ids)
    _, expected = graph_jacobians(twin, [n for n, _ in twin.named_parameters()], ids)
    assert rel_err(jacobians.reshape(expected.shape), expected) <= TOL
    assert model.emb.scale_grad_by_freq


def test_scale_grad_by_freq_linearized_evidence():
    """An EmbeddingBag has no forward-mode derivative in torch: the Embedding alone."""
    model, twin, ids = token_twins(bag=False)
    y = torch.randn(16, 2)
    objectives = []
    for net in (model, twin):  # the linear model's L-BFGS steps follow its gradient, a backward through the layer
        prior, lik = hyper(net, "regression")
        fit = linearized_evidence(net, in_batches(ids, y, 8), lik, prior, structure="diag", steps=3, precondition=False)
        objectives.append(torch.tensor(fit.objective[1]))
    assert rel_err(*objectives) <= TOL
    assert model.emb.scale_grad_by_freq


# --- 3. hooked layers called with their input as a keyword -----------------------------------------------------------


class Keywords(nn.Module):
    """Token and position embeddings and Linears, called with ``input=`` (``keyword``) or positionally."""

    def __init__(self, keyword=True):
        super().__init__()
        self.keyword = keyword
        self.emb, self.pos, self.a, self.b = nn.Embedding(6, 3), nn.Embedding(4, 3), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])[None]  # shared by the batch: expanded by the recorder's pre-hook
        if self.keyword:
            hidden = torch.tanh(self.a(input=self.emb(input=ids) + self.pos(input=positions)))
            return self.b(input=hidden.mean(1))
        return self.b(torch.tanh(self.a(self.emb(ids) + self.pos(positions))).mean(1))


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_keyword_calls_match_dense_reference(structure):
    """The reference records layer inputs positionally: it is taken of the same network called so."""
    model, twin = Keywords(), Keywords(keyword=False)
    twin.load_state_dict(model.state_dict())
    ids, y = torch.randint(0, 6, (12, 4)), torch.randint(0, 2, (12,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer takes the hook path: no exact-path notice
        prior, lik = hyper(model, "classification")
        ev = LaplaceEvidence.fit(model, in_batches(ids, y, 6), lik, prior, structure=structure, mc_samples=0)
    assert rel_err(ev.log_marglik(), reference_marglik(twin, ids, y, "classification", structure, prior, lik)) <= TOL


def dead_layers(kind):
    """Conv -> ReLU -> Linear -> ReLU -> Linear whose middle ReLUs are all off on any input (that Linear's weight 0,
    bias -1): no row of the conv or of the first Linear carries a loss term (their d f / d z is exactly 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        model[3].weight.zero_()
        model[3].bias.fill_(-1.0)
    x = torch.randn(10, 1, 6, 6)
    y = torch.randn(10, 2) if kind == "regression" else torch.randint(0, 2, (10,))
    return model, x, y


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_layers_with_no_loss_term_match_dense_reference(kind):
    """Their G is 0, so their blocks are 0: the reference's input factor, a mean over no kept row, was 0/0 = NaN
    (a timm ResNet stage whose ReLUs are all off, an MLP-Mixer's zero-initialized head)."""
    model, x, y = dead_layers(kind)
    ev, prior, lik = fitted(model, in_batches(x, y, 5), kind, "kron")
    problem = graph_problem(model, x, y, kind)
    assert [float(r.jac.abs().max()) for r in problem.records][:2] == [0.0, 0.0]
    names = [n for n, _ in model.named_parameters()]  # the Sequential-only Kronecker blocks too
    for reference in (problem, Problem(model, names, x, y, kind)):
        expected = reference.reference("kron", "ggn").evaluate(prior, lik)
        assert rel_err(ev.log_det(), expected["log_det"]) <= TOL, (float(ev.log_det()), float(expected["log_det"]))
        assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL


class KeywordHead(nn.Module):
    """An MLP whose output layer (a Linear: the predictive's rank-one Jacobian) is called with ``input=``."""

    def __init__(self, keyword=True):
        super().__init__()
        self.keyword, self.body, self.head = keyword, nn.Linear(2, 5), nn.Linear(5, 3)

    def forward(self, x):
        hidden = torch.tanh(self.body(x))
        return self.head(input=hidden) if self.keyword else self.head(hidden)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_the_predictive_of_a_keyword_called_output_layer_is_that_of_the_positional_call(structure):
    """kron's predictive failed ("The network's forward failed on inputs ... IndexError") where its evidence held."""
    model, twin = KeywordHead(), KeywordHead(keyword=False)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(20, 2), torch.randint(0, 3, (20,))
    predictions = []
    for net in (model, twin):
        evidence, _, _ = fitted(net, in_batches(x, y, 10), "classification", structure)
        predictions.append(predict_classification(evidence, net, x[:6], method="probit"))
    assert rel_err(*predictions) <= TOL


class KeywordsOnly(nn.Module):
    """``y = weight * x``, its input only among keyword arguments: the rule cannot find it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, **inputs):
        return self.weight * inputs["x"]


class ScaleRule(LayerRule):
    def diagonal(self, module, a, g):
        return {"weight": (g * a).pow(2).sum((0, 1))}


class Unread(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.scale, self.b = nn.Linear(3, 3), KeywordsOnly(), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.scale(x=self.a(x))))


def test_layer_input_not_found_takes_the_exact_path_by_name():
    register_layer_rule(KeywordsOnly, ScaleRule())
    model, x, y = Unread(), torch.randn(12, 3), torch.randn(12, 2)
    prior, lik = hyper(model, "regression")
    with pytest.warns(UserWarning, match="'scale': its input, which its layer rule reads, is neither"):
        ev = LaplaceEvidence.fit(model, in_batches(x, y, 6), lik, prior, structure="diag", mc_samples=0)
    assert rel_err(ev.log_marglik(), reference_marglik(model, x, y, "regression", "diag", prior, lik)) <= TOL
