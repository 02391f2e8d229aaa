"""What cost a new user time in the first hour (issue 41): the δ that is applied, stale figures, the two
``structure`` options, keywords of other libraries, checkpoint names next to a validation checkpoint, and an
optimizer's weight decay on top of the prior. Real ``Trainer`` runs and real checkpoints on disk."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from lightning_marglik import (
    GaussianPrior,
    MargLikBoundCallback,
    MargLikCallback,
    MargLikCheckpoint,
    MargLikConfigurationError,
)
from lightning_marglik.curvature import CurvatureOptions
from tests.lightning_models import Regressor, loader, regression_data, trainer

ROOT = Path(__file__).resolve().parent.parent


def _fit(callbacks, max_epochs, model=None, validation=False, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Regressor()
    t = trainer(callbacks, max_epochs, **kwargs)
    t.fit(model, loader(regression_data()), loader(regression_data(seed=1)) if validation else None)
    return model, t


# --- the δ that map_loss applies -------------------------------------------------------------------------------


def test_the_prior_says_which_precision_map_loss_applies():
    model, _ = _fit([MargLikCallback(output_layer="learn", structure="diag", frequency=1, steps=5)], max_epochs=3)
    prior = model.prior
    biases = [prior.param_names.index(n) for n in ("0.bias", "2.bias")]
    weights = [prior.param_names.index(n) for n in ("0.weight", "2.weight")]
    assert prior.treated("decoupled") == ["0.bias", "2.bias"]  # the default biases="decoupled"
    assert prior.precision[biases].ne(1.0).all()  # learned ...
    assert torch.equal(prior.applied_precision[biases], torch.ones(2))  # ... but the declared δ = 1 is applied
    assert torch.equal(prior.applied_precision[weights], prior.precision[weights])
    # applied_precision is what the MAP loss's term uses
    expected = 0.5 * (prior.applied_precision * prior.group_sq_norms()).sum()
    assert prior.penalty().item() == pytest.approx(expected.item(), rel=1e-12)
    assert "decoupled=['0.bias', '2.bias'] (weight decay at precision=1)" in repr(prior)


def test_a_prior_without_treatments_applies_what_it_learned():
    prior = GaussianPrior(nn.Linear(3, 2), precision=2.0)
    prior.log_precision.add_(1.0)
    assert torch.equal(prior.applied_precision, prior.precision) and "decoupled" not in repr(prior)


# --- stale figures and citations ---------------------------------------------------------------------------------


def test_no_file_cites_a_design_note_the_repository_does_not_have():
    name = "DESIGN" + ".md"  # spelled apart: this file names it too
    if (ROOT / name).exists():
        pytest.skip(f"{name} is in the repository")
    files = [ROOT / "README.md", *(p for d in ("docs", "examples", "benchmarks", "lightning_marglik", "tests", "configs")
                                   for p in (ROOT / d).rglob("*") if p.suffix in (".md", ".py", ".yaml"))]
    citing = [str(p.relative_to(ROOT)) for p in files if p != Path(__file__).resolve() and name in p.read_text()]
    assert not citing, f"{citing} cite {name}, which is not in the repository"


def test_the_readme_gives_no_test_count_that_goes_stale():
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"\d+ passed", text), "a count of passed tests on the front page goes stale"


@pytest.mark.skipif(not os.environ.get("MARGLIK_SLOW_TESTS"), reason="the main job, 20 s to minutes: MARGLIK_SLOW_TESTS=1")
def test_the_main_jobs_figures_in_the_install_page_are_what_it_prints(tmp_path):
    ranges, quoted = _main_job_figures()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "examples/toy_regression.py", f"--output-dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = {(int(d), what): float(value) for d, m, s in re.findall(r"^depth (\d): marglik (\S+)  sigma (\S+)",
                                                                       done.stdout, re.M)
               for what, value in (("marglik", m), ("σ", s))}
    outside = {key: value for key, value in printed.items() if not ranges[key][0] <= value <= ranges[key][1]}
    assert len(printed) == 4 and not outside, f"printed {printed}, outside docs/install.md's ranges {ranges}: {outside}"


def _main_job_figures():
    """docs/install.md's checked ranges of the main job's figures, ``{(depth, "marglik" or "σ"): (low, high)}``, and
    the figures it quotes as printed on this project's machine."""
    text = " ".join((ROOT / "docs" / "install.md").read_text().split())
    quoted = re.search(r"What the main job prints, .*?marglik (\S+) for depth 1 and (\S+) for depth 3 .*?σ (\S+) and "
                       r"(\S+?)[ ,]", text)
    number = r"(\d\.\d+)"
    checked = re.search(r"checks what it prints against these ranges: depth 1 marglik {0}–{0} and σ {0}–{0}, depth 3 "
                        r"marglik {0}–{0} and σ {0}–{0}\.".format(number), text)
    assert quoted and checked, "docs/install.md no longer quotes the main job's figures and their checked ranges"
    bounds = [float(v) for v in checked.groups()]
    keys = [(1, "marglik"), (1, "σ"), (3, "marglik"), (3, "σ")]
    ranges = {key: (bounds[2 * i], bounds[2 * i + 1]) for i, key in enumerate(keys)}
    m1, m3, s1, s3 = (float(v) for v in quoted.groups())
    return ranges, {(1, "marglik"): m1, (3, "marglik"): m3, (1, "σ"): s1, (3, "σ"): s3}


