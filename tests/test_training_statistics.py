"""MargLikCallback(statistics="training"): the EF sums of the training passes, in a real Trainer.

Reference: at fixed weights (SGD with lr=0) the sums gathered from one epoch's training forward
and backward equal the evidence pass's sums over the same data, in float64, and so does the log
evidence; the set-up check refuses losses whose gradients are not the EF's columns.
"""
from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikCallback,
    MargLikConfigurationError,
    map_loss,
)

torch.set_num_threads(1)


class Net(pl.LightningModule):
    """An MLP (over the last dimension: ``(B, T, D)`` inputs give ``(B, T, C)`` outputs)."""

    def __init__(self, likelihood, inputs: int = 3, outputs: int = 2, lr: float = 0.0, loss=None, dropout: float = 0.0):
        super().__init__()
        layers = [nn.Linear(inputs, 6), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(6, outputs)]
        self.net = nn.Sequential(*layers)
        self.prior = GaussianPrior(self.net, structure="layerwise")
        self.likelihood = likelihood
        self.lr = lr
        self.loss = loss

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.loss is not None:
            return self.loss(self, x, y)
        return map_loss(self(x), y, self.likelihood, self.prior)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def gaussian_data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randn(n, 2, generator=g, dtype=torch.float64))


def categorical_data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g))


def sequence_data(n: int = 24, positions: int = 5) -> TensorDataset:
    """``(B, T)`` labels with ignored positions (-100), some examples with several kept positions."""
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 2, (n, positions), generator=g)
    y[torch.rand(n, positions, generator=g) < 0.4] = -100
    return TensorDataset(torch.randn(n, positions, 3, generator=g, dtype=torch.float64), y)


@pytest.fixture
def passes(monkeypatch):
    """The evidence passes the callback runs: ``[number of batches]`` per call."""
    from lightning_marglik.callbacks import estimating  # where the callbacks call collect_statistics

    calls = []
    original = estimating.collect_statistics

    def counted(model, batches, *args, **kwargs):
        calls.append(len(batches))
        return original(model, batches, *args, **kwargs)

    monkeypatch.setattr(estimating, "collect_statistics", counted)
    return calls


def fit(module, data, callback, max_epochs=1, batch_size=8, **kwargs):
    trainer = pl.Trainer(
        max_epochs=max_epochs, callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", precision="64-true", **kwargs,
    )
    trainer.fit(module.double(), DataLoader(data, batch_size=batch_size, shuffle=True))
    return trainer


CASES = [
    ("gaussian", GaussianLikelihood, gaussian_data),
    ("categorical", CategoricalLikelihood, categorical_data),
]


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("name,likelihood,data", CASES, ids=[c[0] for c in CASES])
def test_training_sums_equal_the_evidence_pass_at_fixed_weights(structure, name, likelihood, data, passes):
    torch.manual_seed(0)
    module = Net(likelihood())
    callback = MargLikCallback(structure=structure, approx="ef", steps=0, statistics="training")
    fit(module, data(), callback, batch_size=16)  # 40 = 16 + 16 + 8: an odd last batch
    assert passes == [1, 1]  # the set-up batch and the check of the first training batch: no data pass
    ours = callback.evidence
    reference = LaplaceEvidence.fit(module.net, DataLoader(data(), batch_size=40), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure=structure, approx="ef")
    assert ours.n_data == reference.n_data == 40
    for mine, theirs in zip(ours.structures, reference.structures):
        for key, value in theirs.states().items():
            torch.testing.assert_close(mine.states()[key], value, rtol=1e-10, atol=1e-12, msg=key)
    for key, value in reference._lik_stats.items():
        torch.testing.assert_close(ours._lik_stats[key].double(), value.double(), rtol=1e-10, atol=1e-12)
    assert math.isclose(ours.log_marglik().item(), reference.log_marglik().item(), rel_tol=1e-10)


def test_sequence_outputs_with_ignored_positions_kron(passes):
    """(B, T, C) outputs of a position-wise network: every output row's gradient comes from one term."""
    torch.manual_seed(0)
    module = Net(CategoricalLikelihood())
    callback = MargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    fit(module, sequence_data(), callback)
    assert passes == [1, 1]
    reference = LaplaceEvidence.fit(module.net, DataLoader(sequence_data(), batch_size=24), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure="kron", approx="ef")
    assert callback.evidence.n_data == reference.n_data
    for mine, theirs in zip(callback.evidence.structures, reference.structures):
        for key, value in theirs.states().items():
            torch.testing.assert_close(mine.states()[key], value, rtol=1e-10, atol=1e-12, msg=key)
    assert math.isclose(callback.evidence.log_marglik().item(), reference.log_marglik().item(), rel_tol=1e-10)


