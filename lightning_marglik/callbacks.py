"""Algorithm 1 of Immer et al. (2021) as Lightning callbacks.

``MargLikCallback`` estimates the evidence after every ``frequency``-th epoch past ``burnin``
and takes hyperparameter steps; ``MargLikCheckpoint`` and ``MargLikEarlyStopping`` act on those
estimates only (never on a stale value, never during burn-in).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from .curvature import check_model, check_options, collect_statistics
from .distributed import evidence_loader, reduce_statistics, run_on_all_ranks
from .evidence import LaplaceEvidence
from .hyperparameters import GaussianPrior, Likelihood

__all__ = ["MargLikCallback", "MargLikCheckpoint", "MargLikEarlyStopping"]

MONITOR = "marglik"


def _positive_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    return value


class MargLikCallback(Callback):
    """Learn prior precisions, noise and temperature by the Laplace evidence during training.

    After epoch ``e`` (counted from 1) with ``e > burnin`` and ``e % frequency == 0``, and after
    the last epoch of ``max_epochs``, the callback computes the evidence over the whole training
    set at the current weights, takes ``steps`` Adam steps on the log hyperparameters, writes them
    into the ``GaussianPrior`` and ``Likelihood`` registered on the LightningModule, and logs
    ``marglik`` (log evidence per datum, after the update) with every hyperparameter. If training
    ends otherwise (``max_steps``, ``max_time``, early stopping on another metric) after epochs
    without an estimate, a final estimate is made in ``on_train_end`` (``final_marglik``).

    The LightningModule's ``forward(x)`` must return the network outputs, its prior must cover
    all trainable parameters, and its loss should be :func:`lightning_marglik.map_loss`.

    Args:
        structure: Curvature structure, ``"kron"``, ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` or ``"ef"``.
        frequency: Estimate every ``frequency`` epochs (``F``).
        burnin: Epochs before the first estimate (``B``).
        steps: Adam steps per estimate (``K``).
        lr: Adam learning rate on the log hyperparameters (``gamma``).
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact).
        dataloader: Data for the evidence pass (e.g. the training set without augmentation): a
            ``DataLoader``, or the name of a method of the LightningModule or DataModule that
            returns one (usable from YAML). Default: the trainer's training data.
        seed: Seed of the Monte-Carlo samples (the estimate of epoch ``e`` uses ``seed + e``).

    Raises:
        ValueError: On an invalid argument (the message names it).

    Example:
        >>> callback = MargLikCallback(structure="diag", approx="ef", frequency=5, steps=100)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False)
    """

    def __init__(
        self,
        structure: str = "kron",
        approx: str = "ggn",
        frequency: int = 1,
        burnin: int = 0,
        steps: int = 100,
        lr: float = 0.1,
        mc_samples: int = 0,
        dataloader: Union[DataLoader, str, None] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_options(structure, approx, mc_samples)
        self.structure = structure
        self.approx = approx
        self.frequency = _positive_int(frequency, "frequency", 1)
        self.burnin = _positive_int(burnin, "burnin", 0)
        self.steps = _positive_int(steps, "steps", 0)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"`lr` must be a positive finite number, got {lr!r}.")
        self.lr = float(lr)
        self.mc_samples = mc_samples
        if dataloader is not None and not isinstance(dataloader, (DataLoader, str)):
            raise ValueError(f"`dataloader` must be a DataLoader or a method name, got {type(dataloader).__name__}.")
        self.dataloader = dataloader
        self.seed = _positive_int(seed, "seed", 0)
        self.prior: Optional[GaussianPrior] = None
        self.likelihood: Optional[Likelihood] = None
        self.evidence: Optional[LaplaceEvidence] = None
        self._reset_state()

    def _reset_state(self) -> None:
        self.estimations = 0
        self.last_estimate_epoch = -1
        self.last_marglik = math.nan
        self.best_marglik = -math.inf
        self.best_epoch = -1
        self.final_marglik = math.nan
        self.history: List[Dict[str, float]] = []
        self._optimizer_state: dict = {}
        self._last_estimate_step = -1

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self.prior, self.likelihood = find_hyperparameters(pl_module)
        check_model(pl_module, self.prior, self.structure)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                if group.get("weight_decay", 0):
                    rank_zero_warn(
                        f"{type(optimizer).__name__} has weight_decay={group['weight_decay']}: the GaussianPrior "
                        "already regularizes the weights (map_loss), so the prior is counted twice; set "
                        "weight_decay=0."
                    )
                    return

    # --- Algorithm 1 -------------------------------------------------------------------------

    def is_estimation_epoch(self, trainer: "pl.Trainer") -> bool:
        """Whether the epoch now ending (``trainer.current_epoch + 1``) gets an estimate."""
        epoch = trainer.current_epoch + 1
        return (epoch > self.burnin and epoch % self.frequency == 0) or epoch == trainer.max_epochs

    def is_fresh(self, trainer: "pl.Trainer") -> bool:
        """Whether ``marglik`` was estimated in the epoch now ending."""
        return self.last_estimate_epoch == trainer.current_epoch

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.is_estimation_epoch(trainer):
            return
        marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch + 1)
        self.last_estimate_epoch = trainer.current_epoch
        if marglik > self.best_marglik:
            self.best_marglik, self.best_epoch = marglik, trainer.current_epoch
        for key, value in self.logged_values(marglik).items():
            # identical on every rank: the sync is exact and keeps Lightning's DDP logging contract
            pl_module.log(key, value, prog_bar=key == MONITOR, on_step=False, on_epoch=True, sync_dist=True)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.global_step == self._last_estimate_step:
            self.final_marglik = self.last_marglik
            return
        # trainer.current_epoch counts the completed epochs here
        self.final_marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics(self.logged_values(self.final_marglik), step=trainer.global_step)

    def estimate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", epoch: int) -> float:
        """Evidence pass, all-reduce, ``steps`` hyperparameter steps; returns log evidence / N.

        Runs the same collectives on every rank. A non-finite evidence leaves the hyperparameters
        unchanged and returns NaN (``MargLikEarlyStopping`` stops on it).

        Args:
            trainer: The trainer (its strategy runs the collectives).
            pl_module: The module whose forward the evidence pass calls.
            epoch: Number of the epoch (from 1) the estimate follows, for ``history`` and the
                Monte-Carlo seed.

        Returns:
            The log evidence per datum after the hyperparameter steps (NaN if not finite).
        """
        assert self.prior is not None and self.likelihood is not None
        strategy = trainer.strategy
        rank, world = trainer.global_rank, trainer.world_size
        # distinct Monte-Carlo draws on every rank, reproducible for a given (seed, epoch, rank)
        generator = torch.Generator().manual_seed((self.seed + epoch) * world + rank) if self.mc_samples else None

        def local_pass():  # everything that can fail on one rank only, before the first collective
            loader = evidence_loader(self._source_loader(trainer, pl_module), rank, world)
            return collect_statistics(
                pl_module, loader, self.likelihood, self.prior, self.structure, self.approx, self.mc_samples, generator
            )

        stats = reduce_statistics(run_on_all_ranks(strategy, local_pass), strategy)
        evidence = LaplaceEvidence.from_statistics(stats, self.likelihood, self.prior)
        self.evidence = evidence
        if not torch.isfinite(evidence.log_marglik().detach()):
            rank_zero_warn("The evidence is not finite at the current weights; hyperparameters left unchanged.")
            marglik = math.nan
        else:
            value = evidence.optimize(self.steps, self.lr, state=self._optimizer_state)
            self._optimizer_state = evidence.optimizer_state
            for buffer in self._buffers():
                buffer.copy_(strategy.broadcast(buffer, src=0))  # bit-identical on every rank
            marglik = value.item() / evidence.n_data
        self.estimations += 1
        self._last_estimate_step = trainer.global_step
        self.last_marglik = marglik
        self.history.append({"epoch": epoch, "step": trainer.global_step, MONITOR: marglik})
        return marglik

    # --- helpers -----------------------------------------------------------------------------

    def _buffers(self) -> List[torch.Tensor]:
        assert self.prior is not None and self.likelihood is not None
        return [self.prior.log_precision, *self.likelihood.hyperparameters().values()]

    def _source_loader(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> DataLoader:
        if isinstance(self.dataloader, DataLoader):
            return self.dataloader
        if isinstance(self.dataloader, str):
            owner = trainer.datamodule if hasattr(trainer.datamodule, self.dataloader) else pl_module
            method: Optional[Callable[[], DataLoader]] = getattr(owner, self.dataloader, None)
            if method is None:
                raise MisconfigurationException(
                    f"MargLikCallback(dataloader={self.dataloader!r}): neither the DataModule nor the "
                    "LightningModule has such a method."
                )
            return method()
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            raise MisconfigurationException(
                "MargLikCallback needs one training DataLoader of (x, y) batches; pass `dataloader=` "
                f"for the evidence pass (got {type(loader).__name__})."
            )
        return loader

    def logged_values(self, marglik: float) -> Dict[str, float]:
        """What the callback logs for an estimate: ``marglik`` and every hyperparameter by name."""
        assert self.prior is not None and self.likelihood is not None
        out = {MONITOR: marglik}
        prior = self.prior
        if prior.structure == "scalar":
            out["prior_precision"] = prior.precision.item()
        else:
            per_tensor = torch.split(prior.per_parameter(prior.log_precision), prior.param_sizes)
            for name, log_prec in zip(prior.param_names, per_tensor):
                out[f"prior_precision/{name}"] = log_prec.mean().exp().item()  # geometric mean if diagonal
        for name, log_value in self.likelihood.hyperparameters().items():
            out[name[len("log_"):]] = log_value.exp().item()
        return out

    # --- resume ------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {
            "estimations": self.estimations,
            "last_estimate_epoch": self.last_estimate_epoch,
            "last_marglik": self.last_marglik,
            "best_marglik": self.best_marglik,
            "best_epoch": self.best_epoch,
            "history": list(self.history),
            "optimizer_state": self._optimizer_state,
            "last_estimate_step": self._last_estimate_step,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.estimations = state_dict["estimations"]
        self.last_estimate_epoch = state_dict["last_estimate_epoch"]
        self.last_marglik = state_dict["last_marglik"]
        self.best_marglik = state_dict["best_marglik"]
        self.best_epoch = state_dict["best_epoch"]
        self.history = list(state_dict["history"])
        self._optimizer_state = state_dict["optimizer_state"]
        self._last_estimate_step = state_dict["last_estimate_step"]


def find_hyperparameters(pl_module: torch.nn.Module) -> "tuple[GaussianPrior, Likelihood]":
    """The one ``GaussianPrior`` and one ``Likelihood`` registered on ``pl_module``.

    Raises:
        MisconfigurationException: If there is not exactly one of each, saying what to add.
    """
    priors = [m for m in pl_module.modules() if isinstance(m, GaussianPrior)]
    likelihoods = [m for m in pl_module.modules() if isinstance(m, Likelihood)]
    if len(priors) != 1 or len(likelihoods) != 1:
        raise MisconfigurationException(
            f"MargLikCallback needs exactly one GaussianPrior and one Likelihood on the LightningModule, found "
            f"{len(priors)} and {len(likelihoods)}: add e.g. `self.prior = GaussianPrior(self.net)` and "
            "`self.likelihood = CategoricalLikelihood()` in __init__ and use map_loss in training_step."
        )
    return priors[0], likelihoods[0]


class _FollowsEstimates(Callback):
    """Mixin of the callbacks that act on ``MargLikCallback``'s estimates: finds it at set-up."""

    _marglik: MargLikCallback

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            found = [c for c in trainer.callbacks if isinstance(c, MargLikCallback)]  # type: ignore[attr-defined]
            if len(found) != 1:
                raise MisconfigurationException(
                    f"{type(self).__name__} needs exactly one MargLikCallback in the Trainer's callbacks."
                )
            self._marglik = found[0]


class MargLikCheckpoint(_FollowsEstimates, ModelCheckpoint):
    """Keep the best-evidence model(s) instead of validation-based checkpointing.

    Acts only at the end of training epochs in which ``MargLikCallback`` estimated the evidence:
    never on a stale value, never during burn-in, independent of validation loops. A checkpoint
    holds the weights and (as module buffers) the hyperparameters.

    Args:
        dirpath: Directory of the checkpoints (default: the logger's).
        filename: File name pattern, e.g. ``"{epoch}-{marglik:.3f}"``.
        save_top_k: How many of the best-evidence models to keep.
        save_last: Also keep ``last.ckpt`` of the latest estimation epoch.
        verbose: Print a line per save.

    Example:
        >>> checkpoint = MargLikCheckpoint(save_top_k=1, save_last=True)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[MargLikCallback(), checkpoint], logger=False)
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        save_top_k: int = 1,
        save_last: Optional[bool] = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=MONITOR,
            mode="max",
            save_top_k=save_top_k,
            save_last=save_last,
            verbose=verbose,
            save_on_train_epoch_end=True,
        )

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._marglik.is_fresh(trainer):
            super().on_train_epoch_end(trainer, pl_module)


class MargLikEarlyStopping(_FollowsEstimates, EarlyStopping):
    """Stop training when the evidence stops improving, without validation data.

    Patience counts *estimations* (every ``frequency`` epochs), not epochs. Stops with a message
    on a non-finite evidence. Its counters are saved in checkpoints and restored on resume.

    Args:
        patience: Estimations without an improvement of more than ``min_delta`` before stopping.
        min_delta: Smallest increase of ``marglik`` (log evidence per datum) that counts.
        verbose: Print a line per check.

    Example:
        >>> stopper = MargLikEarlyStopping(patience=3, min_delta=1e-3)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[MargLikCallback(), stopper], logger=False)
    """

    def __init__(self, patience: int = 3, min_delta: float = 0.0, verbose: bool = False) -> None:
        _positive_int(patience, "patience", 1)
        if not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"`min_delta` must be a finite number >= 0, got {min_delta!r}.")
        super().__init__(
            monitor=MONITOR, min_delta=min_delta, patience=patience, mode="max", check_finite=True, verbose=verbose
        )

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._marglik.is_fresh(trainer):
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Never act on validation: the evidence comes from the training data."""
