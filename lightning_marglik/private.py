"""The private names of torch and Lightning that lightning_marglik reads, one function each.

Neither package promises these names: an upgrade may rename or drop any of them. Read elsewhere with
a default, a missing name would be skipped silently (without Lightning's ``_average_model`` the
hyperparameters would be averaged with the weights); read plainly, it would raise an
``AttributeError`` far from its cause. Each function here reads one name, and says what it reads and
what happens when the name is gone: either a :class:`PrivateAPIError` that names it, the installed
version and the fix, or, where a public value gives the same answer in the common case, that value
with a warning. ``tests/test_private_attributes.py`` checks every name on the installed versions:
after an upgrade, run it first.
"""
from __future__ import annotations

import importlib
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both Lightning packages
from torch import Tensor, nn

__all__ = [
    "PrivateAPIError",
    "WRAPPER_PREFIXES",
    "averaged_module",
    "batches_that_stepped",
    "conv_base",
    "early_stopping_checks_at_epoch_end",
    "fsdp2_recomputing",
    "fsdp_state_dict_type",
    "fsdp_strategy_kwargs",
    "norm_base",
    "pruned_tensors",
    "strip_wrapper_prefixes",
    "strong_wolfe",
    "tensor_version",
    "unknown_wrappers",
    "user_sampler",
]

# the components torch's FSDP1 and activation-checkpoint wrappers put into the names of the parameters they wrap
# (torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE, ...checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE)
WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPERS = re.compile("(" + "|".join(WRAPPER_PREFIXES) + r")\.")


class PrivateAPIError(RuntimeError):
    """A private name of torch or Lightning that lightning_marglik reads is missing from the installed
    version; the message names it, the version and the fix."""


def _package(owner: Any) -> str:
    """The top-level package an object or class comes from: ``"torch"``, ``"pytorch_lightning"``, ``"lightning"``."""
    module = owner.__module__ if isinstance(owner, type) else type(owner).__module__
    return module.split(".")[0]


def _version(package: str) -> str:
    return getattr(sys.modules.get(package), "__version__", "of unknown version")


def _missing(name: str, package: str, consequence: str, alternative: str = "") -> PrivateAPIError:
    return PrivateAPIError(
        f"lightning_marglik reads {name}, a private name of {package}, which the installed {package} "
        f"{_version(package)} does not have: {consequence}. Install an earlier {package} (one that has it)"
        f"{alternative}."
    )


def _fall_back(owner: Any, name: str, instead: str) -> None:
    """Warn that ``owner`` has no attribute ``name`` and what is done ``instead``."""
    package = _package(owner)
    rank_zero_warn(f"lightning_marglik: the installed {package} {_version(package)} has no "
                   f"{type(owner).__name__}.{name}; {instead}")


def averaged_module(callback: Any) -> Optional[nn.Module]:
    """The module that holds a Lightning weight-averaging callback's averages.

    Reads ``_average_model`` of ``WeightAveraging`` (an ``AveragedModel``, whose ``module`` is the
    averaged copy of the LightningModule) and of ``StochasticWeightAveraging`` (the copy itself).

    Args:
        callback: A ``WeightAveraging`` (e.g. ``EMAWeightAveraging``) or ``StochasticWeightAveraging``.

    Returns:
        The averaged copy, or ``None`` before the callback's set-up made it.

    Raises:
        PrivateAPIError: If ``callback`` has no ``_average_model``: without it the hyperparameters would be
            averaged with the weights, so this is never skipped.
    """
    if not hasattr(callback, "_average_model"):
        raise _missing(
            f"{type(callback).__name__}._average_model", _package(callback),
            "without it the learned hyperparameters would be averaged with the weights",
            f", or train without {type(callback).__name__}",
        )
    average = callback._average_model
    return getattr(average, "module", average)