def test_the_install_pages_figures_of_the_main_job_lie_in_its_checked_ranges():
    ranges, quoted = _main_job_figures()
    assert all(low < high for low, high in ranges.values()), ranges
    assert all(ranges[key][0] <= value <= ranges[key][1] for key, value in quoted.items()), (quoted, ranges)


# --- the two `structure` options --------------------------------------------------------------------------------


@pytest.mark.parametrize("make,value,near", [
    (lambda v: MargLikCallback(structure=v), "diagonal", "diag"),
    (lambda v: MargLikCallback(structure=v), "layerwise", None),
    (lambda v: MargLikBoundCallback(structure=v), "Diagonal", "diag"),
    (lambda v: CurvatureOptions(structure=v), "scalar", None),  # LaplaceEvidence.fit's and select_models' options
])
def test_a_prior_structure_given_to_the_curvature_names_the_prior(make, value, near):
    with pytest.raises(ValueError) as raised:
        make(value)
    message = str(raised.value)
    assert f"got {value!r}" in message and "('full', 'kron', 'ekfac', 'diag')" in message
    assert f"{value!r} is a prior structure, GaussianPrior(structure=...)" in message
    assert (f"did you mean {near!r}" in message) == (near is not None)


@pytest.mark.parametrize("value,near", [("diag", "diagonal"), ("kron", None), ("EKFAC", None), ("full", None)])
def test_a_curvature_structure_given_to_the_prior_names_the_callback(value, near):
    with pytest.raises(ValueError) as raised:
        GaussianPrior(nn.Linear(2, 1), structure=value)
    message = str(raised.value)
    assert "('scalar', 'layerwise', 'diagonal')" in message
    assert f"{value!r} is a curvature structure, MargLikCallback(structure=...) or LaplaceEvidence.fit" in message
    assert (f"did you mean {near!r}" in message) == (near is not None)


def test_a_structure_of_neither_option_is_not_called_the_others():
    with pytest.raises(ValueError) as curvature:
        MargLikCallback(structure="kfac")
    with pytest.raises(ValueError) as prior:
        GaussianPrior(nn.Linear(2, 1), structure="per-layer")
    assert "did you mean 'kron'" in str(curvature.value) and "prior structure" not in str(curvature.value)
    assert "did you mean 'layerwise'" in str(prior.value) and "curvature structure" not in str(prior.value)


