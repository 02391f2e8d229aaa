"""Trainer-level tests of MargLikCallback, MargLikCheckpoint and MargLikEarlyStopping (real Trainer, CPU)."""
from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_marglik import LaplaceEvidence, MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping, predict
from tests.lightning_models import Regressor, loader, regression_data, trainer


def _fit(callbacks, max_epochs, model=None, data=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Regressor()
    t = trainer(callbacks, max_epochs, **kwargs)
    t.fit(model, data or loader(regression_data()))
    return model, t


def test_hyperparameters_learned_and_evidence_increases():
    # Algorithm 1 as such: every learned precision fed back (the guard keeps the declared one where it scores better)
    cb = MargLikCallback(output_layer="learn", settle=None, structure="kron", frequency=1, steps=50, lr=0.1, guard=False)
    model, t = _fit([cb], max_epochs=12)
    assert not torch.allclose(model.prior.log_precision, torch.zeros(4))
    assert model.likelihood.log_sigma.item() < math.log(0.9)  # noise is 0.1: sigma shrinks from 1
    margliks = [h["marglik"] for h in cb.history]
    assert len(margliks) == 12 and margliks[-1] > margliks[0] + 0.1
    keys = set(t.callback_metrics)
    expected = {"marglik", "sigma", "temperature"} | {f"prior_precision/{n}" for n in model.prior.param_names}
    assert expected <= keys
    assert t.callback_metrics["marglik"].item() == pytest.approx(margliks[-1])
    assert t.callback_metrics["sigma"].item() == pytest.approx(model.likelihood.sigma.item())
    # the logged marglik is the evidence after the update, per datum
    ev = LaplaceEvidence.fit(model, loader(regression_data()), model.likelihood, model.prior, "kron")
    assert ev.log_marglik().item() / 64 == pytest.approx(margliks[-1], rel=1e-4)
    # the user's optimizer never saw the hyperparameters
    opt_params = {id(p) for g in t.optimizers[0].param_groups for p in g["params"]}
    assert id(model.prior.log_precision) not in opt_params and model.prior.log_precision.grad is None


@pytest.mark.parametrize("burnin,frequency,max_epochs,expected", [(2, 3, 10, [3, 6, 9, 10]), (3, 3, 9, [6, 9]), (0, 1, 3, [1, 2, 3])])
def test_burnin_and_frequency(burnin, frequency, max_epochs, expected):
    cb = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=frequency, burnin=burnin, steps=5)
    _, t = _fit([cb], max_epochs=max_epochs)
    assert [h["epoch"] for h in cb.history] == expected
    assert cb.estimations == len(expected) and cb.final_marglik == cb.last_marglik


def test_final_estimate_when_training_ends_between_estimations():
    cb = MargLikCallback(structure="diag", approx="ef", frequency=5, steps=5)
    _, t = _fit([cb], max_epochs=20, max_steps=4 * 7)  # 4 batches per epoch: stops after epoch 7
    assert [h["epoch"] for h in cb.history] == [5, 7]
    assert math.isfinite(cb.final_marglik) and cb.final_marglik == cb.history[-1]["marglik"]


def test_evidence_pass_in_eval_mode_and_train_mode_restored():
    model = Regressor(dropout=0.5)
    cb = MargLikCallback(structure="diag", approx="ggn", steps=0)
    _fit([cb], max_epochs=2, model=model)
    assert all(model.train_modes)  # every training step ran in train mode after the estimates
    # dropout off in the evidence pass: a second eval-mode pass reproduces the logged value exactly
    ev = LaplaceEvidence.fit(model, loader(regression_data()), model.likelihood, model.prior, "diag")
    assert ev.log_marglik().item() / 64 == pytest.approx(cb.last_marglik, rel=1e-6)


