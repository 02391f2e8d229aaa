"""The model-selection front end end to end: ranking, files, command line, overrides, resume, plot."""
from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from typing import Union

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, NegativeLogLikelihood, map_loss,
    select_models,
)
from lightning_marglik.callbacks.output_layer import OUTPUT_LAYER
from lightning_marglik.selection import (
    build_parser, check_trainer_arguments, label_points, load_results, run_command_line, select_from_config,
)
from lightning_marglik.selection.cli import duplicate_key, main
from tests.lightning_models import BlobData, Classifier, blobs

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


@pytest.mark.parametrize("rank_by", ["kron-ef", "diag-ggn"])
def test_rank_by_reestimates_the_evidence_at_the_final_weights(rank_by):
    """``rank_by="<structure>-<approx>"``: the evidence of that curvature at the trained weights, the
    learned hyperparameters re-optimised by Newton (reference: LaplaceEvidence by hand); nothing is
    written back, and the callback's own evidence is kept as ``online_marglik``."""
    made = []

    def factory():
        made.append(Classifier(60, width=8))
        return made[-1]

    result = select_models({"mlp": factory}, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER,
                           rank_by=rank_by, verbose=False)[0]
    module = made[-1]
    logged = {k: v for k, v in result.hyperparameters.items() if k.startswith("prior_precision/")}
    precision = module.prior.per_tensor(module.prior.log_precision).exp()
    assert [logged[f"prior_precision/{n}"] for n in module.prior.param_names] == pytest.approx(precision.tolist())
    structure, approx = rank_by.split("-")
    # the ranking evidence learns the output layer's precision that training held (rank_output_layer="learn")
    module.prior.treat(module.prior.treatments[OUTPUT_LAYER][0], "learn", OUTPUT_LAYER)
    evidence = LaplaceEvidence.fit(module, DataLoader(blobs(60, 0), batch_size=60), module.likelihood, module.prior,
                                   structure=structure, approx=approx)
    expected = evidence.optimize(solver="newton", max_evaluations=50).value.item() / 60
    assert result.marglik == pytest.approx(expected, rel=1e-5)
    at_learned = evidence.log_marglik().item() / 60
    if structure == CALLBACK["structure"] and approx == CALLBACK["approx"]:
        # the callback's last estimate solved this same problem at these weights: Newton can only confirm it
        assert expected >= at_learned - 1e-9
    else:
        assert expected > at_learned  # re-optimised: not the callback's hyperparameters' value
    online = select_models({"mlp": lambda: Classifier(60, width=8)}, datamodule=BlobData(), callback=CALLBACK,
                           trainer=TRAINER, rank_by="online", verbose=False)[0]
    assert online.marglik == online.online_marglik == result.online_marglik  # same training, same seed
    assert result.marglik != result.online_marglik


def test_evidence_with_before_a_fit_or_with_swapped_names_says_what_is_wrong():
    callback = MargLikCallback()
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="call it after trainer.fit"):
        callback.evidence_with(trainer, Classifier(60), "kron", "ef")
    with pytest.raises(ValueError, match="`structure` must be one of .* got 'ef'"):
        callback.evidence_with(trainer, Classifier(60), "ef", "kron")


def test_a_candidate_rank_by_cannot_score_is_refused_before_training():
    made = []

    def factory():  # a diagonal prior: fine for the callback's diag training, not for a Kronecker evidence
        module = Classifier(60, width=8)
        module.prior = GaussianPrior(module.net, structure="diagonal")
        made.append((module, [p.detach().clone() for p in module.parameters()]))
        return module

    with pytest.raises(ValueError, match="rank_by='kron-ef' cannot score candidate 'mlp'.*diagonal"):
        select_models({"mlp": factory}, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, verbose=False)
    module, start = made[0]
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), start))  # not trained


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
                                "--data.n_train=45", f"--output_dir={tmp_path / 'other'}", "--rank_by=online"])
    assert {r.epochs for r in results} == {3}
    assert all(r.marglik == r.online_marglik for r in results)
    settings = results[0].settings
    assert settings["rank_by"] == "online"
    assert settings["callback"]["structure"] == "kron" and settings["callback"]["steps"] == 50  # YAML kept
    assert settings["seed"] == 5 and settings["candidate"]["data"]["init_args"]["n_train"] == 45
    assert set(stored(tmp_path, "other")) == {"narrow", "wide"} and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):  # a typo is an error, not a silently ignored setting
        run_command_line([path, "--callback.stepz=5"])
    with pytest.raises(SystemExit):
        run_command_line([path, "--trainer.max_epoch=5"])
    assert "not pl.Trainer arguments: 'max_epoch' (did you mean 'max_epochs'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_command_line([path, "--rank_by=kron"])
    assert "rank_by" in capsys.readouterr().err


