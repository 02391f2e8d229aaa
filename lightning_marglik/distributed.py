"""The evidence pass across processes: unpadded data shards and one reduction of the statistics.

Every function here runs the same collectives in the same order on every rank; decisions that
lead to a collective depend only on values that are identical on all ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from pytorch_lightning.strategies import Strategy
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .curvature import CurvatureStatistics

__all__ = ["evidence_loader", "reduce_statistics", "run_on_all_ranks"]


def evidence_loader(loader: DataLoader, rank: int = 0, world_size: int = 1) -> DataLoader:
    """A loader over this rank's share of ``loader``'s data set, each example on exactly one rank.

    The training loader's sampler is not reused: it may shuffle, drop the last batch, or (under
    DDP) pad shards by repeating examples, all of which would miscount the evidence.

    Args:
        loader: The loader whose data set the evidence covers.
        rank: This process's global rank.
        world_size: Number of processes.

    Returns:
        A loader over examples ``rank, rank + world_size, ...`` in order, with the same batch size
        (that of a custom batch sampler if it has one, else 1; if ``loader`` does not batch, the
        keys stay single items, or index lists of the same length when its sampler is a
        ``BatchSampler``) and the same collation and worker set-up.

    Raises:
        ValueError: If the data set is iterable-style under several processes (it cannot be
            sharded without padding), or has fewer examples than processes.
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if world_size > 1:
            raise ValueError(
                "The evidence pass cannot shard an IterableDataset across processes without repeating "
                "examples; pass `dataloader=` a map-style data set to MargLikCallback."
            )
        return loader
    size = len(dataset)  # type: ignore[arg-type]
    if size < world_size:
        raise ValueError(f"The evidence data set has {size} examples, fewer than the {world_size} processes.")
    batch_size: Optional[int]
    shard: Any = range(rank, size, world_size)
    if loader.batch_size is not None:
        batch_size = loader.batch_size
    elif loader.batch_sampler is not None:  # a custom batch sampler
        batch_size = getattr(loader.batch_sampler, "batch_size", None) or 1
    else:  # automatic batching off: the data set is indexed by the sampler's keys
        batch_size = None
        per_key = getattr(loader.sampler, "batch_size", None)
        if per_key:  # a BatchSampler as sampler: the keys are index lists (one fetch per batch)
            shard = BatchSampler(shard, per_key, drop_last=False)
    workers: Dict[str, Any] = {}
    if loader.num_workers > 0:  # the user's worker set-up (e.g. opening files per worker)
        workers = dict(
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            timeout=loader.timeout,
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=shard,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        **workers,
    )


def run_on_all_ranks(strategy: Strategy, work: Callable[[], CurvatureStatistics]) -> CurvatureStatistics:
    """Run ``work`` on every rank; if it fails anywhere, raise on every rank instead of hanging.

    Raises:
        RuntimeError: If ``work`` failed on another rank (this rank re-raises its own error).
    """
    error: Optional[BaseException] = None
    result = None
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = exc
    device = strategy.root_device
    failures = strategy.reduce(torch.tensor(float(error is not None), device=device), reduce_op="sum")
    if error is not None:
        raise error
    if float(failures) > 0:
        raise RuntimeError("The evidence pass failed on another process; see that process's error.")
    assert result is not None
    return result


def reduce_statistics(stats: CurvatureStatistics, strategy: Strategy) -> CurvatureStatistics:
    """Sum the statistics of all ranks in place (rows of the full structure are concatenated).

    Args:
        stats: This rank's statistics; the same keys on every rank.
        strategy: The trainer's strategy, which owns the collectives.

    Returns:
        ``stats``, now holding the global sums.
    """
    if strategy.world_size == 1:
        return stats
    if stats.structure == "full":
        local = 0 if stats.rows is None else stats.rows.shape[0]
        in_gram = "gram" in stats.sums
        flags = strategy.reduce(torch.tensor([float(local), float(in_gram)], device=strategy.root_device), reduce_op="sum")
        if flags[0] >= stats.n_params or flags[1] > 0:
            stats.to_gram()
            ref = stats.sums["n_data"]
            stats.sums.setdefault("gram", ref.new_zeros(stats.n_params, stats.n_params))
        else:
            stats.rows = _gather_rows(stats.rows, strategy)
    stats.sums = {k: strategy.reduce(v, reduce_op="sum") for k, v in sorted(stats.sums.items())}
    return stats


def _gather_rows(rows: Optional[Tensor], strategy: Strategy) -> Tensor:
    """All-gather row blocks of different lengths (padded to the longest, then trimmed)."""
    assert rows is not None
    lengths = strategy.all_gather(torch.tensor(rows.shape[0], device=rows.device)).reshape(-1)
    longest = int(lengths.max())
    padded = rows.new_zeros(longest, rows.shape[1])
    padded[: rows.shape[0]] = rows
    gathered = strategy.all_gather(padded).reshape(-1, longest, rows.shape[1])
    return torch.cat([block[: int(n)] for block, n in zip(gathered, lengths)])
