"""Kronecker log-determinants with factors that have zero rows (a 3x3 convolution on a 1x1 map, as
resnet18's last stage on 32x32 inputs; a dead unit): the eigen-solve runs on the non-zero part only
and the zero products enter in closed form. Checked against every ``log(s q_i w_j + delta)`` from
the eigenvalues of the whole factors, in float64."""
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.curvature.structures.kron import KronStructure


def conv_on_one_pixel() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        net[0].weight[2] = 0  # output unit 2 dead: its bias-and-weight rows of the next layer's input factor are zero
        net[0].bias[2] = -1
    return net


def brute_force_log_det(structure: KronStructure, scale: float, log_delta) -> float:
    total = 0.0
    for j, layer in enumerate(structure.layers):
        g, a = structure._factors(j)
        q = torch.linalg.eigvalsh(g).clamp(min=0)
        w = torch.linalg.eigvalsh(a[0]).clamp(min=0)
        total += torch.log(scale * torch.outer(q, w) + math.exp(log_delta[layer.roles["weight"]])).sum().item()
        total += torch.log(scale * q + math.exp(log_delta[layer.roles["bias"]])).sum().item()
    return total


def test_zero_rows_are_left_out_of_the_eigen_solve_exactly(monkeypatch):
    sizes = []
    eigvalsh = torch.linalg.eigvalsh

    def recording(matrix):
        sizes.append(matrix.shape[-1])
        return eigvalsh(matrix)

    monkeypatch.setattr(torch.linalg, "eigvalsh", recording)
    net = conv_on_one_pixel()
    x, y = torch.randn(50, 4, 1, 1, dtype=torch.float64), torch.randint(0, 3, (50,))
    prior = GaussianPrior(net, structure="layerwise")
    with torch.no_grad():
        prior.log_precision.copy_(torch.tensor([0.3, -1.0, 2.0, 0.5]))
    ev = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=25), CategoricalLikelihood(temperature=0.7),
                             prior, structure="kron")
    (structure,) = ev.structures
    # conv: A 36 -> 4 (the centre taps), G 6 -> 5 (the dead unit has no output gradient); linear: A 6 -> 5, G 3
    assert sorted(sizes) == [3, 4, 5, 5]
    _, a = structure._factors(0)
    assert int((torch.diagonal(a[0]) == 0).sum()) == 4 * 8  # 8 of the 9 taps read padding only
    _, a = structure._factors(1)
    assert int((torch.diagonal(a[0]) == 0).sum()) == 1  # the dead unit
    expected = brute_force_log_det(structure, 1 / 0.7, prior.log_precision.tolist())
    assert abs(ev.log_det().item() - expected) < 1e-11 * abs(expected)
    derivatives = structure.log_det_derivatives(torch.tensor(1 / 0.7, dtype=torch.float64),
                                                list(prior.log_precision.unbind()))
    assert abs(derivatives.value.item() - expected) < 1e-11 * abs(expected)


def test_non_finite_curvature_still_gives_nan():
    net = conv_on_one_pixel()
    x, y = torch.randn(20, 4, 1, 1, dtype=torch.float64), torch.randint(0, 3, (20,))
    prior = GaussianPrior(net, structure="layerwise")
    ev = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=20), CategoricalLikelihood(), prior,
                             structure="kron")
    (structure,) = ev.structures
    structure.state("0.a")[0, 5, 5] = float("nan")
    structure.prepare()
    assert torch.isnan(ev.log_det())