def test_quick_mode_writes_apart_and_later_overrides_win(tmp_path, capsys):
    path = write_config(tmp_path)
    results, _ = run_command_line([path, "--quick", "--callback.steps=7"])
    out = capsys.readouterr().out.splitlines()
    notice = "--quick: a smoke test (1 epoch of 2 batches per candidate) that checks everything runs; its ranking means nothing."
    assert out[0].startswith(notice) and out[-1].startswith(notice)  # before the run and under the table
    assert "ranking means nothing" in " ".join(build_parser().format_help().split())
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
    for rank_by in ("kron", "kron-mc", "best", None):  # "KRON-EF" is kron-ef: test_rank_by_forgives_case...
        with pytest.raises(ValueError, match="`rank_by` must be one of"):
            select_models({"a": lambda: Classifier(60)}, datamodule=BlobData(), rank_by=rank_by)


def test_rank_by_forgives_case_and_suggests_near_misses(tmp_path, capsys):
    from lightning_marglik import CurvatureOptions
    from lightning_marglik.selection import check_config
    from lightning_marglik.selection.driver import check_rank_by

    assert check_rank_by("KRON-EF") == ("kron-ef", CurvatureOptions("kron", "ef"))
    assert check_rank_by(" Online") == ("online", None)
    with pytest.raises(ValueError, match=r"`rank_by` must be one of .*got 'kron_ef' \(did you mean 'kron-ef'\?\)"):
        select_models({"a": lambda: Classifier(60)}, datamodule=BlobData(), rank_by="kron_ef")
    path = write_config(tmp_path, rank_by="Diag-GGN")
    config = yaml.safe_load(open(path))
    check_config(config)  # the YAML's spelling is forgiven too
    with pytest.raises(ValueError, match=r"got 'diag-gnn' \(did you mean 'diag-ggn'\?\)"):
        check_config({**config, "rank_by": "diag-gnn"})
    for argument, suggested in [("--rank_by=kron-eff", "did you mean 'kron-ef'?"),
                                ("--callback.structure=kfac", "did you mean 'kron'?"),
                                ("--callback.approx=fisher", "did you mean 'ggn'?")]:
        with pytest.raises(SystemExit):
            run_command_line([path, argument])
        assert suggested in capsys.readouterr().err, argument


