"""Algorithm 1 of Immer et al. (2021) as Lightning callbacks.

``MargLikCallback`` estimates the evidence after every ``frequency``-th epoch past ``burnin``
and takes hyperparameter steps; ``MargLikCheckpoint`` and ``MargLikEarlyStopping`` act on those
estimates only (never on a stale or non-finite value, never during burn-in).
"""
from __future__ import annotations

import itertools
import logging
import math
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint, TQDMProgressBar
from pytorch_lightning.callbacks.early_stopping import EarlyStoppingReason
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .curvature import CurvatureOptions, check_model, collect_statistics, eval_mode
from .curvature.batches import call_model, move, split_batch
from .distributed import evidence_loader, reduce_statistics, run_on_all_ranks
from .evidence import SOLVERS, LaplaceEvidence
from .hyperparameters import GaussianPrior, Likelihood, learnable_values

__all__ = ["MargLikCallback", "MargLikCheckpoint", "MargLikConfigurationError", "MargLikEarlyStopping"]

MONITOR = "marglik"
log = logging.getLogger(__name__)


class MargLikConfigurationError(MisconfigurationException, ValueError):
    """A set-up problem found before the first training step; the message names it and the fix.

    A ``MisconfigurationException`` as Lightning raises for set-up problems, and a ``ValueError``
    as the engine raises for the same problems outside Lightning: catch either.
    """


def _positive_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    return value


