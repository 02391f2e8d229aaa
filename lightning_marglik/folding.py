"""The function a BatchNorm network computes at test time, as a network without normalization.

In eval mode a BatchNorm is a fixed affine map per channel, ``y = gamma (x - mu) / sqrt(var + eps) + beta``
with its running statistics. When a layer's output goes only into such a norm, the two fold into one
layer: weight rows ``W_c gamma_c / sqrt(var_c + eps)`` and bias ``(b_c - mu_c) gamma_c / sqrt(var_c + eps) +
beta_c``. The folded network computes the same function; its parameters are those of a network
without normalization, so its evidence does not depend on the arbitrary scale of the channels in
front of the norm (the radial direction of each scale-invariant group: scaling ``W_c`` by ``s`` scales
the running statistics by ``s`` and leaves the folded weights as they are), and ``gamma`` and
``beta`` are no longer parameters of their own. It compares a BatchNorm network with networks without
normalization in one parametrization.

Which layers fold is decided by :func:`.curvature.scale_invariance.find_scale_invariant` (the layer's
output goes only into the norm), restricted to per-channel norms with running statistics
(BatchNorm; an InstanceNorm or a BatchNorm without running statistics normalizes by the batch in
eval mode too, and does not fold).

Given the network's prior, :func:`fold_batchnorm` also puts a prior on the copy: the same structure,
hyperprior and declared precision, each surviving tensor with its precision and treatment, the
folded layers' tensors (new functions of the weights, the norm's parameters and its statistics, no
longer scale-invariant) learned from their old precision or, a new bias, from the declared one.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from .curvature.batches import Inputs
from .curvature.scale_invariance import find_scale_invariant
from .hyperparameters import GaussianPrior
from .private import conv_base, norm_base
from .symmetries import OUTPUT_TOLERANCE, eval_outputs, reference_outputs, relative_change

_ConvNd, _NormBase = conv_base(), norm_base()  # torch's private base classes: lightning_marglik.private

__all__ = ["Folded", "fold_batchnorm"]


@dataclass
class Folded:
    """The folded network and what was folded.

    Attributes:
        model: A copy of the network (eval mode) with every foldable norm folded into the layer before it
            and replaced by ``nn.Identity``; the original is left as it was.
        folded: Layer name -> the name of the norm folded into it.
        output_change: Largest change of the eval-mode outputs on the batch, relative to their largest magnitude.
        prior: With a ``prior`` given: the prior on the copy's network (registered in the copy where the
            original was registered in ``model``), else ``None``.
    """

    model: nn.Module
    folded: Dict[str, str] = field(default_factory=dict)
    output_change: float = 0.0
    prior: Optional[GaussianPrior] = None


def _foldable(layer: nn.Module, norm: nn.Module) -> bool:
    channels = layer.out_features if isinstance(layer, nn.Linear) else getattr(layer, "out_channels", None)
    return (isinstance(layer, (nn.Linear, _ConvNd)) and not getattr(layer, "transposed", False)
            and isinstance(norm, _NormBase) and norm.track_running_stats and norm.running_var is not None
            and norm.num_features == channels)


def _fold(layer: nn.Module, norm: _NormBase) -> None:
    with torch.no_grad():
        var, mean = norm.running_var.to(layer.weight.dtype), norm.running_mean.to(layer.weight.dtype)
        gamma = norm.weight if norm.affine else torch.ones_like(var)
        beta = norm.bias if norm.affine else torch.zeros_like(var)
        scale = gamma / torch.sqrt(var + norm.eps)
        bias = layer.bias if layer.bias is not None else torch.zeros_like(var)
        layer.weight.mul_(scale.reshape((-1,) + (1,) * (layer.weight.dim() - 1)))
        layer.bias = nn.Parameter((bias - mean) * scale + beta, requires_grad=layer.weight.requires_grad)


def fold_batchnorm(model: nn.Module, inputs: Inputs, prior: Optional[GaussianPrior] = None) -> Folded:
    """A copy of ``model`` with every BatchNorm that takes a layer's output alone folded into that layer.

    Evaluate the evidence of ``Folded.model`` under ``Folded.prior`` (or a prior built on the copy): its
    parameters are the folded layers' weights and biases and every other parameter, without the folded
    norms' ``weight`` and ``bias``.

    Args:
        model: The network, or a module holding it and its prior such as a ``LightningModule`` (copied
            without its trainer); its running statistics are the ones folded.
        inputs: One batch of model inputs: the analysis of which layer feeds which norm runs on it, and
            the eval-mode outputs before and after are compared on it.
        prior: The prior of the network in ``model`` (``model`` itself or one of its modules), carried
            over to the copy as the module docstring says.

    Returns:
        The folded copy, what was folded (nothing, for a network without such a norm) and, with ``prior``,
        the copy's prior.

    Raises:
        ValueError: If the eval-mode outputs on ``inputs`` are not finite, or ``prior`` is not a
            ``GaussianPrior`` or covers a network that is not part of ``model``.
        RuntimeError: If the eval-mode outputs on ``inputs`` changed by more than ``OUTPUT_TOLERANCE``
            (relative), or the folded copy's ``forward`` raised, e.g. a ``forward`` that reads a folded
            norm's parameters elsewhere.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
        >>> folded = fold_batchnorm(net.eval(), torch.randn(8, 1, 4, 4))
        >>> folded.folded, type(folded.model[1]).__name__
        ({'0': '1'}, 'Identity')
    """
    if prior is not None and not isinstance(prior, GaussianPrior):
        raise ValueError(f"`prior` must be the network's GaussianPrior (or None), got {type(prior).__name__}.")
    copies: Dict[int, Any] = {}  # original object id -> its copy: where the prior's network went
    folded_model = copy.deepcopy(model, copies).eval()
    if prior is not None and id(prior.model) not in copies:
        raise ValueError(f"`prior` covers a {type(prior.model).__name__} that is not part of the "
                         f"{type(model).__name__} to fold: pass the module that holds the prior's network.")
    before = reference_outputs(folded_model, inputs)
    modules = dict(folded_model.named_modules())
    report = Folded(folded_model)
    for entry in find_scale_invariant(folded_model, inputs):
        layer, norm = modules[entry.layer], modules[entry.norm]
        if not entry.norm or not _foldable(layer, norm):
            continue
        _fold(layer, norm)
        parent, _, attribute = entry.norm.rpartition(".")
        setattr(modules[parent] if parent else folded_model, attribute, nn.Identity())
        report.folded[entry.layer] = entry.norm
    try:
        after = eval_outputs(folded_model, inputs)
    except Exception as err:  # e.g. a forward that reads a folded norm's attributes: the user's code, any error
        raise RuntimeError(f"folding the BatchNorms {sorted(report.folded.values())} broke the model's forward "
                           f"({type(err).__name__}: {err}). Evaluate the evidence of the model as it is.") from err
    report.output_change = relative_change(before, after)
    if not report.output_change <= OUTPUT_TOLERANCE:
        raise RuntimeError(
            f"folding the BatchNorms {sorted(report.folded.values())} changed the eval-mode outputs by "
            f"{report.output_change:.2e} (relative): the model's forward uses them other than as the layer's only "
            "consumer. Evaluate the evidence of the model as it is."
        )
    if prior is not None:
        network = copies[id(prior.model)]
        report.prior = _carried_prior(prior, folded_model, copies.get(id(prior)), network, report.folded)
    return report


def _carried_prior(prior: GaussianPrior, folded_model: nn.Module, old_copy: Optional[nn.Module], network: nn.Module,
                   folded: Dict[str, str]) -> GaussianPrior:
    """``prior`` carried over to the folded ``network`` (module docstring), in ``old_copy``'s place in
    ``folded_model``."""
    prefix = next(name for name, module in folded_model.named_modules() if module is network)
    layers = [layer[len(prefix) + 1:] if prefix else layer for layer in folded]  # named as in ``network``
    refolded = {f"{layer}.{kind}" for layer in layers for kind in ("weight", "bias")}
    names = {name for name, _ in network.named_parameters()} - refolded
    new = GaussianPrior(network, prior.initial_precision, prior.structure, prior.learn,
                        [n for n in prior.fixed if n in names], prior.hyperprior)
    for reason, (treated, treatment) in prior.treatments.items():
        new.treat([n for n in treated if n in names], treatment, reason)
    new.to(prior.log_precision.device, prior.log_precision.dtype)
    with torch.no_grad():
        new.log_precision.copy_(_carried_log_precision(prior, new))
    if int(prior.n_data) > 0:
        new.record_n_data(int(prior.n_data))
    if old_copy is not None:  # the copy holds the new prior where the original held its own
        path = next(name for name, module in folded_model.named_modules() if module is old_copy)
        parent, _, attribute = path.rpartition(".")
        setattr(folded_model.get_submodule(parent), attribute, new)
    return new


def _carried_log_precision(prior: GaussianPrior, new: GaussianPrior) -> Tensor:
    """``new``'s log precisions: a tensor's old ones where its name and size survive (a folded weight's too,
    Newton's start), else the declared precision (a folded layer's new bias)."""
    if prior.structure == "scalar":
        return prior.log_precision.detach()
    per_scalar = prior.per_parameter(prior.log_precision.detach())
    old = dict(zip(prior.param_names, torch.split(per_scalar, prior.param_sizes)))
    declared = prior.log_precision.new_full((1,), math.log(prior.initial_precision))
    values: List[Tensor] = []
    for name, size in zip(new.param_names, new.param_sizes):
        value = old.get(name)
        value = declared.expand(size) if value is None or value.numel() != size else value
        values.append(value if new.structure == "diagonal" else value[:1])
    return torch.cat(values)
