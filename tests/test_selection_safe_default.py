"""``select_models``' default never ranks by an evidence its own EF check flags, and warns when candidates
with and without normalization layers are compared (issue 33).

References: real ``select_models`` runs (real ``Trainer``, real evidence passes); the same runs with
``rank_by="kron-ef"`` given explicitly; the test accuracy on held-out data of the same generator.
"""
from __future__ import annotations

import json
import warnings
from typing import List, Tuple

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, map_loss, select_models
from lightning_marglik.diagnostics import EF_RATIO_THRESHOLD
from lightning_marglik.selection.comparability import mixed_normalization_message, normalization_layers
from lightning_marglik.selection.driver import resolve_auto
from tests.lightning_models import BlobData, Classifier

torch.set_num_threads(1)

N_TRAIN, CLASSES, SIZE = 64, 4, 8


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def motifs(n: int, seed: int, label_noise: float) -> TensorDataset:
    """8 x 8 images of noise with one of four fixed 3 x 3 motifs at a random place; the label names the
    motif, a random one for a ``label_noise`` fraction: a task for translation invariance."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, 3, generator=torch.Generator().manual_seed(123))
    y = torch.arange(n) % CLASSES
    x = 0.3 * torch.randn(n, 1, SIZE, SIZE, generator=g)
    corners = torch.randint(0, SIZE - 2, (n, 2), generator=g)
    for i, (row, col) in enumerate(corners.tolist()):
        x[i, 0, row:row + 3, col:col + 3] += patterns[y[i]]
    noisy = torch.rand(n, generator=g) < label_noise
    return TensorDataset(x, torch.where(noisy, torch.randint(0, CLASSES, (n,), generator=g), y))


class Net(pl.LightningModule):
    """A network with a layerwise prior and a categorical likelihood, trained by Adam on ``map_loss``."""

    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net, self.lr = net, lr
        self.prior = GaussianPrior(net)
        self.likelihood = CategoricalLikelihood()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, N_TRAIN)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)


CANDIDATES = {
    # 16,644 parameters for 64 images: it fits them, noisy labels included
    "mlp": lambda: Net(nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 256), nn.ReLU(), nn.Linear(256, CLASSES)),
                       1e-2),
    # 116 parameters, translation-invariant: it cannot fit the noisy labels
    "cnn": lambda: Net(nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                                     nn.Linear(8, CLASSES)), 3e-2),
}


def select(**kwargs) -> Tuple[List, List[str]]:
    """Both candidates, 100 epochs of the 64 training images in one batch (no estimate before the end: the
    callback's learned precision does not hold the MLP back); the results and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = select_models(CANDIDATES, train_dataloader=DataLoader(motifs(N_TRAIN, 0, 0.1), batch_size=N_TRAIN),
                                test_dataloader=DataLoader(motifs(500, 1, 0.0), batch_size=500),
                                callback={"frequency": 1000, "settle": None},
                                trainer={"max_epochs": 100, "enable_progress_bar": False}, verbose=False, **kwargs)
    return results, [str(w.message) for w in caught]


def test_the_default_does_not_pick_the_interpolating_mlp_its_ef_check_flags(tmp_path):
    results, messages = select(output_dir=str(tmp_path))
    by_name = {r.name: r for r in results}
    mlp, cnn = by_name["mlp"], by_name["cnn"]
    # the situation: the MLP fits its training set (flagged), the CNN does not and tests far better ...
    assert mlp.ef_curvature_ratio < EF_RATIO_THRESHOLD < cnn.ef_curvature_ratio
    assert cnn.metrics["accuracy"] > mlp.metrics["accuracy"] + 0.3
    # ... and kron-EF, the default before, rates the MLP higher
    assert mlp.evidences["kron-ef"] > cnn.evidences["kron-ef"]
    # the default ranks both by the Kronecker GGN, says why, and picks the CNN
    assert [r.name for r in results] == ["cnn", "mlp"]
    assert {r.rank_by for r in results} == {"kron-ggn"}
    for r in results:
        assert r.marglik == r.evidences["kron-ggn"]
        assert "the empirical Fisher's check flags candidate 'mlp' (" in r.rank_by_reason
        assert "'cnn' (" not in r.rank_by_reason
    assert not [m for m in messages if "empirical Fisher evidence" in m]  # auto heeds the check: nothing to warn
    saved = {row["name"]: row for row in json.loads((tmp_path / "results.json").read_text())}
    assert saved["mlp"]["rank_by"] == "kron-ggn" and "flags candidate 'mlp'" in saved["mlp"]["rank_by_reason"]
    # asked for explicitly, kron-EF ranks as asked: the flagged MLP first, with the check's warning
    explicit, messages = select(rank_by="kron-ef")
    assert explicit[0].name == "mlp" and explicit[0].rank_by_reason == "rank_by='kron-ef' was asked for"
    assert len([m for m in messages if "empirical Fisher evidence of 'mlp'" in m]) == 1


