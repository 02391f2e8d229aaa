"""Multi-process FSDP (CPU, gloo) runs for ``tests/test_fsdp.py``: ``python tests/fsdp_worker.py all OUT_DIR``.

Lightning's launcher re-executes ``sys.argv`` for rank 1, so the FSDP runs happen here, in one
process group, each case a fresh Trainer; every rank writes ``OUT_DIR/rank<r>.json``.

* ``cases``: one fit per entry of :data:`CASES` (an FSDP sharding strategy, with or without an
  ``auto_wrap_policy``, or DDP for comparison), weights frozen (SGD at lr 0), 2 epochs, an
  estimate with 20 hyperparameter steps after each: the learned hyperparameters and evidence.
* ``train``: a short training run under FULL_SHARD with ``MargLikCheckpoint`` (best and
  ``last.ckpt``) and ``MargLikEarlyStopping``; the whole weights of every epoch are recorded (torch < 2.14:
  the refusal at set-up, whose full-state-dict save on the CPU would crash the process).
* ``resume``: under FULL_SHARD with sharded state dicts (a checkpoint is a directory), three epochs
  straight against two, then a fresh Trainer resumed from ``last.ckpt`` for the third.
* ``gradients``: three epochs of Adam with an estimate after each, the module's ``optimizer_zero_grad`` Lightning's
  or its own: whether the callback freed the applied gradients, and the whole weights.
* ``map``: two epochs of ``map_loss`` training under DDP and under FULL_SHARD (one unit per Linear).
* ``refused``: fits that must fail at set-up with the callback's error (``use_orig_params=False``;
  FSDP2 and the tensor-parallel refusal: ``tests/fsdp2_worker.py``); the message of each is recorded.

The models and data are built here and imported by the test (importing has no side effects).
Lightning refuses ``strategy="fsdp"`` on a CPU accelerator, so :class:`CPUFSDPStrategy` (a
tests-side subclass, not part of the library) makes the one change a CPU needs.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests` importable

from lightning_marglik import (  # noqa: E402
    GaussianLikelihood,
    GaussianPrior,
    MargLikBoundCallback,
    MargLikCallback,
    MargLikCheckpoint,
    MargLikConfigurationError,
    MargLikEarlyStopping,
    map_loss,
)
from tests.worker_harness import TIMEOUT, ddp, loader, run_worker, two_processes, write_result  # noqa: E402
N = 37  # odd: Lightning's sampler pads the training shards, the evidence must not count the repeat
SIZES = [3, 16, 16, 2]


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU processes over gloo.

    Lightning passes FSDP ``device_id=None`` for a CPU device, which torch's FSDP refuses ("needs a
    non-CPU accelerator device"); here the wrapper is told the CPU. Everything else is Lightning's.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def make_data(n: int = N, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, SIZES[0], generator=gen, dtype=torch.float64)
    w = torch.randn(SIZES[0], SIZES[-1], generator=gen, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x @ w) + 0.3 * torch.randn(n, SIZES[-1], generator=gen, dtype=torch.float64))


class Model(pl.LightningModule):
    """An MLP (float64 weights) with a layerwise GaussianPrior and a Gaussian likelihood; Adam at ``lr``
    (SGD at 0 for ``lr=0``: the weights stay), 100 x ``lr`` from epoch ``jump`` on (the evidence falls)."""

    def __init__(self, lr: float = 0.0, jump: int = 1000, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: List[nn.Module] = []
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
            layers += [nn.Tanh()] if i else []
            layers.append(nn.Linear(a, b, dtype=torch.float64))
        self.net = nn.Sequential(*layers)
        self.prior = GaussianPrior(self.net, structure="layerwise")
        self.likelihood = GaussianLikelihood(sigma=0.8)
        self.lr, self.jump = lr, jump

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)

    def configure_optimizers(self):
        if self.lr == 0:
            return torch.optim.SGD(self.parameters(), lr=0.0)
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 if e < self.jump else 100.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


# name: (strategy, FSDP arguments, callback, N): the frozen-weight cases. statistics="training" takes N = 40: every
# rank's training shard holds 20 examples, none padded, so the estimates use the training passes' sums
CALLBACKS = {
    "kron": lambda: MargLikCallback(structure="kron", approx="ggn", frequency=1, steps=20, settle=None),
    "diag": lambda: MargLikCallback(structure="diag", approx="ggn", frequency=1, steps=20, settle=None),
    "training": lambda: MargLikCallback(structure="kron", approx="ef", statistics="training", frequency=1, steps=20,
                                        settle=None),
    "bound": lambda: MargLikBoundCallback(bound="parametric", structure="kron", lr=0.1),
}
CASES: Dict[str, tuple] = {
    "full_shard": ("fsdp", {"sharding_strategy": "FULL_SHARD"}, "kron", N),
    "shard_grad_op": ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}, "kron", N),
    "no_shard": ("fsdp", {"sharding_strategy": "NO_SHARD"}, "kron", N),
    # HYBRID_SHARD needs an auto_wrap_policy (or process groups or a device mesh) to know its groups
    "hybrid_shard": ("fsdp", {"sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": {nn.Linear}}, "kron", N),
    "full_shard_wrapped": ("fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}}, "kron", N),
    "diag_full_shard": ("fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}}, "diag", N),
    "training_full_shard": ("fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}}, "training", 40),
    "bound_full_shard": ("fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}}, "bound", N),
    "bound_ddp": ("ddp", {}, "bound", N),
}


def strategy(kind: str, fsdp: Dict[str, Any]) -> Any:
    if kind == "ddp":
        return ddp(pl)
    return CPUFSDPStrategy(process_group_backend="gloo", timeout=TIMEOUT, **fsdp)


def trainer(out: Path, strategy_: Any, callbacks: List[Callback], max_epochs: int) -> pl.Trainer:
    return two_processes(pl, out, strategy_, callbacks, max_epochs=max_epochs)


def whole_weights(trainer_: pl.Trainer, module: Model) -> List[list]:
    """Every weight, gathered with FSDP's own API (or as it is under DDP)."""
    model = trainer_.strategy.model
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return [p.detach().reshape(-1).tolist() for p in module.net.parameters()]
    return [p.detach().reshape(-1).tolist() for p in module.net.parameters()]


