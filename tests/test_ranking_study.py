"""Fast checks behind the ranking study (examples/ranking_study.py) and the paper's Fig. 4 claim.

* The online prior precision of ``MargLikCallback`` reaches the optimum of a grid search over fixed
  precisions (paper Fig. 4) on a problem small enough for CI: seconds instead of the 130 s of
  ``examples/prior_selection.py`` (whose full-size check stays behind ``MARGLIK_SLOW_TESTS``).
  On small problems trained with Adam for a fixed number of epochs the two optima differ by the
  unconverged weights (and, for curvature that depends on the weights, by the dependence of
  log|H| on the MAP, which Algorithm 1 ignores); the problem here removes both.
* The rank statistics of the study (Spearman rho, its bootstrap over seeds and test examples,
  family mean ranks) against scipy and hand-made cases.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, map_loss

ROOT = Path(__file__).resolve().parent.parent

# The problem: 1-D regression y = sin(3x) + N(0, 0.2^2), N = 50, x uniform on [-2, 2]; a network
# 1-50-1 (tanh) whose first layer is fixed (random features, PyTorch's initial weights times 3) and
# whose read-out (50 weights and a bias) is trained, with a scalar prior and the known noise 0.2.
# Trainable parameters enter linearly, so the MAP for every delta is unique (a grid over delta is smooth), the Kronecker GGN
# of the read-out is exact, and L-BFGS reaches the MAP within one epoch: what is left to check is
# Algorithm 1 itself -- estimate, Newton on log delta, write the buffer, train on with the new
# delta in ``map_loss`` -- against the evidence of the MAP at each fixed delta. The optimum
# (delta ~ 0.4) is strong enough to shape the MAP: with the prior in ``map_loss`` off by a factor 2
# either way, the online log delta ends 0.4-1.1 away from the grid optimum instead of 0.01
# (measured when this test was written), so the factor 1.1 tolerance (0.095 in log delta) catches it.
N, WIDTH, SIGMA, EPOCHS = 50, 50, 0.2, 10
INITS = (1e-3, 1.0, 1e2)
FACTOR = 1.1  # the online precision must end within this factor of the grid optimum
GRID = np.arange(-8.0, 4.001, 0.1)  # log delta


def _data():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(N, 1, generator=g) * 4 - 2).to(torch.get_default_dtype())
    y = torch.sin(3 * x) + SIGMA * torch.randn(N, 1, generator=g).to(torch.get_default_dtype())
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same random features in every run
    net = nn.Sequential(nn.Linear(1, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    net[0].requires_grad_(False)
    with torch.no_grad():
        net[0].weight.mul_(3.0)  # features tanh(w x + b) with |w| up to 3: about as wiggly as sin(3x)
    return net


def _online(x, y, init: float):
    """Algorithm 1 in a Trainer: full-batch L-BFGS epochs, an estimate after every epoch."""
    import pytorch_lightning as pl

    from lightning_marglik.selection import quiet_lightning

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.prior = GaussianPrior(self.net, precision=init, structure="scalar")
            self.likelihood = GaussianLikelihood(sigma=SIGMA, learn_sigma=False)

        def forward(self, inputs):
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior, N)

        def configure_optimizers(self):
            trainable = [p for p in self.net.parameters() if p.requires_grad]
            return torch.optim.LBFGS(trainable, lr=1, max_iter=50, history_size=20, line_search_fn="strong_wolfe")

    model = Model()
    callback = MargLikCallback(structure="kron", approx="ggn", frequency=1, steps=20, solver="newton", settle=None)
    trainer = pl.Trainer(max_epochs=EPOCHS, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, accelerator="cpu")
    with quiet_lightning():
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=N))
    return model.prior.log_precision.item(), callback.final_marglik


def _grid_marglik(x, y, log_delta: float) -> float:
    """Evidence / N of the network at the exact MAP for the fixed precision exp(log_delta)."""
    net = _net()
    delta = math.exp(log_delta)
    prior = GaussianPrior(net, precision=delta, structure="scalar", learn=False)
    likelihood = GaussianLikelihood(sigma=SIGMA, learn_sigma=False)
    with torch.no_grad():
        features = torch.cat([net[1](net[0](x)), torch.ones(N, 1)], dim=1)
        theta = torch.linalg.solve(features.T @ features / SIGMA**2 + delta * torch.eye(WIDTH + 1),
                                   features.T @ y / SIGMA**2)
        net[2].weight.copy_(theta[:WIDTH].T)
        net[2].bias.copy_(theta[WIDTH:, 0])
    evidence = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=N), likelihood, prior,
                                   structure="kron", approx="ggn")
    return evidence.log_marglik().item() / N


def test_online_prior_precision_from_1e_3_1_and_1e2_ends_within_factor_1_1_of_grid_optimum():
    """Paper Fig. 4 in seconds: the precision learned online from three initial values 5 orders of
    magnitude apart ends within a factor 1.1 of the evidence-optimal fixed precision of a grid
    search (refined by the vertex of the parabola through the best grid point and its neighbours),
    with the grid's best evidence."""
    torch.set_num_threads(1)
    x, y = _data()
    values = np.array([_grid_marglik(x, y, float(v)) for v in GRID])
    best = int(np.argmax(values))
    assert 0 < best < len(GRID) - 1, "grid optimum at the edge of the grid"
    f0, f1, f2 = values[best - 1: best + 2]
    step = GRID[1] - GRID[0]
    optimum = GRID[best] + step * 0.5 * (f0 - f2) / (f0 - 2 * f1 + f2)
    for init in INITS:
        final, marglik = _online(x, y, init)
        assert abs(final - optimum) <= math.log(FACTOR), (init, math.exp(final), math.exp(optimum))
        assert marglik == pytest.approx(values[best], abs=1e-3), (init, marglik, values[best])


