"""Which path each parameter takes in the evidence pass, and the structures that cover them.

Decided per module on the first batch, from the structure of the model alone:

* the hook path (:mod:`.layers`) for a layer with a rule (:func:`.layers.register_layer_rule`)
  called exactly once per forward pass, leading with the batch (indices shared by the batch,
  ``(1, T)``, are expanded per example: :mod:`.hooks`), whose parameters appear once in the
  autograd graph (no tied or functional reuse);
* the exact path (:mod:`.functional`, per-example rows of just those parameters) for the rest:
  other modules' parameters, modules called several times, parameters used outside their module.

``kron`` gives hooked layers whose rule has Kronecker factors (Linear, Conv1d/2d, Embedding, HF
Conv1D) Kronecker blocks and every other parameter an exact diagonal block (``ekfac`` the same with
eigenvalue-corrected blocks); ``diag`` the exact diagonal everywhere; ``full`` takes the exact path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from ..hyperparameters import GaussianPrior
from .layers import computed_role, hook_reason
from .options import CurvatureOptions
from .statistics import LayerPlan, Structure
from .structures import structure_class
from .exchange import Exchange

__all__ = ["LayerLayout", "Plan", "candidates", "check_model", "check_trainable", "locate", "make_plan"]

Owner = Tuple[str, nn.Module, str]


class LayerLayout(NamedTuple):
    """What the first batch showed of a recorded layer's call.

    Attributes:
        in_graph: Its output is part of the autograd graph of the forward pass.
        batch_first: Its input and output lead with the batch dimension (else its rows cannot be
            told apart by example: a positional embedding of ``arange(T)`` broadcast over the batch,
            a sequence-first layout).
        input_read: Its input was found where its rule reads it (:func:`.hooks.layer_input`).
    """

    in_graph: bool
    batch_first: bool
    input_read: bool = True


@dataclass
class Plan:
    """The paths of the evidence pass and the structures that cover the prior's tensors.

    Attributes:
        layers: Layers on the hook path.
        exact: Prior indices on the exact path.
        slow: Module name -> why its parameters take the exact path.
        structures: The structures, covering every prior tensor once.
    """

    layers: List[LayerPlan]
    exact: List[int]
    slow: Dict[str, str] = field(default_factory=dict)
    structures: List[Structure] = field(default_factory=list)


def locate(model: nn.Module, prior: GaussianPrior) -> Tuple[List[str], List[Owner]]:
    """Names of the prior's parameters in ``model`` and, for each, its owning module and role.

    Raises:
        ValueError: If the prior covers parameters ``model`` does not have, or ``model`` has
            trainable parameters the prior does not cover.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params = prior.params
    missing = [n for n, p in zip(prior.param_names, params) if id(p) not in names]
    if missing:
        raise ValueError(f"The prior covers parameters {missing} that `model` does not use.")
    covered = {id(p) for p in params}
    uncovered = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if uncovered:
        raise ValueError(
            f"Parameters {uncovered} require grad but the prior does not cover them: build the "
            "GaussianPrior from the whole network, or set requires_grad=False on them."
        )
    owners: Dict[int, Owner] = {}
    for mod_name, module in model.named_modules():
        for role, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (mod_name, module, role))
    return [names[id(p)] for p in params], [owners[id(p)] for p in params]


def check_trainable(prior: GaussianPrior) -> None:
    """The curvature's tensors are the trainable ones: refuse a prior that covers a tensor frozen after it was
    built (the predictive may read a network frozen for inference; the curvature may not).

    Raises:
        ValueError: Naming the frozen tensors and the fix.
    """
    frozen = [n for n, p in zip(prior.param_names, prior.params) if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"The prior covers parameters {frozen} that do not require grad (frozen after the GaussianPrior was "
            "built): frozen tensors are constants, outside the prior and the curvature. Build the GaussianPrior "
            "after freezing them; a fine-tuning callback that freezes or unfreezes tensors during the fit changes "
            "the tensors the evidence is of, which it does not follow."
        )


def check_model(model: nn.Module, prior: GaussianPrior, options: CurvatureOptions) -> None:
    """What can be checked without data: the prior covers the trainable parameters and no frozen one, a
    diagonal prior is not combined with ``kron``, the ``full`` structure fits in memory.

    Raises:
        ValueError: Naming the problem and a fix.
    """
    locate(model, prior)
    check_trainable(prior)
    structure_class(options.structure).check(prior, options)


