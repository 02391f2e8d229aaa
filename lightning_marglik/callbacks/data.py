"""The evidence data: where they come from (``dataloader=`` or the training data), checked before use."""
from __future__ import annotations

import inspect
import math
import random
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages
from pytorch_lightning.utilities.seed import isolate_rng  # also the numpy and Python generators, which loaders may use
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from ..curvature.batches import split_batch
from ..distributed import evidence_loader
from ..hyperparameters import Likelihood
from ..validators import suggestion
from .package import LightningModule, MargLikConfigurationError, Trainer

__all__ = ["count_data", "dropped_examples", "evidence_batches", "limiting_flag", "named_loader_method",
           "ranks_hold_their_own_data"]

Source = Union[DataLoader, str, None]
BatchFn = Optional[Callable[[Any], Any]]


def named_loader_method(name: str, trainer: Trainer, pl_module: LightningModule) -> Callable[[], Any]:
    """The DataModule's or LightningModule's method named by ``dataloader``.

    Raises:
        MargLikConfigurationError: If neither has such a method (with a "did you mean" for a near miss of their own
            methods' names), or it names a value, or a method that cannot be called without arguments.
    """
    owners = [o for o in (trainer.datamodule, pl_module) if o is not None]
    owner: Any = next((o for o in owners if hasattr(o, name)), None)
    fix = "pass the name of a method that returns a DataLoader when called without arguments, or a DataLoader"
    if owner is None:
        raise MargLikConfigurationError(
            f"MargLikCallback(dataloader={name!r}): neither the DataModule nor the LightningModule has such a "
            f"method{suggestion(name, _own_methods(owners))}; {fix}."
        )
    method = getattr(owner, name)
    if not callable(method):
        raise MargLikConfigurationError(
            f"MargLikCallback(dataloader={name!r}): {type(owner).__name__}.{name} is a value of type "
            f"{type(method).__name__}, not a method; {fix}."
        )
    signature = inspect.signature(method)
    try:
        signature.bind()
    except TypeError:
        raise MargLikConfigurationError(
            f"MargLikCallback(dataloader={name!r}): {type(owner).__name__}.{name}{signature} cannot be called "
            f"without arguments; {fix}."
        ) from None
    return method


def _own_methods(owners: Iterable[Any]) -> List[str]:
    """The public methods the user's own classes define on ``owners``: Lightning's and torch's hundreds would make
    a near miss of any name."""
    return sorted({
        name for owner in owners for cls in type(owner).__mro__
        if cls.__module__.split(".")[0] not in ("builtins", "lightning", "lightning_fabric", "pytorch_lightning", "torch")
        for name, value in vars(cls).items() if callable(value) and not name.startswith("_")
    })


