"""The issue-23 benchmarks' shared parts (``benchmarks/_zoo.py``, ``benchmarks/never_worse.py``): a real tiny
run with ``MargLikCallback``, ``MargLikCheckpoint`` and ``MargLikEarlyStopping``, and the rules the benchmark
derives from a trace."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _zoo  # noqa: E402
import never_worse  # noqa: E402


class _NeverImproves(_zoo.MargLikEarlyStopping):
    """An improvement must exceed 1e6 nats per datum: the stopper stops after the second estimate."""

    def __init__(self, patience: int) -> None:
        super().__init__(patience=patience, min_delta=1e6)


@pytest.fixture(scope="module")
def tiny_run():
    torch.set_num_threads(1)
    # max_step=None: the fixed point below holds for an unbounded, converged solve only; frequency=1: an
    # estimate after every epoch
    spec = _zoo.RunSpec("mlp", "digits", seed=0, epochs=3, n_train=120, n_test=60, batch_size=40,
                        callback={"max_step": None, "settle": None, "frequency": 1}, checkpoint=True, stopping=1)
    patch = pytest.MonkeyPatch()
    patch.setattr(_zoo, "MargLikEarlyStopping", _NeverImproves)
    try:
        return _zoo.train(spec)
    finally:
        patch.undo()


def test_trace_reads_the_evidence_at_its_fixed_point(tiny_run):
    """After a converged Newton solve, every learned tensor satisfies MacKay's delta = gamma / ||theta||^2,
    with gamma from the curvature eigenvalues the trace reads out of the callback's evidence: a wrong
    readout (a missing block, a wrong scale, eigenvalues of another tensor) breaks the identity."""
    rows = [r for r in tiny_run["trace"] if "marglik" in r]
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # frequency 1: an estimate after every epoch
    for row in rows:
        for log_delta, gamma, sq_norm, trace in zip(row["log_delta"], row["gamma"], row["sq_norm"], row["curv_trace"]):
            assert trace > 0 and 0 < gamma
            if log_delta == 0.0:  # held at the declared precision (the output layer, by default): not a fixed point
                continue
            # within the Newton tolerance (1e-6 nats predicted) and the float32 buffer
            assert math.log(gamma / sq_norm) == pytest.approx(log_delta, abs=1e-2)


def test_checkpoint_and_stop_are_recorded(tiny_run):
    best = max(tiny_run["history"], key=lambda h: h["marglik"])
    assert tiny_run["checkpoint"]["epoch"] == best["epoch"]
    row = next(r for r in tiny_run["trace"] if r["epoch"] == best["epoch"])
    # the checkpoint read back from disk predicts as the weights of its epoch did
    assert tiny_run["checkpoint"]["acc"] == pytest.approx(row["test_acc"])
    assert tiny_run["checkpoint"]["nll"] == pytest.approx(row["test_nll"], rel=1e-5)
    # the stopper stopped after epoch 2 (patience 1, no estimate improves by 1e6), and the stop was undone
    assert tiny_run["stop"]["epoch"] == 2
    assert "MargLikEarlyStopping stopped training after epoch 2" in tiny_run["stop"]["reason"]
    assert [r["epoch"] for r in tiny_run["trace"]] == [1, 2, 3]


def test_validation_split_is_stratified_and_disjoint():
    data = _zoo.load("bars", 120, 30)
    train, (x_val, y_val) = _zoo.validation_split(data, 0.2, seed=3)
    assert len(y_val) == 24 and len(train.y_train) == 96
    assert torch.bincount(y_val).tolist() == [4] * 6  # 20 of each class drawn, 20 % of each held out
    rows = {tuple(x.flatten().tolist()) for x in train.x_train}
    assert not any(tuple(x.flatten().tolist()) in rows for x in x_val)


def test_stock_rules_match_lightning_semantics():
    trace = [{"epoch": e, "val_acc": a, "val_nll": n} for e, a, n in
             [(1, 0.5, 1.0), (2, 0.7, 0.8), (3, 0.7, 0.9), (4, 0.6, 0.8), (5, 0.65, 0.85), (6, 0.8, 0.7)]]
    assert never_worse.model_checkpoint_epoch(trace) == 6
    assert never_worse.model_checkpoint_epoch(trace[:5]) == 2  # ties keep the first (strictly better replaces)
    # val loss best 0.8 at epoch 2; 0.9, 0.8 (not < 0.8), 0.85: three without improvement -> stops after epoch 5
    assert never_worse.early_stopping_epoch(trace, patience=3) == 5
    assert never_worse.early_stopping_epoch(trace, patience=4) is None
