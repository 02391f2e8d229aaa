"""Trust, fifth round (issue 41, items 1-7): the Trainer features of real training jobs.

Real Trainers, real Lightning callbacks and loggers, files on disk.
"""
from __future__ import annotations

import csv
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging
from torch.optim.swa_utils import AveragedModel
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from lightning_marglik import (
    GaussianPrior,
    LaplaceEvidence,
    MargLikBoundCallback,
    MargLikCallback,
    MargLikCheckpoint,
    MargLikConfigurationError,
    map_loss,
)
from tests.lightning_models import Regressor, RegressorSteps, loader, regression_data, trainer


class ManualRegressor(Regressor):
    """The Regressor under manual optimization, its ``training_step`` returning nothing (Lightning's idiom)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(map_loss(self(x), y, self.likelihood, self.prior, self.n_data))
        optimizer.step()


def _estimate_epochs(module: pl.LightningModule, max_epochs: int = 30) -> list:
    callback = MargLikCallback(structure="diag", frequency=2, settle=0.05, steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer([callback], max_epochs).fit(module, loader(regression_data()))
    return [entry["epoch"] for entry in callback.history]


# --- item 1: the settle rule reads the loss a manual training_step backpropagates ------------------


def test_settle_rule_under_manual_optimization_estimates_as_under_automatic_optimization():
    torch.manual_seed(0)
    automatic = _estimate_epochs(Regressor())
    torch.manual_seed(0)
    manual = _estimate_epochs(ManualRegressor())
    assert len(automatic) > 2 and automatic[-1] == 30  # settled before the end: estimates every 2nd epoch
    assert manual == automatic


# --- item 2: fit again on a finished trainer keeps the record ---------------------------------------


def test_fit_again_on_a_finished_trainer_keeps_the_record_and_says_so():
    module, callback = Regressor(), MargLikCallback(structure="diag", frequency=2, steps=10)
    fitted = trainer([callback], 4)
    fitted.fit(module, loader(regression_data()))
    final, best, history = callback.final_marglik, callback.best_marglik, list(callback.history)
    assert math.isfinite(final) and len(history) == 2
    with pytest.warns(UserWarning, match=r"this fit trained nothing \(the Trainer had reached epoch 4 of max_epochs=4"
                      r".*the record of the previous fit is kept \(final_marglik=-?\d\.\d{4}, 2 estimates"):
        fitted.fit(module, loader(regression_data()))
    assert (callback.final_marglik, callback.best_marglik, callback.history) == (final, best, history)
    assert callback.state_dict()["history"] == history  # what a checkpoint would save


class FirstBatchProbe(pl.Callback):
    """Records the prior's log precisions when the fit's first training batch starts."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and batch_idx == 0:
            self.log_precision = pl_module.prior.log_precision.clone()


def test_a_new_fit_that_trains_starts_a_fresh_record():
    """Continuing with a new Trainer: training goes on from the learned hyperparameters, the record restarts."""
    module, callback = Regressor(), MargLikCallback(structure="diag", frequency=2, steps=10)
    trainer([callback], 4).fit(module, loader(regression_data()))
    learned, probe = module.prior.log_precision.clone(), FirstBatchProbe()
    assert not torch.equal(learned, torch.zeros_like(learned))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback, probe], 2).fit(module, loader(regression_data()))
    assert not [w for w in caught if "trained nothing" in str(w.message)]
    assert torch.equal(probe.log_precision, learned)
    assert [entry["epoch"] for entry in callback.history] == [2]


# --- item 6: every estimate's row in metrics.csv carries its epoch and a step counted like the others --


