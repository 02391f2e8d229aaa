"""The output layer's precision: found from one forward at set-up, then treated as ``output_layer`` says.

Where the declared prior already fits, the evidence's optimum for the output layer is a stronger prior
than the predictive optimum, and learning it makes held-out NLL worse; holding it at its declared
precision recovered most of that loss at no cost (``benchmarks/results/never_worse_default.md``, issue 42).
The layer is the module with parameters of its own whose forward output is the network's output (the
same storage: a view or reshape of it counts, a softmax or any new tensor after it does not).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..curvature import eval_mode
from ..curvature.batches import call_model
from ..hyperparameters import GaussianPrior
from .package import LightningModule

__all__ = ["OUTPUT_LAYER", "find_output_layer", "treat_output_layer"]

OUTPUT_LAYER = "output layer"  # the prior's treatment reason (``GaussianPrior.treatments``)


def _storage(tensor: Any) -> Optional[int]:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, Tensor) else None


def find_output_layer(pl_module: LightningModule, inputs: Any) -> List[str]:
    """The names (``pl_module.named_parameters()``) of the parameters of the layer whose output is the
    network's output, from one eval-mode forward of ``inputs``.

    Args:
        pl_module: The module whose ``forward`` gives the network's output.
        inputs: One batch of model inputs.

    Returns:
        The names of the layer's trainable parameters that no other module shares; empty if no module with
        parameters of its own returns the network's output (an output computed by a function after the last
        layer, or by tied weights).
    """
    finished: List[tuple] = []  # (module name, output storage) in the order the forwards end
    hooks = []
    for name, module in pl_module.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, name=name: finished.append((name, _storage(out)))))
    try:
        with eval_mode(pl_module), torch.no_grad():
            output = call_model(pl_module, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    made = [name for name, storage in finished if storage is not None and storage == _storage(output)]
    if not made:
        return []
    layer: nn.Module = pl_module.get_submodule(made[-1])
    # a weight tied to another module's (a language model's head and its embedding) is not the output layer's alone
    owners: Dict[int, int] = {}
    for module in pl_module.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    names = {id(param): name for name, param in pl_module.named_parameters()}
    return [names[id(p)] for p in layer.parameters(recurse=False) if p.requires_grad and owners[id(p)] == 1]


def treat_output_layer(pl_module: LightningModule, prior: GaussianPrior, inputs: Any, treatment: str) -> Dict[str, Any]:
    """Find the output layer and give its tensors to the prior with ``treatment`` (reason :data:`OUTPUT_LAYER`).

    Args:
        pl_module: The module (its ``forward`` is run once).
        prior: The prior that takes the treatment.
        inputs: One batch of model inputs.
        treatment: ``output_layer`` of the callback.

    Returns:
        What was decided: ``names`` (the prior's names of the layer's tensors), ``treatment`` (as applied:
        ``"learn"`` for a scalar prior, which has one precision for all) and ``reason``.
    """
    ours = {id(p): n for n, p in zip(prior.param_names, prior.params)}
    full = dict(pl_module.named_parameters())
    names = [ours[id(full[n])] for n in find_output_layer(pl_module, inputs) if id(full[n]) in ours]
    applied = treatment if names and prior.structure != "scalar" else "learn"
    prior.treat(names, applied, OUTPUT_LAYER)
    if not names:
        reason = "no layer's output is the network's output (a function or tied weights make it): nothing treated"
    elif applied != treatment:
        reason = "the prior is scalar (one precision for every tensor): learned with the rest"
    else:
        reason = {"fixed": "held at the declared precision", "decoupled": "learned, weight decay kept declared",
                  "learn": "learned like every other layer"}[applied]
    return {"names": names, "treatment": applied, "reason": reason}