def test_checkpoint_holds_best_evidence_and_reload_restores(tmp_path):
    cb = MargLikCallback(structure="kron", frequency=2, steps=30)
    ck = MargLikCheckpoint(dirpath=tmp_path, filename="{epoch}-{marglik:.4f}", save_top_k=2, save_last=True)
    model, t = _fit([cb, ck], max_epochs=8)
    best = max(cb.history, key=lambda h: h["marglik"])
    assert ck.best_model_score.item() == pytest.approx(best["marglik"])
    assert f"epoch={best['epoch'] - 1}-" in ck.best_model_path
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert len(saved) == 3 and "last.ckpt" in saved  # top-2 + last, only estimation epochs
    assert all(int(n.split("-")[0].split("=")[1]) % 2 == 1 for n in saved if n != "last.ckpt")
    # the last epoch is the best here (evidence keeps increasing): reload restores weights and buffers
    if best["epoch"] == 8:
        restored = Regressor.load_from_checkpoint(ck.best_model_path)
        for (n, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
            assert torch.equal(a, b), n
    state = torch.load(ck.best_model_path, weights_only=False)["state_dict"]
    assert "prior.log_precision" in state and "likelihood.log_sigma" in state


def test_a_checkpoint_reused_in_a_second_trainer_keeps_that_fits_own_best(tmp_path):
    """Reused, it kept the first fit's best file as "best", and trainer.test(ckpt_path="best") loaded the first
    model's weights into the second model without a word."""
    ck = MargLikCheckpoint(dirpath=tmp_path, filename="{epoch}-{marglik:.4f}", save_top_k=1)
    first_cb, second_cb = MargLikCallback(structure="diag", steps=5), MargLikCallback(structure="diag", steps=5)
    _fit([first_cb, ck], max_epochs=6)  # trained longer: a higher evidence than the second fit reaches
    first = ck.best_model_path
    model, trainer = _fit([second_cb, ck], max_epochs=2)
    assert second_cb.best_marglik < first_cb.best_marglik
    assert ck.best_model_path != first and ck.best_model_score.item() == pytest.approx(second_cb.best_marglik)
    assert f"epoch={second_cb.best_epoch}-" in os.path.basename(ck.best_model_path)
    assert set(ck.best_k_models) == {ck.best_model_path}


@pytest.mark.parametrize("max_steps", [28, 26], ids=["at-an-epoch-end", "within-an-epoch"])
def test_the_estimate_when_max_steps_ends_training_is_ranked_and_saved_by_the_checkpoint(tmp_path, max_steps):
    """Training ended by max_steps between scheduled estimates (4 batches an epoch, estimates every 3 epochs): the
    estimate made at its end became the callback's best, but the checkpoint kept an earlier file as "best", so
    trainer.test(ckpt_path="best") loaded a worse model than best_marglik named."""
    cb = MargLikCallback(structure="diag", frequency=3, steps=10)
    ck = MargLikCheckpoint(dirpath=tmp_path, save_top_k=1)
    model, _ = _fit([cb, ck], max_epochs=100, max_steps=max_steps)
    assert [h["step"] for h in cb.history] == [12, 24, max_steps] and cb.estimated_at_end
    assert cb.best_marglik == cb.history[-1]["marglik"]  # the data's evidence rises: the end's estimate is the best
    assert ck.best_model_score.item() == pytest.approx(cb.best_marglik)
    assert os.path.basename(ck.best_model_path) == f"marglik-epoch={cb.best_epoch}-step={max_steps}.ckpt"
    saved = torch.load(ck.best_model_path, weights_only=False)["state_dict"]
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())