def write_module(directory, name: str, text: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.py").write_text(text)


def test_a_class_path_whose_module_is_not_on_the_path_names_the_fix(tmp_path, monkeypatch, capsys):
    """As ``marglik-select configs/digits_selection.yaml`` without ``PYTHONPATH=examples``: the
    module sits in a subdirectory of the working directory, which is not on the Python path."""
    write_module(tmp_path / "mymodels", "elsewhere_models", "from tests.lightning_models import BlobData, Classifier\n")
    configs = tmp_path / "configs"  # not the working directory (jsonargparse parses in the YAML's directory)
    configs.mkdir()
    monkeypatch.chdir(tmp_path)
    fix = ("is in neither: run marglik-select from the directory that holds elsewhere_models.py, or set "
           "PYTHONPATH=mymodels")
    data = {"class_path": "elsewhere_models.BlobData", "init_args": {"n_train": 60}}
    for changes in ({"data": data},  # imported by jsonargparse while parsing
                    {"candidates": {"a": {"class_path": "elsewhere_models.Classifier"}}}):  # by check_config
        path = write_config(configs, **changes)
        with pytest.raises(SystemExit):
            run_command_line([path])
        err = capsys.readouterr().err
        assert "No module named 'elsewhere_models'" in err and fix in err, err
        assert "Does not validate against any of the Union subtypes" not in err  # not jsonargparse's raw report
    with pytest.raises(ValueError, match="set PYTHONPATH=mymodels"):
        select_from_config({**yaml.safe_load(open(path)), "candidates": {"a": {"class_path": "elsewhere_models.X"}}})
    monkeypatch.syspath_prepend(str(tmp_path / "mymodels"))  # the fix works
    results, _ = run_command_line([write_config(configs, data=data), "--trainer.max_epochs=1"])
    assert len(results) == 2


def test_a_missing_dependency_of_a_found_module_is_reported_as_it_is(tmp_path, monkeypatch):
    """The module is on the path but imports a package that is not installed: no PYTHONPATH advice."""
    write_module(tmp_path / "found", "needs_a_package", "import no_such_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path / "found"))
    with pytest.raises(ValueError, match="No module named 'no_such_package_anywhere'") as info:
        select_from_config({"data": {"class_path": "tests.lightning_models.BlobData"},
                            "candidates": {"a": {"class_path": "needs_a_package.Model"}}})
    assert "PYTHONPATH" not in str(info.value)


# --- issue 17: test metrics, results files, trainer overrides, help ---------------------------


class Tokens(pl.LightningModule):
    """Position-wise classifier: (B, T, F) inputs to (B, T, C) logits; batches are dicts read by
    ``marglik_batch`` (``dict_batches``) or ``(x, y)`` pairs."""

    def __init__(self, n_data: int, classes: int, dict_batches: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, classes))
        self.prior = GaussianPrior(self.net)
        self.likelihood = CategoricalLikelihood(ignore_index=-100)
        self.n_data, self.dict_batches, self.steps = n_data, dict_batches, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def marglik_batch(self, batch):
        return (batch["features"], batch["labels"]) if self.dict_batches else batch

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = self.marglik_batch(batch)
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=3e-2)