def test_sequence_outputs_diag_are_refused_by_the_check():
    """diag-EF takes each position as a datum: a sequence's summed gradient has cross terms."""
    module = Net(CategoricalLikelihood())
    callback = MargLikCallback(structure="diag", approx="ef", steps=0, statistics="training")
    with pytest.raises(MargLikConfigurationError, match="differ from the evidence pass"):
        fit(module, sequence_data(), callback)


def test_gradient_accumulation_is_accounted_for(passes):
    torch.manual_seed(0)
    module = Net(GaussianLikelihood())
    callback = MargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    fit(module, gaussian_data(), callback, accumulate_grad_batches=2)
    assert passes == [1, 1]
    reference = LaplaceEvidence.fit(module.net, DataLoader(gaussian_data(), batch_size=40), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure="kron", approx="ef")
    assert math.isclose(callback.evidence.log_marglik().item(), reference.log_marglik().item(), rel_tol=1e-10)


@pytest.mark.parametrize(
    "likelihood,data,loss",
    [
        (GaussianLikelihood, gaussian_data, lambda m, x, y: nn.functional.mse_loss(m(x), y, reduction="sum")),
        (CategoricalLikelihood, categorical_data,
         lambda m, x, y: nn.functional.cross_entropy(m(x), y, label_smoothing=0.1) + m.prior.penalty() / 40),
        (GaussianLikelihood, gaussian_data, lambda m, x, y: 2 * map_loss(m(x), y, m.likelihood, m.prior)),
    ],
    ids=["sum-reduction", "label-smoothing", "scaled"],
)
def test_the_check_refuses_a_loss_that_is_not_map_loss(likelihood, data, loss):
    module = Net(likelihood(), loss=loss)
    callback = MargLikCallback(structure="kron", approx="ef", statistics="training")
    with pytest.raises(MargLikConfigurationError, match="differ from the evidence pass"):
        fit(module, data(), callback)


def test_the_check_refuses_dropout():
    module = Net(GaussianLikelihood(), dropout=0.5)
    with pytest.raises(MargLikConfigurationError, match="no dropout"):
        fit(module, gaussian_data(), MargLikCallback(structure="diag", approx="ef", statistics="training"))


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_fraction_sums_the_last_batches_scaled_to_all_data(structure, passes):
    """statistics_fraction=0.4 of 5 batches: the layer sums of the last 2 (16 data) times 40 / 16, the
    likelihood's sums of all 40; at fixed weights in float64, against the evidence pass of those batches."""
    torch.manual_seed(0)
    module = Net(CategoricalLikelihood()).double()
    data = categorical_data()
    callback = MargLikCallback(structure=structure, approx="ef", steps=0, frequency=2, statistics="training",
                               statistics_fraction=0.4)
    trainer = pl.Trainer(max_epochs=2, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", precision="64-true")
    trainer.fit(module, DataLoader(data, batch_size=8))  # not shuffled: the last two batches are data[24:]
    assert passes == [1, 1] and [h["epoch"] for h in callback.history] == [2]
    prior = GaussianPrior(module.net, structure="layerwise")
    last = LaplaceEvidence.fit(module.net, DataLoader(TensorDataset(*data[24:]), batch_size=16), module.likelihood,
                               prior, structure=structure, approx="ef")
    every = LaplaceEvidence.fit(module.net, DataLoader(data, batch_size=40), module.likelihood, prior,
                                structure=structure, approx="ef")
    ours = callback.evidence
    assert ours.n_data == 40
    for mine, theirs in zip(ours.structures, last.structures):
        for key, value in theirs.states().items():
            factor = 40 / 16 if key == "diag" or key.endswith(".g") else 1  # kron: A and its row count are a mean
            torch.testing.assert_close(mine.states()[key], value * factor, rtol=1e-10, atol=1e-12, msg=key)
    for key, value in every._lik_stats.items():
        torch.testing.assert_close(ours._lik_stats[key].double(), value.double(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure,approx", [("diag", "ef"), ("kron", "ef"), ("ekfac", "ggn")])
def test_rescaled_sums_equal_the_sums_of_the_data_repeated(structure, approx):
    """``Structure.rescale(2)``: the log-determinant of every block as if each datum were there twice."""
    torch.manual_seed(0)
    net = Net(CategoricalLikelihood()).double().net
    data = categorical_data()
    twice = TensorDataset(*(torch.cat([t, t]) for t in data.tensors))
    prior = GaussianPrior(net, structure="layerwise")
    once = LaplaceEvidence.fit(net, DataLoader(data, batch_size=16), CategoricalLikelihood(), prior,
                               structure=structure, approx=approx)
    double = LaplaceEvidence.fit(net, DataLoader(twice, batch_size=16), CategoricalLikelihood(), prior,
                                 structure=structure, approx=approx)
    log_delta = [torch.tensor(v, dtype=torch.float64) for v in (-1.0, 0.5, 1.5, 2.0)]
    scale = torch.tensor(0.7, dtype=torch.float64)
    for mine, theirs in zip(once.structures, double.structures):
        before = mine.log_det(scale, log_delta)
        mine.rescale(2.0)
        mine.prepare()
        after = mine.log_det(scale, log_delta)
        torch.testing.assert_close(after, theirs.log_det(scale, log_delta), rtol=1e-10, atol=1e-10)
        assert not torch.isclose(before, after)  # the test can fail: rescaling changes the block


def test_a_fraction_needs_a_sized_training_dataloader():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(*categorical_data().tensors))

    # the training sums must be the evidence data (no `dataloader=`), and a stream without a limit has no end
    callback = MargLikCallback(structure="diag", approx="ef", statistics="training", statistics_fraction=0.5)
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", precision="64-true")
    module = Net(CategoricalLikelihood(), lr=1.0).double()
    start = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(MargLikConfigurationError, match="IterableDataset without a length.*limit_train_batches"):
        trainer.fit(module, DataLoader(Stream(), batch_size=8))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), start))  # refused before any step


