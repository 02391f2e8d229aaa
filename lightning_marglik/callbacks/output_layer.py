"""The output layer's precision: found from one forward at set-up, then treated as ``output_layer`` says.

Where the declared prior already fits, the evidence's optimum for the output layer is a stronger prior
than the predictive optimum, and learning it makes held-out NLL worse; holding it at its declared
precision recovered most of that loss at no cost (``benchmarks/results/never_worse_default.md``, issue 42).

The output layer is found in the autograd graph of one eval-mode forward: walking back from the network's
output, each path stops at the first module that applies a weight matrix (a tensor of two or more
dimensions: ``Linear``, ``Conv*``, Hugging Face's ``Conv1D``, ``Embedding``). What lies between passes
through: indexing (a sequence classifier's last token), reshapes, a softmax, a scale, a ``LayerNorm`` or
other elementwise parameters, and a root module's own tensors (a position table, a class token) used
before its head. Heads joined by ``torch.cat`` are found together. A weight matrix applied outside
the module that owns it (a language model's output tied to its embedding, a functional call) makes the
output without a layer of its own, so nothing is treated, and the reason says so.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..curvature import eval_mode
from ..curvature.batches import call_model, eager
from ..curvature.hooks import graph_uses
from ..hyperparameters import GaussianPrior
from .package import LightningModule

__all__ = [
    "OUTPUT_LAYER", "OutputLayer", "find_output_layer", "forward_finding_output_layer", "output_layer_learned",
    "treat_output_layer",
]

OUTPUT_LAYER = "output layer"  # the prior's treatment reason (``GaussianPrior.treatments``)

_Reach = Tuple[FrozenSet[int], FrozenSet[str]]  # parameter ids, and the recorded layers a walk stopped at


@dataclass(frozen=True)
class OutputLayer:
    """What the walk back from the network's output found.

    Attributes:
        layers: Module names of the output layer(s), in module order.
        names: The tensors to treat (``named_parameters`` names): the layers' own trainable tensors
            that their forward uses and that no other module owns.
        shared: The layers' tensors left out because another module owns them too (tied weights), each
            as ``("<layer>.<tensor>", "<the other modules>")``.
        outside: Weight matrices that make the output outside the forward of the module that owns them
            (``named_parameters`` names).
    """

    layers: Tuple[str, ...]
    names: Tuple[str, ...]
    shared: Tuple[Tuple[str, str], ...]
    outside: Tuple[str, ...]


def _own(module: nn.Module) -> Dict[str, nn.Parameter]:
    """A module's own parameters by attribute, those its parametrizations compute its weights from included."""
    own = dict(module.named_parameters(recurse=False))
    if parametrize.is_parametrized(module):
        own.update(module.parametrizations.named_parameters())
    return own


def _tensors(output: Any) -> List[Tensor]:
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return [v for v in values if isinstance(v, Tensor)]


class _Graph:
    """The autograd graph of one output, cut at the recorded layer outputs."""

    def __init__(self, recorded: Dict[Any, str], matrices: Set[int]) -> None:
        self.recorded, self.matrices = recorded, matrices
        self._memo: Dict[Any, _Reach] = {}

    def reach(self, start: Any) -> _Reach:
        """The parameters below ``start`` and the recorded layers, on paths that stop at recorded layers."""
        stack = [(start, False)]
        while stack:  # iterative post-order: the graphs of deep networks pass any recursion limit
            node, ready = stack.pop()
            if node in self._memo:
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            inner = [c for c in children if c not in self.recorded and not hasattr(c, "variable")]
            if not ready:
                stack.append((node, True))
                stack.extend((c, False) for c in inner if c not in self._memo)
                continue
            params = {id(c.variable) for c in children if hasattr(c, "variable")}
            stops = {self.recorded[c] for c in children if c in self.recorded}
            for child in inner:
                params |= self._memo[child][0]
                stops |= self._memo[child][1]
            self._memo[node] = (frozenset(params), frozenset(stops))
        return self._memo[start]

    def weights(self, node: Any) -> Set[int]:
        """The weight matrices ``node`` applies itself: on a branch of its own that no layer's output feeds."""
        applied: Set[int] = set()
        for child, _ in node.next_functions:
            if child is None or child in self.recorded:
                continue
            params, stops = ({id(child.variable)}, frozenset()) if hasattr(child, "variable") else self.reach(child)
            if not stops:
                applied |= params & self.matrices
        return applied