def hyperparameters(module: Model) -> Dict[str, list]:
    return {"log_precision": module.prior.log_precision.tolist(), "log_sigma": module.likelihood.log_sigma.reshape(-1).tolist()}


class Recorder(Callback):
    """After the callback in each epoch: the hyperparameters and the whole weights."""

    def __init__(self) -> None:
        self.epochs: List[Dict[str, Any]] = []

    def on_train_epoch_end(self, trainer_, pl_module):
        self.epochs.append({"epoch": trainer_.current_epoch, **hyperparameters(pl_module),
                            "weights": whole_weights(trainer_, pl_module)})


def sharded_evidence(evidence: Any) -> Dict[str, Any]:
    """What this rank holds of the evidence's curvature (per structure: the layers it owns, or the class of a
    replicated one), the evidence's gradient in every log hyperparameter with central differences of its value
    (each evaluation a collective, taken alike on both ranks), and the message refusing its posterior covariance."""
    from lightning_marglik.curvature.structures.sharded import ShardedStructure

    held = [[layer.name for layer in s.share.layers] if isinstance(s, ShardedStructure) else type(s).__name__
            for s in evidence.structures]
    point = {k: v.detach().to(torch.float64).clone() for k, v in evidence.hyperparameters().items()}
    leaves = {k: v.clone().requires_grad_(True) for k, v in point.items()}
    evidence.log_marglik_at(leaves).backward()
    grad, central = [], []
    for name, value in point.items():
        for i in range(value.numel()):
            moved = []
            for step in (1e-5, -1e-5):
                shifted = value.clone().reshape(-1)
                shifted[i] += step
                moved.append(evidence.log_marglik_at({**point, name: shifted.reshape(value.shape)}).item())
            grad.append(leaves[name].grad.reshape(-1)[i].item())
            central.append((moved[0] - moved[1]) / 2e-5)
    try:  # the posterior needs every layer in one process
        evidence.jacobian_covariance(torch.zeros(1, SIZES[-1], sum(evidence.prior.param_sizes), dtype=torch.float64))
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return {"held": held, "grad": grad, "central": central, "covariance_refused": refused}


