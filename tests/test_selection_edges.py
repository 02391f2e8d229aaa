"""Model selection at its edges (a probe's findings): candidates that cannot be ranked together, evidences that are
not finite, unequal training, resume after a candidate changed, and what the command line says it wrote."""
from __future__ import annotations

import json
import math
import re

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn

from lightning_marglik import (
    GaussianLikelihood, GaussianPrior, MargLikCallback, MargLikConfigurationError, map_loss, select_models,
)
from lightning_marglik.selection import load_results
from lightning_marglik.selection.cli import main
from tests.lightning_models import BlobData, Classifier
from tests.test_selection import CALLBACK, write_config

TRAINER = {"max_epochs": 2, "enable_progress_bar": False}


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


class GaussOneHot(pl.LightningModule):
    """The blobs as regression onto one-hot labels: a Gaussian likelihood of the data a Classifier takes."""

    def __init__(self, n_data: int = 60, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 3))
        self.prior = GaussianPrior(self.net)
        self.likelihood = GaussianLikelihood()
        self.n_data = n_data

    def marglik_batch(self, batch):
        x, y = batch
        return x, nn.functional.one_hot(y, 3).float()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = self.marglik_batch(batch)
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-2)


class EmptyPrior(Classifier):
    """A prior over no parameters: GaussianPrior refuses it in the constructor."""

    def __init__(self, n_data: int = 60) -> None:
        super().__init__(n_data)
        self.prior = GaussianPrior(nn.Sequential())


class Frozen(Classifier):
    """The prior's network frozen after the prior was built, and a trainable offset outside the prior."""

    def __init__(self, n_data: int = 60) -> None:
        super().__init__(n_data)
        for p in self.net.parameters():
            p.requires_grad_(False)
        self.offset = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.net(x) + self.offset


# --- 1. every candidate built and checked before the first trains ------------------------------------------------


def test_candidates_of_different_likelihoods_are_refused_before_any_trains(tmp_path):
    """A probability of labels and a density of one-hot targets were ranked side by side without a word."""
    with pytest.raises(MargLikConfigurationError, match=r"different likelihoods by their evidence: 'cat', 'cat2' "
                       r"\(CategoricalLikelihood\); 'gauss' \(GaussianLikelihood\)"):
        select_models({"cat": lambda: Classifier(60), "gauss": GaussOneHot, "cat2": lambda: Classifier(60, width=4)},
                      datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, output_dir=str(tmp_path / "out"),
                      verbose=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("candidate, message", [
    (EmptyPrior, "building candidate 'bad' raised ValueError: GaussianPrior: the model has no parameters that require "
                 "grad.; fix its arguments or its class."),
    (Frozen, "MargLikCallback cannot train candidate 'bad': "),
])
def test_a_candidate_that_cannot_be_built_or_trained_is_refused_before_the_first_trains(tmp_path, candidate, message):
    with pytest.raises(MargLikConfigurationError, match=message.replace("(", r"\(").replace(".", r"\.")):
        select_models({"ok": lambda: Classifier(60), "bad": candidate}, datamodule=BlobData(), callback=CALLBACK,
                      trainer=TRAINER, output_dir=str(tmp_path / "out"), verbose=False, rank_by="online")
    assert not (tmp_path / "out").exists()


def test_a_predictive_the_second_candidate_cannot_take_ends_the_command_in_one_line_before_training(tmp_path, capsys):
    """It ended in a 16-frame traceback after the first candidate trained."""
    path = write_config(tmp_path, predictive="probit", candidates={
        "cat": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 8}},
        "gauss": {"class_path": "tests.test_selection_edges.GaussOneHot"}})
    with pytest.raises(SystemExit) as stopped:
        main([path])
    assert str(stopped.value.code) == (
        "marglik-select: error: select_models: candidate 'gauss': predictive='probit' needs a CategoricalLikelihood "
        "and tensor inputs; use predictive='map' (got GaussianLikelihood).")
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "out").exists()


# --- 2. evidences that are not finite ------------------------------------------------------------------------------


