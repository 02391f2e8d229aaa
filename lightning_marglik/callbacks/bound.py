"""The logic of ``MargLikBoundCallback``: a hyperparameter step on a stochastic evidence bound
every ``k`` training batches (Immer et al., ICML 2023), shared by both Lightning packages.

It shares :class:`~.estimating.EstimatorCore` with ``MargLikCallback`` (set-up checks, the count of
``N``, the scale-invariant treatment, resume, the estimates ``MargLikCheckpoint`` and
``MargLikEarlyStopping`` act on), on a :class:`~.schedule.BatchSchedule` instead of the epoch
schedule: after every ``k``-th batch, :class:`~lightning_marglik.bounds.BoundOptimizer` computes
the bound on that training batch at the current weights, all-reduces its gradient over
processes (each process's batch is one part of the data) and takes one Adam step. At the end of
each epoch with steps, the mean of that epoch's estimates is the epoch's ``marglik``.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional, Union

import torch

from ..bounds import BoundOptimizer, check_bound_options, check_no_hyperprior
from ..curvature import CurvatureOptions
from .arguments import BOUND_KEYWORDS
from .averaging import averaging_callbacks
from .estimating import EstimatorCore
from .package import LightningModule, MargLikConfigurationError, Trainer
from .report import announce_end
from .schedule import BatchSchedule
from .sharding import whole_parameters

__all__ = ["MargLikBoundCallbackCore"]


class MargLikBoundCallbackCore(EstimatorCore):
    """The logic of ``MargLikBoundCallback``, combined with a package's ``Callback``.

    Documented on ``lightning_marglik.MargLikBoundCallback``; the subclass sets ``_package``.
    """

    schedule: BatchSchedule
    _foreign_keywords = BOUND_KEYWORDS

    def __init__(
        self,
        bound: str = "parametric",
        structure: str = "kron",
        approx: str = "ggn",
        every_k_batches: int = 1,
        burnin: int = 0,
        lr: float = 0.1,
        subset_size: Optional[int] = None,
        mc_samples: Union[int, str] = 0,
        seed: int = 0,
        backend: str = "hooks",
        scale_invariant: str = "decoupled",
        flush_denormals: bool = True,
    ) -> None:
        check_bound_options(bound, structure, subset_size, backend)
        if bound == "ntk":  # the set-up check's evidence pass on one batch: kernel form, never refused for P
            options = CurvatureOptions("full", approx, mc_samples, max_memory=sys.maxsize)
        else:
            options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
        schedule = BatchSchedule(every_k_batches, burnin)
        super().__init__(options, schedule, lr, seed, scale_invariant, flush_denormals=flush_denormals)
        self.bound = bound
        self.subset_size = subset_size
        self.every_k_batches = schedule.every
        self._optimizer: Optional[BoundOptimizer] = None
        self._epoch_values: List[float] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # before training, not at the first step: the prior is found by now
            try:
                check_no_hyperprior(self._hyperparameters()[0])
            except ValueError as err:
                raise MargLikConfigurationError(f"{type(self).__name__}: {err}") from err
        averaging = averaging_callbacks(trainer) if stage == "fit" else []
        if averaging:  # its steps write the hyperparameters at every k-th batch, and it has no evidence pass
            raise MargLikConfigurationError(
                f"MargLikBoundCallback with {type(averaging[0]).__name__}: its marglik is a mean of bounds at the "
                "trained weights, and it has no estimate of the averaged weights the fit returns. Use MargLikCallback "
                "with weight averaging (its final estimate is the evidence of the averaged weights), or no averaging."
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        burnin, epochs = self.schedule.burnin, trainer.max_epochs
        if epochs is not None and epochs >= 0 and burnin >= epochs:
            raise MargLikConfigurationError(
                f"MargLikBoundCallback(burnin={burnin}), but the fit trains {epochs} epochs (max_epochs): no epoch is "
                f"left for a hyperparameter step; choose burnin < {epochs}, or more epochs."
            )
        batches = trainer.num_training_batches
        if math.isfinite(batches) and batches < self.every_k_batches:
            raise MargLikConfigurationError(
                f"MargLikBoundCallback(every_k_batches={self.every_k_batches}), but an epoch has {int(batches)} training "
                f"batches: the count restarts every epoch, so no hyperparameter step would ever be taken; choose "
                f"every_k_batches <= {int(batches)}."
            )
        # set-up checks, N on the prior, a changed set of learnables, the set-up line (after every refusal)
        super().on_train_start(trainer, pl_module)
        prior, likelihood = self._hyperparameters()
        # the set-up pass resolved mc_samples="auto" (self.options): the steps run what the set-up line names
        self._optimizer = BoundOptimizer(
            likelihood, prior, bound=self.bound, structure=self.structure, approx=self.approx,
            mc_samples=self.options.mc_samples, subset_size=self.subset_size, lr=self.lr,
            batch_fn=self._batch_fn(pl_module), backend=self.options.backend,
        )
        self._optimizer.load_state_dict(self._optimizer_state)
        self._epoch_values = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # before the bound's own penalty
        if not self.schedule.is_due(trainer, batch_idx):
            return
        assert self._optimizer is not None
        strategy = trainer.strategy
        generator = self._seeded(trainer, trainer.global_step) if self.options.mc_samples else None

        def all_reduce(flat: torch.Tensor) -> torch.Tensor:
            return strategy.reduce(flat.to(strategy.root_device), reduce_op="sum")

        with whole_parameters(trainer):  # under FSDP: the step's forward needs whole weights, on every rank
            value = self._optimizer.step(pl_module, batch, generator, all_reduce if trainer.world_size > 1 else None)
        self._optimizer_signature = self._learnable_signature()
        self._epoch_values.append(value)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epoch_values:  # none in burn-in, or with fewer than k batches
            self._log(pl_module, self._close_epoch(trainer, epoch=trainer.current_epoch + 1))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """No evidence pass: the final value is that of the last (possibly partial) epoch's steps."""
        if self._epoch_values:  # training stopped within an epoch (max_steps, max_time)
            self._close_epoch(trainer, epoch=trainer.current_epoch + 1)
        self.final_marglik = self.last_marglik
        self.summary = announce_end(self)

    def _close_epoch(self, trainer: Trainer, epoch: int) -> float:
        """The mean of the epoch's bound estimates per datum as its ``marglik`` (NaN if none is finite)."""
        finite = [v for v in self._epoch_values if math.isfinite(v)]
        marglik = sum(finite) / len(finite) if finite else math.nan
        steps, self._epoch_values = len(self._epoch_values), []
        return self._record_estimate(trainer, epoch, marglik, steps=steps)

    def state_dict(self) -> Dict[str, Any]:
        if self._optimizer is not None:
            self._optimizer_state = self._optimizer.state_dict()
        return super().state_dict()
