"""Issue 25, items 1 and 4, through a real Trainer.

1. ``statistics="training"`` is used only when a training epoch draws every example of the evidence
   data exactly once; what cannot is refused before the first step (the weights untouched), and at
   fixed weights (lr = 0) every estimate equals the evidence pass's, with one N throughout.
4. A BatchNorm that training keeps in eval mode (set in ``on_train_epoch_start``, as fine-tuning
   recipes do) is not treated as scale-invariant: the detection follows the modes training uses.
"""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, MargLikConfigurationError, map_loss
from tests.lightning_models import trainer
from tests.test_training_statistics import Net, categorical_data

torch.set_num_threads(1)

TRAINING = dict(structure="kron", approx="ef", statistics="training", frequency=1, steps=20, settle=None)


def _fit(model, train_loader, epochs: int = 2, callback_kwargs=None, **trainer_kwargs):
    callback = MargLikCallback(**{**TRAINING, **(callback_kwargs or {})})
    trainer([callback], epochs, precision="64-true", **trainer_kwargs).fit(model, train_loader)
    return callback


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "case, match",
    [
        ("drop_last", r"drops the last 10 of 90 examples each epoch \(drop_last=True with batch_size=20"),
        ("limit_train_batches", r"runs 2 of the loader's 5 batches \(Trainer\(limit_train_batches=0.5\)\)"),
        ("dataloader", r"`dataloader` names other evidence data, which they never see"),
        ("weighted_sampler", r"WeightedRandomSampler|by weight|another distribution"),
    ],
)
def test_training_sums_that_would_not_cover_the_evidence_data_each_example_once_are_refused_before_training(case, match):
    data = categorical_data(90 if case == "drop_last" else 100)
    model = Net(CategoricalLikelihood(), lr=0.1).double()
    before = _weights(model)
    kwargs, trainer_kwargs = {}, {}
    if case == "drop_last":
        train_loader = DataLoader(data, batch_size=20, shuffle=True, drop_last=True)
    elif case == "weighted_sampler":
        train_loader = DataLoader(data, batch_size=20, sampler=WeightedRandomSampler(torch.ones(100), 100))
    else:
        train_loader = DataLoader(data, batch_size=20, shuffle=True)
    if case == "limit_train_batches":
        trainer_kwargs["limit_train_batches"] = 0.5
    if case == "dataloader":
        kwargs["dataloader"] = DataLoader(categorical_data(50), batch_size=10)
    with pytest.raises(MargLikConfigurationError, match=match):
        _fit(model, train_loader, callback_kwargs=kwargs, **trainer_kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))  # refused before the first step


def test_at_fixed_weights_every_training_estimate_equals_the_pass_with_one_n():
    """drop_last=True whose batch size divides the data drops nothing: accepted, and at lr = 0 two
    estimates agree with each other and with the evidence pass, N fixed at the data's 90."""
    data = categorical_data(90)
    estimates, n_data = {}, {}
    for statistics in ("training", "pass"):
        torch.manual_seed(0)
        model = Net(CategoricalLikelihood(), lr=0.0).double()
        loader = DataLoader(data, batch_size=10, shuffle=True, drop_last=True)
        callback = _fit(model, loader, epochs=2, callback_kwargs=dict(statistics=statistics, steps=0))
        estimates[statistics] = [row["marglik"] for row in callback.history]
        n_data[statistics] = int(model.prior.n_data)
    assert n_data == {"training": 90, "pass": 90}
    assert estimates["training"][0] == pytest.approx(estimates["training"][1], rel=1e-10)
    assert estimates["training"] == pytest.approx(estimates["pass"], rel=1e-8)


class FrozenNormNet(pl.LightningModule):
    """conv -> BatchNorm -> tanh -> head; ``freeze`` keeps the BatchNorm in eval mode during training."""

    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
                                 nn.Linear(4 * 5 * 5, 2))
        self.prior = GaussianPrior(self.net, structure="layerwise")
        self.likelihood = CategoricalLikelihood()
        self.freeze = freeze
        self.norm_modes: list = []

    def forward(self, x):
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        if self.freeze:
            self.net[1].eval()

    def training_step(self, batch, batch_idx):
        self.norm_modes.append(self.net[1].training)
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)


@pytest.mark.parametrize("freeze", [False, True], ids=["batch-statistics", "frozen-in-eval-mode"])
def test_a_batchnorm_kept_in_eval_mode_by_the_training_recipe_is_not_treated_as_scale_invariant(freeze):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 1, 5, 5, generator=g), torch.randint(0, 2, (48,), generator=g))
    model = FrozenNormNet(freeze)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([MargLikCallback(frequency=1, steps=10, biases="learn")], 2).fit(model, DataLoader(data, batch_size=16))
    assert set(model.norm_modes) == {not freeze}  # the recipe did what it says
    scale = [str(w.message) for w in caught if "invariant to the scale" in str(w.message)]
    if freeze:
        assert model.prior.scale_invariant == []
        assert torch.equal(model.prior.weight_decay_log_precision(), model.prior.log_precision.detach())
        assert scale == []  # no false warning: the set-up check's answer is held until the modes are known
        (note,) = [str(w.message) for w in caught if "in eval mode" in str(w.message)]
        assert "net.1 (BatchNorm2d) in eval mode" in note and "['0.weight', '0.bias'] are not scale-invariant" in note
    else:
        assert model.prior.scale_invariant == ["0.weight", "0.bias"] and len(scale) == 1
        assert torch.equal(model.prior.weight_decay_log_precision()[:2], torch.zeros(2))
