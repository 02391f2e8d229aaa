"""Which parameter tensors the training loss is invariant to the scale of, found from the graph.

A linear layer (``Linear``, ``Conv*``, ``ConvTranspose*``, ``Embedding``) has an output that is
homogeneous of degree one in its ``(weight, bias)``. If that output goes only into a normalization
that computes its statistics from it in training (BatchNorm and InstanceNorm with batch statistics,
GroupNorm, LayerNorm, RMSNorm), the normalized output, and so the training loss, does not change
when ``(weight, bias)`` are scaled by one positive factor (up to the norm's ``eps``). The data then
do not resist a prior that shrinks these tensors, and a precision learned by the evidence and fed
back as weight decay can grow without bound (Antorán et al., ICML 2022;
``examples/results/ranking_study.md``).

Structural and value-free, like the weight-reuse analysis of :func:`.hooks.graph_uses`: one
training-mode forward pass of one batch, module hooks for which module output feeds which norm,
and the autograd graph for every consumer of the layer's output. A layer qualifies only if it is
called once, its parameters are used only there, and every autograd consumer of its output lies
inside the norm's own computation, after at most a chain of shape operations (view, reshape,
transpose, permute, contiguous) used nowhere else: an activation (even a positively homogeneous ReLU:
the analysis is conservative), a residual add or any other use in between, or a norm with running
statistics, rules it out. Another package's norm (a module whose class name says ``Norm``, as Hugging Face's
``LlamaRMSNorm`` or ``Qwen3RMSNorm``, which are plain modules with their own code) counts where its output on the
batch stays the same for its input scaled by 2 and by 1/2: the one value the analysis reads.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from ..private import conv_base, norm_base
from .batches import Inputs, call_model, eager
from .hooks import graph_uses, layer_input

_ConvNd, _NormBase = conv_base(), norm_base()  # torch's private base classes: lightning_marglik.private

__all__ = ["ScaleInvariantLayer", "find_scale_invariant", "training_modes"]

LINEAR_LAYERS = (nn.Linear, _ConvNd, nn.Embedding)
NORMS: Tuple[type, ...] = (_NormBase, nn.GroupNorm, nn.LayerNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
# autograd nodes of operations that only move values (a scale passes through them unchanged)
SHAPE_OPS = ("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "TransposeBackward", "TBackward",
             "PermuteBackward", "CloneBackward", "SqueezeBackward", "UnsqueezeBackward", "AliasBackward")


@dataclass(frozen=True)
class ScaleInvariantLayer:
    """A layer whose trainable parameters the training loss is jointly scale-invariant in.

    Attributes:
        layer: Module name of the linear layer.
        norm: Module name of the normalization that takes its output.
        params: Full names (in the analysed model) of the layer's trainable parameters.
        reason: One line saying why, for a warning.
    """

    layer: str
    norm: str
    params: Tuple[str, ...]
    reason: str


def _batch_statistics(norm: nn.Module) -> bool:
    """Whether ``norm`` normalizes with statistics of its input (not running averages) right now."""
    if isinstance(norm, _NormBase):  # BatchNorm*, SyncBatchNorm, InstanceNorm*
        return norm.training or norm.running_mean is None
    return True


def _may_normalize(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization: torch's (:data:`NORMS`), or another package's whose class name says
    so (Hugging Face's ``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``T5LayerNorm``: plain modules with their own code), which
    :func:`_keeps_output_when_input_scaled` must confirm."""
    return isinstance(module, NORMS) or ("Norm" in type(module).__name__ and not isinstance(module, LINEAR_LAYERS))


def _keeps_output_when_input_scaled(module: nn.Module, normalized: Tensor) -> bool:
    """Whether another package's norm gives the same output (to 1e-4 of its largest value) for its input scaled by 2
    and by 1/2, in the modes of the pass: the property the analysis assumes of torch's norms, checked on the batch
    where the class is not torch's. The input is first brought to a largest value of 1,000, where a norm's ``eps``
    moves the output by far less (a network at initialisation feeds its norms values whose mean square is near it)."""
    with torch.no_grad():
        size = float(normalized.detach().abs().max()) if normalized.numel() else 0.0
        if not (math.isfinite(size) and size > 0):
            return False
        base = normalized.detach() * (1e3 / size)
        outputs = []
        for factor in (1.0, 2.0, 0.5):
            try:
                outputs.append(module(base * factor))
            except Exception:  # noqa: BLE001 - a module that takes more than its input is not taken for a norm
                return False
        reference = outputs[0]
        if not all(isinstance(out, Tensor) and out.shape == reference.shape for out in outputs):
            return False
        largest = float(reference.abs().max())
        return math.isfinite(largest) and all(float((out - reference).abs().max()) <= 1e-4 * largest
                                              for out in outputs[1:])


def _centres_channels(layer: nn.Module, norm: nn.Module) -> bool:
    """Whether ``norm`` subtracts a mean per output channel of ``layer``: the bias then has no effect."""
    channels = getattr(layer, "out_channels", getattr(layer, "out_features", None))
    if isinstance(norm, _NormBase):
        return norm.num_features == channels
    if isinstance(norm, nn.GroupNorm):
        return norm.num_groups == norm.num_channels == channels
    return False


def training_modes(model: nn.Module) -> Dict[str, bool]:
    """The ``training`` flag of every module of ``model``, by module name (``""`` is the model itself)."""
    return {name: module.training for name, module in model.named_modules()}