def test_metrics_csv_rows_of_every_estimate_carry_epoch_and_consistent_step(tmp_path):
    callback = MargLikCallback(structure="diag", frequency=2, steps=10)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    # 4 batches per epoch: estimates after epochs 2 and 4 (steps 7, 15); max_steps=18 stops within epoch 5,
    # which is not due: the end-of-training estimate
    trainer([callback], 10, logger=logger, max_steps=18, log_every_n_steps=1).fit(Regressor(), loader(regression_data()))
    with open(f"{logger.log_dir}/metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["marglik"]]
    assert [(row["epoch"], row["step"]) for row in rows] == [("1", "7"), ("3", "15"), ("4", "17")]
    assert [entry["epoch"] for entry in callback.history] == [2, 4, 5]
    assert float(rows[-1]["marglik"]) == pytest.approx(callback.final_marglik)


# --- item 4: the N of the loss follows a reloaded training loader -----------------------------------


class GrowingData(Regressor):
    """128 examples for three epochs, then 256 (reload_dataloaders_every_n_epochs=1); records the N each
    epoch's loss uses."""

    def __init__(self):
        super().__init__()
        self.n_by_epoch: dict = {}

    def train_dataloader(self):
        return loader(regression_data(128 if self.current_epoch < 3 else 256), batch_size=32)

    def training_step(self, batch, batch_idx):
        self.n_by_epoch.setdefault(self.current_epoch, set()).add(int(self.prior.n_data))
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)


def test_n_of_the_loss_follows_a_reloaded_training_loader():
    module = GrowingData()
    callback = MargLikCallback(structure="diag", frequency=10, steps=10)
    trainer([callback], 5, reload_dataloaders_every_n_epochs=1).fit(module)
    assert module.n_by_epoch == {0: {128}, 1: {128}, 2: {128}, 3: {256}, 4: {256}}
    assert [entry["epoch"] for entry in callback.history] == [5] and int(module.prior.n_data) == 256


# --- item 5: Lightning's EarlyStopping on marglik where some epochs have no estimate ----------------


@pytest.mark.parametrize("arguments", [dict(frequency=2), dict(frequency=1, burnin=1), dict(frequency=1, settle=0.05)])
def test_lightning_early_stopping_on_marglik_is_refused_at_setup_naming_marglik_early_stopping(arguments):
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    stopper = pl.callbacks.EarlyStopping(monitor="marglik", mode="max")
    with pytest.raises(MargLikConfigurationError, match=r"EarlyStopping\(monitor='marglik'\) checks marglik after every "
                       r"training epoch, but MargLikCallback\(frequency=.*\) does not estimate it after every epoch.*"
                       r"Use MargLikEarlyStopping\(patience=\.\.\.\)"):
        trainer([MargLikCallback(structure="diag", **arguments), stopper], 4).fit(module, loader(regression_data()))


@pytest.mark.parametrize("stopper, intervals", [
    (dict(check_on_train_epoch_end=False), {}),
    ({}, dict(val_check_interval=0.5)),
], ids=["check_on_train_epoch_end=False", "val_check_interval=0.5"])
def test_lightning_early_stopping_on_marglik_after_validation_is_refused(stopper, intervals):
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    callbacks = [MargLikCallback(structure="diag", frequency=1), pl.callbacks.EarlyStopping(monitor="marglik", **stopper)]
    with pytest.raises(MargLikConfigurationError, match=r"EarlyStopping\(monitor='marglik'\) checks marglik after "
                       r"validation or within the epoch, which runs before the epoch's estimate.*Use MargLikEarlyStopping"):
        data = loader(regression_data())
        trainer(callbacks, 4, **intervals).fit(module, data, val_dataloaders=data)


def test_lightning_early_stopping_on_marglik_works_when_every_epoch_estimates():
    stopper = pl.callbacks.EarlyStopping(monitor="marglik", mode="max", patience=1, min_delta=1.0)
    callback = MargLikCallback(structure="diag", frequency=1, steps=10)
    fitted = trainer([callback, stopper], 6)
    fitted.fit(Regressor(), loader(regression_data()))
    assert fitted.current_epoch == 2 and [entry["epoch"] for entry in callback.history] == [1, 2]  # stopped, no crash


class PlateauRegressor(Regressor):
    """``ReduceLROnPlateau`` on ``marglik``, stepped with ``interval`` every ``every`` epochs or steps."""

    def __init__(self, interval: str = "epoch", every: int = 1) -> None:
        super().__init__()
        self.interval, self.every = interval, every

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0, threshold=0,
                                                             threshold_mode="abs")
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "marglik",
                                                         "interval": self.interval, "frequency": self.every}}


