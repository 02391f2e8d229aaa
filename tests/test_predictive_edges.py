"""Edges a probe of the predictive and the likelihoods found: predictions attached to the network's graph, Monte-Carlo
draws of a singular float32 logit covariance, an empty first batch, the likelihood and the prior swapped, one-hot and
(batch, classes, ...) targets, and the NegativeLogLikelihood metric on sequences, label dtypes and logits."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_marglik import (
    BoundOptimizer, CategoricalLikelihood, EvidenceBound, GaussianLikelihood, GaussianPrior, LaplaceEvidence,
    NegativeLogLikelihood, assign_hyperparameters, collect_statistics, linearized_outputs, map_loss, no_decay_names,
    predict, predict_classification, predict_regression,
)
from lightning_marglik.linearized import linearized_evidence
from tests.reference import rel_err


def _mlp(outputs, dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, outputs)).to(dtype)


# --- predictions are plain tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda ev, net, x: predict_regression(ev, net, x),
    lambda ev, net, x: linearized_outputs(ev, net, x),
], ids=["predict_regression", "linearized_outputs"])
def test_regression_predictions_are_detached_and_leave_the_weights_without_grad(call):
    net = _mlp(1)
    x, y = torch.randn(20, 2), torch.randn(20, 1)
    evidence = LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), GaussianPrior(net))  # kron: rank-one weights
    out = call(evidence, net, x[:3])
    assert not any(t.requires_grad for t in out)
    assert out[1].numpy().shape[0] == 3
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("method", ["probit", "tempered", "mc"])
def test_class_probabilities_are_detached(method):
    net = _mlp(3)
    x, y = torch.randn(20, 2), torch.randint(0, 3, (20,))
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))
    probs = predict_classification(evidence, net, x[:3], method, samples=8)
    assert not probs.requires_grad


PREDICTIVES = {
    "linearized_outputs": lambda ev, net, x: linearized_outputs(ev, net, x)[1],
    "predict_regression": lambda ev, net, x: predict_regression(ev, net, x).model_variance,
    "predict_classification": lambda ev, net, x: predict_classification(ev, net, x),
}


@pytest.mark.parametrize("name", list(PREDICTIVES))
def test_the_predictives_refuse_weights_other_than_the_evidences_as_predict_does(name):
    """The posterior covariance is the one of the fitted weights: at others the variances were silently off (40 times
    the fitted ones after a step of 0.5 on the first layer), where predict refused them."""
    classification = name == "predict_classification"
    net = _mlp(3 if classification else 1)
    x = torch.randn(20, 2)
    y = torch.randint(0, 3, (20,)) if classification else torch.randn(20, 1)
    lik = CategoricalLikelihood() if classification else GaussianLikelihood()
    evidence = LaplaceEvidence.fit(net, [(x, y)], lik, GaussianPrior(net), "full")
    fitted = PREDICTIVES[name](evidence, net, x[:3])
    with torch.no_grad():
        net[0].weight.add_(0.5)  # trained further after the estimate
    with pytest.raises(ValueError, match=rf"^{name}: the module's weights, or its running statistics .BatchNorm's., "
                                         r"are not those of the posterior's estimate.*LaplaceEvidence.fit"):
        PREDICTIVES[name](evidence, net, x[:3])
    with torch.no_grad():
        net[0].weight.sub_(0.5)
        net[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"^{name}: the module's weights are not finite: training diverged"):
        PREDICTIVES[name](evidence, net, x[:3])
    with pytest.warns(UserWarning, match="not finite"):  # an evidence fitted at NaN weights is named as not finite
        refitted = LaplaceEvidence.fit(net, [(x, y)], lik, GaussianPrior(net), "full")
    with pytest.raises(ValueError, match="evidence is not finite at these weights"):
        PREDICTIVES[name](refitted, net, x[:3])
    assert torch.isfinite(fitted).all()


def test_predict_keeps_its_own_name_in_the_refusal_of_other_weights():
    net = _mlp(1)
    x, y = torch.randn(20, 2), torch.randn(20, 1)
    evidence = LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), GaussianPrior(net))
    with torch.no_grad():
        net[2].bias.add_(1.0)
    with pytest.raises(ValueError, match=r"^predict: the module's weights, or its running statistics"):
        predict(evidence, net, x[:3])


# --- Monte-Carlo draws of a singular covariance -----------------------------------------------------------------


def _frozen_head_evidence():
    """A float32 10-class head frozen behind 6 trained parameters: a logit covariance of rank at most 6."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 10)).float()
    net[2].requires_grad_(False)
    x, y = torch.randn(200, 2, dtype=torch.float32), torch.randint(0, 10, (200,))
    return net, LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))


