"""The study against cross-validation (``benchmarks/vs_cross_validation.py``) and the harness parts it added to
``benchmarks/_zoo.py``: the arms' runs, cross-validation's choice and cost, the targets, the recipe's schedule,
the augmentation, the scores and the cache names."""
from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _zoo  # noqa: E402
import vs_cross_validation as study  # noqa: E402


def test_every_arm_is_the_run_it_names():
    runs = {arm: study.spec("mnist", "cnn", 1, arm) for arm in study.arms_of("mnist", "cnn")}
    assert runs["defaults"].callback == {} and runs["defaults"].checkpoint  # MargLikCallback() as shipped
    assert runs["previous defaults"].callback == {"settle": 0.05, "frequency": 1, "max_step": 1.0}
    assert runs["Algorithm 1"].callback["steps"] == 100 and runs["Algorithm 1"].callback["lr"] == 1.0
    assert runs[study.PEER_ARM].peer == study.PEER and runs[study.PEER_ARM].callback is None
    for delta in study.GRID:
        full, split = runs[study.fixed(delta)], runs[study.fixed(delta, cv=True)]
        assert full.precision == split.precision == delta and full.callback is None
        assert full.validation == 0.0 and split.validation == study.VALIDATION
        assert replace(split, validation=0.0) == full  # the same run but for the held-out fraction
    assert runs["candidate: output layer held"].fixed == ["7.weight", "7.bias"]  # the CNN's last Linear
    assert runs["candidate: output layer held"].callback == {} and runs["candidate: ekfac"].callback == {"structure": "ekfac"}
    assert runs["candidate: settle rule"].callback == {"settle": 0.05}
    assert all(arm in study.arms_of("bars", "bn_resnet") for arm in study.CANDIDATES)  # every cell
    assert runs["remedy: scalar prior"].prior == "scalar" and runs["remedy: full GGN"].callback == {"structure": "full"}
    augmented = runs["aug defaults, augmented evidence, T=0.2"]
    assert augmented.augment and augmented.evidence == "augmented" and augmented.temperature == 0.2
    assert runs[study.fixed(1.0, aug=True)].augment and not runs[study.fixed(1.0)].augment
    # the same recipe for every arm of a cell, the cell's own for the ResNets
    assert {(r.optimizer, r.lr, r.schedule, r.warmup, r.epochs, r.batch_size) for r in runs.values()} == {
        ("adam", 1e-3, "cosine", 0, 40, 128)}
    resnet = study.spec("bars", "fixup_resnet", 0, "defaults")
    assert (resnet.optimizer, resnet.lr, resnet.warmup, resnet.ood) == ("sgd", 0.03, 5, "mnist")
    assert "remedy: full GGN" not in study.arms_of("digits", "mlp") and "remedy: scalar prior" in study.arms_of("digits", "mlp")
    with pytest.raises(ValueError, match="unknown arm"):
        study.spec("mnist", "cnn", 0, "delta 1")


def _run(cpu, val_nll=None, **final):
    out = {"cpu_seconds": cpu, "final": final}
    if val_nll is not None:
        out["validation"] = {"nll": val_nll}
    return out


def test_cross_validation_picks_each_seeds_lowest_validation_nll_and_costs_six_runs():
    val = {0.01: (0.9, 0.5), 0.1: (0.4, 0.6), 1.0: (0.5, 0.3), 10.0: (0.6, 0.7), 100.0: (2.0, 2.0)}  # per seed
    runs = {study.fixed(d, cv=True): [_run(2.0, v[s]) for s in range(2)] for d, v in val.items()}
    runs.update({study.fixed(d): [_run(10.0 + d, nll=d), _run(20.0 + d, nll=d)] for d in study.GRID})
    cv = study.cross_validation(runs)
    assert cv["chosen"] == [0.1, 1.0]
    assert [r["final"]["nll"] for r in cv["runs"]] == [0.1, 1.0]  # retrained on all the data: the full run
    assert cv["cpu"] == [5 * 2.0 + 10.1, 5 * 2.0 + 21.0]


def test_targets_against_cross_validation_and_delta_one():
    cv = {"nll": 0.30, "ece": 0.02, "auroc": 0.80, "acc": 0.900}
    one = {"acc": 0.910}
    row = {"nll": 0.30, "ece": 0.02, "auroc": 0.80, "acc": 0.905, "cost": 2.0}
    assert all(study.targets(row, cv, one).values())  # every bound is inclusive
    worse = {"nll": 0.31, "ece": 0.03, "auroc": 0.79, "acc": 0.894, "cost": 2.01}
    assert not any(study.targets(worse, cv, one).values())