def test_non_finite_evidences_are_ranked_last_named_written_as_null_and_trained_again(tmp_path, monkeypatch, capsys):
    """They were sorted last silently, results.json held NaN and Infinity (not JSON), and a re-run reused them."""
    evidence_with = MargLikCallback.evidence_with

    def forced(self, trainer, module, *args, **kwargs):  # no small network diverges on demand: its evidence is set
        value = evidence_with(self, trainer, module, *args, **kwargs)
        return getattr(module, "forced", value)

    monkeypatch.setattr(MargLikCallback, "evidence_with", forced)

    def candidate(value):
        def factory():
            module = Classifier(60, width=4)
            module.forced = value
            return module
        return factory

    candidates = {"nan": candidate(math.nan), "fine": lambda: Classifier(60), "inf": candidate(math.inf),
                  "ninf": candidate(-math.inf)}
    out = str(tmp_path / "out")
    run = dict(datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, output_dir=out, rank_by="kron-ggn")
    with pytest.warns(UserWarning, match=r"evidence of candidates 'nan', 'inf', 'ninf' is not finite "
                                         r"\(nan=nan, inf=inf, ninf=-inf\); they are ranked last"):
        results = select_models(candidates, verbose=False, **run)
    assert [r.name for r in results] == ["fine", "nan", "inf", "ninf"]

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    rows = {row["name"]: row for row in json.loads((tmp_path / "out" / "results.json").read_text(),
                                                   parse_constant=refuse)}
    assert rows["nan"]["marglik"] is rows["inf"]["marglik"] is rows["ninf"]["marglik"] is None
    assert math.isnan(load_results(out)["inf"].marglik) and math.isfinite(load_results(out)["fine"].marglik)
    capsys.readouterr()
    with pytest.warns(UserWarning, match="not finite"):
        select_models(candidates, resume=True, **run)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert ["reused" in line for line in printed] == [False, True, False, False]


# --- 3. candidates trained for different numbers of epochs --------------------------------------------------------


class StopsAfterOneEpoch(Classifier):
    """Stops its own training after the first epoch, as early stopping or ``max_time`` would."""

    def on_train_epoch_end(self):
        self.trainer.should_stop = True


def test_candidates_trained_for_different_numbers_of_epochs_are_ranked_with_a_warning_naming_them():
    with pytest.warns(UserWarning, match=r"trained for different numbers of epochs \(full: 3, stopped: 1\)"):
        results = select_models({"full": lambda: Classifier(60), "stopped": lambda: StopsAfterOneEpoch(60)},
                                datamodule=BlobData(), callback=CALLBACK, trainer={**TRAINER, "max_epochs": 3},
                                verbose=False, rank_by="online")
    assert {r.name: r.epochs for r in results} == {"full": 3, "stopped": 1}


# --- 4. resume after a candidate changed ---------------------------------------------------------------------------


def test_resume_trains_again_a_candidate_whose_network_or_metrics_changed(tmp_path, capsys):
    """The settings that decide reuse held nothing of the network: a wider 'b' reused the narrow one's result."""
    def run(width, **kwargs):
        capsys.readouterr()
        results = select_models({"a": lambda: Classifier(60, width=4), "b": lambda: Classifier(60, width=width)},
                                datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, rank_by="online",
                                output_dir=str(tmp_path), resume=True, **kwargs)
        printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
        return ["reused" in line for line in printed], {r.name: r.n_params for r in results}

    assert run(8) == ([False, False], {"a": 27, "b": 51})
    assert run(8) == ([True, True], {"a": 27, "b": 51})
    assert run(32) == ([True, False], {"a": 27, "b": 195})
    accuracy = {"accuracy": torchmetrics.classification.MulticlassAccuracy(3, average="micro")}
    assert run(32, metrics=lambda: accuracy)[0] == [False, False]  # the default metrics before
    assert load_results(str(tmp_path))["b"].settings["network"]["n_params"] == 195


# --- 5. what the command line says it wrote --------------------------------------------------------------------------


class TrainOnly(BlobData):
    """Blobs without test data: no metrics, so no evidence.png."""

    test_dataloader = pl.LightningDataModule.test_dataloader


def test_the_command_names_only_the_files_it_wrote_under_an_aligned_header(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "evidence.png").write_bytes(b"")  # an earlier run's, left as it was
    path = write_config(tmp_path, data={"class_path": "tests.test_selection_edges.TrainOnly"}, candidates={
        "a": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 2}},
        "b": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 4}}})
    main([path, "--trainer.max_epochs=1"])
    out = capsys.readouterr().out.splitlines()
    assert f"results in {tmp_path / 'out'}/ (results.json, results.csv)" in out
    header = out.index(next(line for line in out if line.startswith("rank  candidate")))
    marglik_ends = [re.match(r"\s*\d+\s+\w+\s+-?\d+\.\d{4}", row).end() for row in out[header + 1:header + 3]]
    assert marglik_ends == [out[header].index("marglik") + len("marglik")] * 2  # names shorter than "candidate"
