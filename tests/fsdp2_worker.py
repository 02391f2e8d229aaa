"""Multi-process FSDP2 (CPU, gloo) runs for ``tests/test_fsdp.py``: ``python tests/fsdp2_worker.py all OUT_DIR``.

FSDP2 is ``fully_shard`` applied in ``configure_model`` under Lightning's ``ModelParallelStrategy``
(``data_parallel_size=2, tensor_parallel_size=1``: every rank its share of the data, the weights
sharded across both). Lightning's strategy runs on CPU processes over gloo as it is: no tests-side
subclass is needed. As in ``tests/fsdp_worker.py``, Lightning's launcher re-executes ``sys.argv``
for rank 1, every case is a fresh Trainer in one process group, each rank writes
``OUT_DIR/rank<r>.json``.

* ``cases``: :data:`CASES` (weights frozen, 2 epochs, an estimate with 20 hyperparameter steps after
  each), ``fully_shard`` on every Linear and the root, or on the root only.
* ``grad``: one step of :func:`map_loss` on the whole data set (the same batch on both ranks, so the
  reduced gradient is the single-process one): its value and the whole gradient.
* ``train``: ``MargLikCheckpoint`` (best and ``last.ckpt``) and ``MargLikEarlyStopping`` under FSDP2,
  with Lightning's full (one file) and distributed (a directory) checkpoints.
* ``resume``: three epochs straight against two, then a fresh Trainer resumed from ``last.ckpt``.
* ``gradients``: :func:`tests.fsdp_worker.run_gradients` under FSDP2.
* ``refused``: ``ModelParallelStrategy``'s default on one node (tensor parallelism over both ranks).
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests` importable

from lightning_marglik import GaussianPrior, MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping, map_loss  # noqa: E402
from tests.fsdp_worker import CALLBACKS, Model, hyperparameters, make_data, run_gradients, strategy, trainer  # noqa: E402
from tests.worker_harness import TIMEOUT, loader, run_worker, two_processes, write_result  # noqa: E402

N = 37
GRAD_N = 64  # the data set of the `grad` step
GRAD_PRECISION = 100.0  # a strong prior: its term moves the gradient


class FullyShardedModel(Model):
    """:class:`tests.fsdp_worker.Model` with FSDP2's ``fully_shard`` over the data-parallel mesh in
    ``configure_model``: on every Linear and the root (``per_layer``), or on the root only (FSDP2 keeps the
    root's weights whole from its forward to the end of the backward, the layers' are resharded after forward)."""

    def __init__(self, *args: Any, per_layer: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.per_layer = per_layer

    def configure_model(self) -> None:
        shard_linears(self.net, self.device_mesh["data_parallel"], per_layer=self.per_layer)


def shard_linears(net: nn.Module, mesh: Any, per_layer: bool = True) -> None:
    """FSDP2's ``fully_shard`` over ``mesh`` on every ``nn.Linear`` of ``net`` (if ``per_layer``) and on ``net``.

    Also the FSDP2 wrapping of ``benchmarks/fsdp.py``.
    """
    from torch.distributed.fsdp import fully_shard

    if per_layer:
        for layer in net.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)


def fsdp2(save_distributed_checkpoint: bool = True) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
                                 timeout=TIMEOUT, save_distributed_checkpoint=save_distributed_checkpoint)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered with its own API (a collective, on every rank alike)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_weights(module: Model) -> List[list]:
    return [whole(p).detach().reshape(-1).tolist() for p in module.net.parameters()]


class Recorder(Callback):
    """After the callback in each epoch: the hyperparameters, the whole weights, and whether FSDP2 holds every
    weight sharded again (a DTensor) once the estimate has gathered them."""

    def __init__(self) -> None:
        self.epochs: List[Dict[str, Any]] = []

    def on_train_epoch_end(self, trainer_, pl_module):
        self.epochs.append({"epoch": trainer_.current_epoch, **hyperparameters(pl_module),
                            "sharded": all(isinstance(p, DTensor) for p in pl_module.net.parameters()),
                            "weights": whole_weights(pl_module)})


# name: (fully_shard on every Linear, callback, N); "bound_ddp" is DDP, for the bound callback's comparison.
# UNEVEN: the evidence shards of 17 and 16 examples take 3 and 2 batches, so a pass's forwards and backwards differ
# in number across ranks (FSDP2's hooks, left to act, would pair all-gathers of different batches and hang)
UNEVEN = 33
CASES: Dict[str, tuple] = {
    "kron": (True, "kron", N),
    "kron_uneven": (True, "kron", UNEVEN),
    "kron_root": (False, "kron", N),
    "diag": (True, "diag", N),
    "training": (True, "training", 40),
    "bound": (True, "bound", N),
    "bound_ddp": (None, "bound", N),
}


def run_cases(out: Path) -> Dict[str, Any]:
    results = {}
    for name, (per_layer, callback_kind, n) in CASES.items():
        ddp = per_layer is None
        module = Model() if ddp else FullyShardedModel(per_layer=per_layer)
        callback, recorder = CALLBACKS[callback_kind](), Recorder()
        fit = trainer(out, strategy("ddp", {}) if ddp else fsdp2(), [callback, recorder], max_epochs=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit.fit(module, train_dataloaders=loader(make_data(n)))
        results[name] = {
            **hyperparameters(module),
            "history": callback.history,
            "n_data": int(module.prior.n_data),
            "epochs": recorder.epochs,
            "warnings": [str(w.message) for w in caught if "MargLik" in str(w.message)],
            **(after_training(fit, module, callback) if name == "kron" else {}),
        }
    return results


def after_training(fit: pl.Trainer, module: Model, callback: MargLikCallback) -> Dict[str, Any]:
    """The methods a user calls after training, with the trainer: evidence_with, and fold_batchnorm's refusal."""
    try:
        callback.fold_batchnorm(fit, module)
        refused = {"type": None, "message": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        refused = {"type": type(exc).__name__, "message": str(exc)}
    return {"evidence_with_diag": callback.evidence_with(fit, module, "diag", "ggn"), "fold_refused": refused,
            "sharded_after": all(isinstance(p, DTensor) for p in module.net.parameters())}


def narrowed(module: Model, outputs: int) -> Model:
    """``module`` with its last Linear cut to its first ``outputs`` outputs (1: a one-row weight, which FSDP2 shards
    as the whole row on rank 0 and an empty shard on rank 1)."""
    last = module.net[-1]
    if outputs < last.out_features:
        cut = nn.Linear(last.in_features, outputs, dtype=last.weight.dtype)
        with torch.no_grad():
            cut.weight.copy_(last.weight[:outputs])
            cut.bias.copy_(last.bias[:outputs])
        module.net[-1] = cut
    return module


def grad_data(outputs: int) -> List[torch.Tensor]:
    """The ``grad`` step's inputs and targets (their first ``outputs`` columns)."""
    x, y = make_data(GRAD_N, seed=3).tensors
    return [x, y[:, :outputs]]


class GradModel(FullyShardedModel):
    """One step of ``map_loss`` on the whole ``grad`` data set on every rank (SGD at lr 0): its value and the
    whole gradient, read before the (empty) step."""

    def __init__(self, per_layer: bool, structure: str, outputs: int) -> None:
        super().__init__(seed=3, per_layer=per_layer)
        narrowed(self, outputs)
        self.prior = GaussianPrior(self.net, precision=GRAD_PRECISION, structure=structure)
        self.data = grad_data(outputs)
        self.record: Dict[str, Any] = {}

    def training_step(self, batch, batch_idx):
        x, y = self.data
        loss = map_loss(self(x), y, self.likelihood, self.prior, n_data=GRAD_N)
        self.record["loss"] = loss.item()
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.record["grads"] = [whole(p.grad).reshape(-1).tolist() for p in self.net.parameters()]


# name: (fully_shard on every Linear, prior structure, outputs of the last layer)
GRAD_CASES = {"layerwise": (True, "layerwise", 2), "diagonal": (True, "diagonal", 2), "layerwise_root": (False, "layerwise", 2),
              "layerwise_empty_shard": (True, "layerwise", 1), "diagonal_empty_shard": (True, "diagonal", 1)}


def run_grad(out: Path) -> Dict[str, Any]:
    results = {}
    for name, (per_layer, structure, outputs) in GRAD_CASES.items():
        module = GradModel(per_layer, structure, outputs)
        fit = two_processes(pl, out, fsdp2(), [], max_steps=1)
        fit.fit(module, train_dataloaders=loader(make_data(GRAD_N, seed=3)))
        results[name] = module.record
    return results


def run_training(out: Path, distributed: bool) -> Dict[str, Any]:
    """As ``tests/fsdp_worker.py``'s ``train``: F=1, K=20, MargLikCheckpoint(save_last), MargLikEarlyStopping."""
    module = FullyShardedModel(lr=1e-2, jump=2, seed=1)
    callback = MargLikCallback(structure="kron", frequency=1, steps=20, settle=None)
    name = "distributed" if distributed else "full"
    checkpoint = MargLikCheckpoint(dirpath=str(out / f"checkpoints_{name}"), save_top_k=1, save_last=True)
    stopper, recorder = MargLikEarlyStopping(patience=1), Recorder()
    fit = trainer(out, fsdp2(distributed), [callback, recorder, stopper, checkpoint], max_epochs=8)
    fit.fit(module, train_dataloaders=loader(make_data(101, seed=1)))
    return {
        "epochs": recorder.epochs,
        "history": callback.history,
        "best_marglik": callback.best_marglik,
        "best_epoch": callback.best_epoch,
        "best_model_path": checkpoint.best_model_path,
        "last_model_path": checkpoint.last_model_path,
        "stopped_epoch": stopper.stopped_epoch,
    }


def _resume_fit(out: Path, name: str, max_epochs: int, ckpt_path: Any = None) -> Dict[str, Any]:
    """Adam at lr 1e-2, F=1, K=20, under FSDP2 with distributed checkpoints; ``last`` saved every epoch."""
    module = FullyShardedModel(lr=1e-2, seed=2)
    callback = MargLikCallback(structure="kron", frequency=1, steps=20, settle=None)
    checkpoint = MargLikCheckpoint(dirpath=str(out / name), save_top_k=1, save_last=True)
    fit = trainer(out, fsdp2(), [callback, checkpoint], max_epochs=max_epochs)
    fit.fit(module, train_dataloaders=loader(make_data(64, seed=2)), ckpt_path=ckpt_path)
    return {**hyperparameters(module), "history": callback.history, "weights": whole_weights(module),
            "best_model_path": checkpoint.best_model_path, "last_model_path": checkpoint.last_model_path,
            "best_epoch": callback.best_epoch}


def run_resume(out: Path) -> Dict[str, Any]:
    """Three epochs straight, and two then one more resumed from the distributed ``last.ckpt`` (a directory)."""
    straight = _resume_fit(out, "resume_straight", 3)
    first = _resume_fit(out, "resume_first", 2)
    resumed = _resume_fit(out, "resume_first", 3, ckpt_path=first["last_model_path"])
    return {"straight": straight, "first": first, "resumed": resumed}


def run_refused(out: Path) -> Dict[str, Any]:
    """ModelParallelStrategy's defaults on one node: tensor_parallel_size=2 (the whole mesh)."""
    fit = trainer(out, ModelParallelStrategy(process_group_backend="gloo", timeout=TIMEOUT),
                  [MargLikCallback(settle=None)], max_epochs=1)
    try:
        fit.fit(FullyShardedModel(), train_dataloaders=loader(make_data()))
        return {"type": None, "message": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"type": type(exc).__name__, "message": str(exc)}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    results: Dict[str, Any] = {
        "cases": run_cases(out), "grad": run_grad(out),
        "train": {"full": run_training(out, False), "distributed": run_training(out, True)}, "resume": run_resume(out),
        "refused": run_refused(out),
        "gradients": run_gradients(out, FullyShardedModel, fsdp2, lambda _, module: whole_weights(module)),
    }
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    results["rank"] = rank
    write_result(out, f"rank{rank}.json", results)


if __name__ == "__main__":
    run_worker(lambda: main(Path(sys.argv[2])))
