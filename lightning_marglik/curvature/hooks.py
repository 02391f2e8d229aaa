"""Forward hooks that watch one forward pass: call counts, recorded layer inputs and outputs.

Calls are counted only while the evidence pass runs ``forward`` (:meth:`Recorder.forward`): a
recomputation during backward (activation checkpointing) is not a second use of the weights.

Inputs shared by the whole batch: a recorded layer whose rule allows it (an Embedding of position
indices ``arange(T)[None]``, shape ``(1, T)``, whose output ``(1, T, D)`` is broadcast onto the
``(B, T, D)`` activations) gets its input expanded to ``(B, T)`` by a forward pre-hook. Each
example's rows of the output gradient are its own, but autograd sums the gradient of a broadcast
tensor over the batch before it reaches the layer; on the expanded output ``(B, T, D)`` the layer's
output gradients stay per example, and the hook rules apply unchanged. Values are the same (the
``B`` copies are equal and the broadcast add sees the same operands), which is checked once per
layer: the output with and without the expansion must agree, else the layer is left as it was
(the exact path) or, after the first batch, an error is raised. Only a leading size 1 is expanded:
it keeps the rank, so every broadcast downstream is unchanged; a 1-D index vector ``(T,)`` cannot
be told apart from one index per example when ``T`` equals the batch size and stays exact.

In-place operations after a recorded layer (``ReLU(inplace=True)``, ``x += shortcut``, as in timm's
and torchvision's ResNets) would turn the recorded output into the *post-op* tensor, whose gradient
misses the op's Jacobian, and could overwrite a recorded input. Every forward checks the version
counters of what it recorded; a layer whose input or output was modified in place is recorded again
from a copy (its output replaced by a clone, so the in-place op acts on the clone), which costs one
copy per such layer and one more forward when it is first seen.
"""
from __future__ import annotations

import functools
import inspect
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from ..private import tensor_version
from .batches import Inputs, call_model
from .layers import layer_rule
from .rule_checks import check_rule

__all__ = ["Recorder", "graph_uses", "layer_input"]