class _DivergesAtTheEnd(pl.Callback):
    """The weights turn NaN at the last training step, as a diverging run's do."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last_step:
            with torch.no_grad():
                pl_module.net[0].weight.fill_(float("nan"))


def test_the_estimate_at_the_end_of_training_is_not_saved_at_non_finite_weights(tmp_path):
    cb = MargLikCallback(structure="diag", frequency=3, steps=10)
    ck = MargLikCheckpoint(dirpath=tmp_path, save_top_k=-1)
    with pytest.warns(UserWarning, match="not finite"):
        _fit([cb, ck, _DivergesAtTheEnd(26)], max_epochs=100, max_steps=26)
    assert cb.estimated_at_end and math.isnan(cb.history[-1]["marglik"])
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["marglik-epoch=2-step=12.ckpt", "marglik-epoch=5-step=24.ckpt"]


def test_a_fit_that_ends_at_a_scheduled_estimate_saves_nothing_more_at_its_end(tmp_path):
    cb = MargLikCallback(structure="diag", frequency=2, steps=10)
    ck = MargLikCheckpoint(dirpath=tmp_path, save_top_k=-1)
    _fit([cb, ck], max_epochs=100, max_steps=16)  # 4 epochs: the last estimate is the schedule's
    assert not cb.estimated_at_end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marglik-epoch=1-step=8.ckpt", "marglik-epoch=3-step=16.ckpt"]


def test_a_checkpoint_loaded_to_validate_leaves_the_fits_record_and_follows_its_own_guard_decision(tmp_path):
    """trainer.validate/test/predict(ckpt_path=...) load every callback's state: the callback's was reset, so after
    trainer.test(ckpt_path="best") final_marglik was NaN, summary and evidence None, and predict said "call it after
    trainer.fit" of a fitted callback. The module holds the checkpoint's weights and hyperparameters; the prior's guard
    treatment follows the checkpoint's last decision."""
    cb = MargLikCallback(structure="diag", frequency=1, steps=10)
    ck = MargLikCheckpoint(dirpath=tmp_path, save_top_k=-1)
    data = loader(regression_data())
    model, fitted = _fit([cb, ck], max_epochs=4, data=data)
    record = (list(cb.history), cb.final_marglik, cb.best_marglik, cb.best_epoch, dict(cb.summary), cb.evidence,
              list(cb.guard_decisions))
    end_applied = model.prior.applied_precision.clone()
    assert cb.guard_decisions[-1]["epoch"] == 3  # the estimate after the last epoch guards no training
    # the second estimate's file, its last decision made the opposite of the fit's last one
    second = str(tmp_path / "marglik-epoch=1-step=8.ckpt")
    checkpoint = torch.load(second, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("MargLikCallback")]
    decision = checkpoint["callbacks"][key]["guard_decisions"][-1]
    opposite = "declared" if cb.guard_decisions[-1]["applied"] == "learned" else "learned"
    decision["applied"] = opposite
    torch.save(checkpoint, second)
    fitted.validate(model, data, ckpt_path=second, verbose=False)
    assert (list(cb.history), cb.final_marglik, cb.best_marglik, cb.best_epoch, cb.summary, cb.evidence,
            list(cb.guard_decisions)) == record
    assert torch.equal(model.prior.log_precision, checkpoint["state_dict"]["prior.log_precision"])
    guarded = [i for i, name in enumerate(model.prior.param_names) if name in cb.evidence.prior.learned_names()]
    expected = (model.prior.initial_precision if opposite == "declared" else model.prior.precision[guarded])
    assert torch.allclose(model.prior.applied_precision[guarded], torch.as_tensor(expected, dtype=torch.float64)
                          .expand(len(guarded)))
    assert not torch.equal(model.prior.applied_precision, end_applied)
    with pytest.raises(ValueError, match=r"not those of the posterior's estimate \(a checkpoint loaded"):
        predict(cb, model, torch.zeros(2, 1))  # the weights loaded are the second estimate's, the evidence the last's
    # the checkpoint's record stays the fit's: "best" is still the best-evidence file, not the one loaded
    assert ck.best_model_path.endswith(f"marglik-epoch={cb.best_epoch}-step={4 * (cb.best_epoch + 1)}.ckpt")
    assert ck.best_model_score.item() == pytest.approx(cb.best_marglik) and len(ck.best_k_models) == 4


def test_a_fit_that_trains_nothing_keeps_the_checkpoints_and_early_stoppings_record(tmp_path):
    """fit again on a finished Trainer: the callback kept its record (with a warning), but the checkpoint forgot its
    best file and early stopping its best score, and trainer.validate(ckpt_path="best") refused: 'not configured to
    save the best model'."""
    cb, ck, es = MargLikCallback(structure="diag", frequency=2, steps=10), MargLikCheckpoint(dirpath=tmp_path), \
        MargLikEarlyStopping(patience=3)
    data = loader(regression_data())
    model, fitted = _fit([cb, ck, es], max_epochs=4, data=data)
    record = (ck.best_model_path, ck.best_model_score, dict(ck.best_k_models), es.best_score, es.wait_count)
    assert ck.best_model_path and torch.isfinite(es.best_score)
    with pytest.warns(UserWarning, match="this fit trained nothing"):
        fitted.fit(model, data)
    assert (ck.best_model_path, ck.best_model_score, dict(ck.best_k_models), es.best_score, es.wait_count) == record
    fitted.validate(model, data, ckpt_path="best", verbose=False)


