"""fold_batchnorm (lightning_marglik.folding), in float64: the folded copy computes the eval-mode function
exactly, has no norm parameters, and its weights -- so any evidence of it -- do not depend on the scale of the
channels in front of a BatchNorm, which the evidence of the network itself does."""
import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence, LogNormalHyperprior
from lightning_marglik.folding import fold_batchnorm


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN plus the identity, as in the ranking study's ResNets."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), Block(3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3), nn.BatchNorm1d(3))


def data(n: int = 24):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def trained_statistics(net: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    net = net.double()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d) or isinstance(m, nn.BatchNorm1d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
        net.train()
        for _ in range(3):
            net(data()[0] * 2 + 0.5)
    return net.eval()


def optimized_full_evidence(net: nn.Module) -> float:
    x, y = data()
    evidence = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=8), CategoricalLikelihood(),
                                   GaussianPrior(net, precision=0.5), structure="full")
    solution = evidence.optimize(solver="newton", max_evaluations=100, tol=1e-10)
    assert solution.converged
    return float(solution.value)


def test_the_folded_copy_computes_the_eval_mode_function_without_norm_parameters():
    net = trained_statistics(resnet())
    reference = copy.deepcopy(net.state_dict())
    x, _ = data()
    folded = fold_batchnorm(net, x)
    assert folded.folded == {"0": "1", "3.conv1": "3.bn1", "3.conv2": "3.bn2", "6": "7"}
    assert not any(isinstance(m, nn.BatchNorm2d) or isinstance(m, nn.BatchNorm1d) for m in folded.model.modules())
    torch.testing.assert_close(folded.model(x), net(x), rtol=1e-12, atol=1e-12)
    names = {n for n, _ in folded.model.named_parameters()}
    assert {"3.conv1.bias", "3.conv2.bias"} <= names and not any("bn" in n for n in names)
    sizes = sum(p.numel() for p in folded.model.parameters())
    assert sizes == sum(p.numel() for p in net.parameters()) - 2 * (3 + 3 + 3 + 3) + (3 + 3)  # 2 biases created
    for name, value in net.state_dict().items():  # the original is untouched
        assert torch.equal(value, reference[name])


def test_the_folded_weights_do_not_depend_on_the_scale_of_the_normalized_channels():
    net = trained_statistics(resnet())
    x, _ = data()
    moved = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # each channel in front of a BatchNorm rescaled, its running statistics with it
        for layer, norm in ((moved[0], moved[1]), (moved[3].conv1, moved[3].bn1), (moved[3].conv2, moved[3].bn2)):
            s = torch.exp(torch.randn(layer.out_channels, generator=g, dtype=torch.float64))
            layer.weight.mul_(s.view(-1, 1, 1, 1))
            if layer.bias is not None:
                layer.bias.mul_(s)
            norm.running_mean.mul_(s)
            norm.running_var.copy_(s ** 2 * (norm.running_var + norm.eps) - norm.eps)
    torch.testing.assert_close(moved(x), net(x), rtol=1e-10, atol=1e-10)
    assert abs(optimized_full_evidence(moved) - optimized_full_evidence(net)) > 0.05
    a, b = fold_batchnorm(net, x).model, fold_batchnorm(moved, x).model
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)
    assert optimized_full_evidence(a) == pytest.approx(optimized_full_evidence(b), rel=1e-8)


def test_what_does_not_fold_stays():
    plain = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    x, _ = data()
    folded = fold_batchnorm(plain, x)
    assert folded.folded == {}
    for p, q in zip(folded.model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    # normalizes by the batch in eval mode too: nothing to fold
    batch_stats = trained_statistics(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, track_running_stats=False),
                                                   nn.Flatten(), nn.Linear(8, 3)))
    assert fold_batchnorm(batch_stats, x).folded == {}


