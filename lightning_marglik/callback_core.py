"""The callbacks' logic, shared by both Lightning packages.

``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning``) define separate
``Callback``, ``ModelCheckpoint`` and ``EarlyStopping`` classes, and a Trainer recognises only
its own package's: as its checkpoint callback (``ckpt_path="best"``), as its early-stopping
callback, in its LightningCLI. The mixins here hold every behaviour of the callbacks and use
the trainer only through its attributes; ``lightning_marglik.callbacks`` (``pytorch_lightning``)
and ``lightning_marglik.lightning`` (``lightning.pytorch``) combine each mixin with one
package's base class and describe that package in a ``LightningPackage``. Nothing here
imports either package.
"""
from __future__ import annotations

import itertools
import logging
import math
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from fsspec.core import url_to_fs
from lightning_fabric.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .curvature import CurvatureOptions, check_model, collect_statistics, eval_mode
from .curvature.batches import call_model, move, split_batch
from .curvature.scale_invariance import find_scale_invariant
from .curvature.training_pass import TrainingPassStatistics, mismatch
from .distributed import evidence_loader, isolate_rng, reduce_statistics, run_on_all_ranks
from .evidence import SOLVERS, LaplaceEvidence, require_data
from .hyperparameters import (
    SCALE_INVARIANT_TREATMENTS,
    GaussianPrior,
    Likelihood,
    assign_hyperparameters,
    learnable_values,
)

__all__ = [
    "CheckpointCore",
    "EarlyStoppingCore",
    "LightningPackage",
    "MargLikCallbackCore",
    "MargLikConfigurationError",
    "find_hyperparameters",
]

MONITOR = "marglik"
DESCRIPTION = "Evidence pass"
log = logging.getLogger(__name__)

# A Trainer or LightningModule of either package (the mixins use their attributes only).
Trainer = Any
LightningModule = Any

# Lightning package -> the module whose callbacks that package's Trainer recognises
CALLBACK_MODULES = {"pytorch_lightning": "lightning_marglik", "lightning.pytorch": "lightning_marglik.lightning"}


class MargLikConfigurationError(MisconfigurationException, ValueError):
    """A set-up problem found before the first training step; the message names it and the fix.

    A ``MisconfigurationException`` as Lightning raises for set-up problems, and a ``ValueError``
    as the engine raises for the same problems outside Lightning: catch either. The callbacks of
    both Lightning packages raise this one class.
    """


@dataclass(frozen=True)
class LightningPackage:
    """What the callbacks need to know of one Lightning package.

    Attributes:
        name: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        trainer: The package's ``Trainer`` class.
        lightning_module: The package's ``LightningModule`` class.
        tqdm_bar: Its ``TQDMProgressBar`` class.
        tqdm: The ``tqdm`` class its progress bar draws with.
        rich_bar: Its ``RichProgressBar`` class.
        stopping_reason: Its ``EarlyStoppingReason`` enum.
    """

    name: str
    trainer: type
    lightning_module: type
    tqdm_bar: type
    tqdm: type
    rich_bar: type
    stopping_reason: Any


def check_package(callback: Any, trainer: Trainer) -> None:
    """Refuse a Trainer of the other Lightning package than ``callback``'s.

    Such a Trainer runs the callback's hooks but does not take it for its checkpoint or
    early-stopping callback: it adds a ``ModelCheckpoint`` of its own, and ``ckpt_path="best"``
    would load that one's model instead of the best-evidence one.

    Raises:
        MargLikConfigurationError: Naming the module to import the callbacks from.
    """
    package: LightningPackage = callback._package
    if isinstance(trainer, package.trainer):
        return
    modules = [cls.__module__ for cls in type(trainer).__mro__]
    other = next((name for name in CALLBACK_MODULES for m in modules if m.split(".")[0] == name.split(".")[0]), None)
    if other is None:
        kind, fix = f"{type(trainer).__module__}.{type(trainer).__name__}", f"use a {package.name}.Trainer"
    else:
        kind = f"{other}.Trainer"
        fix = (
            f"import the callbacks for {other}: `from {CALLBACK_MODULES[other]} import MargLikCallback, "
            "MargLikCheckpoint, MargLikEarlyStopping`"
        )
    raise MargLikConfigurationError(
        f"{type(callback).__name__} from {CALLBACK_MODULES[package.name]} is a {package.name} callback, but the "
        f"Trainer is a {kind}, which would run it without taking it for its checkpoint or early-stopping callback "
        f"(ckpt_path='best' would load another model): {fix}."
    )


