"""One pass over a data loader that accumulates sum-reduced curvature statistics.

Data flows one way: batches -> per-layer inputs and output gradients (hooks) or per-example rows
(torch.func) -> the structures' declared float64 statistics. Which path a parameter takes is
planned on the first batch (:mod:`.plan`); the structures live in :mod:`.structures`.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from ..hyperparameters import GaussianPrior, Likelihood, check_likelihood_and_prior
from .batches import (BatchFn, call_model, check_data, check_examples, eager, examples, move, slice_batch,
                      split_batch)
from .estimator import resolved_options
from .exchange import Exchange
from .functional import ExactPath
from .hooks import Recorder, graph_uses, layer_input
from .options import APPROXIMATIONS, BACKENDS, STRUCTURES, CurvatureOptions
from .plan import LayerLayout, Plan, candidates, check_model, check_trainable, locate, make_plan
from .statistics import BatchCurvature, CurvatureStatistics, LayerPlan, Structure, with_notes
from .structures import KronStructure, structure_class

#: Largest size in bytes of one part of a batch's loss-Hessian factor and output gradients (:func:`_part_size`).
PART_BYTES = 128 * 2**20

__all__ = [
    "APPROXIMATIONS",
    "BACKENDS",
    "STRUCTURES",
    "CurvatureOptions",
    "CurvatureStatistics",
    "LayerPlan",
    "Plan",
    "Structure",
    "check_model",
    "collect_statistics",
    "eval_mode",
    "locate",
    "with_notes",
]


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode, with embeddings' gradients unscaled, and restore each one's own flags
    afterwards.

    Sets each submodule's ``training`` flag itself: ``model.eval()`` is never called, because a
    module's own ``train(mode)`` may do more than set flags (freeze a backbone's parameters, merge
    adapter weights) that restoring the flags would not undo. ``scale_grad_by_freq`` of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` is cleared: it divides a row's gradient by its index's count in the batch (a training
    heuristic) where the function, and so its Jacobian, is the same without it; every Jacobian, vector-Jacobian
    product and gradient of the library's passes runs under this context.
    """
    flags = [(m, m.training) for m in model.modules()]
    scaled = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq]
    for module, _ in flags:
        module.training = False
    for module in scaled:
        module.scale_grad_by_freq = False
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
        for module in scaled:
            module.scale_grad_by_freq = True


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision models: layer products in float32 (sums are float64 anyway)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def collect_statistics(
    model: nn.Module,
    dataloader: Iterable,
    likelihood: Likelihood,
    prior: GaussianPrior,
    structure: str = "kron",
    approx: str = "ggn",
    mc_samples: int = 0,
    generator: Optional[torch.Generator] = None,
    batch_fn: Optional[BatchFn] = None,
    on_batch: Optional[Callable[[int], None]] = None,
    options: Optional[CurvatureOptions] = None,
    exchange: Optional[Exchange] = None,
) -> CurvatureStatistics:
    """Accumulate the curvature and likelihood statistics over one pass of ``dataloader``.

    The pass runs in eval mode (no dropout, BatchNorm on running statistics); every module's mode
    is restored afterwards. No ``.grad`` is written and no hook stays installed. A module that
    takes the exact per-example path (slower than the layer hooks) is named in a warning.

    Args:
        model: Network mapping inputs to outputs ``(B, ..., C)``.
        dataloader: Iterable of batches covering the data once.
        likelihood: Defines the loss-Hessian factor and the likelihood statistics.
        prior: Defines which parameters the curvature covers.
        structure: ``"full"``, ``"kron"``, ``"ekfac"`` or ``"diag"`` (ignored if ``options`` is given);
            ``"ekfac"`` reads ``dataloader`` twice.
        approx: ``"ggn"`` or ``"ef"`` (ignored if ``options`` is given).
        mc_samples: Monte-Carlo samples per example for the GGN, 0 for exact (ignored if ``options`` is given).
        generator: Random generator for the Monte-Carlo samples (default: one seeded 0 per call, so that a call
            draws the same samples whether ``mc_samples=k`` or ``"auto"`` chose to sample).
        batch_fn: Maps a batch to ``(inputs, targets)``; default: batches are such pairs.
        on_batch: Called with the batch index after every batch (progress).
        options: The curvature options as one object.
        exchange: Under sharded training, one per pass and process: a layer-owned structure
            (``kron``) sums each batch's statistics of a layer onto the one process that owns it
            (:mod:`.structures.sharded`); every process calls this alike, each with its own share of
            the data. Under the ``backpack`` backend every process keeps every layer (the exchange
            only ends, as it must on every process).

    Returns:
        The sum-reduced statistics (float64, counts as integers).

    Raises:
        ValueError: On bad options, parameters the prior does not cover, a loader with no example (no batch, or
            only empty ones), or targets that do not fit the likelihood.
        TypeError: On data that are not batches (a ``Dataset``, one ``(x, y)`` pair), batches that are not
            ``(inputs, targets)`` pairs, a forward that does not return a tensor, an ``exchange`` that is not
            an :class:`Exchange`, or a ``likelihood`` or ``prior`` that is not one (e.g. the two in the other order).
    """
    check_likelihood_and_prior(likelihood, prior, "collect_statistics(model, dataloader, likelihood, prior)")
    options = options or CurvatureOptions(structure, approx, mc_samples)
    if exchange is not None and not isinstance(exchange, Exchange):
        raise TypeError(f"`exchange` must be an Exchange (the collectives of a sharded pass) or None, got {exchange!r}.")
    if batch_fn is not None and not callable(batch_fn):
        raise TypeError(f"`batch_fn` must map a batch to (inputs, targets), got {type(batch_fn).__name__} {batch_fn!r}.")
    check_data(dataloader, batch_fn)
    check_trainable(prior)
    if options.backend == "backpack":
        from .backpack import backpack_statistics

        with _ending(exchange):  # its statistics are every layer's: only the rounds to agree on
            return backpack_statistics(model, dataloader, likelihood, prior, options, batch_fn, on_batch)
    names, owners = locate(model, prior)
    params = prior.params
    device, dtype = params[0].device, params[0].dtype
    compute = _compute_dtype(dtype)
    stats: Optional[CurvatureStatistics] = None
    plan: Optional[Plan] = None
    with _ending(exchange), eval_mode(model), torch.enable_grad(), eager(), Recorder(model) as recorder:
        recorder.keep = candidates(owners, options)

        def passes() -> int:
            return max(s.passes for s in stats.structures) if stats is not None else 1

        def start_pass(index: int) -> None:
            for structure_ in stats.structures:
                if index < structure_.passes:
                    structure_.start_pass(index)

        for pass_index, batch in _passes(dataloader, passes, start_pass, on_batch):
            inputs, target = split_batch(batch, batch_fn)
            inputs, target = move(inputs, device, dtype), target.to(device)
            size = examples(inputs, target)
            if size == 0:  # nothing to add, and no example to plan the pass on: the plan waits for a batch with one
                continue
            # once planned, a batch taken in parts needs no forward of its own: every part runs one
            output: Optional[torch.Tensor] = (_forward(recorder, inputs, size, target) if plan is None or part >= size
                                              else None)
            if plan is None:
                assert output is not None
                options, estimator = resolved_options(options, likelihood, output.shape)
                if options.mc_samples and generator is None:  # the same draws every call, whatever chose to sample
                    generator = torch.Generator().manual_seed(0)
                leading = (size,)
                layouts = {
                    name: LayerLayout(out.requires_grad, recorder.inputs[name].shape[:1] == out.shape[:1] == leading)
                    for name, out in recorder.outputs.items()
                }
                layouts.update({name: LayerLayout(True, False, input_read=False) for name in recorder.unread})
                layouts = _scaling_with_the_batch(model, inputs, size, layouts)
                plan = make_plan(prior, owners, options, dict(recorder.counts), graph_uses(output, params), layouts,
                                 exchange)
                estimator = with_notes(estimator, plan.structures)
                stats = CurvatureStatistics(
                    options, names, [s.to(device) for s in plan.structures], slow=plan.slow, estimator=estimator
                )
                recorder.keep = {layer.name: layer.module for layer in plan.layers}
                recorder.strict = True
                recorder.kron = issubclass(structure_class(options.structure), KronStructure)
                _warn_slow(plan, options)
                exact_path = ExactPath(
                    model, [names[i] for i in plan.exact], [params[i] for i in plan.exact], list(plan.slow)
                )
                part = _part_size(output, recorder, likelihood, options, sum(prior.param_sizes[i] for i in plan.exact))
            assert stats is not None
            if part < size:
                output = None  # the first batch's graph is not needed either
            for start in range(0, size, part):
                if output is None:
                    stop = min(start + part, size)
                    sub_inputs, sub_target = slice_batch(inputs, start, stop, size), target[start:stop]
                    sub_output = _forward(recorder, sub_inputs, stop - start, sub_target)
                else:
                    sub_inputs, sub_target, sub_output = inputs, target, output
                _accumulate(stats, plan, recorder, exact_path, likelihood, options, generator, pass_index,
                            sub_inputs, sub_target, sub_output, compute)
    if stats is None:
        raise ValueError("The data loader yielded no example (no batch, or only empty ones).")
    return stats


