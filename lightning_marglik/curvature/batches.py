"""How the evidence pass reads a batch: ``(inputs, targets)``, the device and dtype, the model call.

``inputs`` is a tensor (``forward(inputs)``), a tuple or list (``forward(*inputs)``) or a dict
(``forward(**inputs)``, e.g. ``input_ids`` and ``attention_mask``). Without a ``batch_fn`` a batch
must be an ``(inputs, targets)`` pair. :func:`model_batch` normalizes split and moved inputs once
into the call form, size and batch dimensions that the per-example (exact) path reads.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = [
    "BatchFn",
    "Inputs",
    "ModelBatch",
    "batch_dims",
    "batch_size",
    "call_model",
    "check_data",
    "check_examples",
    "eager",
    "examples",
    "model_batch",
    "move",
    "non_finite_data_rows",
    "non_finite_rows",
    "not_a_tensor",
    "split_batch",
]

Inputs = Union[Tensor, Tuple[Any, ...], Dict[str, Any]]
BatchFn = Callable[[Any], Tuple[Inputs, Tensor]]


def split_batch(batch: Any, batch_fn: Optional[BatchFn] = None) -> Tuple[Inputs, Tensor]:
    """The ``(inputs, targets)`` of one batch.

    Args:
        batch: What the data loader yielded.
        batch_fn: Maps a batch to ``(inputs, targets)``; ``None`` for ``(x, y)`` pairs.

    Returns:
        The model inputs and the target tensor.

    Raises:
        TypeError: If the batch (or what ``batch_fn`` returned) is not an ``(inputs, targets)``
            pair with a tensor target.
    """
    pair = batch_fn(batch) if batch_fn is not None else batch
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[1], Tensor):
        source = "`batch_fn`/`marglik_batch` returned" if batch_fn is not None else "The data loader yielded"
        raise TypeError(
            f"{source} {type(pair).__name__}, not an (inputs, targets) pair with a tensor target; map each batch to "
            "(inputs, targets) with `marglik_batch(self, batch)` on the LightningModule (MargLikCallback) or with "
            "`batch_fn=` (LaplaceEvidence.fit)."
        )
    inputs, target = pair
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, (Tensor, tuple, dict)):
        raise TypeError(f"Model inputs must be a tensor, a tuple or a dict of tensors, got {type(inputs).__name__}.")
    return inputs, target


def check_data(data: Any, batch_fn: Optional[BatchFn] = None) -> None:
    """Refuse the two things a hurried caller passes instead of an iterable of batches, naming the fix.

    Raises:
        TypeError: If ``data`` is a map-style ``Dataset`` (iterated, it yields single examples without their batch
            dimension) or, without a ``batch_fn``, one ``(inputs, targets)`` pair of tensors.
    """
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError(
            f"The data are a {type(data).__name__}, whose examples have no batch dimension: pass batches, e.g. "
            "DataLoader(dataset, batch_size=256)."
        )
    if batch_fn is None and isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(v, Tensor) for v in data):
        raise TypeError(
            "The data are one (inputs, targets) pair of tensors, not an iterable of batches: pass [(x, y)] for a "
            "single batch, or a DataLoader."
        )


def non_finite_rows(value: Tensor) -> List[int]:
    """The rows of ``value`` (along its first, the batch dimension) that hold NaN or inf, in order."""
    return (~torch.isfinite(value)).reshape(len(value), -1).any(1).nonzero().flatten().tolist()


def non_finite_data_rows(data: Any, first: int = 5) -> List[int]:
    """The first rows (along the batch dimension) where a floating tensor of ``data`` (a tensor, or tuples and
    dicts of them: a batch's inputs or targets) holds NaN or inf."""

    def rows(value: Any) -> Set[int]:
        if isinstance(value, Tensor):
            return set(non_finite_rows(value)) if value.is_floating_point() and value.dim() > 0 else set()
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        return set().union(*(rows(v) for v in values))

    return sorted(rows(data))[:first]


def move(inputs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``inputs`` on ``device``, floating tensors in ``dtype`` (e.g. a float64 model), recursively."""
    if isinstance(inputs, Tensor):
        return inputs.to(device, dtype if inputs.is_floating_point() else None)
    if isinstance(inputs, tuple):
        return tuple(move(v, device, dtype) for v in inputs)
    if isinstance(inputs, dict):
        return {k: move(v, device, dtype) for k, v in inputs.items()}
    return inputs


def eager() -> contextlib.AbstractContextManager:
    """Run ``torch.compile``d modules eagerly: the same function of the same parameters, and hooks see every
    submodule call."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def call_model(model: nn.Module, inputs: Inputs) -> Tensor:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)``; the output must be one tensor.

    Raises:
        TypeError: If ``forward`` returns something other than a tensor.
    """
    if isinstance(inputs, dict):
        output = model(**inputs)
    elif isinstance(inputs, tuple):
        output = model(*inputs)
    else:
        output = model(inputs)
    if not isinstance(output, Tensor):
        raise not_a_tensor(output)
    return output


def not_a_tensor(output: Any) -> TypeError:
    """The error for a ``forward`` that returned ``output``, not one tensor."""
    return TypeError(
        f"forward returned {type(output).__name__}; the evidence pass needs forward to return the network "
        "output tensor (logits or predictions): return only that tensor from forward and compute other "
        "values elsewhere."
    )


def batch_size(inputs: Inputs) -> int:
    """Number of examples: the leading size of the first tensor in ``inputs`` (depth first through tuples and
    dicts: ``forward(batch)`` of a dict is called with ``(batch,)``)."""
    found = next(_tensors(inputs), None)
    if found is None:
        values = list(inputs.values()) if isinstance(inputs, dict) else inputs
        raise TypeError(
            f"Model inputs contain no tensor (got a {type(inputs).__name__} of "
            f"{[type(v).__name__ for v in values] if isinstance(values, (list, tuple)) else values!r}): the evidence "
            "pass reads tensors in a tensor, tuple or dict (nested too); map batches with `marglik_batch` "
            "(MargLikCallback) or `batch_fn=`."
        )
    return found.shape[0]


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value`` (a tensor, tuples and dicts of them), depth first."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _tensors(item)


def examples(inputs: Inputs, target: Tensor) -> int:
    """Number of examples of a batch with its targets: theirs where an input tensor leads with it too, the inputs
    before it being shared by the batch (position indices ``(1, T)``, as :func:`batch_dims` tells them); else, as
    without targets, :func:`batch_size` (which :func:`check_examples` then holds to the output).

    Raises:
        TypeError: If ``inputs`` contain no tensor.
    """
    size = batch_size(inputs)
    if target.dim() and target.shape[0] != size and any(t.dim() and t.shape[0] == target.shape[0]
                                                         for t in _tensors(inputs)):
        return target.shape[0]
    return size


def check_examples(inputs: Inputs, size: int, output: Tensor, target: Tensor) -> None:
    """Refuse a batch of ``size`` examples (:func:`examples`) whose output and targets lead with another size: no
    input tensor carries their batch dimension, and examples taken along the inputs' first one would mix its rows.

    Raises:
        ValueError: Naming both sizes and the fix.
    """
    if output.dim() and target.dim() and output.shape[0] == target.shape[0] != size:
        raise ValueError(
            f"The output and the targets lead with a batch of {target.shape[0]} examples, but no model input does "
            f"(the first input tensor {tuple(next(_tensors(inputs)).shape)} leads with {size}): the evidence takes "
            "examples along the inputs' first dimension. Pass inputs batch-first: transpose a sequence-first "
            "(T, B, ...) input inside forward or give its layer batch_first=True; return an output flattened to "
            "(B * T, C) as (B, T, C)."
        )


def batch_dims(inputs: Any, size: int) -> Any:
    """``inputs``-shaped: 0 for a tensor leading with the batch dimension, ``None`` for everything else
    (values shared by the batch), as ``torch.func.vmap``'s ``in_dims``."""
    if isinstance(inputs, Tensor):
        return 0 if inputs.dim() > 0 and inputs.shape[0] == size else None
    if isinstance(inputs, tuple):
        return tuple(batch_dims(v, size) for v in inputs)
    if isinstance(inputs, dict):
        return {k: batch_dims(v, size) for k, v in inputs.items()}
    return None


def slice_batch(inputs: Inputs, start: int, stop: int, size: Optional[int] = None) -> Inputs:
    """Examples ``start:stop`` of ``inputs``: every tensor leading with the batch dimension is sliced,
    values shared by the batch (as :func:`batch_dims` tells them) are passed on as they are.

    Args:
        inputs: The batch's model inputs.
        start: The first example taken.
        stop: The example after the last one taken.
        size: The batch's number of examples (:func:`examples`); default: :func:`batch_size`.
    """
    size = batch_size(inputs) if size is None else size

    def take(value: Any, dims: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(take(v, d) for v, d in zip(value, dims))
        if isinstance(value, dict):
            return {k: take(v, dims[k]) for k, v in value.items()}
        return value[start:stop] if dims == 0 else value

    return take(inputs, batch_dims(inputs, size))


@dataclass(frozen=True)
class ModelBatch:
    """Split and moved model inputs, normalized once for the per-example path.

    Attributes:
        args: Positional arguments of ``forward`` (a tensor input is the only one).
        kwargs: Keyword arguments of ``forward`` (a dict input).
        size: Number of examples.
        arg_dims: :func:`batch_dims` of ``args``.
        kwarg_dims: :func:`batch_dims` of ``kwargs``.
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    size: int
    arg_dims: Tuple[Any, ...]
    kwarg_dims: Dict[str, Any]


def model_batch(inputs: Inputs, size: Optional[int] = None) -> ModelBatch:
    """``inputs`` (tensor, tuple or dict, as :func:`call_model` takes them) as one :class:`ModelBatch`.

    Args:
        inputs: The batch's model inputs.
        size: Its number of examples (e.g. the loss-Hessian factor's rows); default: :func:`batch_size`.

    Raises:
        TypeError: If ``size`` is not given and ``inputs`` contain no tensor.
    """
    size = batch_size(inputs) if size is None else size
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    else:
        args, kwargs = (inputs,), {}
    return ModelBatch(args, kwargs, size, batch_dims(args, size), batch_dims(kwargs, size))
