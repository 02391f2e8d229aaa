"""Both Lightning packages, ``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning``),
get the same behaviour: a real Trainer takes our checkpoint and early-stopping callbacks for its own
(``ckpt_path="best"`` loads the best-evidence model), each package's LightningCLI accepts them, a
callback given to the other package's Trainer is refused at set-up with the import to use, and
``import lightning_marglik`` works without ``lightning``. DDP with ``lightning.pytorch``:
``tests/test_ddp.py``.
"""
from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lightning_marglik import MargLikConfigurationError
from tests.lightning_models import Regressor, RegressorSteps, loader, regression_data

L = pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed")

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*", "ignore:.*exists and is not empty.*",
    "ignore:.*no `val_dataloader`.*", "ignore:.*args parameter is intended.*",
)


class LightningRegressor(RegressorSteps, L.LightningModule):
    """:class:`tests.lightning_models.Regressor` as a ``lightning.pytorch`` LightningModule."""


class JumpingLR:
    """Adam at ``lr`` for 3 epochs, then at 30 x ``lr``: the fit degrades, so the best evidence is not the last."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 if epoch < 3 else 30.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


class JumpingRegressor(JumpingLR, Regressor):
    pass


class JumpingLightningRegressor(JumpingLR, LightningRegressor):
    pass


PACKAGES = {
    # package: (Lightning module, our callbacks' module, LightningModule classes, the other package)
    "pytorch_lightning": ("pytorch_lightning", "lightning_marglik", Regressor, JumpingRegressor, "lightning"),
    "lightning": ("lightning.pytorch", "lightning_marglik.lightning", LightningRegressor, JumpingLightningRegressor,
                  "pytorch_lightning"),
}


def _package(name: str) -> SimpleNamespace:
    pl_name, ours, regressor, jumping, other = PACKAGES[name]
    return SimpleNamespace(
        name=name, pl=importlib.import_module(pl_name), ours=importlib.import_module(ours), module_path=ours,
        Regressor=regressor, Jumping=jumping, other=other,
    )


@pytest.fixture(params=list(PACKAGES))
def package(request) -> SimpleNamespace:
    return _package(request.param)


def _trainer(package: SimpleNamespace, callbacks, tmp_path: Path, **kwargs):
    options = dict(
        max_epochs=8, callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", deterministic=True, default_root_dir=str(tmp_path),
    )
    options.update(kwargs)
    return package.pl.Trainer(**options)


def test_trainer_takes_our_callbacks_and_best_loads_the_best_evidence_model(package, tmp_path):
    ours = package.ours
    callback = ours.MargLikCallback(structure="kron", frequency=1, steps=20, settle=None)  # an estimate every epoch
    checkpoint = ours.MargLikCheckpoint(dirpath=str(tmp_path / "best"), filename="{epoch}", save_top_k=1)
    stopper = ours.MargLikEarlyStopping(patience=100)
    trainer = _trainer(package, [callback, checkpoint, stopper], tmp_path)
    # the Trainer's own checkpoint and early-stopping callbacks, and no default ModelCheckpoint besides
    assert trainer.checkpoint_callback is checkpoint and trainer.checkpoint_callbacks == [checkpoint]
    assert trainer.early_stopping_callback is stopper
    package.pl.seed_everything(0, verbose=False)
    model = package.Jumping(lr=1e-2)
    data = loader(regression_data())
    trainer.fit(model, data)
    last = [p.detach().clone() for p in model.parameters()]
    assert 0 <= callback.best_epoch < trainer.current_epoch - 1  # the best evidence came before the last epoch
    best = checkpoint.best_model_path
    assert Path(best).name == f"epoch={callback.best_epoch}.ckpt"
    trainer.validate(model, data, ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == best
    saved = torch.load(best, weights_only=False)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())  # the best model was loaded
    assert not all(torch.equal(a, b) for a, b in zip(last, model.parameters()))  # ... not the last one


def test_ckpt_path_best_follows_the_first_checkpoint_callback_in_the_list(package, tmp_path):
    """With a ModelCheckpoint of the user's as well, Lightning's ``checkpoint_callback`` (what
    ``ckpt_path="best"`` loads) is whichever comes first in ``callbacks`` (docs/callback.md says so)."""
    ours = package.ours
    mine = ours.MargLikCheckpoint(dirpath=str(tmp_path / "a"))
    theirs = package.pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "b"), monitor="val_mse")
    assert _trainer(package, [ours.MargLikCallback(), mine, theirs], tmp_path).checkpoint_callback is mine
    assert _trainer(package, [ours.MargLikCallback(), theirs, mine], tmp_path).checkpoint_callback is theirs


@pytest.mark.parametrize("which", ["MargLikCallback", "MargLikCheckpoint", "MargLikEarlyStopping"])
def test_callback_of_the_other_package_is_refused_at_setup_naming_the_import(package, which, tmp_path):
    other = _package(package.other)
    ours = other.ours  # callbacks of the other package ...
    callbacks = [ours.MargLikCallback(structure="diag", approx="ef", steps=1)]
    if which != "MargLikCallback":  # ... or only one of them: our MargLikCallback plus the other's checkpoint
        callbacks = [package.ours.MargLikCallback(structure="diag", approx="ef", steps=1), getattr(ours, which)()]
    trainer = _trainer(package, callbacks, tmp_path, enable_checkpointing=False)
    model = package.Regressor()
    with pytest.raises(MargLikConfigurationError, match=f"from {package.module_path} import MargLikCallback"):
        trainer.fit(model, loader(regression_data()))
    assert model.train_modes == []  # before the first training step


def test_callbacks_pickle_with_their_package(package):
    ours = package.ours
    for callback in (ours.MargLikCallback(structure="diag"), ours.MargLikCheckpoint(), ours.MargLikEarlyStopping()):
        copy = pickle.loads(pickle.dumps(callback))
        assert type(copy) is type(callback) and isinstance(copy, package.pl.Callback)


def _cli_config(package: SimpleNamespace, tmp_path: Path) -> Path:
    prefix = package.module_path
    config = {
        "trainer": {
            "max_epochs": 2, "logger": False, "enable_progress_bar": False, "accelerator": "cpu",
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {"class_path": f"{prefix}.MargLikCallback", "init_args": {"structure": "diag", "steps": 3, "settle": None, "frequency": 1}},
                {"class_path": f"{prefix}.MargLikCheckpoint", "init_args": {"dirpath": str(tmp_path / "ckpt")}},
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_lightning_cli_accepts_the_callbacks_from_yaml_and_the_command_line(package, tmp_path):
    cli_module = importlib.import_module(f"{package.pl.__name__}.cli")
    args = [
        "--config", str(_cli_config(package, tmp_path)),
        f"--trainer.callbacks+={package.module_path}.MargLikEarlyStopping", "--trainer.callbacks.patience=2",
    ]
    cli = cli_module.LightningCLI(package.Regressor, run=False, args=args, save_config_kwargs={"overwrite": True})
    trainer = cli.trainer
    ours = package.ours
    mine = [type(c) for c in trainer.callbacks if type(c).__name__.startswith("MargLik")]
    assert mine == [ours.MargLikCallback, ours.MargLikEarlyStopping, ours.MargLikCheckpoint]  # checkpoints go last
    assert isinstance(trainer.checkpoint_callback, ours.MargLikCheckpoint)
    assert isinstance(trainer.early_stopping_callback, ours.MargLikEarlyStopping)
    assert trainer.early_stopping_callback.patience == 2
    trainer.fit(cli.model, loader(regression_data()))
    marglik = next(c for c in trainer.callbacks if isinstance(c, ours.MargLikCallback))
    assert marglik.estimations == 2 and Path(trainer.checkpoint_callback.best_model_path).exists()


def test_import_lightning_marglik_does_not_need_lightning():
    code = (
        "import sys; sys.modules['lightning'] = None\n"  # as if `lightning` were not installed
        "import lightning_marglik\n"
        "from lightning_marglik import MargLikCallback\n"
        "assert not any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules if sys.modules[m])\n"
        "try:\n    import lightning_marglik.lightning\nexcept ImportError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert "pip install lightning" in out.stdout and "import them from lightning_marglik" in out.stdout


@pytest.mark.parametrize("bar", ["TQDMProgressBar", "RichProgressBar"])
def test_evidence_pass_progress_with_either_progress_bar_and_no_empty_validation_line(package, bar, tmp_path, capsys):
    callback = package.ours.MargLikCallback(structure="diag", approx="ef", steps=2)
    trainer = _trainer(package, [callback, getattr(package.pl.callbacks, bar)()], tmp_path, max_epochs=2,
                       enable_progress_bar=True, enable_checkpointing=False)
    trainer.fit(package.Regressor(), loader(regression_data()))
    out = capsys.readouterr().out
    assert "Evidence pass" in out and "4/4" in out  # 4 evidence batches
    assert "Validation" not in out  # no validation loop ran: no (empty) validation line either