def _forward(recorder: Recorder, inputs: Any, size: int, target: torch.Tensor) -> torch.Tensor:
    """The recorded forward of ``size`` examples, refused before any statistic is summed where its output and
    targets do not lead with them (:func:`.batches.check_examples`)."""
    output = recorder.forward(inputs, size)
    check_examples(inputs, size, output, target)
    return output


def _scaling_with_the_batch(model: nn.Module, inputs: Any, size: int, layouts: Dict[str, LayerLayout]
                             ) -> Dict[str, LayerLayout]:
    """``layouts`` with ``batch_first`` kept only where the layer's leading dimension follows the batch: one forward
    without gradients of the first batch's first two examples (one, for a batch of two), a size other than the
    batch's. A leading size equal to the batch's by chance (a sequence-first ``(T, B, D)`` or a position table
    ``(T, D)`` with ``T`` the batch size) would take its rows as examples. Where that forward fails (a model that
    needs the batch's size), the first batch's shapes decide.

    Raises:
        ValueError: If the output of those examples does not lead with them: an input that leads with the batch's
            size by chance (a sequence-first ``(T, B, D)`` with ``T`` the batch size) but does not carry the batch.
    """
    if size < 2 or not any(layout.batch_first for layout in layouts.values()):
        return layouts
    modules = dict(model.named_modules())
    leading: Dict[str, Tuple[int, ...]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
            first = layer_input(module, args, kwargs)
            if first is not None and isinstance(output, torch.Tensor):
                leading[name] = first.shape[:1] + output.shape[:1]
        return record

    probe = 2 if size > 2 else 1  # few examples: the forward is a small part of a pass, every pass makes one
    handles = [modules[name].register_forward_hook(hook(name), with_kwargs=True) for name in layouts if name in modules]
    try:
        with torch.no_grad():
            output = call_model(model, slice_batch(inputs, 0, probe, size))
    except Exception:  # noqa: BLE001 - any failure of the model on another batch size: keep the first batch's view
        return layouts
    finally:
        for handle in handles:
            handle.remove()
    if output.shape[:1] != (probe,):
        raise ValueError(
            f"The output of the batch's first {probe} examples has shape {tuple(output.shape)}, not leading with "
            f"{probe}: an input leads with the batch's size {size} without carrying the batch (a sequence-first "
            "(T, B, ...) input with T the batch size). Pass inputs batch-first: transpose it inside forward or give "
            "its layer batch_first=True."
        )
    # (1, 1): an input shared by the batch, which the recorder expanded to the batch on the first batch
    return {name: layout._replace(batch_first=layout.batch_first and leading.get(name) in ((probe, probe), (1, 1)))
            for name, layout in layouts.items()}


def _ending(exchange: Optional[Exchange]) -> ContextManager[None]:
    """Where the pass is sharded, end its exchange on this rank however the pass ends (:meth:`Exchange.ending`)."""
    return nullcontext() if exchange is None else exchange.ending()


def _accumulate(
    stats: CurvatureStatistics, plan: Plan, recorder: Recorder, exact_path: ExactPath, likelihood: Likelihood,
    options: CurvatureOptions, generator: Optional[torch.Generator], pass_index: int, inputs: Any,
    target: torch.Tensor, output: torch.Tensor, compute: torch.dtype,
) -> None:
    """Add one (part of a) batch, forwarded by ``recorder``, to the statistics of pass ``pass_index``."""
    if pass_index == 0:
        stats.add_likelihood(likelihood.statistics(output.detach(), target))
    factor = likelihood.hessian_sqrt(output, target, options.approx, options.mc_samples, generator)
    grads = recorder.backprop(output, factor) if plan.layers else {}
    rows = None
    if plan.exact and pass_index == 0:
        with torch.no_grad():  # the rest of the network enters as constants: no graph to keep
            rows = exact_path.rows(inputs, factor)
        rows = rows.detach().to(compute)
    layers = [
        (layer, _cast(recorder.inputs[layer.name], compute), grads[layer.name].to(compute))
        for layer in plan.layers
    ]
    batch_curvature = BatchCurvature(layers, rows)
    for structure_ in stats.structures:
        if pass_index < structure_.passes:
            structure_.accumulate(batch_curvature)


def _part_size(
    output: torch.Tensor, recorder: Recorder, likelihood: Likelihood, options: CurvatureOptions, exact_size: int
) -> int:
    """Examples per part of a batch, so that one part's factor and output gradients (``K`` columns each)
    take at most :data:`PART_BYTES`: with the exact GGN at ``C = 1000`` a batch of 128 would otherwise hold
    128 x 999 gradients of every layer's output at once. Parts are sums over examples like batches: the
    statistics are the same."""
    size = output.shape[0]
    columns = likelihood.factor_columns(output.shape, options.approx, int(options.mc_samples))
    per_column = 8 * output[0].numel() + sum(
        out[0].numel() * out.element_size() for name, out in recorder.outputs.items() if name in recorder.keep
    ) + exact_size * output.element_size()
    return max(1, min(size, PART_BYTES // max(columns * per_column, 1)))


def _passes(
    dataloader: Iterable, count: Callable[[], int], start: Callable[[int], None],
    on_batch: Optional[Callable[[int], None]],
) -> Iterator[Tuple[int, Any]]:
    """``(pass, batch)`` over ``count()`` passes of ``dataloader`` (``count`` is read after each pass: the plan,
    made on the first batch with an example, decides it); ``start(pass)`` runs before every pass after the first,
    ``on_batch(batch index)`` once the pass has taken each batch of the first, an empty one too.

    Raises:
        ValueError: If a later pass yields no batch (an iterator, not a re-iterable loader).
    """
    done = 0
    while done < count():
        if done:
            start(done)
        seen = False
        for index, batch in enumerate(dataloader):
            seen = True
            yield done, batch
            if on_batch is not None and not done:
                on_batch(index)
        if done and not seen:
            raise ValueError(
                f"The curvature structure reads the data {count()} times (structure='ekfac': the Kronecker factors, "
                "then the second moments in their eigenbasis), but the data iterable was exhausted after the first "
                "pass: pass a re-iterable loader (a DataLoader or a list of batches), not an iterator."
            )
        done += 1


def _cast(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return a.to(dtype) if a.is_floating_point() else a


def _warn_slow(plan: Plan, options: CurvatureOptions) -> None:
    if not plan.slow:
        return
    listed = "; ".join(f"'{name or '<top-level module>'}': {reason}" for name, reason in plan.slow.items())
    warnings.warn(
        f"structure={options.structure!r}: the parameters of {len(plan.slow)} module(s) take the exact per-example "
        f"path (torch.func), slower than the layer hooks: {listed}.",
        stacklevel=3,
    )
