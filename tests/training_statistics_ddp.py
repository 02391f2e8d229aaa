"""DDP worker of tests/test_training_statistics.py: statistics='training' on 2 CPU processes (gloo).

Lightning's ``ddp`` launcher re-executes this file for rank 1. Every rank writes
``OUT/rank<r>.json``: the estimate's log evidence, N, the reduced curvature sums and how many
collectives the reduction of the statistics ran.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests` importable

from lightning_marglik import (  # noqa: E402
    GaussianLikelihood, GaussianPrior, MargLikCallback, MargLikConfigurationError, map_loss,
)
from lightning_marglik.callbacks import core  # noqa: E402  (where the callbacks call reduce_statistics)
from tests.worker_harness import ddp, loader, two_processes, write_result  # noqa: E402

N = 40
ODD = 41  # "odd" (the second argument): a DistributedSampler repeats one example to divide them


def data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64))


def net() -> nn.Sequential:
    torch.manual_seed(0)
    # float64 at construction: the same draws whatever the default dtype (the tests' is float64)
    return nn.Sequential(nn.Linear(3, 6, dtype=torch.float64), nn.Tanh(), nn.Linear(6, 2, dtype=torch.float64))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.prior = GaussianPrior(self.net, structure="layerwise")
        self.likelihood = GaussianLikelihood()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main(out: Path, odd: bool = False) -> None:
    collectives = []
    original = core.reduce_statistics

    def counted(stats, strategy):
        calls = [0]

        class Counting:
            def __getattr__(self, name):
                return getattr(strategy, name)

            def reduce(self, *args, **kwargs):
                calls[0] += 1
                return strategy.reduce(*args, **kwargs)

            def all_gather(self, *args, **kwargs):
                calls[0] += 1
                return strategy.all_gather(*args, **kwargs)

        result = original(stats, Counting())
        collectives.append(calls[0])
        return result

    core.reduce_statistics = counted
    callback = MargLikCallback(structure="kron", approx="ef", steps=0, statistics="training")
    strategy = ddp(pl, timeout=datetime.timedelta(seconds=120))
    trainer = two_processes(pl, out, strategy, [callback], max_epochs=1, precision="64-true")
    module = Model()
    if odd:  # refused at set-up, on every rank
        try:
            trainer.fit(module, loader(data(ODD)))
        except MargLikConfigurationError as refused:
            write_result(out, f"rank{trainer.global_rank}.json", {"refused": str(refused)})
        return
    trainer.fit(module, loader(data()))
    evidence = callback.evidence
    payload = {
        "log_marglik": evidence.log_marglik().item(),
        "n_data": evidence.n_data,
        "states": {f"{i}.{k}": v.tolist() for i, s in enumerate(evidence.structures) for k, v in s.states().items()},
        "collectives": collectives,
    }
    write_result(out, f"rank{trainer.global_rank}.json", payload)


if __name__ == "__main__":
    main(Path(sys.argv[1]), odd=sys.argv[2:] == ["odd"])