def run_cases(out: Path) -> Dict[str, Any]:
    results = {}
    for name, (kind, fsdp, callback_kind, n) in CASES.items():
        module, callback, recorder = Model(), CALLBACKS[callback_kind](), Recorder()
        fit = trainer(out, strategy(kind, fsdp), [callback, recorder], max_epochs=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit.fit(module, train_dataloaders=loader(make_data(n)))
        evidence = getattr(callback, "evidence", None)
        after = {}
        if name == "full_shard_wrapped":  # the methods a user calls after training, with the trainer
            after = {"evidence_with_diag": callback.evidence_with(fit, module, "diag", "ggn"),
                     "evidence_with_kron": callback.evidence_with(fit, module, "kron", "ggn"),
                     "sharded": sharded_evidence(evidence),
                     "folded_weights": [p.reshape(-1).tolist() for p in callback.fold_batchnorm(fit, module).model.net.parameters()]}
        results[name] = {
            **hyperparameters(module),
            "history": callback.history,
            "n_data": int(module.prior.n_data),
            "log_marglik": None if evidence is None else evidence.log_marglik().item(),
            "epochs": recorder.epochs,
            **after,
            "warnings": [str(w.message) for w in caught if "MargLik" in str(w.message)],
            "fsdp_units": sum(isinstance(m, FullyShardedDataParallel) for m in fit.strategy.model.modules()),
            "guard_off": getattr(callback, "guard_off", None),
        }
    return results


def run_training(out: Path) -> Dict[str, Any]:
    """FULL_SHARD (full state dict), F=1, K=20, MargLikCheckpoint(save_last) and MargLikEarlyStopping(patience=1)."""
    module = Model(lr=1e-2, jump=2, seed=1)
    callback = MargLikCallback(structure="kron", frequency=1, steps=20, settle=None)
    checkpoint = MargLikCheckpoint(dirpath=str(out / "checkpoints"), save_top_k=1, save_last=True)
    stopper, recorder = MargLikEarlyStopping(patience=1), Recorder()
    fit = trainer(out, strategy("fsdp", {"sharding_strategy": "FULL_SHARD"}), [callback, recorder, stopper, checkpoint],
                  max_epochs=8)
    try:
        fit.fit(module, train_dataloaders=loader(make_data(101, seed=1)))
    except MargLikConfigurationError as exc:  # torch < 2.14: its save would crash the process (callbacks.sharding)
        return {"refused": {"type": type(exc).__name__, "message": str(exc), "epochs": recorder.epochs}}
    return {
        "epochs": recorder.epochs,
        "history": callback.history,
        "best_marglik": callback.best_marglik,
        "best_epoch": callback.best_epoch,
        "best_model_path": checkpoint.best_model_path,
        "last_model_path": checkpoint.last_model_path,
        "stopped_epoch": stopper.stopped_epoch,
        "current_epoch": fit.current_epoch,
    }


def _resume_fit(out: Path, name: str, max_epochs: int, ckpt_path: Any = None) -> Dict[str, Any]:
    """Adam at lr 1e-2, F=1, K=20, under FULL_SHARD with sharded state dicts; ``last`` saved every epoch."""
    module = Model(lr=1e-2, seed=2)
    callback = MargLikCallback(structure="kron", frequency=1, steps=20, settle=None)
    checkpoint = MargLikCheckpoint(dirpath=str(out / name), save_top_k=1, save_last=True)
    fsdp = {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}, "state_dict_type": "sharded"}
    fit = trainer(out, strategy("fsdp", fsdp), [callback, checkpoint], max_epochs=max_epochs)
    fit.fit(module, train_dataloaders=loader(make_data(64, seed=2)), ckpt_path=ckpt_path)
    return {**hyperparameters(module), "history": callback.history, "weights": whole_weights(fit, module),
            "best_model_path": checkpoint.best_model_path, "last_model_path": checkpoint.last_model_path,
            "best_epoch": callback.best_epoch}


def run_resume(out: Path) -> Dict[str, Any]:
    """Three epochs straight, and two then one more resumed from the sharded ``last.ckpt`` (a directory)."""
    straight = _resume_fit(out, "straight", 3)
    first = _resume_fit(out, "first", 2)
    resumed = _resume_fit(out, "first", 3, ckpt_path=first["last_model_path"])  # the same directory, as a user resumes
    return {"straight": straight, "first": first, "resumed": resumed}