def test_an_early_stop_that_min_epochs_overrules_says_training_goes_on(caplog):
    """Under min_epochs it said "stopped training after epoch 2" where Lightning trained on to epoch 6."""
    stopping = MargLikEarlyStopping(patience=1, min_delta=0.5)  # no estimate gains 0.5: a stop after the second
    with caplog.at_level(logging.INFO):
        _, trainer = _fit([MargLikCallback(frequency=1), stopping], max_epochs=8, min_epochs=4)
    said = [r.getMessage() for r in caplog.records if "MargLikEarlyStopping" in r.getMessage()]
    assert said[0].startswith("MargLikEarlyStopping asked to stop after epoch 2, but Trainer(min_epochs=4) trains "
                              "on to epoch 4:")
    assert stopping.stopping_reason_message.startswith("MargLikEarlyStopping stopped training after epoch 4:")
    assert trainer.current_epoch == 4


def test_checkpoint_not_affected_by_validation(tmp_path):
    data = loader(regression_data())
    paths = []
    for i, kwargs in enumerate([{}, {"check_val_every_n_epoch": 2}, {"check_val_every_n_epoch": 1}]):
        cb = MargLikCallback(structure="diag", approx="ef", frequency=3, steps=20)
        ck = MargLikCheckpoint(dirpath=tmp_path / str(i), save_top_k=1)
        pl.seed_everything(0, verbose=False)
        t = trainer([cb, ck], 7, **kwargs)
        t.fit(Regressor(), data, val_dataloaders=data if kwargs else None)
        paths.append(ck.best_model_path)
    weights = [torch.load(p, weights_only=False)["state_dict"] for p in paths]
    assert len({p.split("/")[-1] for p in paths}) == 1
    for other in weights[1:]:
        for key in weights[0]:
            assert torch.equal(weights[0][key], other[key]), key


def test_early_stopping_counts_estimations():
    # lr=0 and no hyperparameter steps: the evidence never improves after the first estimate
    cb = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=2, steps=0)
    es = MargLikEarlyStopping(patience=2)
    _, t = _fit([cb, es], max_epochs=30, model=Regressor(lr=0.0))
    assert [h["epoch"] for h in cb.history] == [2, 4, 6]  # patience 2 estimations, not 2 epochs
    assert t.current_epoch == 6 and es.wait_count == 2