def token_data(n: int, positions: int, classes: int, seed: int):
    """Labels from the first feature's bin, a quarter of the positions ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, positions, 2, generator=g)
    y = torch.bucketize(x[..., 0].contiguous(), torch.linspace(-1, 1, classes - 1))
    y[torch.rand(n, positions, generator=g) < 0.25] = -100
    return x, y


def token_loader(x, y, dict_batches: bool) -> DataLoader:
    if dict_batches:
        rows = [{"features": a, "labels": b} for a, b in zip(x, y)]
        return DataLoader(rows, batch_size=16)  # default collate: a dict of stacked tensors
    return DataLoader(TensorDataset(x, y), batch_size=16)


def hand_metrics(module, x, y) -> dict:
    """Accuracy, NLL and 15-bin ECE over the kept positions, written out by hand."""
    with torch.no_grad():
        probs = module.eval()(x).softmax(-1)
    kept = y != -100
    probs, labels = probs[kept].double(), y[kept]
    confidence, guess = probs.max(-1)
    correct = (guess == labels).double()
    bins = torch.clamp(torch.ceil(confidence * 15).long() - 1, 0, 14)
    ece = sum((correct[bins == b].sum() - confidence[bins == b].sum()).abs() for b in range(15)) / len(labels)
    return {"accuracy": correct.mean().item(), "nll": -probs[torch.arange(len(labels)), labels].log().mean().item(),
            "ece": float(ece)}


@pytest.mark.parametrize("positions", [3, 5])  # T == C (the softmax once ran over positions) and T != C
@pytest.mark.parametrize("dict_batches", [False, True])
def test_sequence_output_metrics_are_per_kept_position(tmp_path, positions, dict_batches):
    """(B, T, C) outputs: the metrics read classes on the last dim and leave ignored positions out,
    and dict batches reach them through `marglik_batch`, as they reach the evidence."""
    classes = 3
    train, test = token_data(48, positions, classes, 0), token_data(40, positions, classes, 1)
    made = []

    def factory():
        made.append(Tokens(int((train[1] != -100).sum()), classes, dict_batches))
        return made[-1]

    result, = select_models({"tokens": factory}, train_dataloader=token_loader(*train, dict_batches),
                            test_dataloader=token_loader(*test, dict_batches), callback=CALLBACK,
                            trainer={"max_epochs": 4, "enable_progress_bar": False}, output_dir=str(tmp_path),
                            verbose=False)
    expected = hand_metrics(made[-1], *test)
    assert result.metrics == pytest.approx(expected, abs=1e-5)
    assert 0.4 < expected["accuracy"] < 1  # trained, and the check is not between two trivial values
    assert stored(tmp_path, ".")["tokens"]["metrics"] == pytest.approx(expected, abs=1e-5)


def test_test_data_that_cannot_be_scored_fails_before_training(tmp_path):
    """probit on sequence outputs, and a batch the adapter cannot read, stop before the first step."""
    train, test = token_data(48, 4, 3, 0), token_data(40, 4, 3, 1)
    made = []

    def factory():
        made.append(Tokens(100, 3, dict_batches=False))
        return made[-1]

    with pytest.raises(ValueError, match=r"probit.*\(batch, classes\) outputs, got \(16, 4, 3\).*predictive='map'"):
        select_models({"tokens": factory}, train_dataloader=token_loader(*train, False),
                      test_dataloader=token_loader(*test, False), callback=CALLBACK, trainer=TRAINER,
                      predictive="probit", verbose=False)
    with pytest.raises(TypeError, match="marglik_batch"):  # dicts, but the module reads (x, y) pairs
        select_models({"tokens": factory}, train_dataloader=token_loader(*train, False),
                      test_dataloader=token_loader(*test, True), callback=CALLBACK, trainer=TRAINER, verbose=False)
    assert {m.steps for m in made} == {0}  # the pre-pass builds each candidate, too


class FailsAfterTraining(torchmetrics.Metric):
    """Passes the check on the first test batch, then fails: a metric bug that shows only later."""

    def __init__(self):
        super().__init__()
        self.add_state("calls", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, probs, target):
        self.calls += 1
        if getattr(self, "armed", False):
            raise RuntimeError("metric bug")

    def compute(self):
        self.armed = True  # after the check on the first batch
        return self.calls.float()


def test_metrics_failure_after_training_keeps_the_trained_result(tmp_path, capsys):
    candidates = {"linear": lambda: Classifier(60, depth=0), "mlp": lambda: Classifier(60, width=8)}
    run = dict(datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, output_dir=str(tmp_path), resume=True)
    with pytest.raises(RuntimeError, match=r"'linear' trained \(marglik=.*saved in .*results.json\) but its test "
                                           r"metrics failed: RuntimeError: metric bug"):
        select_models(candidates, metrics=lambda: {"broken": FailsAfterTraining()}, **run)
    saved = stored(tmp_path, ".")
    assert set(saved) == {"linear"} and math.isfinite(saved["linear"]["marglik"])
    assert saved["linear"]["metrics_error"] == "RuntimeError: metric bug"
    capsys.readouterr()
    results = select_models(candidates, **run)  # the failed one is trained again, not reused without metrics
    assert "reused" not in capsys.readouterr().out
    assert all(set(r.metrics) == {"accuracy", "nll", "ece"} and r.metrics_error is None for r in results)


@pytest.mark.parametrize("content", [
    '[{"name": "narrow", "marglik": -1.2, "n_par',  # truncated by a full disk
    '{"narrow": -1.2}',  # not a list
    '[{"name": "narrow", "marglik": "high", "n_params": 9, "train_seconds": 1.0, "epochs": 2}]',  # wrong type
    '[{"name": "narrow"}]',  # fields missing
])
def test_unreadable_results_are_moved_aside_with_a_warning(tmp_path, content):
    (tmp_path / "results.json").write_text(content)
    with pytest.warns(UserWarning, match="results.json cannot be read .*moved it to .*results.json.corrupt-"):
        assert load_results(str(tmp_path)) == {}
    aside, = tmp_path.glob("results.json.corrupt-*")
    assert aside.read_text() == content and not (tmp_path / "results.json").exists()


def test_truncated_results_file_is_retrained_not_fatal(tmp_path, capsys):
    path = write_config(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").write_text('[{"name": "narrow", "marglik": -1.2, "n_par')
    with pytest.warns(UserWarning, match="cannot be read"):
        run_command_line([path])
    assert set(stored(tmp_path)) == {"narrow", "wide"} and len(list((tmp_path / "out").glob("*.corrupt-*"))) == 1


def test_a_subset_run_keeps_the_other_candidates_results(tmp_path, capsys):
    path = write_config(tmp_path)
    run_command_line([path])
    first = stored(tmp_path)
    (tmp_path / "subset").mkdir()
    subset = write_config(tmp_path / "subset", output_dir=str(tmp_path / "out"),
                          candidates={"narrow": {"class_path": "tests.lightning_models.Classifier",
                                                 "init_args": {"width": 2}}})
    run_command_line([subset, "--trainer.max_epochs=3"])
    after = stored(tmp_path)
    assert set(after) == {"narrow", "wide"} and after["wide"] == first["wide"] and after["narrow"]["epochs"] == 3
    capsys.readouterr()
    run_command_line([path])  # the full run again: "wide" finished with these settings and is reused
    out = capsys.readouterr().out
    assert "wide: marglik=" in out and "reused" in next(line for line in out.splitlines() if " wide:" in line)
    assert stored(tmp_path)["wide"] == first["wide"] and stored(tmp_path)["narrow"]["epochs"] == 2


HOLD_LOCK = (
    "import sys; from lightning_marglik.selection.results import run_lock\n"
    "lock = run_lock(sys.argv[1]); lock.__enter__(); print('locked', flush=True); sys.stdin.read()\n"
)


def test_two_runs_into_one_directory(tmp_path):
    """Another process holds the directory: a second run is refused naming it; once that process is
    killed (SIGKILL: no clean-up), its lock is gone and a run goes ahead."""
    path = write_config(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "out")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"out is in use by another model-selection run \(pid {holder.pid} on "
                                               r".*Wait for it to finish, or write to another directory"):
            run_command_line([path])
        with pytest.raises(SystemExit, match=r"^marglik-select: error: .*out is in use by another model-selection run"):
            main([path])  # the command: one line, no traceback
        assert not (tmp_path / "out" / "results.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "out" / "results.lock").exists()  # left by the killed process, naming it
    run_command_line([path])
    assert set(stored(tmp_path)) == {"narrow", "wide"} and not (tmp_path / "out" / "results.lock").exists()


class BuiltTooEarly(BlobData):
    def __init__(self, **kwargs):
        raise AssertionError("the data module was built before the trainer arguments were checked")


def test_trainer_overrides_of_the_wrong_type_fail_when_parsed(tmp_path, capsys):
    path = write_config(tmp_path, data={"class_path": "tests.test_selection.BuiltTooEarly"})
    with pytest.raises(SystemExit):
        run_command_line([path, "--trainer.max_epochs=abc"])
    assert ("`trainer.max_epochs` is 'abc' (str), but pl.Trainer takes max_epochs: Optional[int]"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        run_command_line([path, "--trainer.enable_progress_bar=[1]"])
    assert "pl.Trainer takes enable_progress_bar: Optional[bool]" in capsys.readouterr().err

    def never_called():
        raise AssertionError("a candidate was built before the trainer arguments were checked")

    with pytest.raises(ValueError, match=r"`trainer.max_epochs` is 2.5 \(float\)"):
        select_models({"a": never_called}, datamodule=BlobData(), trainer={"max_epochs": 2.5})


def test_help_is_plain_text():
    text = " ".join(build_parser().format_help().split())  # unwrapped
    assert not re.search(r"``|:[a-z]+:`", text), re.findall(r".*(?:``|:[a-z]+:`).*", text)
    assert "The main advantage is" not in text  # Lightning's docstring, cut mid-sentence, was a group title
    assert '"newton" (Newton with a line search' in text and "see lightning_marglik.solvers" in text
    assert "The data: a LightningDataModule subclass" in text and "checked against pl.Trainer's signature" in text


@pytest.mark.parametrize("change,message", [
    ({"narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"widht": 2}}},
     r"`candidates.narrow.init_args.widht` is not an argument of Classifier \(did you mean 'width'\?\)"),
    ({"narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"depth": "two"}}},
     r"`candidates.narrow.init_args.depth` = 'two': Classifier's `depth` takes an int"),
    ({"narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 2.5}}},
     r"`candidates.narrow.init_args.width` = 2.5: Classifier's `width` takes an int \(annotated int\)"),
    ({"narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"norm": 1}}},
     r"`candidates.narrow.init_args.norm` = 1: Classifier's `norm` is a flag \(True or False\)"),
    ({"narrow": {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": True}}},
     r"`candidates.narrow.init_args.width` = True: Classifier's `width` takes an int"),
    ({}, r"The configuration's `candidates` section is empty"),
])
def test_candidates_arguments_that_cannot_build_it_are_refused_before_any_candidate_trains(tmp_path, change, message):
    """The first candidate trained while the second's misspelt argument waited for its turn (a probe found it)."""
    from lightning_marglik.selection import check_config

    config = yaml.safe_load(open(write_config(tmp_path)))
    config["candidates"] = {**config["candidates"], **change} if change else {}
    with pytest.raises(ValueError, match=message):
        check_config(config)
    assert not (tmp_path / "out").exists()