def test_bad_values_are_refused_at_init():
    with pytest.raises(ValueError, match="`statistics` must be one of"):
        MargLikCallback(structure="kron", approx="ef", statistics="train")
    for fraction in (0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5", None):
        with pytest.raises(ValueError, match="`statistics_fraction` must be a finite number in"):
            MargLikCallback(structure="kron", approx="ef", statistics="training", statistics_fraction=fraction)
    with pytest.raises(ValueError, match="needs statistics='training'"):
        MargLikCallback(structure="kron", approx="ef", statistics_fraction=0.5)
    with pytest.raises(ValueError, match="approx='ef'"):
        MargLikCallback(structure="kron", approx="ggn", statistics="training")
    with pytest.raises(ValueError, match="structure='diag' or 'kron'"):
        MargLikCallback(structure="full", approx="ef", statistics="training")


def test_manual_optimization_is_refused():
    class Manual(Net):
        def __init__(self):
            super().__init__(GaussianLikelihood())
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    with pytest.raises(MargLikConfigurationError, match="manual optimization"):
        fit(Manual(), gaussian_data(), MargLikCallback(structure="diag", approx="ef", statistics="training"))


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="gloo")
def test_ddp_sums_equal_the_single_process_evidence_with_one_collective(tmp_path):
    """2 CPU processes: each rank sums its shard's training batches; ONE all-reduce per estimate."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests import training_statistics_ddp as worker

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tests" / "training_statistics_ddp.py"), str(tmp_path)],
                         cwd=str(root), env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    net = worker.net()
    reference = LaplaceEvidence.fit(net, DataLoader(worker.data(), batch_size=40), GaussianLikelihood(),
                                    GaussianPrior(net, structure="layerwise"), structure="kron", approx="ef")
    states = {f"{i}.{k}": v for i, s in enumerate(reference.structures) for k, v in s.states().items()}
    for result in ranks:
        assert result["collectives"] == [1]
        assert result["n_data"] == worker.N
        for key, value in states.items():
            torch.testing.assert_close(torch.tensor(result["states"][key], dtype=value.dtype), value, rtol=1e-10, atol=1e-12)
        assert math.isclose(result["log_marglik"], reference.log_marglik().item(), rel_tol=1e-10)


def test_a_distributed_sampler_that_repeats_an_example_is_refused_at_set_up(tmp_path):
    """41 examples on 2 processes: Lightning's DistributedSampler repeats one, the training batches held 42 data, the
    evidence 41, and every estimate threw the training sums away for an evidence pass."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tests" / "training_statistics_ddp.py"), str(tmp_path), "odd"],
                         cwd=str(root), env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        refused = json.loads((tmp_path / f"rank{rank}.json").read_text())["refused"]
        assert "the DistributedSampler gives the 2 processes 42 of 41 examples per epoch (repeating 1" in refused


def test_bf16_mixed_gradients_are_summed_in_float64():
    """bf16 autocast: output gradients in bf16, products in float32, sums in float64; close to the pass."""
    torch.manual_seed(0)
    module = Net(CategoricalLikelihood()).float()
    data = TensorDataset(categorical_data().tensors[0].float(), categorical_data().tensors[1])
    callback = MargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", precision="bf16-mixed")
    trainer.fit(module, DataLoader(data, batch_size=16))
    assert all(s.states()[k].dtype in (torch.float64, torch.int64) for s in callback.evidence.structures for k in s.states())
    reference = LaplaceEvidence.fit(module.net, DataLoader(data, batch_size=40), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure="kron", approx="ef")
    assert math.isclose(callback.evidence.log_marglik().item(), reference.log_marglik().item(), rel_tol=2e-3)