class SharedOutput(nn.Module):
    """The conv's output goes into the BatchNorm and into a residual sum: the norm is not its only consumer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(1, 1, 3, padding=1), nn.BatchNorm2d(1), nn.Linear(16, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.head((self.bn(h) + h).flatten(1))


def test_a_layer_whose_output_is_used_elsewhere_is_not_folded():
    net = trained_statistics(SharedOutput())
    x, _ = data()
    folded = fold_batchnorm(net, x)
    assert folded.folded == {}
    torch.testing.assert_close(folded.model(x), net(x))


def test_a_batch_with_non_finite_outputs_is_refused():
    net = trained_statistics(resnet())
    with pytest.raises(ValueError, match="not finite"):
        fold_batchnorm(net, torch.full((4, 1, 4, 4), float("inf"), dtype=torch.float64))


def small_net() -> nn.Module:
    """conv (no bias) -> BatchNorm -> ReLU -> a Linear head that does not fold."""
    return trained_statistics(nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2), nn.ReLU(),
                                            nn.Flatten(), nn.Linear(8, 3)))


def test_the_prior_is_carried_to_the_folded_network_with_its_precisions_and_treatments():
    net = small_net()
    hyperprior = LogNormalHyperprior(scale=2.0)
    prior = GaussianPrior(net, precision=0.5, fixed=["4.bias"], hyperprior=hyperprior).double()
    with torch.no_grad():
        prior.log_precision.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))  # 0.weight 1.weight 1.bias 4.weight 4.bias
    prior.treat_scale_invariant(["0.weight"], "fixed")
    prior.treat(["4.weight"], "decoupled", "mine")
    prior.record_n_data(24)
    before = (list(prior.param_names), prior.log_precision.clone())
    folded = fold_batchnorm(net, data()[0], prior=prior)
    new = folded.prior
    assert new.model is folded.model and new.param_names == ["0.weight", "0.bias", "4.weight", "4.bias"]
    # the folded weight starts from its old precision, the new bias from the declared one; the head keeps its own
    torch.testing.assert_close(new.log_precision, torch.tensor([1.0, math.log(0.5), 4.0, 5.0], dtype=torch.float64))
    assert new.fixed == ["4.bias"] and new.treated("decoupled") == ["4.weight"]
    assert new.scale_invariant == [] and new.learned_names() == ["0.weight", "0.bias", "4.weight"]
    assert new.hyperprior is hyperprior and new.initial_precision == 0.5 and int(new.n_data) == 24
    assert (prior.param_names, prior.log_precision.tolist()) == (before[0], before[1].tolist())  # the original stays
    assert prior.model is net


def test_diagonal_and_scalar_priors_carry_their_values():
    net = small_net()
    diagonal = GaussianPrior(net, precision=2.0, structure="diagonal")
    with torch.no_grad():
        diagonal.log_precision.normal_(generator=torch.Generator().manual_seed(0))
    new = fold_batchnorm(net, data()[0], prior=diagonal).prior
    old = dict(zip(diagonal.param_names, torch.split(diagonal.log_precision, diagonal.param_sizes)))
    values = dict(zip(new.param_names, torch.split(new.log_precision, new.param_sizes)))
    for name in ("0.weight", "4.weight", "4.bias"):
        assert torch.equal(values[name], old[name]), name
    assert torch.equal(values["0.bias"], torch.full((2,), math.log(2.0)))
    scalar = GaussianPrior(net, precision=3.0, structure="scalar")
    with torch.no_grad():
        scalar.log_precision.fill_(-1.5)
    assert fold_batchnorm(net, data()[0], prior=scalar).prior.log_precision.tolist() == [-1.5]


class Holder(nn.Module):
    """A network with its prior registered beside it, as a LightningModule holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_net()
        self.prior = GaussianPrior(self.net)

    def forward(self, x):
        return self.net(x)


def test_in_a_module_that_holds_the_prior_the_copy_holds_the_carried_prior():
    holder = Holder()
    folded = fold_batchnorm(holder, data()[0], prior=holder.prior)
    assert folded.folded == {"net.0": "net.1"}
    assert folded.model.prior is folded.prior and folded.prior.model is folded.model.net
    assert holder.prior.model is holder.net and "1.weight" in holder.prior.param_names
    assert [m for m in folded.model.modules() if isinstance(m, GaussianPrior)] == [folded.prior]


def test_a_prior_of_another_network_or_not_a_prior_is_refused():
    with pytest.raises(ValueError, match="not part of the Sequential"):
        fold_batchnorm(small_net(), data()[0], prior=GaussianPrior(small_net()))
    with pytest.raises(ValueError, match="`prior` must be the network's GaussianPrior .*got Tensor"):
        fold_batchnorm(small_net(), data()[0], prior=torch.zeros(3))