def candidates(owners: Sequence[Owner], options: CurvatureOptions) -> Dict[str, nn.Module]:
    """Modules that may take the hook path (to record on the first batch)."""
    if not structure_class(options.structure).hook_path:
        return {}
    roles = _roles(owners)
    return {name: module for name, module, _ in owners if hook_reason(module, roles[name]) is None}


def _roles(owners: Sequence[Owner]) -> Dict[str, List[str]]:
    """Per module name, the roles of its parameters the prior covers."""
    roles: Dict[str, List[str]] = {}
    for name, _, role in owners:
        roles.setdefault(name, []).append(role)
    return roles


def make_plan(
    prior: GaussianPrior,
    owners: Sequence[Owner],
    options: CurvatureOptions,
    calls: Dict[str, int],
    uses: List[int],
    layouts: Dict[str, LayerLayout],
    exchange: Optional[Exchange] = None,
) -> Plan:
    """Plan the pass from the first batch's call counts and graph uses.

    Args:
        prior: The prior (its tensor sizes and structure).
        owners: Owning module and role of every prior tensor (:func:`locate`).
        options: The curvature options.
        calls: Forward calls of every module in the first batch's forward pass.
        uses: Autograd edges into every prior tensor in that pass (:func:`.hooks.graph_uses`).
        layouts: What the first batch showed of each recorded layer's call.
        exchange: Under sharded training, the collectives by which a layer-owned structure keeps
            each layer's statistics on one process (:mod:`.structures.sharded`); others ignore it.

    Raises:
        ValueError: For a diagonal prior with ``kron``, a ``full`` curvature above the memory limit,
            or a trainable layer run outside the autograd graph (reentrant activation checkpointing).
    """
    sizes = prior.param_sizes
    everything = list(range(len(sizes)))
    structure = structure_class(options.structure)
    if not structure.hook_path:
        return Plan([], everything, {}, structure.from_plan([], everything, prior, options))
    structure.check(prior, options)  # e.g. a diagonal prior with kron, with the explanation
    reasons: Dict[str, str] = {}  # per module: a layer takes the hook path whole or not at all
    roles = _roles(owners)
    for index, (name, module, role) in enumerate(owners):
        reason = reasons.get(name) or hook_reason(module, roles[name])
        if reason is None and calls.get(name, 0) != 1:
            count = calls.get(name, 0)
            reason = (
                "never called itself: its parameters are used by another module's code"
                if count == 0
                else f"called {count} times per forward pass (shared weights)"
            )
        layout = layouts.get(name, LayerLayout(True, True))
        if reason is None and not layout.input_read:
            reason = (
                "its input, which its layer rule reads, is neither its call's first positional argument nor the "
                "keyword of its forward's first parameter"
            )
        if reason is None and not layout.in_graph:
            raise ValueError(
                f"The output of module '{name}' is not in the autograd graph of the forward pass: its curvature "
                "cannot be computed. Activation checkpointing with use_reentrant=True runs the forward without "
                "gradients (and supports only .backward()); use torch.utils.checkpoint(..., use_reentrant=False), "
                "PyTorch's recommended mode, or no torch.no_grad() around trainable layers in forward."
            )
        if reason is None and not layout.batch_first:
            reason = (
                "its input or output does not lead with the batch dimension (e.g. a positional embedding of "
                "arange(T) broadcast over the batch, or a sequence-first layout), so its rows cannot be told apart "
                "by example"
            )
        if reason is None and uses[index] > 1:
            reason = f"its {role} is also used outside its forward call (tied or functional weights)"
        if reason is not None:
            reasons[name] = reason
    layers: Dict[str, LayerPlan] = {}
    exact: List[int] = []
    for index, (name, module, role) in enumerate(owners):
        if name in reasons:
            exact.append(index)
        else:
            # by the role the rule computes: a pruned layer's weight_orig is its weight, times the mask
            layers.setdefault(name, LayerPlan(name, module, {})).roles[computed_role(module, role)] = index
    slow = dict(reasons)
    hooked = list(layers.values())
    sharded = {"exchange": exchange} if exchange is not None and structure.layer_owned else {}
    return Plan(hooked, exact, slow, structure.from_plan(hooked, exact, prior, options, **sharded))