_CHUNK = 1 << 20  # outputs compared at a time where a shared input was expanded (4 MiB of float32)


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
        self.unread: Set[str] = set()  # kept layers called without a tensor where layer_input looks for their input
        self.strict = False  # after the first batch: a kept layer must be called exactly once
        self.kron = False  # the pass's structure sums Kronecker factors: check_rule checks a rule's Kronecker half
        self._active = False
        self._handles: list = []
        self._batch = 0
        self._expanded: Set[str] = set()  # layers whose shared input was expanded in this forward
        self._verified: Set[str] = set()  # ... and whose expansion was checked to change no value
        self._unshared: Set[str] = set()  # ... and whose expansion changed the output: never again
        self._copied: Set[str] = set()  # layers whose input or output a later in-place op modifies
        self._versions: Dict[str, Tuple[int, int]] = {}
        self._rules_checked = False  # the kept layers' rules were held to their contract (first strict batch)

    def __enter__(self) -> "Recorder":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
            rule = layer_rule(module)
            if rule is not None and rule.shared_input:
                self._handles.append(module.register_forward_pre_hook(self._expand_shared(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _expand_shared(self, name: str):
        def pre_hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                     ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
            if not self._active or name not in self.keep or name in self._unshared or self._batch <= 1:
                return None
            first = layer_input(module, args, kwargs)
            if first is None or first.dim() < 2 or first.shape[0] != 1:
                return None
            self._expanded.add(name)
            expanded = first.expand(self._batch, *first.shape[1:])
            if args:
                return (expanded,) + tuple(args[1:]), kwargs
            return args, {**kwargs, _input_keyword(type(module)): expanded}

        return pre_hook

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Tensor
                 ) -> Optional[Tensor]:
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
                first = layer_input(module, args, kwargs)
                if first is None:
                    if self.strict:
                        raise ValueError(
                            f"Module '{name}' was called without a tensor as its first positional argument or as the "
                            f"keyword {_input_keyword(type(module))!r}, where its input was on the first batch; call "
                            "it the same way on every batch."
                        )
                    self.unread.add(name)  # the plan sends it to the exact path
                    return None
                leading = (self._batch,)
                if self.strict and not first.shape[:1] == getattr(output, "shape", leading)[:1] == leading:
                    raise ValueError(
                        f"Module '{name}' was called with input {tuple(first.shape)} and output "
                        f"{tuple(output.shape)} on a batch of {self._batch} examples: on the first batch its input and "
                        "output led with the batch dimension. Use the same layout for every batch (a first batch of "
                        "one example cannot show a shared or sequence-first layout: drop_last or a larger batch)."
                    )
                if name in self._copied:
                    self.inputs[name] = first.detach().clone()
                    self.outputs[name] = output
                    return output.clone()
                self.inputs[name] = first.detach()
                self.outputs[name] = output
                self._versions[name] = (tensor_version(first), tensor_version(output))
            return None

        return hook

    def forward(self, inputs: Inputs, size: int) -> Tensor:
        """One forward pass of the model with counting and recording on.

        Args:
            inputs: The batch's model inputs.
            size: Its number of examples (:func:`.batches.examples`), to which shared inputs are expanded.

        Raises:
            ValueError: After the first batch, if expanding a layer's shared input changes the output.
        """
        self._batch = size
        try:
            output: Optional[Tensor] = self._record(inputs)
        except Exception:
            if not self._expanded - self._verified:
                raise
            output = None  # the expansion broke the forward: the check below refuses it
        new = self._expanded - self._verified
        if new and not self._same_without_expansion(inputs, output):
            if self.strict:
                raise ValueError(
                    f"Module(s) {sorted(new)} take an input shared by the batch (leading size 1) that cannot be "
                    "expanded to one copy per example without changing the output; the layout differs from the "
                    "first batch's. Use the same layout for every batch."
                )
            self._unshared |= new  # its rows cannot be told apart by example: the plan sends it to the exact path
            output = self._record(inputs)
        self._verified |= new
        modified = self._modified_in_place()
        if modified:
            self._copied |= modified
            output = self._record(inputs)
        assert output is not None
        return output

    def _modified_in_place(self) -> Set[str]:
        """Recorded layers whose input or output an in-place operation changed after the layer ran."""
        return {
            name
            for name, (v_in, v_out) in self._versions.items()
            if name in self.outputs
            and (tensor_version(self.inputs[name]), tensor_version(self.outputs[name])) != (v_in, v_out)
        }

    def _record(self, inputs: Inputs) -> Tensor:
        self.counts.clear()
        self.inputs.clear()
        self.outputs.clear()
        self.unread.clear()
        self._versions.clear()
        self._expanded = set()
        self._active = True
        try:
            return call_model(self.model, inputs)
        finally:
            self._active = False

    def _same_without_expansion(self, inputs: Inputs, output: Optional[Tensor]) -> bool:
        """Whether the model gives ``output`` without expanding shared inputs (hooks inactive)."""
        if output is None:
            return False
        with torch.no_grad():
            plain = call_model(self.model, inputs)
        if plain.shape != output.shape:
            return False
        scale = float(plain.detach().abs().max()) if plain.numel() else 0.0
        pieces = zip(output.detach().reshape(-1).split(_CHUNK), plain.reshape(-1).split(_CHUNK))
        # in pieces: allclose's temporaries of a whole batch of 50,257-token logits would set the pass's peak memory
        return all(torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6 * scale) for mine, theirs in pieces)

    def backprop(self, output: Tensor, factor: Tensor) -> Dict[str, Tensor]:
        """Gradients of ``sum_n L_n[:, j]^T f_n`` w.r.t. every kept layer's output, for every column ``j``.

        One plain backward pass per column (the graph is kept until the last one): faster than
        ``is_grads_batched`` (vmap), which has no batching rule for some backward ops.

        Args:
            output: Network output ``(B, ...)`` of the recorded forward pass.
            factor: Loss-Hessian factor ``(B, M, K)``, ``M`` the flattened output size.

        Returns:
            Per kept layer, a tensor ``(K, *layer_output.shape)``.

        Raises:
            ValueError: On the first batch after the plan, if a registered rule breaks its contract
                (:func:`.rule_checks.check_rule`).
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
        grads = {
            n: torch.zeros((k,) + o.shape, dtype=o.dtype, device=o.device) if g is None else g
            for n, o, g in zip(names, outs, stacked)
        }
        if self.strict and not self._rules_checked:
            for name in names:
                check_rule(name, self.keep[name], self.inputs[name], grads[name], self.kron)
            self._rules_checked = True
        return grads


def layer_input(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tensor]:
    """The input of a layer's call that its rule reads: the first positional argument, or without one the keyword of
    ``forward``'s first parameter (``input`` of torch's layers: ``self.lin(input=x)``); ``None`` if it is no tensor."""
    first = args[0] if args else kwargs.get(_input_keyword(type(module)))
    return first if isinstance(first, Tensor) else None


@functools.lru_cache(maxsize=None)
def _input_keyword(module_type: type) -> Optional[str]:
    """The name of ``forward``'s first parameter after ``self``, ``None`` where it cannot be passed by keyword."""
    try:
        parameters = list(inspect.signature(module_type.forward).parameters.values())[1:2]
    except (TypeError, ValueError):  # a forward without a signature Python can read (a builtin)
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameters[0].name if parameters and parameters[0].kind in keyword else None


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