class Flexible(Classifier):
    """A candidate whose argument takes a number or a name: the check must not refuse the name."""

    def __init__(self, n_data: int, width: int = 8, schedule: Union[float, str] = 0.1, steps=3) -> None:
        super().__init__(n_data, width)


def test_arguments_that_take_more_than_a_number_are_not_refused(tmp_path):
    from lightning_marglik.selection import check_config

    config = yaml.safe_load(open(write_config(tmp_path)))
    flexible = {"class_path": "tests.test_selection.Flexible", "init_args": {"schedule": "cosine", "width": 4}}
    check_config({**config, "candidates": {"flexible": flexible}})
    with pytest.raises(ValueError, match=r"`candidates.flexible.init_args.steps` = 'many': Flexible's `steps` takes"):
        check_config({**config, "candidates": {"flexible": {**flexible, "init_args": {"steps": "many"}}}})


def test_an_output_dir_that_cannot_be_written_and_a_config_after_an_option_are_named(tmp_path, capsys):
    from lightning_marglik.selection import check_config

    config = yaml.safe_load(open(write_config(tmp_path)))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"a_file is a file, not a directory; name a directory"):
        check_config({**config, "output_dir": str(tmp_path / "a_file" / "results")})
    check_config({**config, "output_dir": str(tmp_path / "not" / "yet")})  # to be created: fine
    path = write_config(tmp_path)
    with pytest.raises(SystemExit):
        run_command_line(["--quick", path])
    assert f"the configuration file comes first: marglik-select {path} [options]" in capsys.readouterr().err