class OwnZeroGrad:
    """A module's own ``optimizer_zero_grad`` (Lightning's body): the callback leaves the gradients to it."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad()


class GradientsFreed(Callback):
    """After the callback at each epoch's end: whether every weight's gradient has been freed."""

    def __init__(self) -> None:
        self.freed: List[bool] = []

    def on_train_epoch_end(self, trainer_, pl_module):
        self.freed.append(all(p.grad is None for p in pl_module.parameters()))


def run_gradients(out: Path, model: type, strategy_: Callable[[], Any],
                  weights: Callable[[pl.Trainer, Any], List[list]]) -> Dict[str, Any]:
    """Three epochs of Adam with an estimate after each, under a sharding ``strategy_``: with ``model``'s default
    ``optimizer_zero_grad`` (the callback frees the applied gradients before each estimate) and with its own (the
    callback leaves them): whether they were freed after each estimate, and the whole weights at the end."""
    results = {}
    for name, cls in (("default", model), ("own_zero_grad", type("OwnZeroGradModel", (OwnZeroGrad, model), {}))):
        module = cls(lr=1e-2, seed=4)
        freed = GradientsFreed()
        fit = trainer(out, strategy_(), [MargLikCallback(structure="kron", frequency=1, steps=20, settle=None), freed],
                      max_epochs=3)
        fit.fit(module, train_dataloaders=loader(make_data(64, seed=4)))
        results[name] = {"freed": freed.freed, "weights": weights(fit, module), **hyperparameters(module)}
    return results


def full_shard() -> Any:
    """FULL_SHARD with one unit per Linear."""
    return strategy("fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {nn.Linear}})


def run_map_training(out: Path) -> Dict[str, Any]:
    """Two epochs of map_loss at a strong prior (precision 100), no estimate: the whole weights under DDP and
    under FULL_SHARD with one unit per Linear, whose units reshard while training_step adds the prior's term."""
    results = {}
    for name, kind, fsdp in (("ddp", "ddp", {}), ("fsdp", "fsdp", {"auto_wrap_policy": {nn.Linear}})):
        module = Model(lr=1e-2, seed=3)
        module.prior = GaussianPrior(module.net, precision=100.0, structure="layerwise")
        fit = trainer(out, strategy(kind, fsdp), [MargLikCallback(frequency=50, steps=0, settle=None)], max_epochs=2)
        fit.fit(module, train_dataloaders=loader(make_data(64, seed=3)))
        results[name] = whole_weights(fit, module)
    return results


class FailingModel(Model):
    """Rank 1's forward raises in an estimate's evidence pass from its ``at``-th batch on (0: the first, before the
    pass has planned its structures); with ``at=None`` rank 1's evidence loader fails to build at the estimate."""

    def __init__(self, at: Any) -> None:
        super().__init__()
        self.at, self.calls = at, None  # calls: counted from the end of the first epoch (Clock)

    def forward(self, x):
        if self.calls is not None and self.at is not None and not self.training and self.trainer.global_rank == 1:
            self.calls += 1
            if self.calls > self.at:
                raise RuntimeError("injected failure in the evidence pass on rank 1")
        return super().forward(x)

    def evidence_dataloader(self) -> DataLoader:
        if self.trainer.global_rank == 1 and self.calls is not None:  # at the estimate, not the set-up check
            raise RuntimeError("injected failure building the evidence loader on rank 1")
        return loader(make_data())


class Clock(Callback):
    """Placed before MargLikCallback: when this rank entered the estimate; starts the module's count of calls."""

    entered: Any = None

    def on_train_epoch_end(self, trainer_, pl_module):
        self.entered, pl_module.calls = time.time(), 0


FAILURES = {"fail-first-batch": 0, "fail-later-batch": 1, "fail-loader": None}


def run_failures(out: Path) -> Dict[str, Any]:
    """Each fit (FULL_SHARD, kron: the sharded exchange) fails on rank 1 only and is caught on both ranks, which
    then go on in step to the next fit: the error and the seconds from entering the estimate to failing."""
    results = {}
    for name, at in FAILURES.items():
        clock = Clock()
        callback = MargLikCallback(structure="kron", frequency=1, steps=5, settle=None,
                                   dataloader="evidence_dataloader" if at is None else None)
        fit = trainer(out, strategy("fsdp", {"sharding_strategy": "FULL_SHARD"}), [clock, callback], max_epochs=2)
        try:
            fit.fit(FailingModel(at), train_dataloaders=loader(make_data()))
            results[name] = {"type": None, "message": None}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            results[name] = {"type": type(exc).__name__, "message": str(exc), "entered": clock.entered, "failed": time.time()}
    return results


REFUSED = {
    "use_orig_params_false": lambda: CPUFSDPStrategy(process_group_backend="gloo", timeout=TIMEOUT, use_orig_params=False),
}


def run_refused(out: Path) -> Dict[str, Any]:
    """Each fit fails on both ranks at the callback's set-up; the error is recorded, the next fit runs."""
    results = {}
    for name, make in REFUSED.items():
        fit = trainer(out, make(), [MargLikCallback(settle=None)], max_epochs=1)
        try:
            fit.fit(Model(), train_dataloaders=loader(make_data()))
            results[name] = {"type": None, "message": None}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            results[name] = {"type": type(exc).__name__, "message": str(exc)}
    return results


def main(out: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    results: Dict[str, Any] = {"cases": run_cases(out), "train": run_training(out), "resume": run_resume(out), "map": run_map_training(out), "refused": run_refused(out),
                               "failures": run_failures(out), "gradients": run_gradients(out, Model, full_shard, whole_weights)}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    results["rank"] = rank
    write_result(out, f"rank{rank}.json", results)


if __name__ == "__main__":
    run_worker(lambda: main(Path(sys.argv[2])))