def test_mc_draws_a_singular_float32_covariance_with_a_root_exact_to_float32_rounding():
    from lightning_marglik.predictive import covariance_root

    net, evidence = _frozen_head_evidence()
    x = torch.randn(20, 2, dtype=torch.float32)
    mean, cov = linearized_outputs(evidence, net, x)
    assert mean.dtype == torch.float32 and cov.dtype == torch.float64
    assert int(torch.linalg.matrix_rank(cov).max()) <= 6
    assert torch.linalg.cholesky_ex(cov.float() + 1e-10 * torch.eye(10, dtype=torch.float32)).info.any()
    root = covariance_root(cov, torch.float32).double()
    assert rel_err(root @ root.mT, cov) <= 1e-6  # the float64 covariance itself, singular as it is
    draw = [predict_classification(evidence, net, x, "mc", samples=64, generator=torch.Generator().manual_seed(1))
            for _ in range(2)]
    assert torch.equal(draw[0], draw[1])
    assert torch.allclose(draw[0].sum(1), torch.ones(20, dtype=torch.float32))


def test_mc_keeps_the_draws_of_a_covariance_cholesky_factors():
    net = _mlp(3, torch.float32)
    x, y = torch.randn(40, 2, dtype=torch.float32), torch.randint(0, 3, (40,))
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))
    mean, cov = linearized_outputs(evidence, net, x[:5])
    chol = torch.linalg.cholesky(cov.to(mean) + 1e-10 * torch.eye(3, dtype=mean.dtype))
    noise = torch.randn(50, 5, 3, dtype=mean.dtype, generator=torch.Generator().manual_seed(2))
    expected = torch.softmax(mean + torch.einsum("bcd,sbd->sbc", chol, noise), dim=2).mean(0)
    got = predict_classification(evidence, net, x[:5], "mc", samples=50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(got, expected)


# --- an empty batch -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [0, 1, 2], ids=["first", "middle", "last"])
def test_an_empty_batch_is_skipped_wherever_it_comes(empty):
    net = _mlp(1)
    x, y = torch.randn(30, 2), torch.randn(30, 1)
    batches = [(x[:15], y[:15]), (x[15:], y[15:])]
    expected = LaplaceEvidence.fit(net, batches, GaussianLikelihood(), GaussianPrior(net)).log_marglik()
    batches.insert(empty, (x[:0], y[:0]))
    seen = []
    stats = collect_statistics(net, batches, GaussianLikelihood(), GaussianPrior(net), on_batch=seen.append)
    assert stats.n_data == 30 and seen == [0, 1, 2]  # the progress counts the empty batch too
    got = LaplaceEvidence.fit(net, batches, GaussianLikelihood(), GaussianPrior(net)).log_marglik()
    assert rel_err(got, expected) <= 1e-12


def test_only_empty_batches_are_refused_as_no_example():
    net = _mlp(1)
    with pytest.raises(ValueError, match=r"yielded no example \(no batch, or only empty ones\)"):
        LaplaceEvidence.fit(net, [(torch.randn(0, 2), torch.randn(0, 1))] * 2, GaussianLikelihood(), GaussianPrior(net))


# --- the likelihood and the prior swapped -------------------------------------------------------------------------


SWAPPABLE = {
    "LaplaceEvidence.fit": lambda net, data, lik, prior: LaplaceEvidence.fit(net, data, lik, prior),
    "collect_statistics": lambda net, data, lik, prior: collect_statistics(net, data, lik, prior),
    "EvidenceBound.fit": lambda net, data, lik, prior: EvidenceBound.fit(net, data, lik, prior),
    "BoundOptimizer": lambda net, data, lik, prior: BoundOptimizer(lik, prior, n_data=8),
    "linearized_evidence": lambda net, data, lik, prior: linearized_evidence(net, data, lik, prior),
    "map_loss": lambda net, data, lik, prior: map_loss(net(data[0][0]), data[0][1], lik, prior, 8),
}


@pytest.mark.parametrize("name", list(SWAPPABLE))
def test_the_likelihood_and_the_prior_swapped_are_named_at_every_entry_point(name):
    net = _mlp(3)
    data = [(torch.randn(8, 2), torch.randint(0, 3, (8,)))]
    prior, lik = GaussianPrior(net), CategoricalLikelihood()
    message = r"\(.*likelihood, prior\) got a GaussianPrior as `likelihood` and a CategoricalLikelihood as `prior`: "
    with pytest.raises(TypeError, match=re.escape(name) + message + r"pass a Likelihood, then a GaussianPrior\.$"):
        SWAPPABLE[name](net, data, prior, lik)


def test_arguments_in_the_wrong_order_or_of_the_wrong_type_are_named_not_attribute_errors():
    """These gave bare AttributeErrors ('GaussianLikelihood' object has no attribute 'log_precision', ...)."""
    net = _mlp(1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    prior, lik = GaussianPrior(net), GaussianLikelihood()
    evidence = LaplaceEvidence.fit(net, [(x, y)], lik, prior)
    with pytest.raises(TypeError, match=r"^assign_hyperparameters\(prior, likelihood, values\) got a GaussianPrior as "
                                        r"`likelihood` and a GaussianLikelihood as `prior`: pass a GaussianPrior, then "
                                        r"a Likelihood\.$"):
        assign_hyperparameters(lik, prior, {})
    with pytest.raises(TypeError, match=r"^no_decay_names\(prior\) takes a GaussianPrior, got Sequential: pass "
                                        r"GaussianPrior\(net\)"):
        no_decay_names(net)
    for name, call in PREDICTIVES.items():
        with pytest.raises(TypeError, match=rf"^{name}\(evidence, model, x\) got a Sequential as `evidence`: pass a "
                                            r"LaplaceEvidence .*then the network\.$"):
            call(net, evidence, x)
    assert no_decay_names(prior) == ["0.bias", "2.bias"]


# --- targets a categorical likelihood does not take ---------------------------------------------------------------


@pytest.mark.parametrize("target", [
    lambda y: F.one_hot(y, 4).double(),
    lambda y: F.one_hot(y, 4),
    lambda y: torch.softmax(torch.randn(8, 4), 1),
], ids=["one-hot float", "one-hot int", "soft labels"])
def test_one_hot_and_soft_labels_are_refused_with_argmax(target):
    logits, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    with pytest.raises(ValueError, match=r"got \(8, 4\) of .*one-hot or soft labels, which are not supported: pass the "
                       r"class indices, y\.argmax\(-1\)\.$"):
        CategoricalLikelihood().check_target(logits, target(y))


def test_regression_targets_of_the_logits_shape_still_name_gaussian_likelihood():
    with pytest.raises(ValueError, match=r"regression targets: for regression use GaussianLikelihood"):
        CategoricalLikelihood().check_target(torch.randn(8, 4), torch.randn(8, 4) + 3)


@pytest.mark.parametrize("logits_shape, labels_shape", [((2, 4, 5), (2, 5)), ((2, 4, 3, 5), (2, 3, 5))])
def test_logits_with_the_classes_second_name_movedim(logits_shape, labels_shape):
    logits, labels = torch.randn(logits_shape), torch.randint(0, 4, labels_shape)
    with pytest.raises(ValueError, match=r"laid out \(batch, classes, \.\.\.\) with 4 classes, as F\.cross_entropy "
                       r"takes them: the classes must be on the last dimension, pass logits\.movedim\(1, -1\)\.$"):
        CategoricalLikelihood().check_target(logits, labels)
    likelihood = CategoricalLikelihood()
    assert torch.allclose(likelihood.nll(logits.movedim(1, -1), labels).mean(), F.cross_entropy(logits, labels))


# --- the NegativeLogLikelihood metric -----------------------------------------------------------------------------


def _nll(probs, target):
    metric = NegativeLogLikelihood()
    metric.update(probs, target)
    return metric.compute()


def test_nll_metric_gathers_classes_on_the_last_dimension_of_sequences():
    torch.manual_seed(3)
    probs, labels = torch.softmax(torch.randn(2, 4, 4), -1), torch.randint(0, 4, (2, 4))
    expected = F.nll_loss(probs.log().reshape(-1, 4), labels.reshape(-1))
    assert rel_err(_nll(probs, labels), expected) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64])