def batches_that_stepped(trainer: Any) -> int:
    """The batch count Lightning logs an epoch's end at (plus one): the fit loop's ``_batches_that_stepped``.

    Falls back to ``trainer.global_step``, with a warning, where the fit loop has no such count; the two
    are equal unless manual optimization steps several optimizers per batch.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_batches_that_stepped"):
        return int(loop._batches_that_stepped)
    _fall_back(loop, "_batches_that_stepped", "the estimate made when training ends is logged at trainer.global_step "
               "instead, which differs from Lightning's own steps under manual optimization with several optimizers.")
    return int(trainer.global_step)


def early_stopping_checks_at_epoch_end(callback: Any, trainer: Any) -> bool:
    """Whether Lightning's ``EarlyStopping`` checks at the end of every training epoch (else after validation).

    Reads its ``_check_on_train_epoch_end`` (the ``check_on_train_epoch_end`` argument, ``None`` until
    the callback's set-up decides it as below). Where it is missing, decides by Lightning's own rule
    (once per epoch with validation every epoch: at the epoch's end), with a warning: an explicit
    ``check_on_train_epoch_end`` cannot be read then.
    """
    rule = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1  # EarlyStopping.setup's
    if not hasattr(callback, "_check_on_train_epoch_end"):
        when = "at the end of every training epoch" if rule else "after validation"
        _fall_back(callback, "_check_on_train_epoch_end", f"assuming it checks {when}, as Lightning's default does.")
        return rule
    checks = callback._check_on_train_epoch_end
    return rule if checks is None else bool(checks)


def checkpoint_saves_at_epoch_end(callback: Any, trainer: Any) -> bool:
    """Whether Lightning's ``ModelCheckpoint`` saves at the end of training epochs only (else also after
    validation, or every ``every_n_train_steps`` or ``train_time_interval``, before the epoch's estimate).

    Reads its ``_save_on_train_epoch_end`` (the ``save_on_train_epoch_end`` argument; ``None``: Lightning's rule,
    at the epoch's end where validation runs once per epoch, or never), ``_every_n_train_steps`` and
    ``_train_time_interval``. Where one is missing, assumes Lightning's default (at the epoch's end), with a
    warning: the arguments cannot be read then.
    """
    rule = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
    names = ("_save_on_train_epoch_end", "_every_n_train_steps", "_train_time_interval")
    for name in names:
        if not hasattr(callback, name):
            _fall_back(callback, name, "assuming it saves at the end of every training epoch, as Lightning's default "
                       "does.")
            return True
    at_end = rule if callback._save_on_train_epoch_end is None else bool(callback._save_on_train_epoch_end)
    return at_end and callback._every_n_train_steps < 1 and callback._train_time_interval is None


def fsdp_strategy_kwargs(strategy: Any) -> Dict[str, Any]:
    """The keyword arguments Lightning's ``FSDPStrategy`` passes to ``FullyShardedDataParallel`` (its
    ``kwargs``, undocumented); ``{}``, with a warning, where the strategy keeps none: ``use_orig_params``
    cannot be checked then."""
    if hasattr(strategy, "kwargs"):
        return dict(strategy.kwargs)
    _fall_back(strategy, "kwargs", "use_orig_params=False, which the callbacks cannot follow, is not checked: leave it "
               "at its default, True.")
    return {}


def fsdp_state_dict_type(strategy: Any) -> str:
    """How Lightning's ``FSDPStrategy`` saves checkpoints (its ``_state_dict_type``: ``"full"`` or ``"sharded"``);
    ``"full"``, with a warning, where the strategy keeps none: the check that needs it then refuses what a full save
    would crash (torch < 2.14 on the CPU) rather than risk it."""
    if hasattr(strategy, "_state_dict_type"):
        return str(strategy._state_dict_type)
    _fall_back(strategy, "_state_dict_type", "taking it for 'full' (the check of a full save on torch < 2.14 refuses).")
    return "full"


def fsdp2_recomputing(modules: Sequence[nn.Module]) -> ContextManager[None]:
    """A context in which FSDP2's ``fully_shard`` modules are in the state FSDP2 gives them while activation
    checkpointing recomputes a forward during backward (``TrainingState.PRE_BACKWARD``); their own states after.

    Reads ``FSDPModule._get_fsdp_state``, each state's ``_training_state`` and
    ``torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState``, all at the call (before the
    context is entered: before any collective).

    Raises:
        PrivateAPIError: If any of them is missing: FSDP2's hooks would then act on the callbacks' passes.
    """
    consequence = "without it FSDP2's hooks would reshard and reduce gradients during the callbacks' passes"
    alternative = ", or use FSDPStrategy (FSDP1) or DDP"
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        recomputing = TrainingState.PRE_BACKWARD
    except (ImportError, AttributeError):
        raise _missing("torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState.PRE_BACKWARD", "torch",
                       consequence, alternative) from None
    if not all(hasattr(module, "_get_fsdp_state") for module in modules):
        raise _missing("FSDPModule._get_fsdp_state", "torch", consequence, alternative)
    states = list({id(state): state for state in (module._get_fsdp_state() for module in modules)}.values())
    if not all(hasattr(state, "_training_state") for state in states):
        raise _missing(f"{type(states[0]).__name__}._training_state", "torch", consequence, alternative)
    return _in_state(states, recomputing)


@contextmanager
def _in_state(states: List[Any], training_state: Any) -> Iterator[None]:
    before = [state._training_state for state in states]
    try:
        for state in states:
            state._training_state = training_state
        yield
    finally:
        for state, own in zip(states, before):
            state._training_state = own


def strip_wrapper_prefixes(name: str) -> str:
    """A parameter's name without the components FSDP1 (``_fsdp_wrapped_module``) and activation checkpointing
    (``_checkpoint_wrapped_module``) put into it: its name in the unwrapped model."""
    return _WRAPPERS.sub("", name)


def unknown_wrappers(missing: Sequence[str], names: Sequence[str]) -> Dict[str, str]:
    """For a name ``missing`` from a model whose names are ``names``: the model's name that is the missing one
    with one more component, e.g. a wrapper's that torch renamed (``{"0._new_wrapper.weight": "0.weight"}``)."""
    parts = {tuple(name.split(".")): name for name in missing}
    found = {}
    for name in names:
        split = name.split(".")
        for i in range(len(split) - 1):
            if tuple(split[:i] + split[i + 1:]) in parts:
                found[name] = parts[tuple(split[:i] + split[i + 1:])]
    return found


def pruned_tensors(module: nn.Module) -> Dict[str, str]:
    """The tensors ``torch.nn.utils.prune`` computes in ``module``'s forward, each to the parameter it
    multiplies by ``<name>_mask``: e.g. ``{"weight": "weight_orig"}``.

    Reads ``module._forward_pre_hooks`` and each pruning hook's ``_tensor_name``.

    Raises:
        PrivateAPIError: If either is missing: a pruned layer's curvature would be that of the unpruned weight.
    """
    from torch.nn.utils import prune

    if not hasattr(module, "_forward_pre_hooks"):
        raise _missing("nn.Module._forward_pre_hooks", "torch", "without it a pruned layer cannot be recognised")
    hooks = [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, prune.BasePruningMethod)]
    if not all(hasattr(hook, "_tensor_name") for hook in hooks):  # a PruningContainer (pruned again) is one too
        raise _missing("prune.BasePruningMethod._tensor_name", "torch",
                       "without it a pruned layer cannot be recognised")
    return {hook._tensor_name: f"{hook._tensor_name}_orig" for hook in hooks}


