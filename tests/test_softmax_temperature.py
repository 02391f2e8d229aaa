"""A softmax temperature, ``softmax(f / T)``, is the output layer's prior precision in another parametrization.

The paper learns a softmax temperature beside the per-layer precisions (Immer et al. 2021, Fig. 3, App. B).
When the network ends in a linear layer ``f = W h + b`` whose weight and bias have precisions of their own
(a layerwise prior), ``f / T = (W / T) h + b / T``: the tempered model with precisions ``delta_W, delta_b``
at ``(W, b)`` is the untempered one with ``delta_W T^2, delta_b T^2`` at ``(W / T, b / T)``, and the Laplace
evidence, an integral over the weights, is the same under this linear change of variables, under every
curvature structure (each block of the output layer scales by ``1 / T^2``, as its precision does). So a
learned temperature cannot reach an evidence the learned output-layer precision does not: the library offers
no separate softmax temperature (``docs/results.md``, issue 32). Checked here in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

TEMPERATURE = 0.4


class Divide(nn.Module):
    """Logits divided by a fixed temperature (no parameters)."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return f / self.temperature


def _evidence(model: nn.Module, covered: nn.Module, log_delta: torch.Tensor, structure: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 3, generator=g), torch.randint(0, 4, (40,), generator=g)
    prior = GaussianPrior(covered, precision=1.0)
    with torch.no_grad():
        prior.log_precision.copy_(log_delta)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    return LaplaceEvidence.fit(model, loader, CategoricalLikelihood(), prior, structure, "ggn").log_marglik()


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_a_softmax_temperature_is_the_output_layers_precision(structure):
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    log_delta = torch.tensor([0.3, -0.5, 1.2, 0.8])  # layer 1 weight, bias; output weight, bias
    tempered = nn.Sequential(net, Divide(TEMPERATURE))
    moved = copy.deepcopy(net)
    with torch.no_grad():
        moved[2].weight.div_(TEMPERATURE)
        moved[2].bias.div_(TEMPERATURE)
    rescaled = log_delta + torch.tensor([0.0, 0.0, 2.0, 2.0]) * torch.log(torch.tensor(TEMPERATURE))
    expected = _evidence(moved, moved, rescaled, structure)
    torch.testing.assert_close(_evidence(tempered, net, log_delta, structure), expected, rtol=1e-10, atol=0.0)
    # and it is a change of the output layer's precision, not of nothing: at the old precisions it differs
    assert abs(_evidence(moved, moved, log_delta, structure) - expected) > 0.1
