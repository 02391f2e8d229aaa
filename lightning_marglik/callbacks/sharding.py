"""Sharded training: the callbacks' forwards see whole parameters, and the strategies they refuse.

Under Lightning's ``FSDPStrategy`` (PyTorch's ``FullyShardedDataParallel``, FSDP1) every rank
holds a flat 1-D shard of the weights outside FSDP's own forward; the callbacks' set-up check,
evidence passes and hyperparameter steps call the LightningModule's forward and read the prior's
parameters directly, so they run inside :func:`whole_parameters`: FSDP gathers every parameter
on every rank (``summon_full_params``), and from there the pass is that of DDP (each rank its
share of the evidence data). The Kronecker factors follow the sharding instead (:func:`shards_parameters`):
each layer's are summed onto one owning rank batch by batch and decomposed there, and the evidence
sums the ranks' log-determinants (:mod:`lightning_marglik.curvature.structures.sharded`); the other
structures' sums are reduced onto every rank, as under DDP. The hyperparameters are buffers, which
FSDP does not shard. The cost: during an estimate every rank holds the whole weights and its own
layers' factors (``benchmarks/results/fsdp.md``).

FSDP2 (``fully_shard`` in ``configure_model``, through Lightning's ``ModelParallelStrategy``)
holds the weights as DTensors sharded across ranks outside its modules' forwards; there the
passes run after ``FSDPModule.unshard`` of every ``fully_shard`` module (the same cost), and the
prior's norms of sharded tensors (:func:`~lightning_marglik.map_loss` during training) are
reduced across ranks by the prior itself.

Strategies whose parameters the callbacks cannot gather (DeepSpeed; tensor parallelism, which
splits each layer's computation) are refused at set-up by :func:`check_strategy`, as is a fit that
torch < 2.14 would crash when it saves a checkpoint (FSDP1 on the CPU with full state dicts).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, List, Optional

import torch
from lightning_utilities.core.overrides import is_overridden
from torch import nn

from ..private import fsdp2_recomputing, fsdp_state_dict_type, fsdp_strategy_kwargs
from .package import LightningModule, MargLikConfigurationError, Trainer

__all__ = ["check_strategy", "release_applied_gradients", "shards_parameters", "whole_parameters"]

# strategy class name (either Lightning package) -> why the callbacks cannot follow it
_REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed partitions the weights (ZeRO) in its own engine, whose parameters the callbacks "
    "cannot gather for the evidence pass",
}
_WORKS = ("strategy='ddp' (every rank holds the whole model), FSDPStrategy (FSDP1; sharding_strategy FULL_SHARD, "
          "SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD, with its default use_orig_params=True) or FSDP2 through "
          "ModelParallelStrategy(data_parallel_size=<number of processes>, tensor_parallel_size=1), with fully_shard "
          "over self.device_mesh['data_parallel'] in configure_model")


def check_strategy(callback: Any, trainer: Trainer) -> None:
    """Refuse a strategy whose sharded parameters the callbacks cannot gather, or whose checkpoints the installed
    torch cannot save.

    Raises:
        MargLikConfigurationError: Naming the strategy, why, and the strategies that work.
    """
    strategy = trainer.strategy
    names = [cls.__name__ for cls in type(strategy).__mro__]
    refused = next((name for name in names if name in _REFUSED), None)
    if refused is not None:
        raise MargLikConfigurationError(
            f"{type(callback).__name__} does not support {type(strategy).__name__}: {_REFUSED[refused]}. Use {_WORKS}."
        )
    if "ModelParallelStrategy" in names:
        _check_no_tensor_parallel(callback, strategy)
    if "FSDPStrategy" in names and not fsdp_strategy_kwargs(strategy).get("use_orig_params", True):
        raise MargLikConfigurationError(
            f"{type(callback).__name__} under FSDPStrategy(use_orig_params=False): the network's parameters are then "
            "FSDP's flat parameters, not the layers' own, which the prior and the curvature are computed from; "
            "leave use_orig_params at its default, True."
        )
    if "FSDPStrategy" in names:
        _check_full_state_dict_save(callback, trainer)


# torch < 2.14: FSDP1's FlatParamHandle.to_cpu (a full state dict with offload_to_cpu=True, as Lightning's FSDPStrategy
# saves it) moves the gathered weights to the CPU and frees the gathered copy; when the weights already lie on the
# CPU the move is no copy, and the save reads freed memory: the process dies of a segmentation fault, no Python error.
# torch 2.14 skips the move on the CPU. On a GPU the move copies.
_CPU_FULL_STATE_DICT_FIXED = (2, 14)


def _check_full_state_dict_save(callback: Any, trainer: Trainer) -> None:
    """Refuse, on torch < 2.14, an FSDP1 fit on the CPU that saves full-state-dict checkpoints: the first save
    would crash the process (Lightning's ``state_dict_type`` is private: :func:`~lightning_marglik.private.fsdp_state_dict_type`)."""
    strategy = trainer.strategy
    if torch.__version__ >= _CPU_FULL_STATE_DICT_FIXED or strategy.root_device.type != "cpu":
        return
    if fsdp_state_dict_type(strategy) != "full" or not trainer.checkpoint_callbacks:
        return
    savers = ", ".join(type(c).__name__ for c in trainer.checkpoint_callbacks)
    raise MargLikConfigurationError(
        f"{type(callback).__name__} under FSDPStrategy on the CPU with state_dict_type='full' and checkpoints ({savers}): "
        f"torch {torch.__version__}'s FSDP crashes the process (segmentation fault) saving a full state dict of "
        "weights on the CPU, fixed in torch 2.14. Use torch>=2.14, FSDPStrategy(state_dict_type='sharded'), "
        "strategy='ddp', or no checkpoints (Trainer(enable_checkpointing=False), no MargLikCheckpoint)."
    )


def _check_no_tensor_parallel(callback: Any, strategy: Any) -> None:
    """Refuse tensor parallelism: its DTensors are split inside the forward (each rank computes part of a layer),
    which neither ``FSDPModule.unshard`` nor the passes undo. The mesh exists once the processes are set up, before
    any callback's ``setup``."""
    size = strategy.device_mesh["tensor_parallel"].size()
    if size > 1:
        raise MargLikConfigurationError(
            f"{type(callback).__name__} under ModelParallelStrategy with tensor_parallel_size={size}: tensor "
            "parallelism splits the layers' computation across ranks, which the callbacks' passes cannot follow "
            f"(ModelParallelStrategy's default on one node). Use {_WORKS}."
        )


def _fsdp_modules(trainer: Trainer) -> List[nn.Module]:
    """The trained module's FSDP1 units and FSDP2 ``fully_shard`` modules (none before a strategy wrapped it)."""
    model = getattr(trainer.strategy, "model", None)
    if model is None or not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # only once a strategy wrapped the model

    return [module for module in model.modules() if isinstance(module, (FSDPModule, FullyShardedDataParallel))]


def shards_parameters(trainer: Trainer) -> bool:
    """Whether the trained module is wrapped by FSDP (FSDP1 units or FSDP2 ``fully_shard`` modules): there
    the evidence's layer-owned curvature (``kron``) is summed onto one rank per layer, not replicated."""
    return bool(_fsdp_modules(trainer))


def release_applied_gradients(trainer: Trainer, pl_module: LightningModule, lightning_module: type) -> None:
    """Under FSDP, free the gradients the optimizers have applied before an estimate at an epoch's end.

    There Lightning's automatic optimization has stepped on them (an epoch's last batch steps, whatever
    ``accumulate_grad_batches``), and its ``optimizer_zero_grad`` sets them to ``None`` before the next backward:
    freed now instead of then, their shards (a quarter of the training state under Adam) are not held through the
    estimate's peak. Left alone under DDP (there every rank's own factors of every layer set the peak), with manual
    optimization and where the module overrides ``optimizer_zero_grad`` (the gradients are then the module's).

    Args:
        trainer: The trainer (its strategy's model, its optimizers).
        pl_module: The trained module.
        lightning_module: Its Lightning package's ``LightningModule`` class.
    """
    if (not shards_parameters(trainer) or not pl_module.automatic_optimization
            or is_overridden("optimizer_zero_grad", pl_module, lightning_module)):
        return
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def whole_parameters(trainer: Trainer, copy_for: Optional[str] = None) -> ContextManager[Any]:
    """A context in which every parameter of the trained module is whole on every rank.

    Under FSDP (any FSDP unit in ``trainer.strategy.model``) or FSDP2 (any ``fully_shard`` module)
    it gathers the shards, a collective that every rank enters: call it on all ranks alike, outside
    FSDP's forward and backward.
    Changes to the parameters inside are discarded (the callbacks change none). Elsewhere it does
    nothing.

    Args:
        trainer: The trainer; its strategy holds the (possibly wrapped) model.
        copy_for: The callback method that copies the module inside the context, if one does.

    Returns:
        A context manager.

    Raises:
        MargLikConfigurationError: If ``copy_for`` is given under FSDP2, whose modules refuse to be
            copied (torch: "FSDP does not support deepcopy"), naming what works instead.
    """
    fully_sharded = _fsdp_modules(trainer)
    if not fully_sharded:
        return nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in fully_sharded):
        return _gathered(trainer.strategy.model, FullyShardedDataParallel)
    if copy_for is not None:
        raise MargLikConfigurationError(
            f"MargLikCallback.{copy_for} copies the module, which FSDP2 (fully_shard) does not allow (torch: \"FSDP "
            "does not support deepcopy\"): load a checkpoint of the fit (e.g. MargLikCheckpoint's best) into a plain "
            f"module and call lightning_marglik.folding.{copy_for} on it."
        )
    return _unsharded(fully_sharded)


