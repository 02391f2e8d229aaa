"""Forward hooks that watch one forward pass: call counts, recorded layer inputs and outputs.

Calls are counted only while the evidence pass runs ``forward`` (:meth:`Recorder.forward`): a
recomputation during backward (activation checkpointing) is not a second use of the weights.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .batches import Inputs, call_model

__all__ = ["Recorder", "graph_uses"]


class Recorder:
    """Counts the calls of every submodule of ``model`` and records the input and output of kept layers.

    Use as a context manager; the hooks are removed on exit, also on error.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.keep: Dict[str, nn.Module] = {}
        self.counts: Counter = Counter()
        self.inputs: Dict[str, Tensor] = {}
        self.outputs: Dict[str, Tensor] = {}
        self.strict = False  # after the first batch: a kept layer must be called exactly once
        self._active = False
        self._handles: list = []

    def __enter__(self) -> "Recorder":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> None:
            if not self._active:
                return
            self.counts[name] += 1
            if name in self.keep:
                if name in self.outputs:
                    if not self.strict:  # first batch: the plan moves it to the exact path
                        return
                    raise ValueError(
                        f"Module '{name}' was called once per forward pass on the first batch and more often "
                        "now (data-dependent control flow); the layer-wise curvature needs a fixed call pattern."
                    )
                self.inputs[name] = inputs[0].detach()
                self.outputs[name] = output

        return hook

    def forward(self, inputs: Inputs) -> Tensor:
        """One forward pass of the model with counting and recording on."""
        self.counts.clear()
        self.inputs.clear()
        self.outputs.clear()
        self._active = True
        try:
            return call_model(self.model, inputs)
        finally:
            self._active = False

    def backprop(self, output: Tensor, factor: Tensor) -> Dict[str, Tensor]:
        """Gradients of ``sum_n L_n[:, j]^T f_n`` w.r.t. every kept layer's output, for every column ``j``.

        One plain backward pass per column (the graph is kept until the last one): faster than
        ``is_grads_batched`` (vmap), which has no batching rule for some backward ops.

        Args:
            output: Network output ``(B, ...)`` of the recorded forward pass.
            factor: Loss-Hessian factor ``(B, M, K)``, ``M`` the flattened output size.

        Returns:
            Per kept layer, a tensor ``(K, *layer_output.shape)``.
        """
        names = [n for n in self.keep if n in self.outputs]
        outs = [self.outputs[n] for n in names]
        k = factor.shape[2]
        stacked: List[Optional[Tensor]] = [None] * len(names)
        for j in range(k):
            grads = torch.autograd.grad(
                output, outs, grad_outputs=factor[:, :, j].reshape(output.shape), retain_graph=j < k - 1, allow_unused=True
            )
            for i, g in enumerate(grads):
                if g is None:  # the output does not depend on this layer for this column
                    if stacked[i] is not None:
                        stacked[i][j] = 0
                    continue
                if k == 1:  # EF and one Monte-Carlo sample: no copy
                    stacked[i] = g.unsqueeze(0)
                    continue
                if stacked[i] is None:  # every earlier column was None: those slots are zeroed
                    stacked[i] = g.new_empty((k,) + g.shape)
                    stacked[i][:j] = 0
                stacked[i][j] = g
        return {
            n: torch.zeros((k,) + o.shape, dtype=o.dtype, device=o.device) if g is None else g
            for n, o, g in zip(names, outs, stacked)
        }


def graph_uses(output: Tensor, params: Sequence[Tensor]) -> List[int]:
    """How many autograd edges lead to each parameter in the graph of ``output``.

    A parameter used once (``F.linear``, ``F.conv2d``, ``F.embedding``) has one edge; a weight
    also used outside its layer (tied or functional reuse) has more. Structural: it does not
    depend on the data values, unlike a comparison of gradients.
    """
    targets = {id(p): i for i, p in enumerate(params)}
    counts = [0] * len(params)
    if output.grad_fn is None:
        return counts
    seen = {output.grad_fn}
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None and id(variable) in targets:
                counts[targets[id(variable)]] += 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return counts
