"""Sharded training: the callbacks' forwards see whole parameters, and the strategies they refuse.

Under Lightning's ``FSDPStrategy`` (PyTorch's ``FullyShardedDataParallel``, FSDP1) every rank
holds a flat 1-D shard of the weights outside FSDP's own forward; the callbacks' set-up check,
evidence passes and hyperparameter steps call the LightningModule's forward and read the prior's
parameters directly, so they run inside :func:`whole_parameters`: FSDP gathers every parameter
on every rank (``summon_full_params``), and from there the pass is that of DDP (each rank its
share of the evidence data, the sums reduced across ranks). The hyperparameters are buffers,
which FSDP does not shard. The cost: during an estimate every rank holds the whole weights and
every layer's curvature, as under DDP (``benchmarks/results/fsdp.md``).

Strategies whose parameters the callbacks cannot gather (DeepSpeed, FSDP2 through
``ModelParallelStrategy``) are refused at set-up by :func:`check_strategy`.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from .package import MargLikConfigurationError, Trainer

__all__ = ["check_strategy", "whole_parameters"]

# strategy class name (either Lightning package) -> why the callbacks cannot follow it
_REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed partitions the weights (ZeRO) in its own engine, whose parameters the callbacks "
    "cannot gather for the evidence pass",
    "ModelParallelStrategy": "FSDP2 (fully_shard) and tensor parallelism hold the weights as sharded DTensors, which "
    "the callbacks' evidence pass does not gather",
}
_WORKS = ("strategy='ddp' (every rank holds the whole model) or FSDPStrategy (FSDP1; sharding_strategy FULL_SHARD, "
          "SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD, with its default use_orig_params=True)")


def check_strategy(callback: Any, trainer: Trainer) -> None:
    """Refuse a strategy whose sharded parameters the callbacks cannot gather.

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
    if "FSDPStrategy" in names and not getattr(strategy, "kwargs", {}).get("use_orig_params", True):
        raise MargLikConfigurationError(
            f"{type(callback).__name__} under FSDPStrategy(use_orig_params=False): the network's parameters are then "
            "FSDP's flat parameters, not the layers' own, which the prior and the curvature are computed from; "
            "leave use_orig_params at its default, True."
        )


def whole_parameters(trainer: Trainer) -> ContextManager[Any]:
    """A context in which every parameter of the trained module is whole on every rank.

    Under FSDP (any FSDP unit in ``trainer.strategy.model``) it gathers the shards, a collective
    that every rank enters: call it on all ranks alike, outside FSDP's forward and backward.
    Changes to the parameters inside are discarded (the callbacks change none). Elsewhere it does
    nothing.

    Args:
        trainer: The trainer; its strategy holds the (possibly wrapped) model.

    Returns:
        A context manager.
    """
    model = getattr(trainer.strategy, "model", None)
    if model is None or not torch.distributed.is_available():
        return nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel  # only once a strategy wrapped the model

    if not any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return nullcontext()
    return _gathered(model, FullyShardedDataParallel)


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