# --- keywords of other libraries ------------------------------------------------------------------------------------


def _packages():
    yield "lightning_marglik"
    try:
        import lightning  # noqa: F401
    except ImportError:
        return
    yield "lightning_marglik.lightning"


@pytest.mark.parametrize("package", list(_packages()))
@pytest.mark.parametrize("cls,kwargs,meant", [
    ("MargLikCallback", {"every_n_epochs": 5}, "'every_n_epochs': use frequency= (an estimate after every frequency-th epoch)"),
    ("MargLikCallback", {"frequncy": 5}, "'frequncy': did you mean 'frequency'?"),
    ("MargLikCallback", {"n_epochs_burnin": 5}, "'n_epochs_burnin': use burnin="),
    ("MargLikCallback", {"colour": "red"}, "'colour': not an option of this callback"),
    ("MargLikCallback", {"patience": 3}, "'patience': an option of MargLikEarlyStopping (patience counted in estimates)"),
    ("MargLikCallback", {"save_top_k": 1}, "'save_top_k': an option of MargLikCheckpoint"),
    ("MargLikEarlyStopping", {"save_last": True}, "'save_last': an option of MargLikCheckpoint"),
    ("MargLikCheckpoint", {"monitor": "val_loss"}, "'monitor': MargLikCheckpoint always monitors the evidence (marglik"),
    ("MargLikCheckpoint", {"every_n_epochs": 2}, "MargLikCallback(frequency=...) sets how often"),
    ("MargLikEarlyStopping", {"monitor": "val_loss", "mode": "min"},
     "'monitor': MargLikEarlyStopping always watches the evidence (marglik, log evidence per datum, higher is better); "
     "for another metric use Lightning's EarlyStopping; 'mode': MargLikEarlyStopping always waits for a higher evidence "
     "(marglik, log evidence per datum, higher is better)"),
    ("MargLikCheckpoint", {"mode": "max"}, "'mode': MargLikCheckpoint always keeps the models of highest evidence (marglik, "
     "log evidence per datum, higher is better) (MargLikCheckpoint takes"),
    ("MargLikBoundCallback", {"frequency": 2}, "'frequency': use every_k_batches="),
])
def test_an_unknown_keyword_names_the_public_class_and_the_option_meant(package, cls, kwargs, meant):
    callback = getattr(__import__(package, fromlist=[cls]), cls)
    with pytest.raises(TypeError) as raised:
        callback(**kwargs)
    message = str(raised.value)
    which = "an unexpected keyword argument" if len(kwargs) == 1 else "unexpected keyword arguments"
    assert message.startswith(f"{cls}() got {which} "), message
    assert meant in message and "Core" not in message
    takes = ", ".join(p for p in __import__("inspect").signature(callback).parameters)
    assert message.endswith(f"({cls} takes {takes})")


def test_no_keyword_advice_puts_an_article_where_it_does_not_belong():
    from lightning_marglik.callbacks import arguments

    advice = [text for table in (arguments.CALLBACK_KEYWORDS, arguments.BOUND_KEYWORDS, arguments.CHECKPOINT_KEYWORDS,
                                 arguments.STOPPING_KEYWORDS) for text in table.values()]
    garbled = [text for text in advice if re.search(r"\b(the|a|an|highest|higher) (the|a|an)\b", text)]
    assert not garbled, garbled  # "keeps the highest the evidence" read as a typo


def test_known_keywords_still_construct_and_copy():
    import copy
    import pickle

    callback = MargLikCallback(frequency=3, structure="diag")
    assert copy.deepcopy(callback).frequency == 3 and pickle.loads(pickle.dumps(MargLikCheckpoint(save_top_k=2))).save_top_k == 2


# --- the checkpoint's file names next to a validation ModelCheckpoint --------------------------------------------