@pytest.mark.parametrize("arguments, interval, every, when", [
    (dict(frequency=3), "epoch", 1, r"at the end of every epoch, but MargLikCallback\(frequency=3, burnin=0\)"),
    (dict(frequency=2), "epoch", 3, r"every 3 epochs \(frequency=3\), but MargLikCallback\(frequency=2"),
    (dict(frequency=2, burnin=2), "epoch", 2, r"every 2 epochs"),
    (dict(frequency=1, settle=0.05), "epoch", 1, r"at the end of every epoch, but .*settle=0.05"),
    (dict(frequency=1), "step", 1, r"within the epoch \(interval='step'\)"),
])
def test_a_plateau_scheduler_on_marglik_that_would_read_a_stale_estimate_is_refused_before_training(
        arguments, interval, every, when):
    """It read the last estimate again as an epoch without improvement and cut the learning rate while every
    estimate rose (strict=False), or failed after the first epoch with Lightning's 'not available' (strict=True)."""
    module = PlateauRegressor(interval, every)
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    fix = r"'interval': 'epoch', 'frequency': F\} from configure_optimizers with the callback's frequency=F"
    with pytest.raises(MargLikConfigurationError, match=r"ReduceLROnPlateau monitors 'marglik' " + when + r".*" + fix):
        trainer([MargLikCallback(structure="diag", **arguments)], 4).fit(module, loader(regression_data()))


@pytest.mark.parametrize("frequency", [1, 2])
def test_a_plateau_scheduler_stepped_with_the_estimates_reads_each_estimate_once(frequency):
    module = PlateauRegressor("epoch", frequency)
    callback = MargLikCallback(structure="diag", frequency=frequency, steps=10)
    fitted = trainer([callback], 4)
    fitted.fit(module, loader(regression_data()))
    rises = sum(b["marglik"] > a["marglik"] for a, b in zip(callback.history, callback.history[1:]))
    assert len(callback.history) == 4 // frequency
    # patience 0: every estimate that did not rise cut the rate once, and nothing else did
    expected_cuts = len(callback.history) - 1 - rises
    assert fitted.optimizers[0].param_groups[0]["lr"] == pytest.approx(module.lr * 0.1 ** expected_cuts)


# --- item 7: the messages say what the sampler and the stream do -------------------------------------


def _weighted(replacement: bool, num_samples: int) -> DataLoader:
    data = regression_data()
    sampler = WeightedRandomSampler(torch.linspace(1, 2, len(data)), num_samples, replacement=replacement)
    return DataLoader(data, batch_size=16, sampler=sampler)


def test_weighted_sampler_without_replacement_drawing_every_example_trains_on_all_of_them():
    callback = MargLikCallback(structure="diag", frequency=1, steps=10)
    trainer([callback], 1).fit(Regressor(), _weighted(replacement=False, num_samples=64))
    assert callback.evidence.n_data == 64 and math.isfinite(callback.final_marglik)


@pytest.mark.parametrize("replacement, num_samples, message", [
    (False, 32, r"WeightedRandomSampler\(replacement=False, num_samples=32\) draws a random part of the 64 examples "
                r"per epoch, by weight"),
    (True, 64, r"WeightedRandomSampler draws examples by weight, with replacement"),
])
def test_weighted_sampler_refusal_says_what_it_draws(replacement, num_samples, message):
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    with pytest.raises(MargLikConfigurationError, match=message + r".*`dataloader=`"):
        trainer([MargLikCallback(structure="diag")], 1).fit(module, _weighted(replacement, num_samples))


class FiniteStream(IterableDataset):
    """A stream of 64 regression examples (8 batches of 8), without a length."""

    def __iter__(self):
        data = regression_data()
        return iter(zip(data.tensors[0], data.tensors[1]))


def test_finite_stream_shorter_than_the_limit_is_warned_with_its_own_count():
    callback = MargLikCallback(structure="diag", frequency=1, steps=10)
    with pytest.warns(UserWarning, match=r"the evidence covers the 8 batches \(the stream ended before the limit of "
                      r"100\) of the training IterableDataset") as caught:
        trainer([callback], 1, limit_train_batches=100).fit(Regressor(), DataLoader(FiniteStream(), batch_size=8))
    assert not [w for w in caught if "first 100 batches" in str(w.message)]
    assert callback.evidence.n_data == 64