@contextlib.contextmanager
def _training_pass(model: nn.Module, modes: Optional[Mapping[str, bool]] = None) -> Iterator[None]:
    """Training mode (or the given per-module ``modes``) without side effects: modes, buffers (running
    statistics) and the RNG restored."""
    flags = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({b.device.index for b, _ in buffers if b.is_cuda} | {
        p.device.index for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        model.train()
        for name, module in model.named_modules() if modes is not None else ():
            module.training = modes.get(name, True)
        try:
            yield
        finally:
            for module, flag in flags:
                module.training = flag
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def _consumers(output: Tensor) -> Dict[object, List[object]]:
    """Every autograd node of ``output``'s graph -> the nodes that take its result (one per edge)."""
    consumers: Dict[object, List[object]] = {}
    if output.grad_fn is None:
        return consumers
    seen, stack = {output.grad_fn}, [output.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return consumers


def _inside(norm_output: Tensor, stop: object) -> Set[object]:
    """The nodes of the norm's own computation: reachable from its output without passing ``stop``."""
    inside, stack = set(), [norm_output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node is stop or node in inside:
            continue
        inside.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return inside


def _through_shape_ops(node: object, consumers: Dict[object, List[object]], stops: Dict[object, str]) -> object:
    """Follow ``node``'s sole consumer while it is a shape operation, up to a norm's input (in ``stops``)."""
    while node not in stops:
        users = consumers.get(node, [])
        if len(users) != 1 or type(users[0]).__name__.rstrip("0123456789") not in SHAPE_OPS:
            return node
        node = users[0]
    return node


def find_scale_invariant(
    model: nn.Module, inputs: Inputs, modes: Optional[Mapping[str, bool]] = None
) -> List[ScaleInvariantLayer]:
    """The layers whose trainable parameters the training-mode function of ``model`` is scale-invariant in.

    Runs one forward pass of ``inputs`` in training mode with gradients on, and leaves the model's
    modes, buffers and the random number generators as they were.

    Args:
        model: The network (or the LightningModule whose ``forward`` calls it).
        inputs: One batch of model inputs (tensor, tuple or dict), as ``forward`` takes them.
        modes: The ``training`` flag training really runs each module with (:func:`training_modes`,
            e.g. a BatchNorm a fine-tuning recipe keeps in eval mode); default every module in
            training mode. A norm in eval mode uses its running statistics and rules its layer out.

    Returns:
        One entry per qualifying layer, in module order; empty if there is none.

    Raises:
        TypeError: If ``forward`` does not return one tensor.
    """
    modules = dict(model.named_modules())
    calls: Dict[str, int] = {}
    outputs: Dict[str, Tensor] = {}
    norm_io: Dict[str, Tuple[Tensor, Tensor]] = {}

    recording = True  # off while the invariance of other packages' norms is checked (their calls are no data)

    def hook(name: str, module: nn.Module):
        def record(_: nn.Module, args: Tuple, kwargs: Dict[str, object], output: object) -> None:
            if not recording:
                return
            calls[name] = calls.get(name, 0) + 1
            if isinstance(module, LINEAR_LAYERS) and isinstance(output, Tensor):
                outputs[name] = output
            normalized = layer_input(module, args, kwargs)  # self.norm(input=h) as well as self.norm(h)
            if not isinstance(module, LINEAR_LAYERS) and normalized is not None and isinstance(output, Tensor):
                norm_io[name] = (normalized, output)

        return record

    handles = [m.register_forward_hook(hook(n, m), with_kwargs=True)
               for n, m in modules.items() if isinstance(m, LINEAR_LAYERS) or _may_normalize(m)]
    try:
        with _training_pass(model, modes), torch.enable_grad(), eager():  # a compiled module's hooks fire eagerly only
            output = call_model(model, inputs)
            recording = False
            for name in [n for n in norm_io if not isinstance(modules[n], NORMS)]:
                if not _keeps_output_when_input_scaled(modules[name], norm_io[name][0]):
                    del norm_io[name]
            found = _analyse(model, modules, calls, outputs, norm_io, output)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _analyse(
    model: nn.Module,
    modules: Dict[str, nn.Module],
    calls: Dict[str, int],
    outputs: Dict[str, Tensor],
    norm_io: Dict[str, Tuple[Tensor, Tensor]],
    output: Tensor,
) -> List[ScaleInvariantLayer]:
    consumers = _consumers(output)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    uses = dict(zip((n for n, _ in params), graph_uses(output, [p for _, p in params])))
    norm_of_input = {x.grad_fn: name for name, (x, _) in norm_io.items() if calls.get(name) == 1 and x.grad_fn}
    found = []
    for name, y in outputs.items():
        layer = modules[name]
        roles = [role for role, p in layer.named_parameters(recurse=False) if p.requires_grad]
        own = [f"{name}.{role}" if name else role for role in roles]
        if not own or calls.get(name) != 1 or y.grad_fn is None:
            continue
        node = _through_shape_ops(y.grad_fn, consumers, norm_of_input)
        norm_name: Optional[str] = norm_of_input.get(node)
        if norm_name is None:
            continue
        if getattr(layer, "max_norm", None) is not None or any(uses.get(p) != 1 for p in own):
            continue  # a renormalized embedding, or weights also used elsewhere
        norm = modules[norm_name]
        users = consumers.get(node, [])
        if not _batch_statistics(norm) or not users or not set(users) <= _inside(norm_io[norm_name][1], node):
            continue
        centred = "bias" in roles and _centres_channels(layer, norm)
        bias = " (its bias also has no effect: the norm subtracts a mean per channel)" if centred else ""
        how = ("normalizes it with statistics of its input in training" if isinstance(norm, NORMS) else
               "gave the same output for its input scaled by 2 and by 1/2 on the set-up batch")
        reason = (f"output feeds only {type(norm).__name__} '{norm_name}', which {how}: the training loss does not "
                  f"change when ({', '.join(own)}) are scaled{bias}")
        found.append(ScaleInvariantLayer(name, norm_name, tuple(own), reason))
    return found
