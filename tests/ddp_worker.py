"""Multi-process (DDP, CPU, gloo) runs for ``tests/test_ddp.py``.

Lightning's ``ddp`` launcher re-executes ``sys.argv`` once per extra rank, so the DDP part of the
tests runs here, as a script: ``python tests/ddp_worker.py MODE OUT_DIR``. Every rank writes its
results to ``OUT_DIR/<mode>-rank<r>.json`` (and rank 0 the initial weights and data of each case
to ``OUT_DIR/case-<name>.pt``); the test compares them with single-process references.

Modes:
    popen          the ``ddp`` (popen) strategy, in one process group, each case a fresh
                   Trainer: ``evidence`` (one fit per case, weights frozen, K=0, the evidence of
                   every rank recorded), ``train`` (a short training run with MargLikCheckpoint
                   and MargLikEarlyStopping), ``samplers`` (the training loader samples a subset,
                   through Lightning's DistributedSamplerWrapper or the user's own sampler), then
                   ``errors`` with the default cases, so the run ends with an error on both ranks
                   (exit code 1) by design.
    spawn          ``ddp_spawn``: per-rank results from the workers, and what the main process
                   gets back (``spawn-main.json``).
    train          the ``train`` part of ``popen`` alone (``train-rank<r>.json``); with
                   ``DDP_WORKER_PACKAGE=lightning`` in the environment the worker uses
                   ``lightning.pytorch`` and ``lightning_marglik.lightning`` throughout.
    errors [CASE ...]
                   one fit per case in which rank 1 alone fails (default ``error-setup``: a bad
                   batch, not an ``(inputs, targets)`` pair, in rank 1's evidence shard from the
                   start, found by the set-up check; ``error-batch``: the same, only after the
                   first training epoch, so the evidence pass meets it; ``error-collect``: the
                   network raises in rank 1's evidence pass). Every case but the last is caught
                   on both ranks and the next fit runs; the last one propagates, so the run ends
                   with an error on both ranks. ``error-loader`` (building the evidence loader
                   fails on rank 1) is not in the suite.

The models and data are built here and imported by the test (``from tests import ddp_worker``;
importing has no side effects).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, SubsetRandomSampler, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, map_loss
from lightning_marglik.denormals import flushing_denormals

# the Lightning package (and our callbacks for it) the worker runs with
PACKAGE = os.environ.get("DDP_WORKER_PACKAGE", "pytorch_lightning")
if PACKAGE == "lightning":
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_marglik.lightning import MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping
else:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

    from lightning_marglik import MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests` importable

from tests.worker_harness import TIMEOUT, ddp, loader, run_worker, two_processes, write_result  # noqa: E402, F401  (test_ddp reads TIMEOUT here)

# --------------------------------------------------------------------------------------------
# models and data (shared with the test)
# --------------------------------------------------------------------------------------------


class Model(pl.LightningModule):
    """A network with a GaussianPrior and a likelihood, trained with ``map_loss``."""

    def __init__(self, net: nn.Module, kind: str, n_data: int, prior_structure: str = "layerwise", lr: float = 0.0):
        super().__init__()
        self.net = net
        self.prior = GaussianPrior(net, precision=1.0, structure=prior_structure)
        self.likelihood = GaussianLikelihood(sigma=0.8) if kind == "regression" else CategoricalLikelihood()
        self.n_data = n_data
        self.lr = lr
        self.seen = 0  # training examples seen by this rank in the last epoch
        self.fail_in_evidence_on_rank: Optional[int] = None
        self.evidence_data: Optional[Dataset] = None

    def evidence_dataloader(self) -> DataLoader:
        """For ``MargLikCallback(dataloader="evidence_dataloader")``: shuffled, batch 5."""
        assert self.evidence_data is not None
        return DataLoader(self.evidence_data, batch_size=5, shuffle=True)

    def forward(self, x):
        if (
            self.fail_in_evidence_on_rank is not None
            and not self.training
            and self.trainer.global_step > 0  # past the set-up check: in the evidence pass
            and self.trainer.global_rank == self.fail_in_evidence_on_rank
        ):
            raise RuntimeError(f"injected failure in the evidence pass on rank {self.trainer.global_rank}")
        return self.net(x)

    def on_train_start(self):  # after the callbacks' on_train_start
        self.counted = int(self.prior.n_data)  # N counted at set-up, summed over the ranks' shards

    def on_train_epoch_start(self):
        self.seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += x.shape[0]
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        if self.lr == 0:  # lr 0: the weights stay exactly where they are
            return torch.optim.SGD(self.net.parameters(), lr=0.0)
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)


# name: (layer sizes, likelihood kind, curvature structure, approx, prior structure, evidence data)
# N = 37 (odd) everywhere; the training loader shuffles and drops the last batch. Evidence data:
# None = the trainer's training loader, "loader" = MargLikCallback(dataloader=<a shuffled
# DataLoader, batch 5>), "method" = MargLikCallback(dataloader="evidence_dataloader").
# Full-structure rows: k per example = outputs (GGN, Gaussian), classes (GGN, categorical), 1 (EF).
CASES: Dict[str, tuple] = {
    "diag-ggn-regression": ([3, 8, 2], "regression", "diag", "ggn", "diagonal", None),
    "diag-ef-classification": ([4, 8, 3], "classification", "diag", "ef", "layerwise", "method"),
    "kron-ggn-classification": ([4, 8, 6, 3], "classification", "kron", "ggn", "layerwise", None),
    "kron-ef-regression": ([3, 8, 2], "regression", "kron", "ef", "scalar", "loader"),
    # 37 * 3 = 111 rows < P = 115: determinant lemma (Woodbury) on the gathered rows
    "full-woodbury": ([3, 16, 3], "regression", "full", "ggn", "layerwise", None),
    "full-woodbury-loader": ([3, 16, 3], "regression", "full", "ggn", "layerwise", "loader"),
    # 37 * 2 = 74 rows >= P = 26, and each rank's share (38 / 36 rows) too: Gram matrices
    "full-gram": ([3, 4, 2], "regression", "full", "ggn", "scalar", None),
    # EF, 1 row per example, P = 19: rank 0 (19 rows) switches to the Gram matrix, rank 1 (18) keeps rows
    "full-mixed": ([1, 2, 5], "regression", "full", "ef", "layerwise", None),
    # classification with the full GGN: 37 * 3 = 111 rows >= P = 51 (Gram)
    "full-ggn-classification": ([4, 6, 3], "classification", "full", "ggn", "layerwise", None),
}
N_EVIDENCE = 37
BATCH = 8


def make_net(sizes: List[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def make_data(sizes: List[int], kind: str, n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, sizes[0], generator=gen)
    if kind == "regression":
        w = torch.randn(sizes[0], sizes[-1], generator=gen)
        y = torch.sin(x @ w) + 0.3 * torch.randn(n, sizes[-1], generator=gen)
    else:
        y = torch.randint(0, sizes[-1], (n,), generator=gen)
    return TensorDataset(x, y)


def make_case(name: str, seed: int = 0):
    """Model (lr 0) and data set of an evidence case."""
    sizes, kind, _, _, prior_structure, _ = CASES[name]
    net = make_net(sizes, seed)
    return Model(net, kind, N_EVIDENCE, prior_structure, lr=0.0), make_data(sizes, kind, N_EVIDENCE, seed)


def train_loader(dataset: Dataset, batch_size: int = BATCH) -> DataLoader:
    """Shuffled, dropping the last batch: must not change the evidence."""
    return loader(dataset, batch_size, drop_last=True)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def ddp_trainer(out: Path, callbacks: List[Callback], max_epochs: int, start_method: str = "popen", **kwargs) -> pl.Trainer:
    return two_processes(pl, out, ddp(pl, start_method), callbacks, max_epochs=max_epochs, **kwargs)


def buffers(module: Model) -> Dict[str, list]:
    return {
        "log_precision": module.prior.log_precision.tolist(),
        "log_sigma": module.likelihood.log_sigma.tolist() if hasattr(module.likelihood, "log_sigma") else None,
        "log_temperature": module.likelihood.log_temperature.tolist(),
    }


def weights(module: Model) -> List[list]:
    return [p.detach().reshape(-1).tolist() for p in module.net.parameters()]


def metric(trainer: pl.Trainer, key: str = "marglik") -> Optional[float]:
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


class Recorder(Callback):
    """After MargLikCallback in each epoch: the hyperparameters, ``marglik`` and the weights."""

    def __init__(self) -> None:
        self.epochs: List[Dict[str, Any]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        self.epochs.append(
            {
                "epoch": trainer.current_epoch,
                "marglik": metric(trainer),
                "buffers": buffers(pl_module),
                "weights": weights(pl_module),
                "seen": pl_module.seen,
                "sampler": type(sampler).__name__,
                "sampler_total_size": getattr(sampler, "total_size", None),
                "dtype": str(next(pl_module.net.parameters()).dtype),
                "flushing": flushing_denormals(),  # MargLikCallback flushes denormals for the fit
            }
        )


# --------------------------------------------------------------------------------------------
# modes
# --------------------------------------------------------------------------------------------


COLLECTIVES: List[List[str]] = []


def _count_collectives() -> None:
    """Record the collectives of every ``reduce_statistics`` call (one list per estimate)."""
    from lightning_marglik.callbacks import core  # where the callbacks call reduce_statistics

    original = core.reduce_statistics

    class Counting:
        def __init__(self, strategy, calls):
            self._strategy, self._calls = strategy, calls

        def __getattr__(self, name):
            return getattr(self._strategy, name)

        def reduce(self, tensor, *args, **kwargs):
            self._calls.append(f"reduce:{tensor.numel()}")
            return self._strategy.reduce(tensor, *args, **kwargs)

        def all_gather(self, tensor, *args, **kwargs):
            self._calls.append(f"all_gather:{tensor.numel()}")
            return self._strategy.all_gather(tensor, *args, **kwargs)

    def counted(stats, strategy):
        calls: List[str] = []
        COLLECTIVES.append(calls)
        return original(stats, Counting(strategy, calls))

    core.reduce_statistics = counted


def run_evidence_cases(out: Path) -> Dict[str, Any]:
    _count_collectives()
    results = {}
    for name, (_, _, structure, approx, _, source) in CASES.items():
        module, dataset = make_case(name)
        module.evidence_data = dataset
        evidence_data: Any = {
            None: None,
            "loader": DataLoader(dataset, batch_size=5, shuffle=True),
            "method": "evidence_dataloader",
        }[source]
        callback = MargLikCallback(structure=structure, approx=approx, frequency=1, steps=0, dataloader=evidence_data, settle=None)
        recorder = Recorder()
        trainer = ddp_trainer(out, [callback, recorder], max_epochs=1)
        if trainer.global_rank == 0:
            torch.save({"state_dict": module.state_dict(), "x": dataset.tensors[0], "y": dataset.tensors[1]},
                       out / f"case-{name}.pt")
        trainer.fit(module, train_dataloaders=train_loader(dataset))
        ev = callback.evidence
        assert ev is not None
        results[name] = {
            "log_marglik": ev.log_marglik().item(),
            "log_likelihood": ev.log_likelihood().item(),
            "log_prior": ev.log_prior().item(),
            "log_det": ev.log_det().item(),
            "n_data": ev.n_data,
            "likelihood_statistics": {k: v.item() for k, v in ev.likelihood_statistics.items()},
            "counted_at_setup": module.counted,
            "last_marglik": callback.last_marglik,
            "logged_marglik": metric(trainer),
            "estimations": callback.estimations,
            "epoch": recorder.epochs[-1],
            "world_size": trainer.world_size,
            # full structure: whether the determinant lemma (rows kept) or the Gram matrix was used
            "regime": None if structure != "full" else ("woodbury" if ev.structures[0].gram is None else "gram"),
            "collectives": COLLECTIVES.pop() if COLLECTIVES else None,
        }
    return results


class JumpingLR(Model):
    """Adam at ``lr`` for the first ``good_epochs`` epochs, then at 100 x ``lr``: the weights
    degrade, so the evidence falls after the best epoch and early stopping fires."""

    good_epochs = 2

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 if e < self.good_epochs else 100.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


def run_training(out: Path) -> Dict[str, Any]:
    """A few epochs, F=1, K=20, with MargLikCheckpoint and MargLikEarlyStopping(patience=1)."""
    sizes = [3, 16, 2]
    dataset = make_data(sizes, "regression", 101, seed=1)
    module = JumpingLR(make_net(sizes, seed=1), "regression", n_data=101, prior_structure="layerwise", lr=1e-2)
    callback = MargLikCallback(structure="kron", approx="ggn", frequency=1, steps=20, lr=0.1, settle=None)
    checkpoint = MargLikCheckpoint(dirpath=str(out / "checkpoints"), filename="{epoch}-{marglik:.6f}", save_top_k=1)
    stopper = MargLikEarlyStopping(patience=1)
    recorder = Recorder()
    trainer = ddp_trainer(out, [callback, recorder, stopper, checkpoint], max_epochs=8)
    trainer.fit(module, train_dataloaders=train_loader(dataset, batch_size=16))
    return {
        "epochs": recorder.epochs,
        "history": callback.history,
        "best_marglik": callback.best_marglik,
        "best_epoch": callback.best_epoch,
        "final_marglik": callback.final_marglik,
        "estimations": callback.estimations,
        "logged_marglik": metric(trainer),
        "buffers": buffers(module),
        "weights": weights(module),
        "current_epoch": trainer.current_epoch,
        "should_stop": trainer.should_stop,
        "stopped_epoch": stopper.stopped_epoch,
        "wait_count": stopper.wait_count,
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": None if checkpoint.best_model_score is None else float(checkpoint.best_model_score),
        "max_epochs": trainer.max_epochs,
        "package": PACKAGE,
        "trainer_checkpoint_is_ours": trainer.checkpoint_callback is checkpoint,
        "trainer_early_stopping_is_ours": trainer.early_stopping_callback is stopper,
        "flushing_after": flushing_denormals(),
    }


# A training sampler over a subset of the 37 examples (15, odd: Lightning's wrapper pads it to 16).
# name: Trainer(use_distributed_sampler=...): True wraps the sampler in a DistributedSamplerWrapper,
# False leaves every rank with the user's SubsetRandomSampler.
SAMPLER_CASES = {"sampler-wrapped": True, "sampler-own": False}
SAMPLER_SUBSET = list(range(0, N_EVIDENCE, 3)) + [1, 2]
SAMPLER_MODEL = "diag-ggn-regression"  # weights and data of this evidence case (lr 0: they stay)
OWN_SHARDS = "shards-own"


def run_sampler_cases(out: Path) -> Dict[str, Any]:
    """One fit per case (K=0): the evidence must cover the sampler's subset, unpadded."""
    results = {}
    for name, use_distributed_sampler in SAMPLER_CASES.items():
        module, dataset = make_case(SAMPLER_MODEL)
        structure, approx = CASES[SAMPLER_MODEL][2:4]
        callback = MargLikCallback(structure=structure, approx=approx, frequency=1, steps=0, settle=None)
        recorder = Recorder()
        trainer = ddp_trainer(out, [callback, recorder], max_epochs=1, use_distributed_sampler=use_distributed_sampler)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=SubsetRandomSampler(SAMPLER_SUBSET))
        trainer.fit(module, train_dataloaders=loader)
        ev = callback.evidence
        assert ev is not None
        results[name] = {"log_marglik": ev.log_marglik().item(), "n_data": ev.n_data, "epoch": recorder.epochs[-1]}
    # every rank its own shard (use_distributed_sampler=False, no sampler of the user's): the evidence covers both
    module, dataset = make_case(SAMPLER_MODEL)
    structure, approx = CASES[SAMPLER_MODEL][2:4]
    callback = MargLikCallback(structure=structure, approx=approx, frequency=1, steps=0, settle=None)
    trainer = ddp_trainer(out, [callback], max_epochs=1, use_distributed_sampler=False)
    shard = Subset(dataset, range(int(os.environ.get("LOCAL_RANK", 0)), N_EVIDENCE, 2))
    trainer.fit(module, train_dataloaders=DataLoader(shard, batch_size=BATCH))
    results[OWN_SHARDS] = {"log_marglik": callback.evidence.log_marglik().item(), "n_data": callback.evidence.n_data}
    return results


