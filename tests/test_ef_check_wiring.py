"""The empirical Fisher's curvature check where EF evidence is used (issue 24, item 2): the callback's
estimates with ``approx="ef"`` and ``select_models``' EF ranking, read from the pass's own sums.

References: :func:`lightning_marglik.diagnostics.ef_curvature_ratio`, a separate forward pass over
the same data at the same weights; the warning names exactly the models below the threshold.
"""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss, select_models
from lightning_marglik.diagnostics import EF_RATIO_THRESHOLD, ef_curvature_ratio
from tests.lightning_models import BlobData, Classifier, trainer

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float32():
    """Lightning's default training dtype (the models and BlobData are float32)."""
    torch.set_default_dtype(torch.float32)


# four classes with a margin: the rows of the map, and data near twice each row
MAP = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [-0.577, -0.577, -0.577]])


class Fitted(pl.LightningModule):
    """A linear classifier whose logits are ``scale`` times a fixed map, on labels that map predicts
    with a margin: a large ``scale`` fits its training labels with growing confidence (interpolation)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.net = nn.Linear(3, 4)
        with torch.no_grad():
            self.net.weight.copy_(scale * MAP)
            self.net.bias.zero_()
        self.prior = GaussianPrior(self.net)
        self.likelihood = CategoricalLikelihood()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # fixed weights: every estimate sees the same fit


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    y = torch.arange(64) % 4
    return DataLoader(TensorDataset(2 * MAP[y] + 0.1 * torch.randn(64, 3, generator=g), y), batch_size=16)


@pytest.mark.parametrize("statistics", ["pass", "training"])
@pytest.mark.parametrize("scale", [0.3, 10.0], ids=["calibrated", "interpolating"])
def test_the_callback_records_the_ratio_of_its_own_sums_and_warns_once_below_the_threshold(scale, statistics):
    # float64: at interpolation float32 gradients cancel (p ~ 1 - 1e-8), which the training check refuses
    model = Fitted(scale).double()
    callback = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=1, steps=5, statistics=statistics)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], 3, precision="64-true").fit(model, _data())
    ratios = [row["ef_curvature_ratio"] for row in callback.history]
    expected = ef_curvature_ratio(model, _data(), model.likelihood)  # a pass of its own at the same weights
    assert ratios == pytest.approx([expected] * 3, rel=1e-6)
    below = expected < EF_RATIO_THRESHOLD
    assert below is (scale > 1)  # the two cases do fall on either side
    messages = [str(w.message) for w in caught if "empirical Fisher" in str(w.message)]
    assert len(messages) == int(below)
    if below:
        assert "the model after epoch 1" in messages[0] and 'approx="ggn"' in messages[0]


def test_a_ggn_callback_records_no_ratio():
    callback = MargLikCallback(structure="diag", approx="ggn", frequency=1, steps=5)
    trainer([callback], 1).fit(Fitted(10.0), _data())
    assert "ef_curvature_ratio" not in callback.history[0]


def test_select_models_names_the_candidates_whose_ef_evidence_is_unreliable():
    candidates = {"fitted": lambda: Fitted(10.0), "mlp": lambda: Classifier(60, width=8)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted = select_models({"fitted": candidates["fitted"]}, train_dataloader=_data(),
                               callback={"structure": "diag", "approx": "ggn", "steps": 5},
                               trainer={"max_epochs": 2, "enable_progress_bar": False}, rank_by="kron-ef",
                               verbose=False)[0]
        mlp = select_models({"mlp": candidates["mlp"]}, datamodule=BlobData(),
                            callback={"structure": "diag", "approx": "ggn", "steps": 5},
                            trainer={"max_epochs": 2, "enable_progress_bar": False}, rank_by="kron-ef",
                            verbose=False)[0]
    assert fitted.ef_curvature_ratio < EF_RATIO_THRESHOLD < mlp.ef_curvature_ratio
    messages = [str(w.message) for w in caught if "empirical Fisher" in str(w.message)]
    assert len(messages) == 1 and "'fitted'" in messages[0] and "'mlp'" not in messages[0]
    assert 'rank_by="kron-ggn"' in messages[0]
    ggn = select_models({"fitted": candidates["fitted"]}, train_dataloader=_data(),
                        callback={"structure": "diag", "approx": "ggn", "steps": 5},
                        trainer={"max_epochs": 1, "enable_progress_bar": False}, rank_by="kron-ggn", verbose=False)[0]
    assert ggn.ef_curvature_ratio is None  # a GGN ranking needs no check


def test_a_likelihood_whose_statistics_lack_the_traces_gets_no_ratio_and_no_error():
    """A subclass with statistics of its own (no traces): the estimate runs, no ratio is recorded."""

    class OwnStatistics(CategoricalLikelihood):
        def term_statistics(self, output, target, mask):
            return {"log_lik": -self.term_nll(output, target).sum()}

    model = Fitted(10.0).double()
    model.likelihood = OwnStatistics()
    callback = MargLikCallback(structure="diag", approx="ef", frequency=1, steps=5)
    trainer([callback], 1, precision="64-true").fit(model, _data())
    assert len(callback.history) == 1 and "ef_curvature_ratio" not in callback.history[0]