# --- item 3: weight averaging never averages the hyperparameters; every evidence is of its weights ----


class AverageProbe(pl.Callback):
    """After MargLikCallback: records, after every training batch, how far the averaging callback's copy of
    the hyperparameters is from the module's (the learned values)."""

    def __init__(self, averaging):
        self.averaging, self.gaps = averaging, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        average = self.averaging._average_model
        copy = getattr(average, "module", average)
        self.gaps.append(max(float((copy.prior.log_precision - pl_module.prior.log_precision).abs().max()),
                             float((copy.likelihood.log_sigma - pl_module.likelihood.log_sigma).abs().max()),
                             abs(int(copy.prior.n_data) - int(pl_module.prior.n_data))))


def _evidence_per_datum(module) -> float:
    """The Laplace evidence per datum of the module's weights under its hyperparameters (as they are)."""
    evidence = LaplaceEvidence.fit(module, loader(regression_data()), module.likelihood, module.prior, structure="diag")
    return evidence.log_marglik().item() / evidence.n_data


@pytest.mark.parametrize("use_buffers", [True, False])
def test_ema_weight_averaging_keeps_learned_hyperparameters_and_final_marglik_is_the_returned_models(use_buffers):
    module = Regressor(lr=3e-2)
    ema = EMAWeightAveraging(decay=0.9, use_buffers=use_buffers)
    callback = MargLikCallback(structure="diag", frequency=2, steps=20)
    probe = AverageProbe(ema)
    trainer([ema, callback, probe], 6).fit(module, loader(regression_data()))
    assert max(probe.gaps) == 0.0  # the average's hyperparameters are the learned ones after every step
    average = ema._average_model.module
    for returned, averaged in zip(module.parameters(), average.parameters()):
        assert torch.equal(returned, averaged)  # the fit returns the averaged weights ...
    assert callback.history[-1]["marglik"] == callback.final_marglik
    assert callback.final_marglik == pytest.approx(_evidence_per_datum(module), rel=1e-9)  # ... and their evidence
    assert torch.equal(average.prior.log_precision, module.prior.log_precision)  # trainer.save_checkpoint holds them


def test_stochastic_weight_averaging_checkpoints_and_final_marglik_are_evidences_of_their_weights(tmp_path):
    module = Regressor(lr=3e-2)
    swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)
    callback = MargLikCallback(structure="diag", frequency=2, steps=20)
    checkpoint = MargLikCheckpoint(dirpath=tmp_path, save_top_k=3)
    trainer([swa, callback, checkpoint], 6).fit(module, loader(regression_data()))
    assert callback.final_marglik == pytest.approx(_evidence_per_datum(module), rel=1e-9)
    assert callback.final_marglik != callback.history[-2]["marglik"]  # the averaged weights' own estimate
    assert len(checkpoint.best_k_models) == 3
    for path, score in checkpoint.best_k_models.items():
        saved = Regressor()
        saved.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
        assert float(score) == pytest.approx(_evidence_per_datum(saved), rel=1e-9)


def test_weight_averaging_listed_after_marglik_callback_is_refused_naming_the_order():
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    with pytest.raises(MargLikConfigurationError, match=r"EMAWeightAveraging is listed after MargLikCallback in the "
                       r"Trainer's callbacks: list it before, e.g. callbacks=\[EMAWeightAveraging\(\.\.\.\), "
                       r"MargLikCallback\(\.\.\.\), \.\.\.\]"):
        trainer([MargLikCallback(structure="diag"), EMAWeightAveraging()], 2).fit(module, loader(regression_data()))


@pytest.mark.parametrize("make_checkpoint", [lambda path: MargLikCheckpoint(dirpath=path),
                                             lambda path: pl.callbacks.ModelCheckpoint(dirpath=path, monitor="marglik")])