GUARD_CASE = "kron-ggn-classification"  # the prior guard's case: its weights (lr 0) and data


def run_guard_case(out: Path) -> Dict[str, Any]:
    """Two epochs (K=5): the prior guard scores the first epoch's estimate over both ranks' folds."""
    module, dataset = make_case(GUARD_CASE)
    callback = MargLikCallback(frequency=1, steps=5, settle=None)
    recorder = Recorder()
    trainer = ddp_trainer(out, [callback, recorder], max_epochs=2)
    trainer.fit(module, train_dataloaders=train_loader(dataset))
    return {"decisions": callback.guard_decisions, "after_first": recorder.epochs[0]["buffers"]}


ERROR_CASES = ["error-setup", "error-batch", "error-collect"]


def popen(out: Path) -> None:
    """Evidence cases, training, sampler cases, then the error cases: the run ends with an error by design."""
    results = {"evidence": run_evidence_cases(out), "train": run_training(out), "samplers": run_sampler_cases(out),
               "guard": run_guard_case(out)}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    results["rank"] = rank
    write_result(out, f"popen-rank{rank}.json", results)
    errors(out, ERROR_CASES)


class SpawnRecorder(Callback):
    """Writes, from inside each spawned rank, what that rank holds at the end of training."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        marglik = next(c for c in trainer.callbacks if isinstance(c, MargLikCallback))
        write_result(
            Path(self.out),
            f"spawn-rank{trainer.global_rank}.json",
            {
                "buffers": buffers(pl_module),
                "weights": weights(pl_module),
                "history": marglik.history,
                "best_marglik": marglik.best_marglik,
                "estimations": marglik.estimations,
                "logged_marglik": metric(trainer),
                "current_epoch": trainer.current_epoch,
                "pid": os.getpid(),
            },
        )


def spawn(out: Path) -> None:
    sizes = [3, 16, 2]
    dataset = make_data(sizes, "regression", 37, seed=2)
    module = Model(make_net(sizes, seed=2), "regression", n_data=37, lr=1e-2)
    before = buffers(module)
    callback = MargLikCallback(structure="diag", approx="ggn", frequency=1, steps=20, lr=0.1, settle=None)
    checkpoint = MargLikCheckpoint(dirpath=str(out / "spawn-checkpoints"), save_top_k=1)
    trainer = ddp_trainer(out, [callback, SpawnRecorder(str(out)), checkpoint], max_epochs=2, start_method="spawn")
    trainer.fit(module, train_dataloaders=train_loader(dataset))
    write_result(
        out,
        "spawn-main.json",
        {
            "buffers_before": before,
            "buffers": buffers(module),
            "weights": weights(module),
            "history": callback.history,
            "best_marglik": callback.best_marglik,
            "estimations": callback.estimations,
            "logged_marglik": metric(trainer),
            "callback_metrics": sorted(trainer.callback_metrics),
            "current_epoch": trainer.current_epoch,
            "best_model_path": checkpoint.best_model_path,
            "pid": os.getpid(),
        },
    )


class OddBatchesAreBad(Dataset):
    """Odd indices (rank 1's evidence shard) yield ``(x, y, extra)`` triples once ``armed``."""

    def __init__(self, dataset: TensorDataset, armed: bool = True) -> None:
        self.dataset = dataset
        self.armed = armed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        x, y = self.dataset[i]
        return (x, y) if i % 2 == 0 or not self.armed else (x, y, x)


class Clock(Callback):
    """Placed before MargLikCallback: when this rank entered the evidence pass; arms ``bad`` then."""

    def __init__(self, bad: Optional[OddBatchesAreBad] = None) -> None:
        self.entered: Optional[float] = None
        self.bad = bad

    def on_train_epoch_end(self, trainer, pl_module):
        self.entered = time.time()
        if self.bad is not None:
            self.bad.armed = True


def failing_fit(out: Path, case: str, catch: bool) -> None:
    """One fit in which rank 1 (only) fails at set-up or in the evidence pass of the first epoch.

    ``error-setup``: rank 1's evidence shard yields ``(x, y, extra)`` batches (set-up check).
    ``error-batch``: the same from the end of the first epoch (evidence pass).
    ``error-collect``: the network's eval-mode forward raises on rank 1 after the first step.
    ``error-loader``: building the evidence loader (``dataloader="evidence_dataloader"``) raises
    on rank 1, before the evidence pass.
    Each rank writes ``<case>-rank<r>.json`` (error, time entering the estimate, time failing).
    """
    sizes = [3, 8, 2]
    dataset = make_data(sizes, "regression", N_EVIDENCE, seed=3)
    module = Model(make_net(sizes, seed=3), "regression", N_EVIDENCE, lr=1e-2)
    loader: Any = None
    bad: Optional[OddBatchesAreBad] = None
    if case in ("error-setup", "error-batch"):
        bad = OddBatchesAreBad(dataset, armed=case == "error-setup")
        loader = DataLoader(bad, batch_size=BATCH)
    elif case == "error-collect":
        module.fail_in_evidence_on_rank = 1
    elif case == "error-loader":
        def evidence_dataloader():
            if module.trainer.global_rank == 1:
                raise RuntimeError("injected failure building the evidence loader on rank 1")
            return DataLoader(dataset, batch_size=BATCH)

        module.evidence_dataloader = evidence_dataloader  # type: ignore[method-assign]
        loader = "evidence_dataloader"
    else:
        raise SystemExit(f"unknown error case {case!r}")
    clock = Clock(bad)
    callback = MargLikCallback(structure="diag", approx="ggn", frequency=1, steps=5, dataloader=loader, settle=None)
    trainer = ddp_trainer(out, [clock, callback], max_epochs=3)
    record: Dict[str, Any] = {"type": None, "message": None}
    try:
        trainer.fit(module, train_dataloaders=train_loader(dataset))
    except Exception as exc:
        record = {"type": type(exc).__name__, "message": str(exc), "epoch": trainer.current_epoch,
                  "entered": clock.entered, "failed": time.time(), "flushing_after": flushing_denormals()}
        if not catch:
            write_result(out, f"{case}-rank{trainer.global_rank}.json", record)
            raise
    write_result(out, f"{case}-rank{trainer.global_rank}.json", record)


def errors(out: Path, cases: List[str]) -> None:
    """Every case but the last is caught (both ranks continue to the next fit, which only works if
    both failed at the same point); the last propagates, so both processes exit with an error."""
    for i, case in enumerate(cases):
        failing_fit(out, case, catch=i < len(cases) - 1)


def main(argv: List[str]) -> None:
    mode, out = argv[1], Path(argv[2])
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*must be a positive integer.*")
    if mode == "popen":
        popen(out)
    elif mode == "spawn":
        spawn(out)
    elif mode == "train":
        write_result(out, f"train-rank{int(os.environ.get('LOCAL_RANK', '0'))}.json", {"train": run_training(out)})
    elif mode == "errors":
        errors(out, argv[3:] or ERROR_CASES)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    run_worker(lambda: main(sys.argv))
