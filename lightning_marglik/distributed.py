"""The evidence pass across processes: unpadded data shards and one reduction of the statistics (a sharded
pass's exchange is :mod:`.curvature.exchange`'s).

Every function here runs the same collectives in the same order on every rank; decisions that
lead to a collective depend only on values that are identical on all ranks.
"""
from __future__ import annotations

import itertools
import operator
import pickle
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, Iterable, Iterator, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

if TYPE_CHECKING:  # a strategy of either Lightning package: only its collectives are called
    from pytorch_lightning.strategies import Strategy

from .curvature import CurvatureStatistics
from .curvature.exchange import FAILED_ELSEWHERE, Collectives
from .private import user_sampler

__all__ = ["epoch_keys", "evidence_loader", "reduce_statistics", "run_on_all_ranks"]

T = TypeVar("T")

_FIX = (
    "the evidence needs every training example exactly once: pass MargLikCallback `dataloader=` a DataLoader "
    "over the examples to evaluate (e.g. `DataLoader(Subset(dataset, indices))`)."
)


def evidence_loader(
    loader: DataLoader, rank: int = 0, world_size: int = 1, max_batches: Optional[int] = None
) -> Iterable:
    """This rank's share of the examples one epoch of ``loader`` draws, each example on exactly one rank.

    The examples are those of ``loader``'s sampler (its index set: a ``SubsetRandomSampler``'s
    indices, a custom sampler's keys, the whole data set for sequential, shuffling and distributed
    samplers), each once, in sorted order (first-seen order for keys that do not sort). The
    sampler itself is not reused: it may shuffle, drop the last batch or (under DDP) pad shards by
    repeating examples, all of which would miscount the evidence. Under DDP, Lightning's
    ``DistributedSamplerWrapper`` around a custom sampler is looked through to the user's sampler.

    Args:
        loader: The loader whose examples the evidence covers.
        rank: This process's global rank.
        world_size: Number of processes.
        max_batches: For an iterable-style data set (which has no index set): read only its first
            ``max_batches`` batches, those one training epoch uses. Ignored for map-style data.

    Returns:
        A loader over every ``world_size``-th key of that index set starting at ``rank``, with the
        same batch size (that of a custom batch sampler if it has one, else 1; if ``loader`` does not
        batch, the keys stay single items, or index lists of the same length when its sampler is a
        ``BatchSampler``) and the same collation and worker set-up. An iterable-style loader comes
        back as it is (or bounded by ``max_batches``).

    Raises:
        ValueError: If the sampler draws another distribution than its index set (with
            replacement, by weight, a random part of it, or a key more than once), has no finite
            length, or there are fewer examples than processes; if the data set is iterable-style
            under several processes (it cannot be sharded without repeating examples), or has no
            length and no ``max_batches`` (the pass would never end).
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if world_size > 1:
            raise ValueError(
                "The evidence pass cannot shard an IterableDataset across processes without repeating "
                "examples; pass `dataloader=` a map-style data set to MargLikCallback."
            )
        return _bounded(loader, max_batches)
    source, batched, batch_size, per_key = _key_source(loader)
    keys = epoch_keys(source, batched)
    if len(keys) < world_size:
        raise ValueError(f"The evidence data set has {len(keys)} examples, fewer than the {world_size} processes.")
    shard: Any = keys[rank::world_size]
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


def _key_source(loader: DataLoader) -> Tuple[Union[Sampler, Iterable], bool, Optional[int], Optional[int]]:
    """Where ``loader``'s keys come from: ``(sampler, yields batches, batch size, keys per fetch)``.

    A custom batch sampler with an inner ``sampler`` (a ``BatchSampler``) gives that sampler;
    one without is returned itself (it yields batches of keys). The last entry is set when
    automatic batching is off and the sampler is a ``BatchSampler`` (every key an index list).
    """
    if loader.batch_size is not None:  # automatic batching: BatchSampler(loader.sampler)
        return loader.sampler, False, loader.batch_size, None
    if loader.batch_sampler is not None:  # a custom batch sampler
        size = getattr(loader.batch_sampler, "batch_size", None) or 1
        inner = getattr(loader.batch_sampler, "sampler", None)
        return (loader.batch_sampler, True, size, None) if inner is None else (inner, False, size, None)
    per_key = getattr(loader.sampler, "batch_size", None)
    if per_key and hasattr(loader.sampler, "sampler"):
        return loader.sampler.sampler, False, None, per_key  # type: ignore[union-attr]
    return loader.sampler, False, None, None


def epoch_keys(sampler: Union[Sampler, Iterable], batched: bool = False) -> Sequence:
    """The keys one epoch of ``sampler`` draws, each once, sorted (or in first-seen order).

    Sequential, shuffling (without replacement) and distributed samplers draw every index of their
    data set, as does a ``WeightedRandomSampler(replacement=False)`` of as many samples as weights;
    a ``SubsetRandomSampler`` its ``indices``; Lightning's ``DistributedSamplerWrapper`` the keys of
    the sampler it wraps; any other sampler (or a batch sampler, flattened) what one
    pass over it yields, taken with the random state restored afterwards so that training draws
    as it would have.

    Args:
        sampler: The sampler (or any iterable of keys with a length).
        batched: Whether ``sampler`` yields batches of keys (a custom batch sampler).

    Raises:
        ValueError: For a sampler that draws another distribution (with replacement, by weight, a
            random part of the data set, a key more than once) or has no finite length; the
            message names ``dataloader=``.
    """
    name = type(sampler).__name__
    while isinstance(sampler, DistributedSampler):
        inner = user_sampler(sampler.dataset)  # Lightning's DistributedSamplerWrapper keeps the user's sampler there
        if inner is None:
            return range(len(sampler.dataset))  # type: ignore[arg-type]  # the whole data set, before padding
        sampler = inner
        name = type(sampler).__name__
    if isinstance(sampler, SequentialSampler):
        return range(len(sampler))
    if isinstance(sampler, WeightedRandomSampler):
        size = len(sampler.weights)
        if sampler.replacement:
            raise ValueError(f"The training sampler {name} draws examples by weight, with replacement; {_FIX}")
        if sampler.num_samples != size:
            raise ValueError(
                f"The training sampler {name}(replacement=False, num_samples={sampler.num_samples}) draws a random "
                f"part of the {size} examples per epoch, by weight; {_FIX}"
            )
        return range(size)  # every example once per epoch, in an order drawn by weight
    if isinstance(sampler, RandomSampler):
        size = len(sampler.data_source)
        if sampler.replacement:
            raise ValueError(
                f"The training sampler RandomSampler(replacement=True) draws examples with replacement; {_FIX}"
            )
        if sampler.num_samples != size:
            raise ValueError(
                f"The training sampler RandomSampler(num_samples={sampler.num_samples}) draws a random part (or "
                f"repeats) of the {size} examples per epoch; {_FIX}"
            )
        return range(size)
    if isinstance(sampler, SubsetRandomSampler):
        return _unique(sampler.indices, name)
    try:
        length = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        length = None
    if length is None or length == float("inf"):
        raise ValueError(f"The training sampler {name} has no finite length, so its examples cannot be listed; {_FIX}")
    with torch.random.fork_rng(devices=[]):  # a random sampler must not shift the random stream training draws from
        drawn = list(itertools.islice(iter(sampler), length))
    if batched:
        drawn = [key for batch in drawn for key in batch]
    return _unique(drawn, name)


def _unique(keys: Iterable, name: str) -> Sequence:
    """``keys`` (ints where they are integral, e.g. 0-dim tensors), sorted where they sort.

    Raises:
        ValueError: If a key repeats (the sampler draws another distribution than its key set).
    """
    seen: Dict[Hashable, None] = {}
    for key in keys:
        key = _as_key(key)
        if key in seen:
            raise ValueError(f"The training sampler {name} draws example {key!r} more than once per epoch; {_FIX}")
        seen[key] = None
    try:
        return sorted(seen)  # type: ignore[type-var]
    except TypeError:  # keys of mixed or unordered types: the sampler's own order
        return list(seen)


def _as_key(key: Any) -> Hashable:
    try:
        return operator.index(key)  # int, numpy integer, 0-dim integer tensor
    except TypeError:
        return key


class _FirstBatches:
    """The first ``count`` batches of ``loader``, with a length (for progress)."""

    def __init__(self, loader: DataLoader, count: int) -> None:
        self.loader, self.count = loader, count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.count)

    def __len__(self) -> int:
        return self.count


def _bounded(loader: DataLoader, max_batches: Optional[int]) -> Iterable:
    """An iterable-style ``loader``, read up to ``max_batches`` batches; never unbounded."""
    try:
        length: Optional[int] = len(loader)
    except TypeError:  # an IterableDataset without __len__: possibly endless
        length = None
    if max_batches is None:
        if length is None:
            raise ValueError(
                "The evidence data is an IterableDataset without a length, so the evidence pass would never end: "
                "set Trainer(limit_train_batches=<number of batches>) or pass MargLikCallback `dataloader=` a "
                "DataLoader of finite length."
            )
        return loader
    return _FirstBatches(loader, max_batches)  # also where __len__ says fewer: a stream may yield more than it says


def run_on_all_ranks(strategy: Strategy, work: Callable[[], T]) -> T:
    """Run ``work`` on every rank; if it fails anywhere, raise on every rank instead of hanging.

    One collective (a gather of failure flags) follows ``work`` on every rank, whatever happened; where a rank
    failed with an error of its own, one more hands that error to the others, who raise it too, naming its process
    (one rank's refusal of its data reads the same on rank 0, whose output users read).

    Raises:
        Exception: This rank's own error; else the first failing rank's (its type and message, with the process),
            or ``RuntimeError`` where it cannot be passed on.
    """
    error: Optional[BaseException] = None
    result: Optional[T] = None
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = exc
    if strategy.world_size == 1:
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    own = error is not None and not (isinstance(error, RuntimeError) and str(error) == FAILED_ELSEWHERE)
    flags = strategy.all_gather(torch.tensor([float(error is not None), float(own)], device=strategy.root_device))
    flags = flags.reshape(-1, 2)
    if not bool(flags[:, 0].any()):
        return result  # type: ignore[return-value]
    owners = [rank for rank, flag in enumerate(flags[:, 1].tolist()) if flag]
    told = strategy.broadcast(_passed_on(error) if own and strategy.global_rank == owners[0] else None,
                              src=owners[0]) if owners else None
    if own or told is None:
        raise error if error is not None else RuntimeError(FAILED_ELSEWHERE)
    raise _on_process(told, owners[0]) from error


def _passed_on(error: BaseException) -> BaseException:
    """``error`` as another process can receive it: itself where it pickles and unpickles, else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an error type that does not travel: its name and message do
        return RuntimeError(f"{type(error).__name__}: {error}")


def _on_process(error: BaseException, rank: int) -> BaseException:
    """``error`` of the same type, its message naming the process ``rank`` it was raised on."""
    try:
        return type(error)(f"{error} (raised on process {rank})")
    except Exception:  # noqa: BLE001 - a type whose constructor takes other arguments
        return RuntimeError(f"{type(error).__name__} on process {rank}: {error}")


def reduce_statistics(stats: CurvatureStatistics, strategy: Strategy) -> CurvatureStatistics:
    """Sum the statistics of all ranks in place: every declared statistic in ONE all-reduce.

    The full structure's low-rank rows (while fewer rows than parameters) are gathered instead,
    in one more collective pair (lengths, padded rows); its choice depends on the global row
    count only. A sharded structure's layers are already summed onto their owners (:mod:`.curvature.exchange`).

    Args:
        stats: This rank's statistics; the same declared states on every rank.
        strategy: The trainer's strategy, which owns the collectives.

    Returns:
        ``stats``, now holding the global sums.
    """
    if strategy.world_size == 1:
        return stats
    collectives = Collectives(strategy)
    return stats.reduce(collectives.sum, collectives.gather)
