"""The callbacks that act on the estimates: the best-evidence checkpoint and early stopping.

They act at the end of the training epochs whose estimate is fresh (the estimating callback's
:meth:`Schedule.is_fresh <.schedule.Schedule.is_fresh>`): never on a stale value, never during
burn-in, independent of validation loops.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import uuid
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch
from fsspec.core import url_to_fs

from ..distributed import run_on_all_ranks
from ..validators import flag, integer, number, optional
from .arguments import CHECKPOINT_KEYWORDS, STOPPING_KEYWORDS, KnownKeywords
from .estimating import EstimatorCore
from .package import MONITOR, LightningModule, LightningPackage, MargLikConfigurationError, Trainer, check_package

__all__ = ["CheckpointCore", "EarlyStoppingCore"]

log = logging.getLogger(__name__)

# Lightning's default is "{epoch}-{step}": a validation ModelCheckpoint in the same folder would write the same names
FILENAME = "marglik-{epoch}-{step}"


class _FollowsEstimates(KnownKeywords):
    """Mixin of the callbacks that act on the estimating callback's estimates: finds it at set-up."""

    _package: ClassVar[LightningPackage]
    _marglik: EstimatorCore
    # the attributes of one fit's record, which set-up resets and a fit that trains nothing gets back
    _RECORD: ClassVar[Tuple[str, ...]]
    _kept: Optional[Dict[str, Any]] = None

    _fitting = True  # whether Lightning last set up a fit: a checkpoint loaded outside one leaves the record

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_package(self, trainer)
        self._fitting = stage == "fit"
        if stage == "fit":  # before the subclass resets it: a fit that trains nothing keeps it (teardown)
            self._kept = {name: copy.deepcopy(getattr(self, name)) for name in self._RECORD}
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            found = [c for c in trainer.callbacks if isinstance(c, EstimatorCore)]
            if len(found) != 1:
                raise MargLikConfigurationError(
                    f"{type(self).__name__} needs exactly one MargLikCallback in the Trainer's callbacks."
                )
            self._marglik = found[0]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        self._kept = None  # this fit trains: its own record

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a checkpoint's record for a fit that resumes from it. Loaded to test, validate or predict
        (Lightning loads every callback's state for any stage), the checkpoint is the module's: the fit's record
        stays, so ``best_model_path`` still names the best-evidence model after ``ckpt_path=`` an earlier one."""
        if not self._fitting:
            return
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._kept = None  # a checkpoint's record

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """A fit that trained nothing (``fit`` again on a finished Trainer) gives the previous fit's record back, as
        the estimating callback does: its best file stays ``ckpt_path="best"``."""
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit" and self._kept is not None:
            for name, value in self._kept.items():
                setattr(self, name, value)
            self._kept = None


# ModelCheckpoint's record of one fit's files and scores (its state_dict's), as its __init__ leaves it
_BEST_STATE = ("current_score", "best_k_models", "kth_best_model_path", "kth_value", "best_model_score",
               "best_model_path", "last_model_path")


class CheckpointCore(_FollowsEstimates):
    """The logic of ``MargLikCheckpoint``, combined with a package's ``ModelCheckpoint``.

    Documented on ``lightning_marglik.MargLikCheckpoint``.
    """

    _RECORD = _BEST_STATE

    _foreign_keywords = CHECKPOINT_KEYWORDS

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        save_top_k: int = 1,
        save_last: Optional[bool] = None,
        verbose: bool = False,
    ) -> None:
        # Lightning reads a filename first at the first save after burn-in (a bad one fails the fit late), and its
        # TypeError for a dirpath names no option
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise ValueError(f"`dirpath` must be a directory (a str or path), or None for the logger's, got "
                             f"{dirpath!r}.")
        if filename is not None and not isinstance(filename, str):
            raise ValueError(f"`filename` must be a str pattern such as '{{epoch}}-{{marglik:.3f}}', or None for "
                             f"{FILENAME!r}, got {filename!r}.")
        # not Lightning's save_last="link": last.ckpt must hold the epoch now ending, not the latest best file
        save_last = optional(flag, save_last, "save_last", what="write last.ckpt after every epoch with finite weights")
        super().__init__(  # type: ignore[call-arg]
            dirpath=dirpath,
            filename=filename or FILENAME,  # Lightning's for "" would be a validation ModelCheckpoint's names
            monitor=MONITOR,
            mode="max",
            save_top_k=integer(save_top_k, "save_top_k", -1, what="the best-evidence models kept; -1: all, 0: none"),
            save_last=save_last,
            verbose=flag(verbose, "verbose", what="log a line per save"),
            save_on_train_epoch_end=True,
        )
        self._unfitted = {name: copy.deepcopy(getattr(self, name)) for name in _BEST_STATE}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # resolves dirpath (by default the logger's)
        if stage == "fit":
            # a new fit keeps its own best (a resumed one restores it after setup): reused in a second Trainer, the
            # first fit's best file stayed "best", and trainer.test(ckpt_path="best") loaded it into the new model
            for name, value in self._unfitted.items():
                setattr(self, name, copy.deepcopy(value))
            run_on_all_ranks(trainer.strategy, lambda: self._check_writable(trainer))

    def _check_writable(self, trainer: Trainer) -> None:
        """Write and remove a file in ``dirpath`` (on rank 0, which saves): an unwritable directory
        fails when training starts, not at the first save after burn-in."""
        if not trainer.is_global_zero or self.dirpath is None:
            return
        fs, path = url_to_fs(str(self.dirpath))
        probe = f"{path.rstrip('/')}/.marglik-write-check-{uuid.uuid4().hex}"
        try:
            fs.makedirs(path, exist_ok=True)
            with fs.open(probe, "wb"):
                pass
            fs.rm(probe)
        except Exception as err:  # noqa: BLE001 - any failure to write is the problem reported
            raise MargLikConfigurationError(
                f"MargLikCheckpoint cannot write to dirpath={str(self.dirpath)!r} ({type(err).__name__}: {err}); "
                "pass a writable directory as `dirpath`, or none for the logger's directory."
            ) from err

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The best-evidence files after an epoch with a fresh, finite estimate; ``last.ckpt``
        (``save_last``) after every epoch, estimate or not, as Lightning's ``ModelCheckpoint`` once did:
        a job killed before the first estimate resumes from its last epoch. Never non-finite weights."""
        fresh = self._marglik.schedule.is_fresh(trainer)
        if not (fresh or self.save_last) or self._should_skip_saving_checkpoint(trainer):
            return
        # saving runs collectives: every rank must take the same decisions (the schedule and estimate are identical)
        weights = trainer.strategy.reduce_boolean_decision(_all_finite(pl_module), all=True)
        candidates = self._monitor_candidates(trainer)
        if fresh and weights and math.isfinite(self._marglik.last_marglik):
            self._save_topk_checkpoint(trainer, candidates)
        elif fresh and self.verbose:
            log.info(f"MargLikCheckpoint: epoch {trainer.current_epoch} not saved (non-finite evidence or weights).")
        if self.save_last and weights:
            self._save_last_checkpoint(trainer, candidates)
        elif self.save_last and self.verbose:
            log.info(f"MargLikCheckpoint: last.ckpt not updated after epoch {trainer.current_epoch} (non-finite weights).")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The estimate made where training ended between scheduled estimates (``max_steps``, ``max_time``) is ranked
        with the others, and saved where it is among the best, named by the epochs it followed (``best_epoch``'s
        count); never at non-finite weights. ``last.ckpt`` is not rewritten: it holds the last epoch with finite
        weights (a resume from it trains on from there), not Lightning's save of the final weights."""
        marglik = self._marglik
        if not marglik.estimated_at_end or self._should_skip_saving_checkpoint(trainer):
            return
        weights = trainer.strategy.reduce_boolean_decision(_all_finite(pl_module), all=True)
        if weights and math.isfinite(marglik.last_marglik):
            candidates = self._monitor_candidates(trainer)
            candidates["epoch"] = torch.tensor(marglik.history[-1]["epoch"] - 1)
            self._save_topk_checkpoint(trainer, candidates)
        elif self.verbose:
            log.info("MargLikCheckpoint: the estimate at the end of training not saved (non-finite evidence or "
                     "weights).")


def _all_finite(module: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of ``module`` is finite on this rank (one sync): of a
    sharded tensor (FSDP2's DTensor) its local shard, as FSDP1's flat shards; the caller combines the ranks."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t
               for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


class EarlyStoppingCore(_FollowsEstimates):
    """The logic of ``MargLikEarlyStopping``, combined with a package's ``EarlyStopping``.

    Documented on ``lightning_marglik.MargLikEarlyStopping``.
    """

    _foreign_keywords = STOPPING_KEYWORDS
    _RECORD = ("wait_count", "stopped_epoch", "best_score", "stopping_reason", "stopping_reason_message")

    def __init__(self, patience: int = 3, min_delta: float = 0.0, verbose: bool = False) -> None:
        super().__init__(
            patience=integer(patience, "patience", 1),
            min_delta=number(min_delta, "min_delta", 0, low_open=False),
            monitor=MONITOR,
            mode="max",
            check_finite=True,
            verbose=flag(verbose, "verbose", what="also log every check"),
            log_rank_zero_only=True,  # the evidence is identical on every rank
        )
        self._epoch = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new fit (a resumed one restores the counters after setup)
            self.wait_count, self.stopped_epoch = 0, 0
            self.best_score = torch.tensor(-math.inf)
            self.stopping_reason, self.stopping_reason_message = self._package.stopping_reason.NOT_STOPPED, None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._marglik.schedule.is_fresh(trainer):
            return
        self._epoch, self._min_epochs = trainer.current_epoch + 1, trainer.min_epochs or 0
        stopped_before = trainer.should_stop
        self._run_early_stopping_check(trainer)
        if trainer.should_stop and not stopped_before and self.stopped_epoch == trainer.current_epoch:
            if self.stopping_reason_message and not self.verbose:  # verbose: Lightning logged it already
                self._log_info(trainer, self.stopping_reason_message, self.log_rank_zero_only)

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> Tuple[bool, Optional[str]]:
        """Lightning's criteria, with a reason that says when and why in terms of estimations."""
        should_stop, reason = super()._evaluate_stopping_criteria(current)
        if not should_stop:
            return should_stop, reason
        if self.stopping_reason == self._package.stopping_reason.PATIENCE_EXHAUSTED:
            reason = (
                f"{MONITOR} (log evidence per datum) did not improve by more than min_delta={self.min_delta} in "
                f"the last {self.wait_count} estimations (patience={self.patience}); best {self.best_score:.4f}."
            )
        if self._epoch < self._min_epochs:  # Lightning trains on: "stopped" would be false
            return should_stop, (f"MargLikEarlyStopping asked to stop after epoch {self._epoch}, but Trainer("
                                 f"min_epochs={self._min_epochs}) trains on to epoch {self._min_epochs}: {reason}")
        return should_stop, f"MargLikEarlyStopping stopped training after epoch {self._epoch}: {reason}"

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Never act on validation: the evidence comes from the training data."""