def test_auto_resolves_by_the_ef_check_only_where_it_would_rank_by_the_ef():
    too_large = {"a": "too large", "b": "too large"}
    assert resolve_auto(too_large, {"a": 0.5, "b": 0.31})[0] == "kron-ef"
    assert resolve_auto(too_large, {"a": 0.5, "b": None})[0] == "kron-ef"  # not measured: not flagged
    choice, why = resolve_auto(too_large, {"a": 0.05, "b": 0.29})
    assert choice == "kron-ggn"
    assert "flags candidates 'a' (0.05), 'b' (0.29) (tr EF / tr GGN below 0.3): they fit their training set" in why
    assert resolve_auto({"a": None, "b": None}, {"a": 0.05, "b": 0.29})[0] == "full-ggn"  # the EF is not used


def test_candidates_with_and_without_normalization_are_ranked_with_a_warning_naming_them(tmp_path):
    def group_norm() -> Classifier:
        module = Classifier(60, width=8)
        module.net = nn.Sequential(nn.Linear(2, 8), nn.GroupNorm(2, 8), nn.Tanh(), nn.Linear(8, 3))
        module.prior = GaussianPrior(module.net)
        return module

    candidates = {"plain": lambda: Classifier(60, width=8), "bn": lambda: Classifier(60, width=8, norm=True),
                  "gn": group_norm}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = select_models(candidates, datamodule=BlobData(), callback={"steps": 5},
                                trainer={"max_epochs": 2, "enable_progress_bar": False}, verbose=False,
                                output_dir=str(tmp_path))
    assert sorted(r.name for r in results) == ["bn", "gn", "plain"]  # ranked all the same
    assert {r.name: r.normalization for r in results} == {"plain": [], "bn": ["BatchNorm1d"], "gn": ["GroupNorm"]}
    messages = [str(w.message) for w in caught if "normalization layers" in str(w.message)]
    assert len(messages) == 1
    assert ("cannot compare candidates with normalization layers ('bn' (BatchNorm1d), 'gn' (GroupNorm)) and "
            "without ('plain') by their evidence") in messages[0]
    assert "When to trust Step 2" in messages[0]
    saved = {row["name"]: row["normalization"] for row in json.loads((tmp_path / "results.json").read_text())}
    assert saved == {"plain": [], "bn": ["BatchNorm1d"], "gn": ["GroupNorm"]}


def test_the_normalization_check_names_only_mixed_runs():
    assert normalization_layers(nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Linear(4, 4),
                                              nn.BatchNorm1d(4), nn.InstanceNorm1d(4))) == \
        ["BatchNorm1d", "InstanceNorm1d", "LayerNorm"]
    assert normalization_layers(nn.Sequential(nn.Linear(2, 4), nn.ReLU())) == []
    assert mixed_normalization_message({"a": [], "b": []}) == ""
    assert mixed_normalization_message({"a": ["BatchNorm2d"], "b": ["LayerNorm"]}) == ""  # all normalized
    assert mixed_normalization_message({"a": ["BatchNorm2d"], "old": None}) == ""  # an older file's result: unknown
    message = mixed_normalization_message({"a": ["BatchNorm2d"], "b": [], "old": None})
    assert "('a' (BatchNorm2d)) and without ('b')" in message and "'old'" not in message