def _positive_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    return value


class MargLikCallbackCore:
    """The logic of ``MargLikCallback`` (Algorithm 1), combined with a package's ``Callback``.

    Documented on ``lightning_marglik.MargLikCallback``; the subclass sets ``_package``.
    """

    _package: ClassVar[LightningPackage]

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
        scale_invariant: str = "decoupled",
        statistics: str = "pass",
        statistics_fraction: float = 1.0,
    ) -> None:
        super().__init__()
        self.options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
        self.statistics = _check_statistics(statistics, self.options)
        self.statistics_fraction = _check_fraction(statistics_fraction, self.statistics)
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
        if scale_invariant not in SCALE_INVARIANT_TREATMENTS:
            raise ValueError(f"`scale_invariant` must be one of {SCALE_INVARIANT_TREATMENTS}, got {scale_invariant!r}.")
        self.scale_invariant = scale_invariant
        self.prior: Optional[GaussianPrior] = None
        self.likelihood: Optional[Likelihood] = None
        self.evidence: Optional[LaplaceEvidence] = None
        self._training: Optional[TrainingPassStatistics] = None  # statistics='training': the sums of the epoch
        self._setup_plan: Any = None  # the set-up batch's evidence-pass statistics (their structures' layout)
        self._training_check: Any = None  # the first training batch, until its sums are checked
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
        # the hyperparameters the Adam state belongs to (_learnable_signature)
        self._optimizer_signature: Optional[List[Tuple[str, List[int], List[str]]]] = None
        self._last_estimate_step = -1
        self.evidence = None

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_package(self, trainer)
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
        if self.options.structure == "ekfac" and trainer.world_size > 1:
            raise MargLikConfigurationError(
                "structure='ekfac' needs the Kronecker factors summed over all processes before its second pass "
                f"(the basis must be the same on every rank), which is not implemented; with {trainer.world_size} "
                "processes use structure='kron', or compute the EKFAC evidence after training in one process "
                "(LaplaceEvidence.fit(..., structure='ekfac'))."
            )
        if self.statistics == "training":
            _check_training_statistics(trainer, pl_module)
        if type(pl_module).forward in (nn.Module.forward, self._package.lightning_module.forward):
            raise MargLikConfigurationError(
                f"{type(pl_module).__name__} defines no forward, which the evidence pass calls for the network "
                "outputs: add e.g. `def forward(self, x): return self.net(x)`."
            )
        if isinstance(self.dataloader, str):
            self._named_loader_method(trainer, pl_module)  # a wrong name fails now, not after burn-in

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                if group.get("weight_decay", 0):
                    rank_zero_warn(
                        f"{type(optimizer).__name__} has weight_decay={group['weight_decay']}: the GaussianPrior "
                        "already regularizes the weights (map_loss), so the prior is counted twice; set "
                        "weight_decay=0."
                    )
                    return

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check everything the evidence needs, before the first step (the training data exist from here)."""
        # one rank's failure (e.g. its shard's first batch) is raised on every rank, not left hanging
        local = run_on_all_ranks(
            trainer.strategy, lambda: self._count_data(trainer, pl_module, self._check_setup(trainer, pl_module))
        )
        strategy = trainer.strategy
        self._record_n_data(int(strategy.reduce(torch.tensor(local, device=strategy.root_device), reduce_op="sum")))
        self._follow_changed_learnables()  # after the set-up check, which decides the scale-invariant treatment
        if self.statistics == "training":
            self._start_training_statistics(trainer, pl_module)

    def _follow_changed_learnables(self) -> None:
        """After a resume: tensors whose precision the checkpoint learned and the prior now fixes take
        the declared ``precision``; a changed set of learned hyperparameters restarts the Adam state.
        Both with a warning (identical on every rank: the checkpoint's state is)."""
        assert self.prior is not None and self.likelihood is not None
        saved, signature = self._optimizer_signature, self._learnable_signature()
        if saved is None:
            return
        learned_before = next((entry[2] for entry in saved if entry[0] == "log_precision" and len(entry) > 2), [])
        newly_fixed = [name for name in self.prior.fixed_names() if name in learned_before]
        if newly_fixed:
            assign_hyperparameters(
                self.prior, self.likelihood, {"log_precision": self.prior.declared_log_precision(newly_fixed)}
            )
            rank_zero_warn(
                f"MargLikCallback: the checkpoint learned the prior precision of {newly_fixed}, which the prior now "
                f"fixes (GaussianPrior(fixed=...)): they take the declared precision={self.prior.initial_precision:g}."
            )
        if self._optimizer_state and [tuple(entry) for entry in saved] != signature:
            rank_zero_warn(
                f"MargLikCallback: the learnable hyperparameters changed since the checkpoint "
                f"({saved} -> {signature}): the Adam state of the hyperparameter steps starts "
                "afresh; the evidence history and best value are kept."
            )
            self._optimizer_state, self._optimizer_signature = {}, None

    def _check_setup(self, trainer: Trainer, pl_module: LightningModule) -> torch.Tensor:
        """Everything the evidence needs, on one evidence batch; returns that batch's outputs."""
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
        self._treat_scale_invariant(pl_module, move(inputs, device, dtype))
        try:  # the evidence pass itself on this batch, exact per-example path included (e.g. what vmap refuses)
            self._setup_plan = collect_statistics(
                pl_module, [batch], self.likelihood, self.prior, generator=torch.Generator().manual_seed(self.seed),
                batch_fn=self._batch_fn(pl_module), options=self.options,
            )
        except (ValueError, RuntimeError) as err:
            raise MargLikConfigurationError(f"MargLikCallback, one evidence batch through the evidence pass: {err}") from err
        return output

    def _treat_scale_invariant(self, pl_module: LightningModule, inputs: Any) -> None:
        """Find the scale-invariant tensors (one training-mode forward) and give them to the prior with the treatment."""
        assert self.prior is not None
        layers = find_scale_invariant(pl_module, inputs)
        ours = {id(p): n for n, p in zip(self.prior.param_names, self.prior.params)}
        full = dict(pl_module.named_parameters())
        # the prior's names of each layer's tensors (the analysis names them from the LightningModule)
        named = [(layer, [ours[id(full[n])] for n in layer.params if id(full[n]) in ours]) for layer in layers]
        names = [n for _, group in named for n in group]
        treatment, scalar = self.scale_invariant, ""
        if names and treatment != "learn" and self.prior.structure == "scalar":
            treatment = "learn"
            scalar = (" needs one precision per tensor, but the prior is scalar (use GaussianPrior(structure="
                      "'layerwise')), so they are learned with the rest:")
        self.prior.treat_scale_invariant(names, treatment)
        if not names:
            return
        held = [n for n in names if n in self.prior.fixed]
        what = {
            "decoupled": "the evidence learns their precision, but their weight decay in map_loss stays at the prior's "
            f"initial precision {self.prior.initial_precision:g} (not fed back)",
            "fixed": f"their precision stays at its initial value {self.prior.initial_precision:g}",
            "learn": "their learned precision is fed back as weight decay and can grow without bound while they shrink",
        }[treatment]
        groups = "; ".join(f"{', '.join(group)} -> {layer.norm}" for layer, group in named if group)
        rank_zero_warn(
            f"MargLikCallback: the training loss is invariant to the scale of {len(named)} layer(s), each of whose output "
            f"feeds only a normalization with statistics of its input ({groups}), so the data do not determine their "
            f"prior precision. scale_invariant={self.scale_invariant!r}{scalar or ':'} {what}"
            + (f"; {held} keep GaussianPrior(fixed=...)" if held else "")
            + ". Choose with MargLikCallback(scale_invariant='decoupled'|'fixed'|'learn')."
        )

    # --- Algorithm 1 -------------------------------------------------------------------------

    def is_estimation_epoch(self, trainer: Trainer) -> bool:
        """Whether the epoch now ending (``trainer.current_epoch + 1``) gets an estimate."""
        epoch = trainer.current_epoch + 1
        return (epoch > self.burnin and epoch % self.frequency == 0) or epoch == trainer.max_epochs

    def is_fresh(self, trainer: Trainer) -> bool:
        """Whether ``marglik`` was estimated in the epoch now ending."""
        return self.last_estimate_epoch == trainer.current_epoch

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.is_estimation_epoch(trainer):
            return
        marglik = self.estimate(trainer, pl_module, epoch=trainer.current_epoch + 1)
        for key, value in self.logged_values(marglik).items():
            # identical on every rank: the sync is exact and keeps Lightning's DDP logging contract
            pl_module.log(key, value, prog_bar=key == MONITOR, on_step=False, on_epoch=True, sync_dist=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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

    def estimate(self, trainer: Trainer, pl_module: LightningModule, epoch: int) -> float:
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
        evidence = self._evidence(trainer, pl_module, self.options, generator)
        self.evidence = evidence
        self._record_n_data(evidence.n_data)  # the N of map_loss follows the evidence (e.g. a stream's new masks)
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
        return self._record_estimate(trainer, epoch, marglik)

    def _evidence(
        self, trainer: Trainer, pl_module: LightningModule, options: CurvatureOptions,
        generator: Optional[torch.Generator],
    ) -> LaplaceEvidence:
        """The evidence of the curvature ``options`` at the current weights, summed over all ranks:
        this epoch's training-pass sums where they are the callback's own and complete, else one
        evidence pass over this rank's evidence batches."""
        assert self.prior is not None and self.likelihood is not None

        def local_pass():  # everything that can fail on one rank only, before the first collective
            taken = self._take_training_statistics(trainer) if options is self.options else None
            if taken is not None:
                return taken
            batches = self._evidence_batches(trainer, pl_module)
            with _progress(trainer, batches, self._package) as on_batch:
                return collect_statistics(
                    pl_module, batches, self.likelihood, self.prior, generator=generator,
                    batch_fn=self._batch_fn(pl_module), on_batch=on_batch, options=options,
                )

        stats = reduce_statistics(run_on_all_ranks(trainer.strategy, local_pass), trainer.strategy)
        return LaplaceEvidence.from_statistics(stats, self.likelihood, self.prior)

    def evidence_with(self, trainer: Trainer, pl_module: LightningModule, structure: str, approx: str) -> float:
        """The log evidence per datum at the current weights with another curvature approximation.

        One evidence pass over the callback's evidence data with ``structure`` and ``approx``
        (exact, no Monte-Carlo), then the learnable hyperparameters re-optimised on that curvature
        by Newton from their current values, as after training for ranking models
        (:func:`lightning_marglik.select_models`, ``rank_by``). Nothing is written: the
        hyperparameters and the callback's state stay as they are.

        Args:
            trainer: The trainer that trained ``pl_module`` (its data and strategy).
            pl_module: The trained module.
            structure: ``"kron"``, ``"ekfac"``, ``"diag"`` or ``"full"``.
            approx: ``"ggn"`` or ``"ef"``.

        Returns:
            The re-optimised log evidence per datum (NaN if the evidence is not finite).

        Raises:
            ValueError: On an unknown ``structure`` or ``approx``.
            RuntimeError: If the callback has not been set up by a fit (no prior or likelihood yet).
        """
        options = CurvatureOptions(structure, approx, 0, backend=self.options.backend)
        if self.prior is None or self.likelihood is None:
            raise RuntimeError(
                "MargLikCallback.evidence_with reads the prior and likelihood the callback found when training "
                "started: call it after trainer.fit(module) with this callback."
            )
        evidence = self._evidence(trainer, pl_module, options, None)
        if not torch.isfinite(evidence.log_marglik().detach()):
            return math.nan
        solution = evidence.optimize(solver="newton", max_evaluations=50)
        return solution.value.item() / evidence.n_data

    def _record_estimate(self, trainer: Trainer, epoch: int, marglik: float, **extra: Any) -> float:
        """Book an estimate after ``epoch`` (counted from 1): history, last and best (never NaN)."""
        self.estimations += 1
        self._last_estimate_step = trainer.global_step
        self.last_estimate_epoch = epoch - 1
        self.last_marglik = marglik
        if marglik > self.best_marglik:  # False for NaN
            self.best_marglik, self.best_epoch = marglik, epoch - 1
        self.history.append({"epoch": epoch, "step": trainer.global_step, MONITOR: marglik, **extra})
        return marglik

    # --- statistics from the training passes (statistics="training") ---------------------------

    def _start_training_statistics(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Hooks for the training passes, laid out as the set-up batch's evidence pass; the first
        training batch is checked against the evidence pass (:meth:`on_after_backward`)."""
        assert self.likelihood is not None and self._setup_plan is not None
        try:
            self._training = TrainingPassStatistics(
                pl_module, self.likelihood, self._setup_plan, self._batch_fn(pl_module)
            )
        except ValueError as err:
            raise MargLikConfigurationError(f"MargLikCallback: {err}") from err
        self._training.attach()
        self._training_check = True  # replaced by the first batch in on_train_batch_start
        if self.statistics_fraction < 1 and not math.isfinite(trainer.num_training_batches):
            raise MargLikConfigurationError(
                f"MargLikCallback(statistics_fraction={self.statistics_fraction}) sums the last part of each "
                "estimation epoch's batches, but the training dataloader has no length (an iterable dataset): "
                "give it a __len__, or use statistics_fraction=1."
            )

    def _collects(self, trainer: Trainer) -> bool:
        """Whether this epoch's training batches are summed: estimation epochs, and the first batch (its check)."""
        return self._training is not None and (self._training_check is True or self.is_estimation_epoch(trainer))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._training is not None:
            self._training.reset()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._collects(trainer):
            assert self._training is not None
            layers = self._training_check is True or batch_idx >= self._first_summed_batch(trainer)
            if self._training_check is True:
                self._training.reset()  # the check compares this batch's sums alone
                self._training_check = batch
            self._training.begin(batch, trainer.accumulate_grad_batches, layers)

    def _first_summed_batch(self, trainer: Trainer) -> int:
        """The first batch of an epoch whose layer products are summed (``statistics_fraction``)."""
        batches = trainer.num_training_batches
        if self.statistics_fraction == 1 or not math.isfinite(batches):
            return 0
        return int(batches) - math.ceil(self.statistics_fraction * int(batches))

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._training is None or self._training_check is None or self._training_check is True:
            return
        batch, self._training_check = self._training_check, None
        self._training.end()  # the batch's backward is done; the reference pass below must not be recorded
        run_on_all_ranks(trainer.strategy, lambda: self._check_training_batch(trainer, pl_module, batch))

    def _check_training_batch(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """The first batch's training-pass sums must equal the evidence pass's at the same weights.

        Raises:
            MargLikConfigurationError: Naming the statistic that differs and the likely causes.
        """
        assert self._training is not None and self.likelihood is not None and self.prior is not None
        problems = list(self._training.problems)
        if not problems:
            reference = collect_statistics(
                pl_module, [batch], self.likelihood, self.prior, batch_fn=self._batch_fn(pl_module),
                options=self.options,
            )
            precision = str(trainer.precision)
            rtol = 5e-2 if "16" in precision else 1e-8 if "64" in precision else 1e-3  # (b)f16 gradients, float64, float32
            found = mismatch(self._training.stats, reference, rtol)
            if found is not None:
                problems.append(
                    f"the first training batch's sums differ from the evidence pass's at the same weights ({found})"
                )
        if problems:
            raise MargLikConfigurationError(
                f"MargLikCallback(statistics='training'): {'; '.join(problems)}. The training backward gives the "
                "empirical Fisher only if training_step returns map_loss(self(x), y, ...) (mean reduction, no label "
                "smoothing or other loss terms on the outputs) of one forward call, the training forward equals the "
                "eval-mode one (no dropout, no batch statistics) and, for (batch, positions, classes) outputs, layers "
                "do not mix positions. Use statistics='pass' (the evidence pass) otherwise."
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._training is None:
            return
        self._training.end()
        if not self.is_estimation_epoch(trainer):
            self._training.reset()  # only the check's batch was summed

    def _take_training_statistics(self, trainer: Trainer) -> Any:
        """This rank's sums of the epoch now ending, if they cover all its batches (else ``None``:
        the evidence pass runs, e.g. after a resume within the epoch or for a final estimate after
        ``max_steps``)."""
        if self._training is None:
            return None
        if self._training.problems:  # seen after the first batch's check: the sums are not the EF's
            raise MargLikConfigurationError(
                f"MargLikCallback(statistics='training'): {'; '.join(self._training.problems)}; use statistics='pass'."
            )
        stats, batches = self._training.take(), self._training.batches
        self._training.reset()
        expected = trainer.num_training_batches
        complete = batches > 0 and (not math.isfinite(expected) or batches == int(expected))
        return stats if complete else None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._training is not None:
            self._training.detach()
            self._training = None

    # --- helpers -----------------------------------------------------------------------------

    def _count_data(self, trainer: Trainer, pl_module: LightningModule, like: torch.Tensor) -> int:
        """This rank's number of data in the evidence batches, from their targets alone (no forward):
        every batch through the likelihood's target checks, as in the evidence pass."""
        assert self.likelihood is not None
        count = 0
        with isolate_rng():  # reading the data (loader seeds, augmentations) must not shift training's random stream
            for batch in self._evidence_batches(trainer, pl_module):
                try:
                    count += self.likelihood.count_targets(split_batch(batch, self._batch_fn(pl_module))[1], like)
                except (TypeError, ValueError) as err:
                    raise MargLikConfigurationError(f"MargLikCallback, the targets of the evidence data: {err}") from err
        return count

    def _record_n_data(self, n_data: int) -> None:
        """Store the evidence's ``N`` on the prior, where ``map_loss`` reads it; refuse data without a datum."""
        assert self.prior is not None and self.likelihood is not None
        try:
            require_data(n_data, self.likelihood)
        except ValueError as err:
            raise MargLikConfigurationError(f"MargLikCallback: {err} Or pass `dataloader=` data with labels.") from err
        self.prior.record_n_data(n_data)

    def _named_buffers(self) -> Dict[str, torch.Tensor]:
        assert self.prior is not None and self.likelihood is not None
        return {"prior.log_precision": self.prior.log_precision, **{
            f"likelihood.{name}": buffer for name, buffer in self.likelihood.hyperparameters().items()
        }}

    def _learnable_signature(self) -> List[Tuple[str, List[int], List[str]]]:
        """What the Adam steps optimize, in the engine's order: each hyperparameter's name and shape,
        and for ``log_precision`` the names of the tensors whose precision is learned (the same shape
        may hold other groups)."""
        assert self.prior is not None and self.likelihood is not None
        return [
            (name, list(value.shape), self.prior.learned_names() if name == "log_precision" else [])
            for name, value in learnable_values(self.prior, self.likelihood).items()
        ]

    @staticmethod
    def _batch_fn(pl_module: LightningModule) -> Optional[Callable[[Any], Any]]:
        method = getattr(pl_module, "marglik_batch", None)
        return method if callable(method) else None

    def _named_loader_method(self, trainer: Trainer, pl_module: LightningModule) -> Callable[[], Any]:
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

    def _source_loader(self, trainer: Trainer, pl_module: LightningModule) -> DataLoader:
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

    def _evidence_batches(self, trainer: Trainer, pl_module: LightningModule, warn: bool = False) -> Iterable:
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


STATISTICS = ("pass", "training")


def _check_statistics(statistics: Any, options: CurvatureOptions) -> str:
    """Validate ``statistics``: ``"training"`` takes the empirical Fisher of ``diag`` or ``kron`` only."""
    if statistics not in STATISTICS:
        raise ValueError(f"`statistics` must be one of {STATISTICS}, got {statistics!r}.")
    if statistics == "training" and (options.approx != "ef" or options.structure not in ("diag", "kron")):
        raise ValueError(
            f"statistics='training' takes structure='diag' or 'kron' with approx='ef', got structure="
            f"{options.structure!r}, approx={options.approx!r}: the training backward gives one gradient of the loss "
            "per example (the empirical Fisher), not the GGN's loss-Hessian columns, the full structure's per-example "
            "rows or EKFAC's second pass; use statistics='pass' for those."
        )
    if statistics == "training" and options.backend != "hooks":
        raise ValueError(f"statistics='training' takes backend='hooks', got backend={options.backend!r}.")
    return statistics


def _check_fraction(fraction: Any, statistics: str) -> float:
    """Validate ``statistics_fraction``: a number in (0, 1], below 1 only with statistics='training'."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"`statistics_fraction` must be a number in (0, 1], got {fraction!r}.")
    if fraction < 1 and statistics != "training":
        raise ValueError(
            f"`statistics_fraction`={fraction} subsamples the training passes' sums: it needs statistics='training', "
            f"got statistics={statistics!r}."
        )
    return float(fraction)


def _check_training_statistics(trainer: Trainer, pl_module: LightningModule) -> None:
    """Refuse what statistics='training' cannot follow: manual optimization and float16 loss scaling."""
    if not pl_module.automatic_optimization:
        raise MargLikConfigurationError(
            "MargLikCallback(statistics='training') reads the gradients of the loss Lightning's automatic "
            "optimization backpropagates; with manual optimization (automatic_optimization = False, which several "
            "optimizers need) the callback cannot know which backward is the loss's or how it is scaled: use "
            "statistics='pass'."
        )
    if str(trainer.precision) == "16-mixed":
        raise MargLikConfigurationError(
            "MargLikCallback(statistics='training') with precision='16-mixed': the gradient scaler multiplies the "
            "loss by a changing factor and skips steps with overflowing gradients, which would enter the curvature; "
            "use precision='bf16-mixed' (no scaler) or statistics='pass'."
        )


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
def _progress(
    trainer: Trainer, batches: Iterable, package: LightningPackage
) -> Iterator[Optional[Callable[[int], None]]]:
    """A line for the evidence pass in the trainer's progress bar, TQDM or Rich (rank 0 only, if it is on).

    TQDM: placed and drawn as the bar's validation line, and gone when the pass ends as that one
    is. Rich: one line under the training bar, showing the latest pass.

    Yields:
        The per-batch callback for ``collect_statistics(on_batch=...)``, or ``None`` without a bar.
    """
    bars = trainer.progress_bar_callback
    if bars is None or not bars.is_enabled or not trainer.is_global_zero:
        yield None
        return
    try:
        total: Optional[int] = len(batches)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if isinstance(bars, package.tqdm_bar):
        # not init_validation_tqdm(): that bar draws an empty "Validation:" line when it is made
        bar = package.tqdm(
            desc=DESCRIPTION, total=total, position=2 * bars.process_position + 1, disable=bars.is_disabled,
            leave=False, dynamic_ncols=True, file=sys.stdout, bar_format=bars.BAR_FORMAT,
        )
        try:
            yield lambda _: bar.update(1)
        finally:
            bar.close()
    elif isinstance(bars, package.rich_bar) and bars.progress is not None:
        # one line under the training bar, reset for every pass and kept (a log file gets the last pass)
        progress = bars.progress
        size = math.inf if total is None else total
        task = next((t.id for t in progress.tasks if t.description == DESCRIPTION), None)
        if task is None:
            task = progress.add_task(DESCRIPTION, total=size)
        else:
            progress.reset(task, total=size, visible=True)

        def step(_: int) -> None:
            progress.update(task, advance=1)
            bars.refresh()

        yield step
        bars.refresh()
    else:
        yield None


def find_hyperparameters(pl_module: nn.Module) -> "tuple[GaussianPrior, Likelihood]":
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


class _FollowsEstimates:
    """Mixin of the callbacks that act on ``MargLikCallback``'s estimates: finds it at set-up."""

    _package: ClassVar[LightningPackage]
    _marglik: MargLikCallbackCore

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_package(self, trainer)
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            found = [c for c in trainer.callbacks if isinstance(c, MargLikCallbackCore)]
            if len(found) != 1:
                raise MargLikConfigurationError(
                    f"{type(self).__name__} needs exactly one MargLikCallback in the Trainer's callbacks."
                )
            self._marglik = found[0]


class CheckpointCore(_FollowsEstimates):
    """The logic of ``MargLikCheckpoint``, combined with a package's ``ModelCheckpoint``.

    Documented on ``lightning_marglik.MargLikCheckpoint``.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        save_top_k: int = 1,
        save_last: Optional[bool] = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            dirpath=dirpath,
            filename=filename,
            monitor=MONITOR,
            mode="max",
            save_top_k=save_top_k,
            save_last=save_last,
            verbose=verbose,
            save_on_train_epoch_end=True,
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # resolves dirpath (by default the logger's)
        if stage == "fit":
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
        if not self._marglik.is_fresh(trainer):
            return
        finite = math.isfinite(self._marglik.last_marglik) and _all_finite(pl_module)
        # saving runs collectives: every rank must take the same decision
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            super().on_train_epoch_end(trainer, pl_module)
        elif self.verbose:
            log.info(f"MargLikCheckpoint: epoch {trainer.current_epoch} not saved (non-finite evidence or weights).")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """``last.ckpt`` comes from estimation epochs only: not Lightning's save of the final weights,
        which may be non-finite or never estimated."""


def _all_finite(module: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of ``module`` is finite (one sync)."""
    tensors = [t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


class EarlyStoppingCore(_FollowsEstimates):
    """The logic of ``MargLikEarlyStopping``, combined with a package's ``EarlyStopping``.

    Documented on ``lightning_marglik.MargLikEarlyStopping``.
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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # a new fit (a resumed one restores the counters after setup)
            self.wait_count, self.stopped_epoch = 0, 0
            self.best_score = torch.tensor(-math.inf)
            self.stopping_reason, self.stopping_reason_message = self._package.stopping_reason.NOT_STOPPED, None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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
        if self.stopping_reason == self._package.stopping_reason.PATIENCE_EXHAUSTED:
            reason = (
                f"{MONITOR} (log evidence per datum) did not improve by more than min_delta={self.min_delta} in "
                f"the last {self.wait_count} estimations (patience={self.patience}); best {self.best_score:.4f}."
            )
        return should_stop, f"MargLikEarlyStopping stopped training after epoch {self._epoch}: {reason}"

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Never act on validation: the evidence comes from the training data."""
