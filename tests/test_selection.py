"""The model-selection front end end to end: ranking, files, command line, overrides, resume, plot."""
from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys

import pytest
import torch
import yaml

from lightning_marglik import NegativeLogLikelihood, select_models
from lightning_marglik.selection import label_points, run_command_line
from tests.lightning_models import BlobData, Classifier

CALLBACK = {"structure": "diag", "approx": "ggn", "steps": 50}
TRAINER = {"max_epochs": 8, "enable_progress_bar": False}


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def write_config(tmp_path, **changes) -> str:
    """A two-candidate YAML over the tests' blob data, written to ``tmp_path/candidates.yaml``."""
    config = {
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
        "trainer": {"max_epochs": 2, "enable_progress_bar": False},
        "callback": CALLBACK,
        "data": {"class_path": "tests.lightning_models.BlobData", "init_args": {"n_train": 60}},
        "candidates": {
            "narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 2}},
            "wide": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 16}},
        },
        **changes,
    }
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def stored(tmp_path, sub: str = "out") -> dict:
    return {row["name"]: row for row in json.loads((tmp_path / sub / "results.json").read_text())}


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
        assert r.settings["trainer"] == TRAINER and r.settings["seed"] == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] linear: marglik=") and "| elapsed 0:" in lines[0] and "left" in lines[0]
    assert lines[1].startswith("[2/2] mlp: marglik=") and lines[1].endswith("about 0:00 left")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in saved] == [r.name for r in results]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert float(rows[0]["marglik"]) == pytest.approx(results[0].marglik) and "accuracy" in rows[0]
    assert (tmp_path / "evidence.png").stat().st_size > 1000
    assert not list(tmp_path.glob("*.partial"))


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


def test_command_line_entry_point(tmp_path):
    """The module runs as a program (what the `marglik-select` script calls), with Lightning's banners kept quiet."""
    path = write_config(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "lightning_marglik.selection", path, "--trainer.max_epochs=3"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved) == 2 and saved[0]["marglik"] >= saved[1]["marglik"] and saved[0]["epochs"] == 3
    assert f"   1  {saved[0]['name']}" in done.stdout
    assert "GPU available" not in done.stdout + done.stderr and "does not have many workers" not in done.stderr


def test_command_line_overrides(tmp_path, capsys):
    path = write_config(tmp_path)
    results, _ = run_command_line([path, "--trainer.max_epochs=3", "--callback.structure=kron", "--seed=5",
                                "--data.n_train=45", f"--output_dir={tmp_path / 'other'}"])
    assert {r.epochs for r in results} == {3}
    settings = results[0].settings
    assert settings["callback"]["structure"] == "kron" and settings["callback"]["steps"] == 50  # YAML kept
    assert settings["seed"] == 5 and settings["candidate"]["data"]["init_args"]["n_train"] == 45
    assert set(stored(tmp_path, "other")) == {"narrow", "wide"} and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):  # a typo is an error, not a silently ignored setting
        run_command_line([path, "--callback.stepz=5"])
    with pytest.raises(SystemExit):
        run_command_line([path, "--trainer.max_epoch=5"])
    assert "not pl.Trainer arguments: ['max_epoch']" in capsys.readouterr().err


def test_quick_mode_writes_apart_and_later_overrides_win(tmp_path):
    path = write_config(tmp_path)
    results, _ = run_command_line([path, "--quick", "--callback.steps=7"])
    assert {r.epochs for r in results} == {1}
    settings = results[0].settings
    assert settings["trainer"]["limit_train_batches"] == 2 and settings["callback"]["steps"] == 7
    assert set(stored(tmp_path, "out/quick")) == {"narrow", "wide"}
    assert not (tmp_path / "out" / "results.json").exists()  # the real results are never mixed with quick ones


def test_rerun_skips_finished_candidates(tmp_path, capsys):
    """A run killed after its first candidate: the re-run trains only the other one."""
    path = write_config(tmp_path)
    run_command_line([path])
    first = stored(tmp_path)
    killed = [row for row in json.loads((tmp_path / "out" / "results.json").read_text()) if row["name"] == "narrow"]
    (tmp_path / "out" / "results.json").write_text(json.dumps(killed))  # as a run killed during "wide" leaves it
    capsys.readouterr()

    run_command_line([path])
    out = capsys.readouterr().out
    assert "[1/2] narrow: marglik=" in out and "reused" in out.splitlines()[0]
    assert "[2/2] wide: marglik=" in out and "reused" not in out.splitlines()[1]
    again = stored(tmp_path)
    assert again["narrow"] == first["narrow"]  # not retrained: identical, timing included
    assert again["wide"]["marglik"] == pytest.approx(first["wide"]["marglik"], abs=1e-6)  # same seed
    assert again["wide"]["train_seconds"] != first["wide"]["train_seconds"]

    run_command_line([path, "--trainer.max_epochs=3"])  # other settings: nothing is reused
    assert "reused" not in capsys.readouterr().out and {r["epochs"] for r in stored(tmp_path).values()} == {3}
    run_command_line([path, "--trainer.max_epochs=3", "--rerun"])
    assert "reused" not in capsys.readouterr().out


def test_scatter_labels_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig, ax = plt.subplots(figsize=(5, 4))
    points = [(0.0, 0.9), (0.01, 0.9), (0.02, 0.91), (0.0, 0.89), (0.5, 0.5), (0.51, 0.5), (1.0, 0.1)]
    ax.scatter(*zip(*points), s=40)
    ax.margins(0.2)
    label_points(ax, points, [f"candidate{i}" for i in range(len(points))], [40] * len(points))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the labels without their leader lines
    assert len(boxes) == len(points)
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    plt.close(fig)


def test_bad_arguments():
    with pytest.raises(ValueError, match="candidates"):
        select_models({}, datamodule=BlobData())
    with pytest.raises(ValueError, match="exactly one"):
        select_models({"a": lambda: Classifier(60)})
    with pytest.raises(ValueError, match="predictive.*'mc'"):
        select_models({"a": lambda: Classifier(60)}, datamodule=BlobData(), predictive="mc")