# --- the study's statistics ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, str(ROOT / "examples"))
    import ranking_study

    return ranking_study


def test_spearman_matches_scipy_with_ties(study):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=22), rng.integers(0, 5, size=22).astype(float)  # b has ties
    assert study.spearman(a, b) == pytest.approx(stats.spearmanr(a, b)[0], abs=1e-12)
    batch = rng.normal(size=(3, 22))
    assert np.allclose(study.spearman(batch, b), [stats.spearmanr(row, b)[0] for row in batch])


def test_bootstrap_interval_contains_rho_and_is_degenerate_for_a_perfect_noise_free_ranking(study):
    rng = np.random.default_rng(1)
    quality = np.linspace(0.6, 0.95, 8)
    correct = (rng.random((8, 2, 400)) < quality[:, None, None]).astype(float)
    evidence = np.repeat(quality[:, None], 2, axis=1)
    rho, low, high = study.bootstrap_spearman(evidence, correct, samples=300)
    assert low <= rho <= high and rho > 0.9
    exact = np.repeat(np.repeat(quality[:, None, None], 2, axis=1), 5, axis=2)  # every test example says the same
    assert study.bootstrap_spearman(evidence, exact, samples=50) == pytest.approx((1.0, 1.0, 1.0))


def test_family_mean_ranks_rank_highest_evidence_first(study):
    ranks = study.family_mean_ranks([-0.3, -0.5, -0.2, -0.9], ["CNN", "MLP", "ResNet", "MLP"])
    assert ranks == {"MLP": 3.5, "CNN": 2.0, "ResNet": 1.0}


def test_default_ranking_resolves_auto_per_seed_by_the_ef_check(study):
    """Seed 0: no candidate below the threshold, so kron-EF; seed 1: 'b' is, so kron-GGN for every candidate."""
    ef, ggn = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), -np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    ratios = np.array([[0.5, 0.5], [0.31, 0.05], [0.9, np.nan]])  # NaN: not measured, not flagged
    ranked, choices = study.default_ranking(ef, ggn, ratios, ["a", "b", "c"], [5000, 5000, 5000], 40000)
    assert choices == ["kron-ef", "kron-ggn"]
    assert ranked.tolist() == [[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]]
    with pytest.raises(ValueError, match="resolves to 'full-ggn'"):  # small enough for the full GGN: not measured
        study.default_ranking(ef, ggn, ratios, ["a", "b", "c"], [50, 50, 50], 400)


def test_the_rescaled_ef_records_the_check_of_an_own_forward_pass_and_divides_the_curvature(study):
    from lightning_marglik import CategoricalLikelihood
    from lightning_marglik.diagnostics import ef_curvature_ratio

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(60, 1, 4, 4)
    with torch.no_grad():  # labels the network predicts confidently: r well below 1, as for a fitted network
        net[-1].weight.mul_(5)
        loader = DataLoader(TensorDataset(x, net(x).argmax(1)), batch_size=20)
    state = {"net": {k: v.clone() for k, v in net.state_dict().items()}, "log_precision": torch.zeros(4)}
    plain, rescaled = (study.posthoc_evidence(net, state, loader, label, "layerwise", 0)
                       for label in ("kron-EF", "kron-EF/r"))
    ratio = ef_curvature_ratio(net, loader, CategoricalLikelihood())
    assert plain["ef_ratio"] == pytest.approx(ratio, rel=1e-10)
    assert rescaled["ef_ratio"] == pytest.approx(ratio, rel=1e-10)
    assert ratio < 1 and rescaled["marglik"] < plain["marglik"]  # more curvature: a larger Occam penalty


def test_the_held_output_layer_evidence_keeps_its_precision_and_the_plain_one_learns_it(study):
    """``", output held"`` (issue 52): Newton on every precision but the output layer's, held at its trained value;
    reference: a prior with the output layer in ``fixed=``, the same pass and Newton by hand."""
    from lightning_marglik import CategoricalLikelihood
    from lightning_marglik.curvature import collect_statistics

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(60, 1, 4, 4)
    loader = DataLoader(TensorDataset(x, torch.arange(60) % 3), batch_size=20)
    state = {"net": {k: v.clone() for k, v in net.state_dict().items()}, "log_precision": torch.zeros(4)}
    held, learned = (study.posthoc_evidence(net, state, loader, label, "layerwise", 0)
                     for label in ("kron-GGN folded, output held", "kron-GGN folded"))

    def by_hand(fixed):
        prior, likelihood = GaussianPrior(net, fixed=fixed), CategoricalLikelihood()
        evidence = LaplaceEvidence.from_statistics(collect_statistics(net, loader, likelihood, prior), likelihood, prior)
        return evidence.optimize(solver="newton", max_evaluations=50).value.item() / 60

    assert held["marglik"] == pytest.approx(by_hand(["3.weight", "3.bias"]), rel=1e-6)
    assert learned["marglik"] == pytest.approx(by_hand(None), rel=1e-6)
    assert learned["marglik"] > held["marglik"] + 1e-3