class PoisonAtTheFirstStep(pl.Callback):
    """NaN weights from the first training step on: after set-up, which refuses outputs that are not finite."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            with torch.no_grad():
                pl_module.net[0].weight.fill_(float("nan"))


def test_early_stopping_on_non_finite_evidence():
    model = Regressor()
    cb = MargLikCallback(structure="diag", approx="ef", steps=5)
    es = MargLikEarlyStopping(patience=10)
    before = [b.clone() for b in (model.prior.log_precision, model.likelihood.log_sigma)]
    with pytest.warns(UserWarning, match="not finite.*where the weights are NaN or inf, training diverged"):
        _fit([cb, es, PoisonAtTheFirstStep()], max_epochs=5, model=model)
    assert cb.estimations == 1 and math.isnan(cb.last_marglik)
    assert torch.equal(before[0], model.prior.log_precision) and torch.equal(before[1], model.likelihood.log_sigma)


def test_resume_matches_uninterrupted_run(tmp_path):
    def run(max_epochs, ckpt_path=None, dirpath=None):
        cb = MargLikCallback(structure="kron", frequency=2, steps=30, lr=0.1)
        es = MargLikEarlyStopping(patience=5)
        ck = MargLikCheckpoint(dirpath=dirpath or tmp_path / "x", save_last=True)
        pl.seed_everything(0, verbose=False)
        model = Regressor()
        t = trainer([cb, es, ck], max_epochs)
        t.fit(model, loader(regression_data()), ckpt_path=ckpt_path)
        return model, cb, es

    full_model, full_cb, full_es = run(8, dirpath=tmp_path / "full")
    run(4, dirpath=tmp_path / "part")
    resumed_model, resumed_cb, resumed_es = run(8, ckpt_path=tmp_path / "part" / "last.ckpt", dirpath=tmp_path / "part")
    assert [h["epoch"] for h in resumed_cb.history] == [h["epoch"] for h in full_cb.history]
    for a, b in zip(resumed_cb.history, full_cb.history):
        assert a["marglik"] == pytest.approx(b["marglik"], rel=1e-5)
    for (name, a), b in zip(full_model.state_dict().items(), resumed_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert resumed_es.wait_count == full_es.wait_count
    assert resumed_cb.best_epoch == full_cb.best_epoch


def test_missing_prior_fails_before_first_epoch():
    class NoPrior(Regressor):
        def __init__(self):
            super().__init__()
            del self.prior

        def training_step(self, batch, batch_idx):
            raise AssertionError("training must not start")

    with pytest.raises(MisconfigurationException, match="GaussianPrior"):
        _fit([MargLikCallback()], max_epochs=1, model=NoPrior())


def test_kron_with_a_layer_norm_learns_its_precisions():
    """Issue 9: kron takes any network; the LayerNorm gets exact diagonal blocks and its own precisions."""
    model = Regressor()
    model.net.insert(1, nn.LayerNorm(16))
    model.prior = type(model.prior)(model.net)
    _fit([MargLikCallback(output_layer="learn", structure="kron")], max_epochs=2, model=model)
    names = model.prior.param_names
    learned = dict(zip(names, model.prior.log_precision.tolist()))
    assert "1.weight" in learned and all(v != 0.0 for v in learned.values())


def test_kron_with_a_diagonal_prior_fails_before_the_first_epoch():
    model = Regressor()
    model.prior = type(model.prior)(model.net, structure="diagonal")
    with pytest.raises(ValueError, match="[Dd]iagonal prior.*Kronecker"):
        _fit([MargLikCallback(structure="kron")], max_epochs=1, model=model)


def test_checkpoint_requires_the_callback():
    with pytest.raises(MisconfigurationException, match="MargLikCallback"):
        _fit([MargLikCheckpoint()], max_epochs=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"structure": "dense"}, "structure.*'dense'"),
        ({"approx": "fisher"}, "approx.*'fisher'"),
        ({"frequency": 0}, "frequency.*0"),
        ({"burnin": -1}, "burnin.*-1"),
        ({"steps": 2.5}, "steps.*2.5"),
        ({"lr": 0.0}, "lr.*0.0"),
        ({"lr": float("nan")}, "lr.*nan"),
        ({"mc_samples": 2, "approx": "ef"}, "mc_samples.*ggn"),
        ({"dataloader": [1, 2]}, "dataloader.*list"),
    ],
)
def test_init_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MargLikCallback(**kwargs)


@pytest.mark.parametrize("kwargs,match", [({"patience": 0}, "patience.*0"), ({"min_delta": -1.0}, "min_delta.*-1.0")])
def test_early_stopping_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MargLikEarlyStopping(**kwargs)


def test_dataloader_by_method_name():
    class WithEvidenceData(Regressor):
        def evidence_dataloader(self):
            return loader(regression_data(n=64), batch_size=64)

    cb = MargLikCallback(structure="diag", approx="ef", steps=0, dataloader="evidence_dataloader")
    model, _ = _fit([cb], max_epochs=1, model=WithEvidenceData(), data=loader(regression_data(), batch_size=8, shuffle=True))
    ev = LaplaceEvidence.fit(model, loader(regression_data()), model.likelihood, model.prior, "diag", "ef")
    assert cb.evidence.n_data == 64
    assert cb.last_marglik == pytest.approx(ev.log_marglik().item() / 64, rel=1e-6)


def test_float64_training_with_float32_data():
    torch.set_default_dtype(torch.float32)
    data = loader(regression_data())
    cb = MargLikCallback(structure="kron", steps=5)
    model, _ = _fit([cb], max_epochs=2, precision="64-true", data=data)
    assert model.net[0].weight.dtype == torch.float64 and model.prior.log_precision.dtype == torch.float64
    assert math.isfinite(cb.last_marglik)


def test_large_lr_never_ends_below_the_start_and_warns():
    """Issue 8.2: the best point of the steps is kept; a diverging lr is named with a safer one."""
    _fit([cb0 := MargLikCallback(structure="kron", steps=0)], max_epochs=1)
    with pytest.warns(UserWarning, match=r"lr=10.*try lr=0.5 or smaller"):
        _fit([cb := MargLikCallback(structure="kron", steps=100, lr=10.0, solver="adam")], max_epochs=1)
    assert cb.history[0]["marglik"] >= cb0.history[0]["marglik"]


def test_newton_solver_converges_where_adam_needs_many_steps():
    _fit([adam := MargLikCallback(structure="kron", steps=2000, lr=0.05, solver="adam")], max_epochs=1)
    _fit([newton := MargLikCallback(structure="kron", solver="newton", steps=20)], max_epochs=1)
    assert newton.history[0]["marglik"] == pytest.approx(adam.history[0]["marglik"], abs=1e-4)
    with pytest.raises(ValueError, match="solver.*'lbfgs'"):
        MargLikCallback(solver="lbfgs")


def test_option_values_ignore_case_and_near_misses_name_the_value_meant():
    """Issue 26.8: ``solver="Newton"`` is ``"newton"``; ``"newtn"`` is refused with the value meant."""
    assert MargLikCallback(solver="Newton").solver == "newton"
    assert MargLikCallback(scale_invariant=" Fixed").scale_invariant == "fixed"
    with pytest.raises(ValueError, match=r"`solver` must be one of \('adam', 'newton'\), got 'newtn' \(did you mean 'newton'\?\)"):
        MargLikCallback(solver="newtn")
    with pytest.raises(ValueError, match=r"`statistics`.*'Trainig' \(did you mean 'training'\?\)"):
        MargLikCallback(structure="kron", approx="ef", statistics="Trainig")


def test_numpy_scalars_are_taken_as_the_numbers_they_are():
    """A config read with NumPy (``np.int64(5)``) is an int and a float to the callbacks; a bool or a float where an
    int goes is still refused."""
    cb = MargLikCallback(frequency=np.int64(5), lr=np.float32(0.5), steps=np.int64(3))
    assert (cb.frequency, cb.lr, cb.steps) == (5, 0.5, 3) and type(cb.frequency) is int and type(cb.lr) is float
    assert MargLikEarlyStopping(patience=np.int64(3)).patience == 3
    for bad in (np.bool_(True), np.float64(2.0)):
        with pytest.raises(ValueError, match=r"`frequency` must be an int >= 1, got np"):
            MargLikCallback(frequency=bad)


class CompiledRegressor(Regressor):
    """The network trained through torch.compile (the evidence pass runs it eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="eager")
        self.prior = type(self.prior)(self.net)