def _inside(name: str, layer: str) -> bool:
    return layer == "" or name.startswith(layer + ".")


def find_output_layer(pl_module: LightningModule, inputs: Any) -> OutputLayer:
    """The output layer(s) of ``pl_module``, from one eval-mode forward of ``inputs`` with gradients on
    (:func:`forward_finding_output_layer`'s).

    Args:
        pl_module: The module whose ``forward`` gives the network's output.
        inputs: One batch of model inputs.

    Returns:
        The layers found, the tensors to treat, and what was left out and why; empty where the output
        depends on no weight matrix.
    """
    return forward_finding_output_layer(pl_module, inputs)[1]


def forward_finding_output_layer(pl_module: LightningModule, inputs: Any) -> Tuple[Tensor, OutputLayer]:
    """One eval-mode forward of ``inputs`` with gradients on: its output (detached), and the output layer(s)
    found in its graph. Set-up's target check and the output layer's search share it.

    Forward hooks record the output of each module that owns a weight matrix (the innermost, where a
    module returns its child's output). The walk back from the network's output stops, on each path,
    at the first recorded output of a module whose forward applies its own matrix (a container that
    only passes its child's output on, such as a root that holds a position table, is walked through),
    or at an operation that applies a weight matrix outside its module.

    Args:
        pl_module: The module whose ``forward`` gives the network's output.
        inputs: One batch of model inputs.

    Returns:
        The output, and what :func:`find_output_layer` returns.

    Raises:
        TypeError: Where ``forward`` returns no tensor (:func:`~lightning_marglik.curvature.batches.call_model`).
    """
    modules = {n: m for n, m in pl_module.named_modules() if not isinstance(m, parametrize.ParametrizationList)}
    own = {name: _own(module) for name, module in modules.items()}
    owners: Dict[int, List[str]] = {}
    for name, params in own.items():
        for p in params.values():
            owners.setdefault(id(p), []).append(name)
    matrices = {id(p) for p in pl_module.parameters() if p.dim() >= 2}
    recorded: Dict[Any, str] = {}  # an output's autograd node -> the innermost module that returned it

    def record(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for tensor in _tensors(output):
                if tensor.grad_fn is not None:
                    recorded.setdefault(tensor.grad_fn, name)
        return hook

    hooks = [modules[n].register_forward_hook(record(n)) for n, params in own.items()
             if any(p.dim() >= 2 for p in params.values())]
    try:
        with eval_mode(pl_module), torch.enable_grad(), eager():  # a compiled module's hooks fire only eagerly
            output = call_model(pl_module, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    graph = _Graph(recorded, matrices)
    found: Dict[str, FrozenSet[int]] = {}
    outside: Set[int] = set()
    queue = deque([output.grad_fn] if output.grad_fn is not None else [])
    seen = set(queue)
    while queue:
        node = queue.popleft()
        layer = recorded.get(node)
        if layer is not None:
            params, stops = graph.reach(node)
            mine = params & {id(p) for p in own[layer].values()}
            # a trainable matrix is a node of the graph: the module applies it where the walk reaches it; a module
            # whose matrices are all frozen applies one unless its output is its child's, passed on
            if any(p.requires_grad and id(p) in matrices for p in own[layer].values()):
                applies = bool(mine & matrices)
            else:
                applies = not any(_inside(stop, layer) for stop in stops)
            if applies:
                found[layer] = found.get(layer, frozenset()) | mine
                continue
        applied = graph.weights(node)
        if applied:
            outside |= applied
            continue
        for child, _ in node.next_functions:
            if child is not None and not hasattr(child, "variable") and child not in seen:
                seen.add(child)
                queue.append(child)
    layers = tuple(n for n in modules if n in found)
    held: Set[int] = set()
    shared: List[Tuple[str, str]] = []
    for layer in layers:
        for attr, p in own[layer].items():
            # a tensor its parent registers too (Hugging Face's MLM head: `self.decoder.bias = self.bias`) is the
            # layer's alone where the graph uses it once
            ancestors_only = all(_inside(layer, o) for o in owners[id(p)] if o != layer)
            once = ancestors_only and graph_uses(output, [p]) == [1]
            others = [o for o in owners[id(p)] if o != layer and not once]
            if id(p) in found[layer] and others:
                shared.append((f"{layer}.{attr}", ", ".join(others)))
            elif id(p) in found[layer]:
                held.add(id(p))
    named = list(pl_module.named_parameters())
    return output.detach(), OutputLayer(layers, tuple(n for n, p in named if id(p) in held), tuple(shared),
                                        tuple(n for n, p in named if id(p) in outside))


def _listed(names: Tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" if n else "the root module" for n in names)


def _tied(shared: Tuple[Tuple[str, str], ...]) -> str:
    return ", ".join(f"`{tensor}` is tied to `{others}`" for tensor, others in shared)


def _nothing(found: OutputLayer) -> str:
    """Why the prior treats none of the output layer's tensors."""
    if found.outside and not found.layers:
        return (f"the output is computed from {_listed(found.outside)} outside the module that owns it (tied weights "
                "or a functional call), not by a layer of its own")
    if found.shared and not found.names:
        return f"{_tied(found.shared)} (a tied tensor is learned with the module it is shared with)"
    if found.names:
        return f"the prior covers none of the output layer {_listed(found.layers)}'s tensors"
    if found.layers:
        return f"the output layer {_listed(found.layers)} has no trainable tensor"
    return "no layer with a weight matrix (a trainable tensor of two or more dimensions) makes the network's output"


def treat_output_layer(pl_module: LightningModule, prior: GaussianPrior, found: OutputLayer, treatment: str) -> Dict[str, Any]:
    """Give the output layer's tensors to the prior with ``treatment`` (reason :data:`OUTPUT_LAYER`).

    Args:
        pl_module: The module the output layer was found in (its parameters' names).
        prior: The prior that takes the treatment.
        found: The output layer (:func:`find_output_layer`, or set-up's :func:`forward_finding_output_layer`).
        treatment: ``output_layer`` of the callback.

    Returns:
        What was decided: ``names`` (the prior's names of the layer's tensors), ``treatment`` (as applied:
        ``"learn"`` for a scalar prior, which has one precision for all, and where nothing is treated) and
        ``reason`` (the layer(s) and the treatment, or why nothing is treated).

    Raises:
        TypeError: If ``found`` is not an :class:`OutputLayer` (model inputs, as this function took before).
    """
    if not isinstance(found, OutputLayer):
        raise TypeError(f"treat_output_layer takes the OutputLayer that find_output_layer(pl_module, inputs) returns, "
                        f"got {type(found).__name__}.")
    ours = {id(p): n for n, p in zip(prior.param_names, prior.params)}
    full = dict(pl_module.named_parameters())
    names = [ours[id(full[n])] for n in found.names if id(full[n]) in ours]
    applied = treatment if names and prior.structure != "scalar" else "learn"
    prior.treat(names, applied, OUTPUT_LAYER)
    if not names:
        return {"names": names, "treatment": applied, "reason": f"nothing treated: {_nothing(found)}"}
    if applied != treatment:
        what = "the prior is scalar (one precision for every tensor), so learned with the rest"
    else:
        what = {"fixed": "held at the declared precision", "decoupled": "learned, weight decay kept declared",
                "learn": "learned like every other layer"}[applied]
    notes = [f"{_tied(found.shared)}, so learned"] * bool(found.shared)
    notes += [f"applied outside their module, learned: {_listed(found.outside)}"] * bool(found.outside)
    reason = f"output layer {_listed(found.layers)}: {what}"
    return {"names": names, "treatment": applied, "reason": "; ".join([reason, *notes])}


@contextlib.contextmanager
def output_layer_learned(prior: GaussianPrior) -> Iterator[Optional[str]]:
    """Inside, the evidence learns the output layer's precision that training holds (``output_layer="fixed"``).

    For ranking trained models only: held at the declared precision, the output layer's Occam factor is
    charged at a prior the evidence did not choose, and the ranking study ranked better with it learned
    (``benchmarks/results/default_ranking.md``, issue 52). The treatment is restored on leaving, and
    nothing is written to the precisions. Tensors that another reason or ``fixed=`` holds stay held.

    Args:
        prior: The prior whose ``"output layer"`` treatment :func:`treat_output_layer` declared.

    Yields:
        What changed, in words (``None``: nothing, the output layer's precision was learned already,
        or no output layer is treated).
    """
    names, treatment = prior.treatments.get(OUTPUT_LAYER, ([], "learn"))
    if treatment != "fixed" or not names:
        yield None
        return
    prior.treat(names, "learn", OUTPUT_LAYER)
    try:
        yield (f"the output layer's precision ({_listed(tuple(names))}) learned by the ranking evidence; training "
               "held it at the declared precision (output_layer='fixed')")
    finally:
        prior.treat(names, treatment, OUTPUT_LAYER)
