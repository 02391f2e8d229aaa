"""MargLikBoundCallback in a real Trainer (CPU): its steps are BoundOptimizer's on the training batches."""
from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from lightning_marglik import (
    BoundOptimizer, GammaHyperprior, GaussianPrior, MargLikBoundCallback, MargLikCheckpoint, MargLikConfigurationError,
)
from tests.lightning_models import Classifier, Regressor, blobs, loader, regression_data, trainer


def _fit(callbacks, max_epochs, model=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Regressor()
    t = trainer(callbacks, max_epochs, **kwargs)
    t.fit(model, loader(regression_data()))
    return model, t


@pytest.mark.parametrize("bound", ["parametric", "ntk"])
def test_steps_are_bound_optimizer_steps_on_every_kth_batch(bound):
    """Weights held fixed (lr=0): the callback's hyperparameters after an epoch equal BoundOptimizer's
    steps by hand on batches 2 and 4 (every_k_batches=2) of the 4."""
    options = dict(bound=bound, structure="kron" if bound == "parametric" else "full", subset_size=4 if bound == "ntk" else None)
    callback = MargLikBoundCallback(every_k_batches=2, lr=0.05, **options)
    model, t = _fit([callback], max_epochs=1, model=Regressor(lr=0.0))
    pl.seed_everything(0, verbose=False)
    by_hand = Regressor(lr=0.0)
    optimizer = BoundOptimizer(by_hand.likelihood, by_hand.prior, n_data=64, lr=0.05, **options)
    values = [optimizer.step(by_hand, batch) for i, batch in enumerate(loader(regression_data())) if i % 2 == 1]
    assert torch.allclose(model.prior.log_precision, by_hand.prior.log_precision, atol=1e-6)
    assert torch.allclose(model.likelihood.log_sigma, by_hand.likelihood.log_sigma, atol=1e-6)
    assert not torch.allclose(model.prior.log_precision, torch.zeros(4))  # the steps moved them
    assert callback.history == [{"epoch": 1, "step": 4, "marglik": pytest.approx(sum(values) / 2, rel=1e-5), "steps": 2}]
    assert t.callback_metrics["marglik"].item() == pytest.approx(sum(values) / 2, rel=1e-5)
    assert callback.final_marglik == callback.last_marglik


@pytest.mark.parametrize("classes,resolved,estimator", [
    (3, 0, "auto: the exact GGN"), (12, 1, "auto: the Monte-Carlo GGN (1 sample)"),
])
def test_ntk_mc_samples_auto_runs_what_the_setup_line_names(classes, resolved, estimator):
    """bound="ntk" with mc_samples="auto": the set-up pass decides the estimator, its line names it, and every step
    runs it: the fit equals one with that count set (the same seeded draws)."""
    x, y = blobs(40, seed=0).tensors
    fits = []
    for mc_samples in ("auto", resolved):
        callback = MargLikBoundCallback(bound="ntk", mc_samples=mc_samples, every_k_batches=2, subset_size=4)
        pl.seed_everything(0, verbose=False)
        model = Classifier(n_data=40, classes=classes)
        trainer([callback], max_epochs=1).fit(model, loader(TensorDataset(x.double(), y), batch_size=10))
        fits.append((callback, model.prior.log_precision))
    (auto, by_auto), (set_, by_count) = fits
    assert auto.estimator.startswith(estimator) and auto.options.mc_samples == resolved
    assert torch.equal(by_auto, by_count) and auto.history == set_.history


def test_learns_the_noise_and_checkpoints_the_best_epoch(tmp_path):
    callback = MargLikBoundCallback(bound="parametric", structure="kron", every_k_batches=1, lr=0.1)
    checkpoint = MargLikCheckpoint(dirpath=tmp_path, save_top_k=1)
    model, t = _fit([callback, checkpoint], max_epochs=12)
    assert model.likelihood.log_sigma.item() < math.log(0.9)  # the noise is 0.1: sigma shrinks from 1
    assert torch.isfinite(model.prior.log_precision).all()
    assert [h["epoch"] for h in callback.history] == list(range(1, 13))
    assert checkpoint.best_model_path and callback.best_marglik == max(h["marglik"] for h in callback.history)
    assert callback.state_dict()["optimizer_state"]["state"]  # Adam's moments travel with checkpoints


def test_burnin_epochs_take_no_step():
    callback = MargLikBoundCallback(structure="diag", burnin=2, every_k_batches=3)
    model, _ = _fit([callback], max_epochs=3)
    assert [(h["epoch"], h["steps"]) for h in callback.history] == [(3, 1)]


def test_resume_continues_adam(tmp_path):
    """Two epochs in one fit equal one epoch, a checkpoint, and a resumed second epoch."""
    callback = MargLikBoundCallback(structure="diag", every_k_batches=1, lr=0.05)
    straight, _ = _fit([callback], max_epochs=2)
    first = MargLikBoundCallback(structure="diag", every_k_batches=1, lr=0.05)
    _, t = _fit([first], max_epochs=1)
    t.save_checkpoint(tmp_path / "one.ckpt")
    pl.seed_everything(0, verbose=False)
    resumed_callback = MargLikBoundCallback(structure="diag", every_k_batches=1, lr=0.05)
    resumed = Regressor()
    trainer([resumed_callback], 2).fit(resumed, loader(regression_data()), ckpt_path=tmp_path / "one.ckpt")
    assert torch.allclose(resumed.prior.log_precision, straight.prior.log_precision, atol=1e-6)
    assert [h["epoch"] for h in resumed_callback.history] == [1, 2]


def test_lightning_pytorch_package():
    """The same callback for ``lightning.pytorch`` (``import lightning``) steps in its Trainer."""
    lightning_pl = pytest.importorskip("lightning.pytorch")
    from lightning_marglik.lightning import MargLikBoundCallback as LightningBoundCallback
    from tests.lightning_models import RegressorSteps

    class LightningRegressor(RegressorSteps, lightning_pl.LightningModule):
        pass

    callback = LightningBoundCallback(structure="diag", every_k_batches=2)
    t = lightning_pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    model = LightningRegressor()
    t.fit(model, loader(regression_data()))
    assert callback.history[0]["steps"] == 2 and not torch.allclose(model.prior.log_precision, torch.zeros(4))


def test_every_k_beyond_an_epoch_is_refused_before_training():
    model = Regressor()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(MargLikConfigurationError, match="every_k_batches=5.*an epoch has 4 training batches"):
        _fit([MargLikBoundCallback(every_k_batches=5)], max_epochs=1, model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_prior_with_a_hyperprior_is_refused_before_training():
    """Refused at set-up with BoundOptimizer's message, not at the first bound step after training batches."""
    model = Regressor()
    model.prior = GaussianPrior(model.net, hyperprior=GammaHyperprior())
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(MargLikConfigurationError, match=r"MargLikBoundCallback: .*does not take a hyperprior"):
        _fit([MargLikBoundCallback(every_k_batches=3)], max_epochs=1, model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(every_k_batches=0), "`every_k_batches` must be an int >= 1"),
    (dict(bound="kernel"), "`bound` must be one of"),
    (dict(structure="ekfac"), "bound='parametric' takes structure"),
    (dict(subset_size=8), "`subset_size` splits batches for bound='ntk'"),
    (dict(bound="ntk", backend="backpack"), "applies to bound='parametric' only"),
    (dict(bound="ntk", structure="diag"), "structure='diag' would be ignored; `structure` applies to bound='parametric'"),
    (dict(lr=-1.0), r"`lr` must be a finite number in \(0, inf\)"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MargLikBoundCallback(**kwargs)


_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_ddp_steps_sum_both_ranks_batches(tmp_path):
    """2 processes (real DDP, gloo): each step's bound is over both ranks' batches (one part each),
    as BoundOptimizer with the other rank's pieces added; the hyperparameters are identical on both ranks."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.data import DistributedSampler

    from lightning_marglik.hyperparameters import learnable_values
    from tests import bound_ddp_worker as worker

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tests" / "bound_ddp_worker.py"), str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    # by hand: Lightning's DistributedSampler (shuffled with seed 0) gives each rank its examples; steps after batches 2 and 4
    pl.seed_everything(0, verbose=False)
    model = Regressor(lr=0.0)
    x, y = regression_data().tensors
    shards = [torch.tensor(list(DistributedSampler(regression_data(), num_replicas=2, rank=r, shuffle=True, seed=0))) for r in (0, 1)]
    optimizer = BoundOptimizer(model.likelihood, model.prior, n_data=64, structure="kron", lr=worker.LR)
    other = BoundOptimizer(model.likelihood, model.prior, n_data=64, structure="kron")
    values = []
    for t in (1, 3):
        batches = [(x[shard[t * 8 : (t + 1) * 8]], y[shard[t * 8 : (t + 1) * 8]]) for shard in shards]
        leaves = other._leaves_for({n: v.double() for n, v in learnable_values(model.prior, model.likelihood).items()})
        pieces, _ = other._local_pieces(model, batches[1], leaves, None)
        values.append(optimizer.step(model, batches[0], all_reduce=lambda v: v + torch.cat([pieces, v.new_zeros(1)])))
    assert ranks[0]["log_precision"] == pytest.approx(model.prior.log_precision.tolist(), abs=1e-6)
    assert ranks[0]["log_sigma"] == pytest.approx(model.likelihood.log_sigma.item(), abs=1e-6)
    assert ranks[0]["history"][0]["marglik"] == pytest.approx(sum(values) / 2, rel=1e-5)