def test_compiled_network_in_a_trainer_with_kron():
    """Issue 13: torch.compile'd network, structure='kron': no refusal, the plain network's evidence."""
    model, _ = _fit([cb := MargLikCallback(structure="kron", steps=20)], max_epochs=2, model=CompiledRegressor())
    plain = Regressor()
    plain.net.load_state_dict(model.net._orig_mod.state_dict())
    plain.prior.load_state_dict(model.prior.state_dict())
    plain.likelihood.load_state_dict(model.likelihood.state_dict())
    ev = LaplaceEvidence.fit(plain, loader(regression_data()), plain.likelihood, plain.prior, "kron")
    compiled = LaplaceEvidence.fit(model, loader(regression_data()), model.likelihood, model.prior, "kron")
    assert compiled.log_marglik().item() == pytest.approx(ev.log_marglik().item(), rel=1e-10)
    assert math.isfinite(cb.history[-1]["marglik"])


@pytest.mark.parametrize("solver", ["newton", "adam"])
def test_fixed_groups_stay_fixed_in_a_trainer(solver):
    model = Regressor()
    model.prior = type(model.prior)(model.net, fixed=["0.weight"])
    _fit([cb := MargLikCallback(output_layer="learn", settle=None, frequency=1, structure="kron", steps=20, solver=solver)], max_epochs=3, model=model)
    assert model.prior.log_precision[0].item() == 0.0  # "0.weight": still at precision 1
    assert (model.prior.log_precision[1:] != 0.0).all()
    assert len(cb.history) == 3 and all(math.isfinite(h["marglik"]) for h in cb.history)