def test_nll_metric_takes_any_integer_labels(dtype):
    probs, labels = torch.softmax(torch.randn(6, 3), 1), torch.randint(0, 3, (6,))
    assert rel_err(_nll(probs, labels.to(dtype)), F.nll_loss(probs.log(), labels)) <= 1e-12


@pytest.mark.parametrize("probs, labels, message", [
    (torch.full((6, 3), 1 / 3), torch.zeros(6, 1, dtype=torch.long),
     r"integer labels of shape \(6,\) \(the probabilities' \(6, 3\) without the classes\), got \(6, 1\)"),
    (torch.full((6, 3), 1 / 3), torch.zeros(6, dtype=torch.float64), r"got \(6,\) of torch.float64: pass integer"),
    (torch.full((6, 3), 1 / 3), torch.tensor([-100, 0, 1, 2, 0, 1]),
     r"labels in \[0, 3\), got values in \[-100, 2\]: leave out the ignored positions"),
    (torch.full((6, 3), 1 / 3), torch.tensor([3, 0, 1, 2, 0, 1]), r"labels in \[0, 3\), got values in \[0, 3\]"),
    (torch.tensor([[2.0, -1.0, 0.5]]).repeat(6, 1), torch.zeros(6, dtype=torch.long), r"got an entry -1 \(logits\?\): "
     r"pass probabilities, logits\.softmax\(-1\)\.$"),
    (torch.full((6, 3), 0.5), torch.zeros(6, dtype=torch.long), r"got a row summing to 1\.5 \(logits\?\)"),
], ids=["(N, 1) labels", "float labels", "ignore_index", "label C", "logits", "rows summing to 1.5"])
def test_nll_metric_refuses_what_it_cannot_score_naming_the_fix(probs, labels, message):
    with pytest.raises(ValueError, match=r"NegativeLogLikelihood takes .*" + message):
        NegativeLogLikelihood().update(probs, labels)