def tensor_version(tensor: Tensor) -> int:
    """``tensor._version``: autograd's count of in-place changes, which the evidence pass compares to find a layer
    whose recorded input or output a later in-place operation changed.

    Raises:
        PrivateAPIError: If tensors have no ``_version``: such a change would go unseen.
    """
    try:
        return tensor._version
    except AttributeError:
        raise _missing("Tensor._version", "torch", "without it an in-place operation after a layer goes unseen by "
                       "the evidence pass") from None


def user_sampler(dataset: Any) -> Optional[Any]:
    """The user's sampler inside the data set of Lightning's ``DistributedSamplerWrapper``, else ``None``.

    Reads ``_DatasetSamplerWrapper`` (``lightning_fabric.utilities.distributed``, and its copy in
    ``lightning.fabric`` for ``import lightning``) and its ``_sampler``.

    Raises:
        PrivateAPIError: If neither package has the class, or it keeps no ``_sampler``: the keys would be taken
            for the whole data set's.
    """
    wrappers = []
    for package, module in (("lightning_fabric", "lightning_fabric.utilities.distributed"),
                            ("lightning", "lightning.fabric.utilities.distributed")):
        if package not in sys.modules:
            continue  # not imported: ``dataset`` cannot be its wrapper (and ``lightning`` is optional)
        try:
            wrappers.append(importlib.import_module(module)._DatasetSamplerWrapper)
        except (ImportError, AttributeError):
            raise _missing(f"{module}._DatasetSamplerWrapper", package,
                           "without it the keys of a sampler under DDP would be taken for the whole data set's",
                           ", or set Trainer(use_distributed_sampler=False) and shard the data yourself") from None
    if not isinstance(dataset, tuple(wrappers)):
        return None
    if not hasattr(dataset, "_sampler"):
        raise _missing("_DatasetSamplerWrapper._sampler", _package(dataset),
                       "without it the keys of a sampler under DDP would be taken for the whole data set's")
    return dataset._sampler


def strong_wolfe() -> Callable[..., Any]:
    """``torch.optim.lbfgs._strong_wolfe``, the line search of ``torch.optim.LBFGS``.

    Raises:
        PrivateAPIError: If torch has no such function.
    """
    from torch.optim import lbfgs

    if not hasattr(lbfgs, "_strong_wolfe"):
        raise _missing("torch.optim.lbfgs._strong_wolfe", "torch",
                       "the preconditioned L-BFGS of lightning_marglik.linearized searches its steps with it")
    return lbfgs._strong_wolfe


def norm_base() -> type:
    """``torch.nn.modules.batchnorm._NormBase``, the base class of ``BatchNorm*``, ``SyncBatchNorm`` and
    ``InstanceNorm*``.

    Raises:
        PrivateAPIError: If torch has no such class (at ``import lightning_marglik``).
    """
    from torch.nn.modules import batchnorm

    if not hasattr(batchnorm, "_NormBase"):
        raise _missing("torch.nn.modules.batchnorm._NormBase", "torch",
                       "BatchNorm and InstanceNorm layers are recognised by it")
    return batchnorm._NormBase


def conv_base() -> type:
    """``torch.nn.modules.conv._ConvNd``, the base class of ``Conv*d`` and ``ConvTranspose*d``.

    Raises:
        PrivateAPIError: If torch has no such class (at ``import lightning_marglik``).
    """
    from torch.nn.modules import conv

    if not hasattr(conv, "_ConvNd"):
        raise _missing("torch.nn.modules.conv._ConvNd", "torch", "convolutions are recognised by it")
    return conv._ConvNd
