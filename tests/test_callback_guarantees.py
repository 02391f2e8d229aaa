"""Callback promises of issue 17: a resume with other fixed precision groups, a module whose own
``train()`` does more than set flags, and an unwritable checkpoint directory (real Trainer, real
checkpoints on disk)."""
from __future__ import annotations

import math
import warnings

import pytest
import pytorch_lightning as pl

from lightning_marglik import GaussianPrior, MargLikCallback, MargLikCheckpoint, MargLikConfigurationError
from tests.lightning_models import Regressor, loader, regression_data, trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*", "ignore:.*exists and is not empty.*",
    "ignore:.*no `val_dataloader`.*",
)


def _fit(callbacks, max_epochs, model, ckpt_path=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    trainer(callbacks, max_epochs, **kwargs).fit(model, loader(regression_data()), ckpt_path=ckpt_path)
    return model


def _with_fixed(fixed) -> Regressor:
    model = Regressor()
    model.prior = GaussianPrior(model.net, precision=1.0, fixed=fixed)  # net: 0 Linear, 1 Tanh, 2 Linear
    return model


# --- issue 17 item 3: resume with a different GaussianPrior(fixed=...) ---------------------------


def test_resume_with_other_fixed_groups_resets_the_newly_fixed_and_restarts_adam(tmp_path):
    callback = MargLikCallback(output_layer="learn", settle=None, frequency=1, structure="diag", approx="ef", steps=20, lr=0.1, solver="adam")
    saved = _fit([callback, MargLikCheckpoint(dirpath=tmp_path, save_last=True)], 3, _with_fixed(["0.weight"]))
    learned = dict(zip(saved.prior.param_names, saved.prior.precision.tolist()))
    assert learned["0.weight"] == 1.0 and not math.isclose(learned["2.weight"], 1.0, rel_tol=1e-3)
    # the same number of learned groups (3), so the Adam state has the same shape: only the names differ
    model = _with_fixed(["2.weight"])
    callback = MargLikCallback(output_layer="learn", settle=None, frequency=1, structure="diag", approx="ef", steps=20, lr=0.1, solver="adam")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit([callback, MargLikCheckpoint(dirpath=tmp_path, save_last=True)], 5, model,
             ckpt_path=tmp_path / "last.ckpt")
    messages = [str(w.message) for w in caught]
    assert any("'2.weight'" in m and "declared precision=1" in m for m in messages), messages
    assert any("learnable hyperparameters changed" in m and "starts afresh" in m for m in messages), messages
    resumed = dict(zip(model.prior.param_names, model.prior.precision.tolist()))
    assert resumed["2.weight"] == pytest.approx(1.0, rel=1e-12)  # the declared value, kept while fixed
    assert not math.isclose(resumed["0.weight"], 1.0, rel_tol=1e-3)  # learned now
    assert [h["epoch"] for h in callback.history] == [1, 2, 3, 4, 5]


# --- issue 17 item 5: a module whose own train() does more than set .training ---------------------


class FreezesFirstLayerInEval(Regressor):
    """Its own ``train(mode)`` also freezes the first layer's parameters in eval mode (as a module
    that keeps a frozen backbone for evaluation may): something no flag restore undoes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def train(self, mode: bool = True):
        super().train(mode)
        self.net[0].requires_grad_(mode)
        return self

    def training_step(self, batch, batch_idx):
        self.seen.append(([p.requires_grad for p in self.parameters()], [m.training for m in self.modules()]))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_training_sees_the_same_requires_grad_and_modes_with_and_without_the_callback(structure):
    without = _fit([], 3, FreezesFirstLayerInEval())
    with_callback = _fit([MargLikCallback(structure=structure, steps=5)], 3, FreezesFirstLayerInEval())
    assert len(with_callback.seen) == len(without.seen) == 12
    assert with_callback.seen == without.seen
    assert all(all(grads) and all(modes) for grads, modes in with_callback.seen)


# --- issue 17 item 11: an unwritable checkpoint directory ----------------------------------------


def test_unwritable_checkpoint_dirpath_fails_when_training_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = Regressor()
    checkpoint = MargLikCheckpoint(dirpath=str(blocker / "checkpoints"))
    with pytest.raises(MargLikConfigurationError, match=r"cannot write to dirpath=.*a-file/checkpoints.*writable"):
        _fit([MargLikCallback(structure="diag", approx="ef", burnin=2, steps=1), checkpoint], 4, model)
    assert model.train_modes == []  # not after burn-in: before the first step


def test_writable_checkpoint_dirpath_is_left_as_it_was(tmp_path):
    checkpoint = MargLikCheckpoint(dirpath=str(tmp_path / "new" / "checkpoints"), save_top_k=1)
    _fit([MargLikCallback(structure="diag", approx="ef", steps=1), checkpoint], 1, Regressor())
    assert [p.name for p in (tmp_path / "new" / "checkpoints").iterdir()] == [checkpoint.best_model_path.split("/")[-1]]