def test_ema_next_to_a_marglik_checkpoint_is_refused_naming_what_works(tmp_path, make_checkpoint):
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    callbacks = [EMAWeightAveraging(), MargLikCallback(structure="diag"), make_checkpoint(tmp_path)]
    with pytest.raises(MargLikConfigurationError, match=r"\(monitor='marglik'\) next to EMAWeightAveraging: .*saves the "
                       r"averaged weights in every checkpoint.*MargLikCheckpoint with StochasticWeightAveraging"):
        trainer(callbacks, 2).fit(module, loader(regression_data()))


def test_bound_callback_with_weight_averaging_is_refused():
    module = Regressor()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    with pytest.raises(MargLikConfigurationError, match=r"MargLikBoundCallback with EMAWeightAveraging: .*Use "
                       r"MargLikCallback with weight averaging"):
        trainer([EMAWeightAveraging(), MargLikBoundCallback(structure="diag")], 2).fit(module, loader(regression_data()))


def test_torch_averaged_model_copies_the_hyperparameter_buffers_without_use_buffers():
    """What docs/works-with.md says of torch.optim.swa_utils.AveragedModel in a plain loop."""
    module = Regressor()
    kept, mixed = AveragedModel(module), AveragedModel(module, use_buffers=True)
    for value in (0.0, 2.0):
        module.prior.log_precision.fill_(value)
        kept.update_parameters(module)
        mixed.update_parameters(module)
    assert float(kept.module.prior.log_precision.max()) == 2.0  # copied from the model
    assert float(mixed.module.prior.log_precision.max()) == 1.0  # averaged: use_buffers=False keeps them


# --- Trainer features that hold (docs/works-with.md) -------------------------------------------------


class DictRegressor(Regressor):
    """Returns a dict with the loss and an extra entry from ``training_step``."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "batch": batch_idx}


def test_dict_returns_estimate_as_tensor_returns():
    torch.manual_seed(0)
    plain = _estimate_epochs(Regressor())
    torch.manual_seed(0)
    assert _estimate_epochs(DictRegressor()) == plain and len(plain) > 2


def _learned(precision: str) -> torch.Tensor:
    torch.manual_seed(0)
    module = Regressor(lr=3e-2).float()
    data = regression_data()
    callback = MargLikCallback(structure="diag", frequency=2, steps=20)
    trainer([callback], 6, precision=precision).fit(module, loader(TensorDataset(*(t.float() for t in data.tensors))))
    assert math.isfinite(callback.final_marglik)
    return module.prior.log_precision.clone()


def test_bf16_mixed_learns_the_precisions_of_float32():
    assert (_learned("bf16-mixed") - _learned("32-true")).abs().max() < 0.01  # 0.0027 measured


class ConvRegressor(Regressor):
    """A small convolutional regressor; ``channels_last`` runs the network and its inputs in that memory format."""

    def __init__(self, channels_last: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 1))
        self.prior = GaussianPrior(self.net)
        self.channels_last = channels_last
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.net(x.contiguous(memory_format=torch.channels_last) if self.channels_last else x)


def _images() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 6, 6, generator=g)
    return TensorDataset(x, x.mean(dim=(1, 2, 3)).unsqueeze(1))


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_channels_last_gives_the_evidence_of_the_contiguous_network(structure):
    results = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        module, callback = ConvRegressor(channels_last), MargLikCallback(structure=structure, frequency=2, steps=10)
        trainer([callback], 2).fit(module, loader(_images()))
        results.append(callback.final_marglik)
    assert results[1] == pytest.approx(results[0], rel=1e-6)


def test_ema_weight_averaging_of_the_lightning_package_keeps_the_hyperparameters_out_of_the_average():
    pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed (the `integrations` extra)")
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import EMAWeightAveraging as LightningEMA

    from lightning_marglik.lightning import MargLikCallback as LightningMargLikCallback

    class Module(RegressorSteps, LightningModule):
        pass

    module, ema = Module(lr=3e-2), LightningEMA(decay=0.9)
    callback = LightningMargLikCallback(structure="diag", frequency=2, steps=20)
    Trainer(max_epochs=4, callbacks=[ema, callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, accelerator="cpu").fit(module, loader(regression_data()))
    assert torch.equal(ema._average_model.module.prior.log_precision, module.prior.log_precision)
    assert callback.final_marglik == pytest.approx(_evidence_per_datum(module), rel=1e-9)