def test_the_recipe_warms_up_linearly_then_decays_to_zero():
    spec = _zoo.RunSpec("mlp", "digits", 0, epochs=10, n_train=100, n_test=10, schedule="cosine", warmup=2)
    factor = _zoo.lr_factor(spec, steps_per_epoch=5)
    assert [factor(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factor(10) == pytest.approx(1.0) and factor(50) == pytest.approx(0.0, abs=1e-12)
    assert factor(30) == pytest.approx(0.5)  # half-way through the decay
    assert _zoo.lr_factor(replace(spec, schedule="constant", warmup=0), 5)(37) == 1.0
    with pytest.raises(ValueError, match="unknown schedule"):
        _zoo.lr_factor(replace(spec, schedule="linear"), 5)
    with pytest.raises(ValueError, match="unknown optimizer"):
        _zoo.optimizer_of(replace(spec, optimizer="rmsprop"))


def test_augmented_batches_are_the_images_shifted_by_at_most_the_shift():
    torch.manual_seed(0)
    images = torch.zeros(64, 1, 14, 14)
    images[:, :, 7, 7] = 1.0  # one bright pixel in the middle
    labels = torch.arange(64)
    x, y = _zoo.shifted(list(zip(images, labels)))
    assert torch.equal(y, labels) and x.shape == images.shape
    rows, cols = (x[:, 0] == 1.0).nonzero()[:, 1:].T
    assert len(rows) == 64  # each image keeps its pixel, moved by at most SHIFT each way
    assert (rows - 7).abs().max() <= _zoo.SHIFT and (cols - 7).abs().max() <= _zoo.SHIFT
    assert len({(int(r), int(c)) for r, c in zip(rows, cols)}) > 5  # and the shifts differ


def test_scores_of_known_predictions():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    y = torch.tensor([0, 0, 1, 1])
    ood = torch.tensor([[0.5, 0.5], [0.55, 0.45]])  # less confident than any test input
    got = _zoo._softmax_scores(probs, y, ood)
    assert got["acc"] == 0.75 and got["confidence"] == pytest.approx((0.9 + 0.8 + 0.7 + 0.6) / 4)
    assert got["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.8) + math.log(0.7) + math.log(0.4)) / 4)
    assert got["auroc"] == 1.0  # maximum softmax probability separates them
    # ECE: 15 equal bins of confidence; here every example has a bin of its own: mean |conf - correct|
    assert got["ece"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.6) / 4)


def test_cache_names_ignore_fields_at_their_defaults():
    spec = _zoo.RunSpec("mlp", "digits", 0, epochs=3, n_train=100, n_test=10)
    assert spec.key() == replace(spec, prior="layerwise", trace=True).key()  # defaults: the same run, the same name
    assert spec.key() != replace(spec, prior="scalar").key() != replace(spec, epochs=4).key()
    assert spec.key().startswith("mlp_digits_s0_")


def test_augmented_arms_are_scored_against_cross_validation_under_the_same_augmentation():
    def run(arm, seed):
        aug, split = arm.startswith("aug "), " cv " in f" {arm} "
        nll = (2.0 if aug else 1.0) + (0.1 * seed)
        out = {"cpu_seconds": 1.0, "param_names": ["w"], "log_delta": [0.0], "final": {
            m: nll for m in study.METRICS}}
        if split:  # validation NLL lowest at delta = 10 with augmentation, at 0.1 without
            delta = float(arm.split("delta=")[1])
            out["validation"] = {"nll": abs(math.log10(delta) - (1 if aug else -1))}
        return out

    runs = {arm: [run(arm, s) for s in range(2)] for arm in study.arms_of("mnist", "mlp")}
    plain, augmented = study.analyse_cell(runs), study.analyse_cell(runs, aug=True)
    assert plain["table"]["cross-validation"]["chosen"] == [0.1, 0.1]
    assert augmented["table"]["cross-validation"]["chosen"] == [10.0, 10.0]
    assert augmented["table"]["delta=1"]["nll"] == pytest.approx(2.05)  # the augmented delta = 1 runs
    assert set(augmented["table"]) >= {f"{arm} (final)" for arm in study.AUGMENTED}
    assert not any(arm.startswith("aug") for arm in plain["table"])
    text = study.markdown({("mnist", "mlp"): plain, ("mnist", "mlp" + study.AUGMENTED_SUFFIX): augmented},
                          ["HEAD abc"], [0, 1], "cmd", [])
    assert "## mnist / mlp, augmented" in text
    # a targets table per group: the augmented arms (equal to their cross-validation, ties met) in their own
    assert "| arm | mnist / mlp | cells meeting all |" in text
    assert "| arm | mnist / mlp, augmented | cells meeting all |\n|---|---|---|\n| aug defaults, plain evidence (final) | all met | 1 / 1 |" in text


def test_never_worse_targets_hold_an_arm_to_delta_1_and_to_cross_validation_where_delta_1_overfits():
    one = {"nll": 0.50, "acc": 0.90}
    cv_weaker, cv_stronger = {"chosen": [0.1, 1.0, 0.01], "nll": 0.45, "acc": 0.91}, {"chosen": [10.0, 10.0, 1.0], "nll": 0.45, "acc": 0.91}
    assert not study.overfits(cv_weaker) and study.overfits(cv_stronger)
    inside = {"nll": 0.52, "acc": 0.89, "cost": 2.0}  # exactly at the slack: met
    assert all(ok in (True, None) for ok in study.never_worse(inside, cv_weaker, one).values())
    missed = study.never_worse({"nll": 0.5201, "acc": 0.8899, "cost": 2.01}, cv_weaker, one)
    assert [t for t, ok in missed.items() if ok is False] == ["NLL <= delta=1 + 0.02", "acc >= delta=1 - 1", "cost <= 2"]
    # where delta = 1 overfits, beating delta = 1 is not enough: cross-validation's NLL and accuracy too
    over = study.never_worse({"nll": 0.46, "acc": 0.905, "cost": 1.2}, cv_stronger, one)
    assert [t for t, ok in over.items() if ok is False] == ["NLL <= CV (overfit cell)", "acc >= CV (overfit cell)"]