class MargLikCallback(Callback):
    """Learn prior precisions, noise and temperature by the Laplace evidence during training.

    After epoch ``e`` (counted from 1) with ``e > burnin`` and ``e % frequency == 0``, and after
    the last epoch of ``max_epochs``, the callback computes the evidence over the examples one
    training epoch draws at the current weights, takes ``steps`` Adam steps on the log
    hyperparameters, writes them into the ``GaussianPrior`` and ``Likelihood`` registered on the
    LightningModule, and logs ``marglik`` (log evidence per datum, after the update) with every
    hyperparameter. If training ends otherwise (``max_steps``, ``max_time``, early stopping on
    another metric) after epochs without an estimate, a final estimate is made in ``on_train_end``
    (``final_marglik``; it also updates ``best_marglik`` and ``trainer.callback_metrics``).

    The evidence data are the examples of the training loader's sampler, each once (a
    ``SubsetRandomSampler``'s indices, a custom sampler's keys, else the whole data set); samplers
    that draw another distribution (``WeightedRandomSampler``, ``RandomSampler(replacement=True)``,
    repeated keys) are refused: pass ``dataloader=``. An iterable-style training set is read for
    the batches one training epoch uses (``limit_train_batches``); one without length or limit
    is refused.

    Everything the evidence needs is checked when training starts, before the first step: the
    ``dataloader`` source, one eval-mode ``forward`` of one evidence batch (a single output tensor
    whose shape fits the likelihood and the targets), and hyperparameters that are finite in the
    module's dtype. Every problem raises a :class:`MargLikConfigurationError` naming the fix.

    Each ``fit`` starts afresh (history, best value, Adam state of the hyperparameter steps); a
    ``fit(ckpt_path=...)`` restores them from the checkpoint. If the learnable hyperparameters
    changed since the checkpoint (e.g. ``learn_temperature`` turned on), the Adam state starts
    afresh with a warning; the rest of the state is kept.

    The LightningModule's ``forward(inputs)`` must return the network outputs (batches are
    ``(inputs, targets)`` pairs, or define ``marglik_batch(self, batch) -> (inputs, targets)``),
    its prior must cover all trainable parameters, and its loss should be
    :func:`lightning_marglik.map_loss`. With Lightning's progress bar on, the evidence pass shows
    its own bar.

    Args:
        structure: Curvature structure, ``"kron"``, ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` or ``"ef"``.
        frequency: Estimate every ``frequency`` epochs (``F``).
        burnin: Epochs before the first estimate (``B``).
        steps: Adam steps per estimate (``K``), or the Newton solver's evaluation budget.
        lr: Adam learning rate on the log hyperparameters (``gamma``; ``solver="adam"`` only).
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact).
        dataloader: Data for the evidence pass (e.g. the training set without augmentation): a
            ``DataLoader``, or the name of a method of the LightningModule or DataModule that
            returns one (usable from YAML). Default: the trainer's training data.
        seed: Seed of the Monte-Carlo samples (the estimate of epoch ``e`` uses ``seed + e``).
        solver: Hyperparameter steps per estimate: ``"newton"`` (Newton with a line search until
            converged, at most ``steps`` evaluations; see :mod:`lightning_marglik.solvers`) or
            ``"adam"`` (``steps`` Adam steps at ``lr``, the paper's Algorithm 1; its moments carry
            over between estimates).
        backend: Curvature backend: ``"hooks"`` (ours, any network) or ``"backpack"`` (optional
            extra ``lightning_marglik[backpack]``; Sequential networks of Linear/Conv2d layers).

    Raises:
        ValueError: On an invalid argument (the message names it).

    Example:
        >>> callback = MargLikCallback(structure="diag", approx="ef", frequency=5, steps=100)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False)
    """

    # state_dict key -> attribute; every key is optional in load_state_dict (default: a fresh fit's value)
    _STATE = {
        "estimations": "estimations",
        "last_estimate_epoch": "last_estimate_epoch",
        "last_marglik": "last_marglik",
        "best_marglik": "best_marglik",
        "best_epoch": "best_epoch",
        "history": "history",
        "optimizer_state": "_optimizer_state",
        "optimizer_signature": "_optimizer_signature",
        "last_estimate_step": "_last_estimate_step",
    }

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
        solver: str = "newton",
        backend: str = "hooks",
    ) -> None:
        super().__init__()
        self.options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
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
        if solver not in SOLVERS:
            raise ValueError(f"`solver` must be one of {SOLVERS}, got {solver!r}.")
        self.solver = solver
        self.prior: Optional[GaussianPrior] = None
        self.likelihood: Optional[Likelihood] = None
        self.evidence: Optional[LaplaceEvidence] = None
        self._reset_state()

    def _reset_state(self) -> None:
        """The state of a fit that has not estimated yet."""
        self.estimations = 0
        self.last_estimate_epoch = -1
        self.last_marglik = math.nan
        self.best_marglik = -math.inf
        self.best_epoch = -1
        self.final_marglik = math.nan
        self.history: List[Dict[str, float]] = []
        self._optimizer_state: dict = {}
        # names and shapes of the hyperparameters the Adam state belongs to
        self._optimizer_signature: Optional[List[Tuple[str, List[int]]]] = None
        self._last_estimate_step = -1
        self.evidence = None

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        # Every fit starts afresh: the Adam state and history of another model must not carry over.
        # Lightning restores a checkpoint (load_state_dict) after setup, so a resumed fit gets its state back.
        self._reset_state()
        self.prior, self.likelihood = find_hyperparameters(pl_module)
        try:
            check_model(pl_module, self.prior, self.options)
        except ValueError as err:  # the engine's message names the module and a structure that works
            raise MargLikConfigurationError(str(err)) from err
        if type(pl_module).forward in (nn.Module.forward, pl.LightningModule.forward):
            raise MargLikConfigurationError(
                f"{type(pl_module).__name__} defines no forward, which the evidence pass calls for the network "
                "outputs: add e.g. `def forward(self, x): return self.net(x)`."
            )
        if isinstance(self.dataloader, str):
            self._named_loader_method(trainer, pl_module)  # a wrong name fails now, not after burn-in

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

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Check everything the evidence needs, before the first step (the training data exist from here)."""
        signature = self._learnable_signature()
        if self._optimizer_state and self._optimizer_signature != signature:
            rank_zero_warn(
                f"MargLikCallback: the learnable hyperparameters changed since the checkpoint "
                f"({self._optimizer_signature} -> {signature}): the Adam state of the hyperparameter steps starts "
                "afresh; the evidence history and best value are kept."
            )
            self._optimizer_state, self._optimizer_signature = {}, None
        # one rank's failure (e.g. its shard's first batch) is raised on every rank, not left hanging
        run_on_all_ranks(trainer.strategy, lambda: self._check_setup(trainer, pl_module))

    def _check_setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self.prior is not None and self.likelihood is not None
        params = self.prior.params
        dtype, device = params[0].dtype, params[0].device
        for name, buffer in self._named_buffers().items():
            # h and 1/h must exist in the dtype the module computes in (the buffer may be float64)
            if not torch.isfinite(buffer.detach().to(dtype).abs().exp()).all():
                flat = buffer.detach().reshape(-1)
                value = flat[flat.abs().argmax()].double().exp().item()
                raise MargLikConfigurationError(
                    f"MargLikCallback: {name} = {value:.3g} (or its inverse) is not finite in the module's dtype "
                    f"{dtype}; choose a value within {dtype}'s range or train in float64 "
                    "(Trainer(precision='64-true'))."
                )
        batches = self._evidence_batches(trainer, pl_module, warn=True)
        try:
            batch = next(iter(batches))
        except StopIteration:
            raise MargLikConfigurationError("MargLikCallback: the evidence data loader yields no batches.") from None
        try:
            inputs, target = split_batch(batch, self._batch_fn(pl_module))
            with eval_mode(pl_module), torch.no_grad():
                output = call_model(pl_module, move(inputs, device, dtype))
        except (TypeError, NotImplementedError) as err:
            raise MargLikConfigurationError(f"MargLikCallback, one evidence batch through forward: {err}") from err
        try:
            self.likelihood.check_target(output, target.to(device))
        except ValueError as err:
            raise MargLikConfigurationError(
                f"MargLikCallback, one evidence batch through forward: {err} forward must return outputs of shape "
                "(batch, outputs) that fit the targets; map batches with `marglik_batch(self, batch) -> "
                "(inputs, targets)` on the LightningModule, or pass `dataloader=`."
            ) from err

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
        for key, value in self.logged_values(marglik).items():
            # identical on every rank: the sync is exact and keeps Lightning's DDP logging contract
            pl_module.log(key, value, prog_bar=key == MONITOR, on_step=False, on_epoch=True, sync_dist=True)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.global_step == self._last_estimate_step:
            self.final_marglik = self.last_marglik
            return
        # trainer.current_epoch counts the completed epochs here
        self.final_marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch)
        values = self.logged_values(self.final_marglik)
        # self.log is not allowed in on_train_end: write the metrics where callbacks and users read them
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in values.items()})
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def estimate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", epoch: int) -> float:
        """Evidence pass, all-reduce, ``steps`` hyperparameter steps; returns log evidence / N.

        Runs the same collectives on every rank. A non-finite evidence leaves the hyperparameters
        unchanged and returns NaN (``MargLikEarlyStopping`` stops on it, ``MargLikCheckpoint``
        skips it). Updates ``history``, ``last_marglik`` and ``best_marglik``/``best_epoch``.

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
            batches = self._evidence_batches(trainer, pl_module)
            with _progress(trainer, batches) as on_batch:
                return collect_statistics(
                    pl_module, batches, self.likelihood, self.prior, generator=generator,
                    batch_fn=self._batch_fn(pl_module), on_batch=on_batch, options=self.options,
                )

        stats = reduce_statistics(run_on_all_ranks(strategy, local_pass), strategy)
        evidence = LaplaceEvidence.from_statistics(stats, self.likelihood, self.prior)
        self.evidence = evidence
        if not torch.isfinite(evidence.log_marglik().detach()):
            rank_zero_warn("The evidence is not finite at the current weights; hyperparameters left unchanged.")
            marglik = math.nan
        else:
            solution = evidence.optimize(
                self.steps, self.lr, state=self._optimizer_state, solver=self.solver, max_evaluations=max(self.steps, 1)
            )
            self._optimizer_state = solution.state
            self._optimizer_signature = self._learnable_signature()
            # rank 0's values everywhere: bit-identical hyperparameters on every rank
            evidence.set_hyperparameters(strategy.broadcast(solution.values, src=0))
            marglik = solution.value.item() / evidence.n_data
        self.estimations += 1
        self._last_estimate_step = trainer.global_step
        self.last_estimate_epoch = epoch - 1
        self.last_marglik = marglik
        if marglik > self.best_marglik:  # False for NaN
            self.best_marglik, self.best_epoch = marglik, epoch - 1
        self.history.append({"epoch": epoch, "step": trainer.global_step, MONITOR: marglik})
        return marglik

    # --- helpers -----------------------------------------------------------------------------

    def _named_buffers(self) -> Dict[str, torch.Tensor]:
        assert self.prior is not None and self.likelihood is not None
        return {"prior.log_precision": self.prior.log_precision, **{
            f"likelihood.{name}": buffer for name, buffer in self.likelihood.hyperparameters().items()
        }}

    def _learnable_signature(self) -> List[Tuple[str, List[int]]]:
        """Names and shapes of the hyperparameters the Adam steps optimize, in the engine's order."""
        assert self.prior is not None and self.likelihood is not None
        return [(name, list(value.shape)) for name, value in learnable_values(self.prior, self.likelihood).items()]

    @staticmethod
    def _batch_fn(pl_module: "pl.LightningModule") -> Optional[Callable[[Any], Any]]:
        method = getattr(pl_module, "marglik_batch", None)
        return method if callable(method) else None

    def _named_loader_method(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Callable[[], Any]:
        """The DataModule's or LightningModule's method named by ``dataloader``."""
        name = self.dataloader
        assert isinstance(name, str)
        owner: Any = next((o for o in (trainer.datamodule, pl_module) if o is not None and hasattr(o, name)), None)
        if owner is None:
            raise MargLikConfigurationError(
                f"MargLikCallback(dataloader={name!r}): neither the DataModule nor the LightningModule has such a "
                "method; pass the name of a method that returns a DataLoader, or a DataLoader."
            )
        method = getattr(owner, name)
        if not callable(method):
            raise MargLikConfigurationError(
                f"MargLikCallback(dataloader={name!r}): {type(owner).__name__}.{name} is a value of type "
                f"{type(method).__name__}, not a method; pass the name of a method that returns a DataLoader, "
                "or a DataLoader."
            )
        return method

    def _source_loader(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> DataLoader:
        if isinstance(self.dataloader, DataLoader):
            return self.dataloader
        if isinstance(self.dataloader, str):
            loader = self._named_loader_method(trainer, pl_module)()
            if not isinstance(loader, DataLoader):
                raise MargLikConfigurationError(
                    f"MargLikCallback(dataloader={self.dataloader!r}) returned a {type(loader).__name__}; the method "
                    "must return a torch DataLoader of (inputs, targets) batches."
                )
            return loader
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            raise MargLikConfigurationError(
                "MargLikCallback needs one training DataLoader of (x, y) batches; pass `dataloader=` "
                f"for the evidence pass (got {type(loader).__name__})."
            )
        return loader

    def _evidence_batches(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", warn: bool = False) -> Iterable:
        """This rank's evidence batches: its unpadded shard of the examples one training epoch draws.

        Args:
            warn: Warn where the evidence data differ from what a training epoch uses (once, at set-up).
        """
        source = self._source_loader(trainer, pl_module)
        max_batches: Optional[int] = None
        if self.dataloader is None:  # the training data: one training epoch's batches bound a stream
            limit = trainer.num_training_batches
            max_batches = int(limit) if math.isfinite(limit) else None
            if warn and max_batches is not None:
                _warn_if_limited(source, max_batches, trainer.limit_train_batches)
        try:
            return evidence_loader(source, trainer.global_rank, trainer.world_size, max_batches)
        except ValueError as err:
            raise MargLikConfigurationError(str(err)) from err

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
        state = {key: getattr(self, attribute) for key, attribute in self._STATE.items()}
        state["history"] = list(self.history)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a checkpoint's state; a key it lacks keeps a fresh fit's value."""
        self._reset_state()
        for key, attribute in self._STATE.items():
            if key in state_dict:
                setattr(self, attribute, state_dict[key])
        self.history = list(self.history)


def _warn_if_limited(loader: DataLoader, max_batches: int, limit: Union[int, float]) -> None:
    """Say how the evidence data relate to a training epoch limited by ``limit_train_batches``."""
    try:
        length: Optional[int] = len(loader)
    except TypeError:  # a stream without length
        length = None
    if length is not None and max_batches >= length:
        return
    if isinstance(loader.dataset, IterableDataset):
        rank_zero_warn(
            f"MargLikCallback: the evidence covers the first {max_batches} batches of the training IterableDataset, "
            f"those one training epoch uses (Trainer(limit_train_batches={limit})); pass `dataloader=` for other "
            "evidence data."
        )
    else:
        rank_zero_warn(
            f"MargLikCallback: Trainer(limit_train_batches={limit}) trains on {max_batches} of {length} batches per "
            "epoch, but the evidence covers every example of the training sampler; pass `dataloader=` for other "
            "evidence data."
        )


@contextmanager
def _progress(trainer: "pl.Trainer", batches: Iterable) -> Iterator[Optional[Callable[[int], None]]]:
    """A bar for the evidence pass from the trainer's TQDM progress bar (rank 0 only, if it is on).

    Yields:
        The per-batch callback for ``collect_statistics(on_batch=...)``, or ``None`` without a bar.
    """
    bars = trainer.progress_bar_callback
    if not isinstance(bars, TQDMProgressBar) or not bars.is_enabled or not trainer.is_global_zero:
        yield None
        return
    bar = bars.init_validation_tqdm()  # the progress bar's own placement, file and format
    try:
        total: Optional[int] = len(batches)  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar.reset(total=total)
    bar.set_description("Evidence pass")
    try:
        yield lambda _: bar.update(1)
    finally:
        bar.close()


def find_hyperparameters(pl_module: torch.nn.Module) -> "tuple[GaussianPrior, Likelihood]":
    """The one ``GaussianPrior`` and one ``Likelihood`` registered on ``pl_module``.

    Raises:
        MargLikConfigurationError: If there is not exactly one of each, saying what to add.
    """
    priors = [m for m in pl_module.modules() if isinstance(m, GaussianPrior)]
    likelihoods = [m for m in pl_module.modules() if isinstance(m, Likelihood)]
    if len(priors) != 1 or len(likelihoods) != 1:
        raise MargLikConfigurationError(
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
                raise MargLikConfigurationError(
                    f"{type(self).__name__} needs exactly one MargLikCallback in the Trainer's callbacks."
                )
            self._marglik = found[0]


class MargLikCheckpoint(_FollowsEstimates, ModelCheckpoint):
    """Keep the best-evidence model(s) instead of validation-based checkpointing.

    Acts only at the end of training epochs in which ``MargLikCallback`` estimated the evidence:
    never on a stale value, never during burn-in, independent of validation loops. An estimate
    that is not finite, or weights (or buffers) that are not, are never saved, neither as a best
    model nor as ``last.ckpt``: until a finite estimate exists, ``best_model_path`` is empty. A
    checkpoint holds the weights and (as module buffers) the hyperparameters.

    Like Lightning's ``ModelCheckpoint``, the top-k ranking persists across fits of the same
    instance (e.g. to keep the best-evidence model of several candidates in one directory).

    Args:
        dirpath: Directory of the checkpoints (default: the logger's).
        filename: File name pattern, e.g. ``"{epoch}-{marglik:.3f}"``.
        save_top_k: How many of the best-evidence models to keep.
        save_last: Also keep ``last.ckpt`` of the latest estimation epoch with a finite estimate.
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
        if not self._marglik.is_fresh(trainer):
            return
        finite = math.isfinite(self._marglik.last_marglik) and _all_finite(pl_module)
        # saving runs collectives: every rank must take the same decision
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            super().on_train_epoch_end(trainer, pl_module)
        elif self.verbose:
            log.info(f"MargLikCheckpoint: epoch {trainer.current_epoch} not saved (non-finite evidence or weights).")

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """``last.ckpt`` comes from estimation epochs only: not Lightning's save of the final weights,
        which may be non-finite or never estimated."""


def _all_finite(module: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of ``module`` is finite (one sync)."""
    tensors = [t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


class MargLikEarlyStopping(_FollowsEstimates, EarlyStopping):
    """Stop training when the evidence stops improving, without validation data.

    Patience counts *estimations* (every ``frequency`` epochs), not epochs. Stops on a
    non-finite evidence. When it stops, it logs why and when at info level (on rank 0) and keeps
    the message in ``stopping_reason_message`` (the kind in ``stopping_reason``). Its counters
    start afresh with every fit, are saved in checkpoints and restored on resume.

    Args:
        patience: Estimations without an improvement of more than ``min_delta`` before stopping.
        min_delta: Smallest increase of ``marglik`` (log evidence per datum) that counts.
        verbose: Also log every check (improvements), as Lightning's ``EarlyStopping`` does.

    Example:
        >>> stopper = MargLikEarlyStopping(patience=3, min_delta=1e-3)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[MargLikCallback(), stopper], logger=False)
    """

    def __init__(self, patience: int = 3, min_delta: float = 0.0, verbose: bool = False) -> None:
        _positive_int(patience, "patience", 1)
        if not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"`min_delta` must be a finite number >= 0, got {min_delta!r}.")
        super().__init__(
            monitor=MONITOR,
            min_delta=min_delta,
            patience=patience,
            mode="max",
            check_finite=True,
            verbose=verbose,
            log_rank_zero_only=True,  # the evidence is identical on every rank
        )
        self._epoch = 0

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new fit (a resumed one restores the counters after setup)
            self.wait_count, self.stopped_epoch = 0, 0
            self.best_score = torch.tensor(-math.inf)
            self.stopping_reason, self.stopping_reason_message = EarlyStoppingReason.NOT_STOPPED, None

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self._marglik.is_fresh(trainer):
            return
        self._epoch = trainer.current_epoch + 1
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
        if self.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED:
            reason = (
                f"{MONITOR} (log evidence per datum) did not improve by more than min_delta={self.min_delta} in "
                f"the last {self.wait_count} estimations (patience={self.patience}); best {self.best_score:.4f}."
            )
        return should_stop, f"MargLikEarlyStopping stopped training after epoch {self._epoch}: {reason}"

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Never act on validation: the evidence comes from the training data."""
