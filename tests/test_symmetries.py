"""The canonical point of a network's rescaling orbits (lightning_marglik.symmetries), in float64.

What must hold: the function does not change (training and eval mode); every network of one orbit
is moved to the same point (units: the same weights; normalized channels: the same weights up to one
scale per tensor), so the dense ``full`` evidence with optimized precisions is the same for all of
them while the plain evidence is not; the units' point has the least prior energy of its orbit.
"""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.symmetries import canonicalize


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 5), nn.LeakyReLU(0.1), nn.Linear(5, 3))


def cnn() -> nn.Module:  # conv -> ReLU -> pool -> conv -> flatten -> linear: channel blocks of the flattened map
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


def bn_cnn() -> nn.Module:  # a normalized conv, whose BatchNorm's affine map then feeds a ReLU unit
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3, padding=1, bias=False),
                         nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def data(n: int = 24):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def build(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = factory().double()
    x, _ = data()
    net.train()
    with torch.no_grad():
        for _ in range(3):  # running statistics that are not the initial ones
            net(x * 2 + 0.5)
    return net.eval()


def random_orbit_move(net: nn.Module, seed: int) -> nn.Module:
    """The same function at another point of its orbits: every unit and normalized channel rescaled at random."""
    moved = copy.deepcopy(net)
    g = torch.Generator().manual_seed(seed)
    layers = [m for m in moved if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d))]
    with torch.no_grad():
        for source, target in zip(layers, layers[1:]):
            if isinstance(target, nn.BatchNorm2d):  # channels of a normalized conv: statistics follow
                s = torch.exp(torch.randn(source.out_channels, generator=g, dtype=torch.float64))
                source.weight.mul_(s.view(-1, 1, 1, 1))
                target.running_mean.mul_(s)
                target.running_var.copy_(s ** 2 * (target.running_var + target.eps) - target.eps)
                continue
            channels = source.num_features if isinstance(source, nn.BatchNorm2d) else source.weight.shape[0]
            a = torch.exp(torch.randn(channels, generator=g, dtype=torch.float64))
            source.weight.mul_(a.view(-1, *[1] * (source.weight.dim() - 1)))
            if source.bias is not None:
                source.bias.mul_(a)
            target.weight.view(target.weight.shape[0], channels, -1).div_(a.view(1, -1, 1))
    return moved


def optimized_full_evidence(net: nn.Module) -> float:
    x, y = data()
    prior = GaussianPrior(net, precision=0.5)
    evidence = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=8), CategoricalLikelihood(), prior,
                                   structure="full")
    solution = evidence.optimize(solver="newton", max_evaluations=100, tol=1e-10)
    assert solution.converged
    return float(solution.value)


def prior_energy(net: nn.Module) -> float:
    return float(sum(p.detach().pow(2).sum() for p in net.parameters()))


@pytest.mark.parametrize("factory", [mlp, cnn, bn_cnn])
def test_the_function_does_not_change_in_eval_and_training_mode(factory):
    net = build(factory)
    x, _ = data()
    reference = copy.deepcopy(net)
    report = canonicalize(net, GaussianPrior(net), x)
    assert report.converged and report.sweeps > 1
    assert report.output_change < 1e-12
    torch.testing.assert_close(net(x), reference(x), rtol=1e-10, atol=1e-10)  # eval mode: exact
    for model in (net, reference):  # training mode: batch statistics, invariant up to the norm's eps
        model.train()
        for norm in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.eps = 1e-200
    torch.testing.assert_close(net(x), reference(x), rtol=1e-10, atol=1e-10)
    moved = [n for (n, p), q in zip(net.named_parameters(), reference.parameters()) if not torch.equal(p, q)]
    assert moved, "nothing was moved: the test would pass for a no-op"


def test_what_it_finds():
    net = build(bn_cnn)
    report = canonicalize(net, GaussianPrior(net), data()[0])
    assert report.units == {"0 -> 2": 3, "3 -> 7": 4}  # the BatchNorm's affine map is the second unit layer
    assert report.channels == {"2": 4}
    flat = build(cnn)
    assert canonicalize(flat, GaussianPrior(flat), data()[0]).units == {"0 -> 3": 3, "3 -> 6": 4}


@pytest.mark.parametrize("factory", [mlp, cnn])
def test_every_point_of_a_unit_orbit_goes_to_the_same_weights_of_least_prior_energy(factory):
    net = build(factory)
    x, _ = data()
    canonical = copy.deepcopy(net)
    canonicalize(canonical, GaussianPrior(canonical), x)
    for seed in range(3):
        moved = random_orbit_move(net, seed)
        assert prior_energy(moved) > prior_energy(canonical)
        canonicalize(moved, GaussianPrior(moved), x)
        for p, q in zip(moved.parameters(), canonical.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9)