def _source_loader(dataloader: Source, trainer: Trainer, pl_module: LightningModule) -> DataLoader:
    """The loader ``dataloader`` names: itself, a method's result, or (``None``) the training loader."""
    if isinstance(dataloader, DataLoader):
        return dataloader
    if isinstance(dataloader, str):
        loader = named_loader_method(dataloader, trainer, pl_module)()
        if not isinstance(loader, DataLoader):
            raise MargLikConfigurationError(
                f"MargLikCallback(dataloader={dataloader!r}) returned a {type(loader).__name__}; the method "
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


def dropped_examples(loader: Any) -> Optional[Tuple[int, int, int, bool]]:
    """What a ``drop_last=True`` loader leaves out of each epoch: ``(dropped, examples, batch_size, shuffled)``
    (this process's), or ``None`` where it drops none."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner, size = getattr(batch_sampler, "sampler", None), getattr(batch_sampler, "batch_size", None)
    if not getattr(batch_sampler, "drop_last", False) or inner is None or not size:
        return None
    try:
        examples = len(inner)
    except TypeError:
        return None
    in_order = isinstance(inner, SequentialSampler) or (isinstance(inner, DistributedSampler) and not inner.shuffle)
    return (examples % size, examples, size, not in_order) if examples % size else None


def _warn_if_dropped(loader: DataLoader) -> None:
    """Say where a training loader never draws some examples the evidence covers (``drop_last`` in order)."""
    dropped = dropped_examples(loader)
    if dropped is not None and not dropped[3]:
        count, examples, size, _ = dropped
        rank_zero_warn(
            f"MargLikCallback: the training DataLoader drops its last {count} of {examples} examples every epoch "
            f"(drop_last=True with batch_size={size}, without shuffling): training never sees them, but the evidence "
            "covers every example; shuffle, set drop_last=False, or pass `dataloader=` with the examples training sees."
        )


def evidence_batches(
    dataloader: Source, trainer: Trainer, pl_module: LightningModule, warn: bool = False, own: bool = False,
) -> Iterable:
    """This rank's evidence batches: its unpadded shard of the examples one training epoch draws.

    Args:
        dataloader: The callback's ``dataloader`` argument.
        trainer: The trainer (its training data, rank and number of processes).
        pl_module: The module whose method ``dataloader`` may name.
        warn: Warn where the evidence data differ from what a training epoch uses (once, at set-up).
        own: Each process's loader holds its own examples (:func:`ranks_hold_their_own_data`): all of them are
            this rank's, not a share.

    Raises:
        MargLikConfigurationError: On a source that cannot give the evidence data, naming the fix.
    """
    source = _source_loader(dataloader, trainer, pl_module)
    max_batches: Optional[int] = None
    if dataloader is None:  # the training data: one training epoch's batches bound a stream
        limit = trainer.num_training_batches
        max_batches = int(limit) if math.isfinite(limit) else None
        if warn and max_batches is not None and not isinstance(source.dataset, IterableDataset):
            _warn_if_limited(source, max_batches, limiting_flag(trainer))
        if warn:
            _warn_if_dropped(source)
    elif warn:
        _warn_if_other_examples(source, trainer.train_dataloader)
    try:
        return evidence_loader(source, 0 if own else trainer.global_rank, 1 if own else trainer.world_size, max_batches)
    except ValueError as err:
        raise MargLikConfigurationError(str(err)) from err


def ranks_hold_their_own_data(dataloader: Source, trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether each process's evidence loader holds its own examples (a shard the user gave each process, with
    ``Trainer(use_distributed_sampler=False)``) rather than one data set, which the evidence splits across the
    processes (split again, a user's shards left half of the data out, silently): told by the data sets' lengths and
    first and last examples on every process, in one all-gather. Call it on every process.
    """
    if trainer.world_size == 1:
        return False
    loader = _source_loader(dataloader, trainer, pl_module)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or isinstance(loader.sampler, DistributedSampler):
        return False  # a stream is refused under several processes; a DistributedSampler splits one data set
    size = len(dataset)
    with isolate_rng():  # an augmenting __getitem__ draws alike on every process
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        mark = [float(size), *(_read_total(dataset, i) if size else 0.0 for i in (0, size - 1))]
    strategy = trainer.strategy
    marks = strategy.all_gather(torch.tensor(mark, dtype=torch.float64, device=strategy.root_device))
    return not bool((marks == marks[0]).all())


def _read_total(dataset: Any, index: int) -> float:
    """:func:`_total` of ``dataset[index]``; inf where reading it fails: the all-gather must run on every process,
    and the evidence pass raises the failure itself, on every process."""
    try:
        return _total(dataset[index])
    except Exception:  # noqa: BLE001 - any failure: reported by the pass that reads the data
        return math.inf


def _total(item: Any) -> float:
    """The sum of the numbers an example holds (tensors, arrays, scalars, nested in tuples, lists and dicts)."""
    if isinstance(item, (tuple, list)):
        return sum(_total(part) for part in item)
    if isinstance(item, dict):
        return sum(_total(part) for part in item.values())
    if isinstance(item, (torch.Tensor, np.ndarray, int, float)) and not isinstance(item, bool):
        return float(torch.nan_to_num(torch.as_tensor(item, dtype=torch.float64)).sum())  # NaN equals NaN here
    return 0.0


def limiting_flag(trainer: Trainer) -> str:
    """The ``Trainer`` argument that limits a training epoch's batches, as the user set it: ``fast_dev_run`` and
    ``overfit_batches`` set ``limit_train_batches`` themselves, and a message naming that would name a flag the
    user never set."""
    if trainer.fast_dev_run:
        return f"fast_dev_run={trainer.fast_dev_run}"
    if trainer.overfit_batches:
        return f"overfit_batches={trainer.overfit_batches}"
    return f"limit_train_batches={trainer.limit_train_batches}"


def _warn_if_limited(loader: DataLoader, max_batches: int, limit: str, read: int = 0) -> None:
    """Say how the evidence data relate to a training epoch limited by the Trainer argument ``limit``
    (:func:`limiting_flag`); ``read``: the batches a stream (an IterableDataset) yielded, which may end before
    the limit."""
    try:
        length: Optional[int] = len(loader)
    except TypeError:  # a stream without length
        length = None
    if length is not None and max_batches >= length:
        return
    if isinstance(loader.dataset, IterableDataset):
        which = (f"first {read} batches" if read >= max_batches else
                 f"{read} batches (the stream ended before the limit of {max_batches})")
        rank_zero_warn(
            f"MargLikCallback: the evidence covers the {which} of the training IterableDataset, "
            f"those one training epoch uses (Trainer({limit})); pass `dataloader=` for other "
            "evidence data."
        )
    else:
        rank_zero_warn(
            f"MargLikCallback: Trainer({limit}) trains on {max_batches} of {length} batches per "
            "epoch, but the evidence covers every example of the training sampler; pass `dataloader=` for other "
            "evidence data."
        )


def count_data(
    dataloader: Source, trainer: Trainer, pl_module: LightningModule, likelihood: Likelihood, batch_fn: BatchFn,
    like: torch.Tensor, own: bool = False,
) -> int:
    """This rank's number of data in the evidence batches, from their targets alone (no forward):
    every batch through the likelihood's target checks, as in the evidence pass.

    Raises:
        MargLikConfigurationError: On targets the likelihood refuses.
    """
    count = read = 0
    with isolate_rng():  # reading the data (loader seeds, augmentations) must not shift training's random stream
        for read, batch in enumerate(evidence_batches(dataloader, trainer, pl_module, own=own), start=1):
            try:
                count += likelihood.count_targets(split_batch(batch, batch_fn)[1], like)
            except (TypeError, ValueError) as err:
                raise MargLikConfigurationError(f"MargLikCallback, the targets of the evidence data: {err}") from err
    source = trainer.train_dataloader
    limit = trainer.num_training_batches
    if dataloader is None and isinstance(source.dataset, IterableDataset) and math.isfinite(limit):
        _warn_if_limited(source, int(limit), limiting_flag(trainer), read)  # a stream's count is known now
    return count


def _warn_if_other_examples(evidence: DataLoader, training: Any) -> None:
    """Say where the ``dataloader=`` data hold another number of examples than the training data: N is theirs, so
    the weight decay ``map_loss`` applies (``delta / N``) is not the training data's."""
    try:
        ours, theirs = len(evidence.dataset), len(training.dataset)
    except (AttributeError, TypeError):  # a stream, or several loaders: no count to compare
        return
    if ours != theirs:
        rank_zero_warn(
            f"MargLikCallback(dataloader=...): the evidence data hold {ours} examples, the training data {theirs}: N, "
            f"and so the weight decay map_loss applies (delta / N), is counted on the evidence data; pass the "
            "training examples (e.g. without augmentation) for the evidence of what training fits."
        )