@contextmanager
def _gathered(model: nn.Module, fsdp: type) -> Iterator[None]:
    """Every FSDP unit's parameters gathered, and the units inside the root (an ``auto_wrap_policy``'s) out of
    the way: FSDP's own forward must not run while they are gathered, so their parents call the wrapped layers."""
    with fsdp.summon_full_params(model, writeback=False, with_grads=False):
        inner = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if isinstance(child, fsdp) and child is not model
        ]
        try:
            for parent, name, child in inner:
                setattr(parent, name, child.module)
            yield
        finally:
            for parent, name, child in inner:
                setattr(parent, name, child)


@contextmanager
def _unsharded(modules: List[nn.Module]) -> Iterator[None]:
    """FSDP2: every ``fully_shard`` module's parameters gathered (``FSDPModule.unshard``, which registers the whole
    tensors on the modules), and FSDP2's forward hooks kept from acting on the passes: left as they are, they
    would reshard a module after its forward and, in a backward, reduce-scatter gradients and reshard again,
    collectives whose count would follow each rank's share of the data. In the state FSDP2 gives its modules
    while activation checkpointing recomputes a forward during backward (``TrainingState.PRE_BACKWARD``), the
    hooks only cast the inputs and outputs as a mixed-precision policy says. The modules are resharded after."""
    recomputing = fsdp2_recomputing(modules)  # reads FSDP2's private names before any collective
    try:
        for module in modules:  # in the modules' order, alike on every rank: the all-gathers pair up
            module.unshard()
        with recomputing:
            yield
    finally:
        for module in modules:
            module.reshard()