def test_the_balance_weighs_each_tensor_by_its_precision():
    net = build(mlp)
    prior = GaussianPrior(net)
    with torch.no_grad():
        prior.log_precision.copy_(torch.linspace(-2.0, 2.0, len(prior.log_precision)))
    canonicalize(net, prior, data()[0])
    delta = prior.log_precision.exp()
    first, bias, second = delta[0], delta[1], delta[2]  # 1.weight, 1.bias, 3.weight
    incoming = first * net[1].weight.pow(2).sum(1) + bias * net[1].bias.pow(2)
    outgoing = second * net[3].weight.pow(2).sum(0)
    torch.testing.assert_close(incoming, outgoing, rtol=1e-8, atol=1e-12)  # a^4 = e_out / e_in: balanced


@pytest.mark.parametrize("factory", [mlp, cnn, bn_cnn])
def test_the_full_evidence_at_the_canonical_point_is_the_same_for_every_point_of_the_orbit(factory):
    net = build(factory)
    x, _ = data()
    plain, canonical = [], []
    for seed in range(3):
        moved = random_orbit_move(net, seed)
        plain.append(optimized_full_evidence(moved))
        canonicalize(moved, GaussianPrior(moved), x)
        canonical.append(optimized_full_evidence(moved))
    assert max(plain) - min(plain) > 0.05, "the plain evidence should depend on the point of the orbit"
    assert max(canonical) - min(canonical) < 1e-6 * abs(canonical[0])


def test_a_second_call_moves_nothing():
    net = build(bn_cnn)
    x, _ = data()
    canonicalize(net, GaussianPrior(net), x)
    before = copy.deepcopy(net.state_dict())
    report = canonicalize(net, GaussianPrior(net), x)
    assert report.sweeps == 1
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=1e-9, atol=1e-12)


def test_units_and_channels_can_be_left_alone():
    net = build(bn_cnn)
    report = canonicalize(net, GaussianPrior(net), data()[0], units=False)
    assert report.units == {} and report.channels == {"2": 4}
    untouched = build(bn_cnn)
    reference = copy.deepcopy(untouched.state_dict())
    report = canonicalize(untouched, GaussianPrior(untouched), data()[0], units=False, channels=False)
    assert report.sweeps == 0 and report.converged
    for name, value in untouched.state_dict().items():
        assert torch.equal(value, reference[name])


def test_a_frozen_or_shared_layer_is_not_moved():
    net = build(mlp)
    net[5].weight.requires_grad_(False)  # the prior does not hold it: its energy is unknown
    report = canonicalize(net, GaussianPrior(net), data()[0])
    assert report.units == {"1 -> 3": 6}
    shared = nn.Linear(4, 4).double()
    tied = nn.Sequential(shared, nn.ReLU(), shared)
    assert canonicalize(tied, GaussianPrior(tied), torch.randn(3, 4, dtype=torch.float64)).units == {}


def test_a_flattened_sequence_of_linear_features_is_not_taken_for_channel_blocks():
    # (batch, 4 steps, 5 features) -> Linear -> (batch, 4, 6) -> flatten: step-major, the units interleave
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Flatten(), nn.Linear(24, 2)).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    reference = net(x)
    report = canonicalize(net, GaussianPrior(net), x)
    assert report.units == {}
    torch.testing.assert_close(net(x), reference)


def test_a_prior_of_another_model_is_refused():
    net, other = build(mlp), build(mlp)
    with pytest.raises(ValueError, match="not built on this model"):
        canonicalize(net, GaussianPrior(other), data()[0])


class OutOfOrder(nn.Module):
    """Holds a Sequential but puts a tanh, which is not positively homogeneous, between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        return self.body[2](torch.tanh(self.body[0](x.flatten(1))))


def test_a_forward_that_breaks_the_symmetry_is_refused_and_the_model_restored():
    net = build(OutOfOrder)
    reference = copy.deepcopy(net.state_dict())
    with pytest.raises(RuntimeError, match="changed the model's outputs"):
        canonicalize(net, GaussianPrior(net), data()[0])
    for name, value in net.state_dict().items():
        assert torch.equal(value, reference[name])


def test_a_batch_with_non_finite_outputs_is_refused_before_anything_moves():
    net = build(bn_cnn)
    reference = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="not finite"):
        canonicalize(net, GaussianPrior(net), torch.full((4, 1, 4, 4), float("nan"), dtype=torch.float64))
    for name, value in net.state_dict().items():
        assert torch.equal(value, reference[name])


def test_each_module_keeps_its_own_training_flag():
    net = build(bn_cnn).train()
    net[3].eval()  # a BatchNorm a fine-tuning recipe keeps frozen inside a model in training
    canonicalize(net, GaussianPrior(net), data()[0])
    assert net.training and not net[3].training and net[0].training
