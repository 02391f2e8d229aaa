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
    NegativeLogLikelihood, collect_statistics, linearized_outputs, map_loss, predict_classification,
    predict_regression,
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
