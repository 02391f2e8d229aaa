"""The model-selection front end end to end: two tiny candidates, ranking, files, command line."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
import yaml

from lightning_marglik import NegativeLogLikelihood, select_models
from tests.lightning_models import BlobData, Classifier

CALLBACK = {"structure": "diag", "approx": "ggn", "steps": 50}
TRAINER = {"max_epochs": 8, "enable_progress_bar": False}


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def test_select_models_ranks_and_writes_files(tmp_path, capsys):
    candidates = {"linear": lambda: Classifier(60, depth=0), "mlp": lambda: Classifier(60, width=8, depth=1)}
    results = select_models(
        candidates, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, output_dir=str(tmp_path), seed=0
    )
    assert [r.marglik for r in results] == sorted((r.marglik for r in results), reverse=True)
    assert {r.name for r in results} == {"linear", "mlp"}
    by_name = {r.name: r for r in results}
    assert by_name["linear"].n_params == 2 * 3 + 3 and by_name["mlp"].n_params == 2 * 8 + 8 + 8 * 3 + 3
    for r in results:
        assert set(r.metrics) == {"accuracy", "nll", "ece"}
        assert 0.5 < r.metrics["accuracy"] <= 1 and r.metrics["nll"] > 0 and 0 <= r.metrics["ece"] <= 1
        assert r.epochs == 8 and r.train_seconds > 0 and "prior_precision/0.weight" in r.hyperparameters
    assert "[1/2] linear: marglik=" in capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in saved] == [r.name for r in results]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert float(rows[0]["marglik"]) == pytest.approx(results[0].marglik) and "accuracy" in rows[0]
    assert (tmp_path / "evidence.png").stat().st_size > 1000


def test_probit_predictive_metrics_differ_from_map(tmp_path):
    runs = {
        p: select_models({"mlp": lambda: Classifier(60)}, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, predictive=p, verbose=False)[0]
        for p in ("map", "probit")
    }
    assert runs["map"].marglik == runs["probit"].marglik  # same training, only the test predictive differs
    assert runs["map"].metrics["nll"] != runs["probit"].metrics["nll"]


def test_negative_log_likelihood_metric():
    metric = NegativeLogLikelihood()
    metric.update(torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.tensor([0, 1]))
    assert metric.compute().item() == pytest.approx(-(torch.tensor(0.5).log() + torch.tensor(0.75).log()).item() / 2)


def test_command_line(tmp_path):
    config = {
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
        "trainer": TRAINER,
        "callback": CALLBACK,
        "data": {"class_path": "tests.lightning_models.BlobData", "init_args": {"n_train": 60}},
        "candidates": {
            "narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 2}},
            "wide": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 16}},
        },
    }
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_marglik.selection", str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved) == 2 and saved[0]["marglik"] >= saved[1]["marglik"]
    assert f"   1  {saved[0]['name']}" in done.stdout


def test_bad_arguments():
    with pytest.raises(ValueError, match="candidates"):
        select_models({}, datamodule=BlobData())
    with pytest.raises(ValueError, match="exactly one"):
        select_models({"a": lambda: Classifier(60)})
    with pytest.raises(ValueError, match="predictive.*'mc'"):
        select_models({"a": lambda: Classifier(60)}, datamodule=BlobData(), predictive="mc")