def test_without_an_output_dir_the_command_says_that_nothing_is_written(tmp_path, capsys):
    run_command_line([write_config(tmp_path, output_dir=None), "--trainer.max_epochs=1"])
    assert "no output_dir: nothing written" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


# --- what a hurried command line passed (tenth session's probe) -------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("--callback.structur=diag", "unrecognized arguments: --callback.structur=diag"),  # a prefix is no option
    ("--threads=0", "--threads must be at least 1, got 0."),
    ("--trainer.max_epochs=0", "`trainer.max_epochs` is 0: no candidate would be trained"),
    ("--trainer.limit_train_batches=0", "`trainer.limit_train_batches` is 0: no candidate would be trained"),
    ("--trainer.devices=2", "`trainer` asks for several processes (devices=2)"),
    ("--trainer.devices=0,1", "`trainer` asks for several processes (devices='0,1')"),
])
def test_overrides_that_would_mislead_are_refused_in_one_line_before_any_training(tmp_path, capsys, override, message):
    path = write_config(tmp_path)
    with pytest.raises(SystemExit):
        run_command_line([path, override])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("trainer, message", [
    ([{"max_epochs": 3}], "`trainer` must be a mapping of pl.Trainer's arguments"),
    ({"devices": -1}, "several processes (devices=-1)"),
    ({"num_nodes": 2}, "several processes (num_nodes=2)"),
])
def test_trainer_arguments_a_hurried_caller_passes_are_refused_by_name(trainer, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_trainer_arguments(trainer)
    assert check_trainer_arguments({"devices": None, "max_epochs": -1}) == {"devices": None, "max_epochs": -1}


def test_print_config_with_quick_shows_the_quick_overrides(tmp_path, capsys):
    """docs/selection.md: --print_config prints the configuration after all overrides; with --quick it printed the
    YAML's max_epochs."""
    with pytest.raises(SystemExit) as done:
        run_command_line([write_config(tmp_path), "--quick", "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_epochs"] == 1 and printed["trainer"]["limit_train_batches"] == 2


def test_quick_in_the_yaml_is_the_command_lines_quick(tmp_path):
    results, config = run_command_line([write_config(tmp_path, quick=True)])
    assert {r.epochs for r in results} == {1} and config["trainer"]["limit_train_batches"] == 2
    assert config["output_dir"] == str(tmp_path / "out" / "quick")


def test_a_key_twice_in_the_yaml_is_refused_before_anything_trains(tmp_path, capsys):
    """A candidate copied and not renamed: PyYAML would keep the second and drop the first without a word."""
    path = tmp_path / "twice.yaml"
    text = open(write_config(tmp_path)).read().replace("  wide:", "  narrow:")
    path.write_text(text)
    with pytest.raises(SystemExit):
        run_command_line([str(path), "--trainer.max_epochs=1"])
    assert re.search(r"twice\.yaml: 'narrow' twice in one mapping \(lines \d+ and \d+\): YAML keeps only the last",
                     capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    shipped = [name for name in os.listdir("configs") if name.endswith(".yaml")]
    assert shipped and all(duplicate_key(open(os.path.join("configs", name)).read()) is None for name in shipped)


class EvidenceFromAList(Classifier):
    """Names an evidence method that returns no DataLoader: only the callback's set-up can see it."""

    def evidence_batches(self):
        return [(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))]


def test_a_misspelt_evidence_method_is_refused_before_anything_trains(tmp_path, capsys):
    path = write_config(tmp_path, callback={**CALLBACK, "dataloader": "train_dataloadr"})
    with pytest.raises(SystemExit):
        main([path])
    err = capsys.readouterr().err
    assert ("`callback.dataloader` = 'train_dataloadr': neither BlobData nor candidate 'narrow''s Classifier defines "
            "such a method (did you mean 'train_dataloader'?)") in err
    assert not (tmp_path / "out").exists()


def test_a_candidates_set_up_refusal_ends_the_command_in_one_message(tmp_path, capsys):
    path = write_config(tmp_path, callback={**CALLBACK, "dataloader": "evidence_batches"},
                        candidates={"listed": {"class_path": "tests.test_selection.EvidenceFromAList",
                                               "init_args": {"n_data": 60}}})
    with pytest.raises(SystemExit) as stopped:
        main([path])
    message = str(stopped.value.code)
    assert message.startswith("marglik-select: error: MargLikCallback(dataloader='evidence_batches') returned a list")
    assert "raised while training candidate 'listed' (1 of 1)" in message and "Traceback" not in capsys.readouterr().err


class StopsItself(Classifier):
    """Sends its own process SIGTERM in training, as a cluster's time limit or `kill` would."""

    def training_step(self, batch, batch_idx):
        os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def test_a_run_stopped_by_sigterm_says_so_and_fails(tmp_path, capsys):
    path = write_config(tmp_path, candidates={"stops": {"class_path": "tests.test_selection.StopsItself",
                                                       "init_args": {"n_data": 60}}})
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            main([path])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143  # not Lightning's 0, which `marglik-select ... && next-step` takes for success
    assert "marglik-select: stopped by SIGTERM; the candidates finished before are kept" in capsys.readouterr().err