def test_float16_loss_scaling_is_refused():
    """A Trainer on CPU turns precision='16-mixed' into bf16 (no GradScaler): the refusal is checked on
    the attribute it reads, and the message names the fix."""
    from types import SimpleNamespace

    from lightning_marglik.callbacks.checks import check_training_statistics

    with pytest.raises(MargLikConfigurationError, match="bf16-mixed"):
        check_training_statistics(SimpleNamespace(precision="16-mixed"), Net(GaussianLikelihood()))


def test_only_estimation_epochs_are_summed_and_a_partial_epoch_takes_the_pass(passes):
    """frequency=2 over 3 epochs: estimates after epochs 2 and 3 from the training sums, no data pass;
    max_steps ending within epoch 4 gives a final estimate from the evidence pass (the epoch is partial)."""
    module = Net(GaussianLikelihood(), lr=1e-2)
    callback = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=2, steps=5, statistics="training")
    fit(module, gaussian_data(), callback, max_epochs=3, batch_size=8)  # 5 batches per epoch
    assert [h["epoch"] for h in callback.history] == [2, 3] and passes == [1, 1]
    passes.clear()
    callback = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=2, steps=5, statistics="training")
    fit(Net(GaussianLikelihood(), lr=1e-2), gaussian_data(), callback, max_epochs=10, max_steps=17, batch_size=8)
    assert [h["epoch"] for h in callback.history] == [2, 4] and passes == [1, 1, 5]  # the final estimate: a pass


class KeywordCalls(nn.Module):
    """The Net's MLP with its Linears called as ``layer(input=x)``."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net[2](input=torch.tanh(self.net[0](input=x)))


def test_keyword_called_layers_are_summed_as_positional_ones(passes):
    """A Linear called with input= crashed the training passes' hook (inputs[0] of no positional argument)."""
    torch.manual_seed(0)
    module = Net(CategoricalLikelihood())
    module.net = KeywordCalls(module.net)
    module.prior = GaussianPrior(module.net, structure="layerwise")
    callback = MargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    fit(module, categorical_data(), callback, batch_size=16)
    assert passes == [1, 1]  # the training sums were taken: no evidence pass
    reference = LaplaceEvidence.fit(module.net, DataLoader(categorical_data(), batch_size=40), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure="kron", approx="ef")
    assert math.isclose(callback.evidence.log_marglik().item(), reference.log_marglik().item(), rel_tol=1e-10)


def test_in_place_activation_after_a_hooked_layer(passes):
    """A hooked layer's output modified in place (ReLU(inplace=True)): the tensor hook gets the
    gradient of the layer's output, not of the activation."""
    torch.manual_seed(0)
    module = Net(CategoricalLikelihood())
    module.net[1] = nn.ReLU(inplace=True)
    callback = MargLikCallback(structure="diag", approx="ef", steps=0, statistics="training")
    fit(module, categorical_data(), callback, batch_size=16)
    assert passes == [1, 1]
    reference = LaplaceEvidence.fit(module.net, DataLoader(categorical_data(), batch_size=40), module.likelihood,
                                    GaussianPrior(module.net, structure="layerwise"), structure="diag", approx="ef")
    torch.testing.assert_close(callback.evidence.structures[0].states()["diag"], reference.structures[0].states()["diag"],
                               rtol=1e-10, atol=1e-12)


class Scale(nn.Module):
    """A layer without a hook rule: its parameter takes the exact per-example path."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x


def test_exact_path_parameters_are_refused_naming_the_module():
    module = Net(GaussianLikelihood())
    module.net.insert(1, Scale(6))
    module.prior = GaussianPrior(module.net, structure="layerwise")
    with pytest.raises(MargLikConfigurationError, match=r"'net\.1': Scale has no hook rule.*register_layer_rule"):
        fit(module, gaussian_data(), MargLikCallback(structure="kron", approx="ef", statistics="training"))


def test_lightning_pytorch_package(passes):
    """``lightning.pytorch``'s Trainer with ``lightning_marglik.lightning.MargLikCallback``: the same sums."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning_marglik.lightning import MargLikCallback as LightningMargLikCallback
    from tests.lightning_models import RegressorSteps

    class Regressor(RegressorSteps, L.LightningModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.0)

    torch.manual_seed(0)
    module = Regressor(n_data=40).double()
    data = TensorDataset(torch.linspace(-2, 2, 40).unsqueeze(1), torch.sin(torch.linspace(-2, 2, 40)).unsqueeze(1))
    callback = LightningMargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    L.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, accelerator="cpu", precision="64-true").fit(module, DataLoader(data, batch_size=16))
    assert passes == [1, 1]
    reference = LaplaceEvidence.fit(module.net, DataLoader(data, batch_size=40), module.likelihood,
                                    GaussianPrior(module.net), structure="kron", approx="ef")
    assert math.isclose(callback.evidence.log_marglik().item(), reference.log_marglik().item(), rel_tol=1e-10)
