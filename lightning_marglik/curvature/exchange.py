"""The exchange of a sharded evidence pass: owners, agreement rounds, the reduce onto owners, and failure.

Under sharded training (FSDP) a layer-owned structure keeps each layer's statistics on one rank
(:class:`~.structures.sharded.ShardedStructure`). This module is the protocol between the ranks, in one
place for the pass (:func:`~lightning_marglik.curvature.collect_statistics`) and the evidence built from it:

* owners: every layer has one owning rank, :func:`balanced_owners` of the layers' sizes, the same on every rank;
* rounds: ranks may hold different numbers of batches (the evidence data split without padding), so each batch
  begins with a round (:meth:`Exchange.round`) in which the ranks agree whether any still sends and whether any
  failed; a rank that has run out sends zeros while another sends (:meth:`Exchange.finish`);
* reduce: each layer's batch sums are summed onto its owner (``Exchange.reduce``), every evaluation of the
  evidence sums the ranks' shares (``Exchange.sum``); :func:`sharded_pass` takes both from the trainer's strategy
  (:class:`Collectives`);
* failure: a failure on one rank ends the exchange on all (:meth:`Exchange.ending`, :func:`sharded_pass`), so
  that none waits for a partner, and the others raise :data:`FAILED_ELSEWHERE`.

Every function here runs the same collectives in the same order on every rank; decisions that lead to a
collective depend only on values that are identical on all ranks. An unsharded pass has only the collectives
of every evidence pass (:mod:`lightning_marglik.distributed`: one rank's failure told to all, one reduction of
the statistics), over the same :class:`Collectives`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from .statistics import ReduceFn, SumFn

if TYPE_CHECKING:
    from pytorch_lightning.strategies import Strategy

__all__ = ["FAILED_ELSEWHERE", "Collectives", "Exchange", "balanced_owners", "sharded_pass"]

#: What a rank raises when the evidence pass failed on another.
FAILED_ELSEWHERE = "The evidence pass failed on another process; see that process's error."

def balanced_owners(costs: Sequence[int], world_size: int) -> List[int]:
    """The owning rank of each item: the largest first, each to the least loaded rank (ties: the lower
    rank); a function of ``costs`` only, so every rank computes the same owners.

    Example:
        >>> balanced_owners([4, 4, 4, 2], 2)
        [0, 1, 0, 1]
    """
    loads = [0] * world_size
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += costs[j]
    return owners


@dataclass
class Exchange:
    """The collectives of a sharded evidence pass, given by its caller (the callbacks: the trainer's strategy).

    One per pass: the agreement rounds end it (:meth:`finish`).

    Attributes:
        rank: This process's global rank.
        world_size: Number of processes.
        reduce: Sum a tensor of every rank into rank ``dst``'s, in place there.
        sum: All-reduce (sum) of a 1-D float64 tensor; returns the sum.
        send_zeros: This rank's part of a round in which it has no batch, set by the pass's sharded structure
            (``None`` until one is built: a rank sends only what every rank planned alike).
    """

    rank: int
    world_size: int
    reduce: ReduceFn
    sum: SumFn
    closed: bool = field(default=False, init=False)  # set once a round ended the exchange on every rank
    send_zeros: Optional[Callable[[], None]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"Exchange(world_size={self.world_size!r}): the number of processes, an int >= 1.")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"Exchange(rank={self.rank!r}): this process's rank, an int in [0, {self.world_size}).")
        if not (callable(self.reduce) and callable(self.sum)):
            raise TypeError("Exchange(reduce=..., sum=...) take the collectives as callables.")

    def round(self, sending: bool, failed: bool = False) -> bool:
        """One agreement round: whether any rank sends a batch now.

        Raises:
            RuntimeError: If another rank's pass failed (every rank learns it in the same round).
        """
        flags = self.sum(torch.tensor([float(sending), float(failed)], dtype=torch.float64))
        if float(flags[1]) > 0:
            self.closed = True
            if not failed:
                raise RuntimeError(FAILED_ELSEWHERE)
        return float(flags[0]) > 0

    def finish(self, failed: bool) -> None:
        """End the pass on this rank: send zeros while another rank still sends, or tell every rank of this
        rank's failure; nothing if a round already ended the exchange. Every rank calls it once after its pass.

        Raises:
            RuntimeError: If another rank's pass failed.
        """
        while not self.closed:
            if not self.round(False, failed) or failed:
                self.closed = True
            else:
                assert self.send_zeros is not None  # a rank sends only what every rank planned alike
                self.send_zeros()

    @contextmanager
    def ending(self) -> Iterator[None]:
        """End the exchange on this rank however the block (the pass) ends, so that no other rank waits for it:
        a failure here is told to the others before it is raised."""
        try:
            yield
        except BaseException:
            self.finish(failed=True)
            raise
        self.finish(failed=False)


class Collectives:
    """The collectives of the trainer's strategy that an evidence pass uses, on the strategy's device.

    Args:
        strategy: The trainer's strategy (either Lightning package's).
    """

    def __init__(self, strategy: "Strategy") -> None:
        self.strategy = strategy

    def sum(self, flat: Tensor) -> Tensor:
        """All-reduce (sum) of ``flat`` over every rank."""
        return self.strategy.reduce(flat.to(self.strategy.root_device), reduce_op="sum")

    def gather(self, tensor: Tensor) -> List[Tensor]:
        """Every rank's ``tensor`` (of one shape), in rank order."""
        return list(self.strategy.all_gather(tensor.to(self.strategy.root_device)).unbind(0))

    def reduce_onto(self, tensor: Tensor, dst: int) -> None:
        """Sum every rank's ``tensor`` into rank ``dst``'s, in place there: torch's reduce in the default process
        group, which Lightning's strategies do not offer."""
        moved = tensor.to(self.strategy.root_device)
        torch.distributed.reduce(moved, dst=dst)
        if moved is not tensor and dst == self.strategy.global_rank:
            tensor.copy_(moved)


@contextmanager
def sharded_pass(strategy: "Strategy", sharded: bool) -> Iterator[Optional[Exchange]]:
    """The exchange of one sharded evidence pass over the strategy's :class:`Collectives` (``None`` where
    ``sharded`` is false). A failure before the pass began its rounds is told to the other ranks, which would
    otherwise wait for this one; the pass tells its own (:meth:`Exchange.ending`)."""
    if not sharded:
        yield None
        return
    collectives = Collectives(strategy)
    exchange = Exchange(strategy.global_rank, strategy.world_size, collectives.reduce_onto, collectives.sum)
    try:
        yield exchange
    except BaseException:
        exchange.finish(failed=True)  # nothing if the pass's own rounds already ended the exchange
        raise
