"""Denormal floats flushed to zero while the library trains or estimates, and the process's own setting restored.

Real Trainer fits (the DDP case is in ``tests/test_ddp.py``); the evidence with and without the flush
compared on a network whose weights are denormal floats.
"""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_marglik import (
    CategoricalLikelihood, DenormalFlush, GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikBoundCallback, MargLikCallback,
    MargLikConfigurationError,
)
from lightning_marglik.denormals import flushing_denormals
from tests.lightning_models import Regressor, loader, regression_data, trainer


@pytest.fixture(autouse=True, params=[False, True], ids=["process-unflushed", "process-flushed"])
def process_setting(request):
    """Every test runs once with the process not flushing (torch's default) and once flushing already."""
    torch.set_flush_denormal(request.param)
    assert flushing_denormals() is request.param
    yield request.param
    torch.set_flush_denormal(False)


class ModeRecorder(pl.Callback):
    """Whether the thread flushed in each training step, and at each epoch's end (after the estimate)."""

    def __init__(self) -> None:
        self.steps, self.epochs = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(flushing_denormals())

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append(flushing_denormals())


def test_flushing_reads_the_mode_torch_sets(process_setting):
    torch.set_flush_denormal(not process_setting)
    assert flushing_denormals() is (not process_setting)
    torch.set_flush_denormal(process_setting)
    assert flushing_denormals() is process_setting


def test_flush_sets_then_restores_what_it_found(process_setting):
    flush = DenormalFlush()
    flush.start()
    assert flushing_denormals() and flush.active
    flush.start()  # a second start keeps the first's saved setting
    flush.stop()
    assert flushing_denormals() is process_setting and not flush.active
    flush.stop()  # without a start: nothing
    assert flushing_denormals() is process_setting
    with DenormalFlush() as inside:
        assert flushing_denormals() and inside.active
    assert flushing_denormals() is process_setting
    with DenormalFlush(enabled=False) as off:
        assert flushing_denormals() is process_setting and not off.active


def test_flush_restores_after_an_exception_in_its_block(process_setting):
    with pytest.raises(RuntimeError, match="inside"):
        with DenormalFlush():
            raise RuntimeError("inside")
    assert flushing_denormals() is process_setting


@pytest.mark.parametrize("kind", [MargLikCallback, MargLikBoundCallback])
def test_callback_flushes_for_the_fit_and_restores(process_setting, kind):
    recorder = ModeRecorder()
    callback = kind(settle=None, structure="diag", steps=5) if kind is MargLikCallback else kind(structure="diag")
    trainer([callback, recorder], max_epochs=2).fit(Regressor(), loader(regression_data()))
    assert recorder.steps and all(recorder.steps) and recorder.epochs == [True, True]
    assert flushing_denormals() is process_setting


def test_flush_denormals_false_leaves_the_mode_alone(process_setting):
    recorder = ModeRecorder()
    callback = MargLikCallback(settle=None, structure="diag", steps=5, flush_denormals=False)
    trainer([callback, recorder], max_epochs=2).fit(Regressor(), loader(regression_data()))
    assert set(recorder.steps) == set(recorder.epochs) == {process_setting}
    assert flushing_denormals() is process_setting


def test_flush_denormals_must_be_a_bool():
    for bad in ("false", 1, None):
        with pytest.raises(ValueError, match="`flush_denormals` must be True or False"):
            MargLikCallback(flush_denormals=bad)
        with pytest.raises(ValueError, match="`flush_denormals` must be True or False"):
            net = nn.Linear(1, 1)
            LaplaceEvidence.fit(net, loader(regression_data()), GaussianLikelihood(), GaussianPrior(net),
                                flush_denormals=bad)
        with pytest.raises(ValueError, match="`enabled` must be True or False \\(of DenormalFlush\\)"):
            DenormalFlush(bad)  # a plain loop's own flush: "false" would otherwise read as True


class FailsInEpoch(Regressor):
    """Raises in the first training step of epoch ``epoch`` (0-based)."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.fail_epoch = epoch

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.fail_epoch:
            raise RuntimeError("injected failure in training")
        return super().training_step(batch, batch_idx)


def test_setting_restored_after_an_exception_in_training(process_setting):
    recorder = ModeRecorder()
    callback = MargLikCallback(settle=None, structure="diag", steps=5)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer([callback, recorder], max_epochs=3).fit(FailsInEpoch(1), loader(regression_data()))
    assert recorder.epochs == [True]  # epoch 0 ran flushed; the failure came in epoch 1
    assert flushing_denormals() is process_setting


class Uncovered(Regressor):
    """A trainable layer outside the prior: refused in ``setup``."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(1, 1)


def test_setting_restored_after_a_refused_set_up(process_setting):
    with pytest.raises(MargLikConfigurationError, match="extra"):
        trainer([MargLikCallback()], max_epochs=1).fit(Uncovered(), loader(regression_data()))
    assert flushing_denormals() is process_setting


class Records(nn.Module):
    """``nn.Linear`` that notes whether the thread flushed when it ran."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.seen = layer, []

    def forward(self, x):
        self.seen.append(flushing_denormals())
        return self.layer(x)


def denormal_classifier() -> tuple:
    """A float32 classifier whose middle layer's weights and bias are float32 denormals (|w| < 1.2e-38),
    as a group the evidence has shrunk, and its data."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Records(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 3)).float()
    with torch.no_grad():
        middle = net[2].layer
        middle.weight.copy_(torch.randn(8, 8, generator=g) * 1e-39)
        middle.bias.copy_(torch.randn(8, generator=g) * 1e-39)
    assert 0 < middle.weight.abs().max() < torch.finfo(torch.float32).tiny
    x = torch.randn(48, 4, generator=g).float()
    y = torch.randint(0, 3, (48,), generator=g)
    return net, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


@pytest.mark.parametrize("structure,approx", [("kron", "ggn"), ("diag", "ef"), ("full", "ggn")])
def test_evidence_with_denormal_weights_equals_the_unflushed_one(process_setting, structure, approx):
    """The flush changes the evidence and the optimized hyperparameters by less than float resolution."""
    values = {}
    for flush in (False, True):
        torch.set_flush_denormal(False)  # the unflushed reference, whatever the process does
        net, data = denormal_classifier()
        prior = GaussianPrior(net, precision=1.0)
        evidence = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), prior, structure, approx,
                                       flush_denormals=flush)
        assert set(net[2].seen) == {flush}  # the pass ran in the mode asked for
        assert not flushing_denormals()  # and left the mode as it found it
        solution = evidence.optimize(solver="newton", max_evaluations=30)
        values[flush] = (evidence.log_marglik().detach(), solution.value.detach(), solution.values["log_precision"])
    (marglik, optimum, log_delta), (marglik_flushed, optimum_flushed, log_delta_flushed) = values[False], values[True]
    torch.testing.assert_close(marglik_flushed, marglik, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(optimum_flushed, optimum, rtol=1e-12, atol=0.0)
    # the solver's own resolution: terms of 1e-78 in the full GGN move its converged iterate by ~1e-10
    torch.testing.assert_close(log_delta_flushed, log_delta, rtol=0.0, atol=1e-8)