def test_marglik_checkpoint_files_are_told_apart_from_a_validation_checkpoints(tmp_path):
    callback = MargLikCallback(structure="diag", frequency=1, steps=5)
    ours, theirs = MargLikCheckpoint(save_top_k=1), ModelCheckpoint(monitor="val_mse", save_top_k=1)
    _fit([callback, ours, theirs], max_epochs=3, default_root_dir=str(tmp_path), validation=True)
    assert Path(ours.dirpath) == Path(theirs.dirpath)  # one folder
    best = callback.best_epoch
    assert Path(ours.best_model_path).name == f"marglik-epoch={best}-step={4 * (best + 1)}.ckpt"
    assert re.fullmatch(r"epoch=\d-step=\d+\.ckpt", Path(theirs.best_model_path).name)
    names = sorted(p.name for p in Path(ours.dirpath).iterdir())
    assert names == sorted([Path(ours.best_model_path).name, Path(theirs.best_model_path).name])
    assert not any("-v1" in name for name in names)
    saved = torch.load(ours.best_model_path, weights_only=True)
    assert saved["callbacks"] and math.isfinite(callback.best_marglik)


def test_a_filename_of_ones_own_wins(tmp_path):
    callback, ours = MargLikCallback(structure="diag", frequency=1, steps=5), MargLikCheckpoint(dirpath=str(tmp_path), filename="{epoch}")
    _fit([callback, ours], max_epochs=2)
    assert [p.name for p in tmp_path.iterdir()] == [f"epoch={callback.best_epoch}.ckpt"]


# --- an optimizer's weight decay on top of the prior -------------------------------------------------------------


class _Optimized(Regressor):
    """The regressor with an optimizer of the test's making."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self.net)


def _groups(net):
    return [{"params": [net[0].weight, net[2].weight]}, {"params": [net[0].bias, net[2].bias], "weight_decay": 1e-3}]


@pytest.mark.parametrize("make,named", [
    (lambda net: torch.optim.SGD(net.parameters(), lr=1e-2, weight_decay=1e-4),
     "SGD param group 0 has weight_decay=0.0001 (0.weight, 0.bias, 2.weight, 2.bias)"),
    (lambda net: torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4),
     "Adam param group 0 has weight_decay=0.0001 (0.weight, 0.bias, 2.weight, 2.bias)"),
    (lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2),
     "AdamW param group 0 has weight_decay=0.01, AdamW's default (0.weight, 0.bias, 2.weight, 2.bias)"),
    (lambda net: torch.optim.Adam(_groups(net), lr=1e-2),  # one group's decay: the others have none
     "Adam param group 1 has weight_decay=0.001 (0.bias, 2.bias)"),
    (lambda net: torch.optim.AdamW(_groups(net), lr=1e-2),  # AdamW's default on group 0, the group's own on 1
     "AdamW param group 0 has weight_decay=0.01, AdamW's default (0.weight, 2.weight); AdamW param group 1 has "
     "weight_decay=0.001 (0.bias, 2.bias)"),
])
@pytest.mark.parametrize("estimator", ["callback", "bound"])
def test_an_optimizers_weight_decay_on_the_priors_tensors_is_refused_before_training(make, named, estimator):
    model = _Optimized(make)
    before = [p.detach().clone() for p in model.parameters()]
    callback = (MargLikCallback(structure="diag", steps=1) if estimator == "callback"
                else MargLikBoundCallback(structure="diag", every_k_batches=1))
    with pytest.raises(MargLikConfigurationError) as raised:
        _fit([callback], max_epochs=1, model=model)
    message = str(raised.value)
    assert message.startswith(named + ":"), message
    assert "the GaussianPrior already is these tensors' weight decay" in message and "Set weight_decay=0" in message
    assert model.train_modes == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step


def test_an_optimizer_without_weight_decay_trains():
    model = _Optimized(lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0))
    _fit([MargLikCallback(structure="diag", steps=1)], max_epochs=1, model=model)
    assert len(model.train_modes) == 4
