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
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd

from .curvature.batches import Inputs
from .curvature.scale_invariance import find_scale_invariant
from .symmetries import OUTPUT_TOLERANCE, eval_outputs, reference_outputs, relative_change

__all__ = ["Folded", "fold_batchnorm"]


@dataclass
class Folded:
    """The folded network and what was folded.

    Attributes:
        model: A copy of the network (eval mode) with every foldable norm folded into the layer before it
            and replaced by ``nn.Identity``; the original is left as it was.
        folded: Layer name -> the name of the norm folded into it.
        output_change: Largest change of the eval-mode outputs on the batch, relative to their largest magnitude.
    """

    model: nn.Module
    folded: Dict[str, str] = field(default_factory=dict)
    output_change: float = 0.0


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


def fold_batchnorm(model: nn.Module, inputs: Inputs) -> Folded:
    """A copy of ``model`` with every BatchNorm that takes a layer's output alone folded into that layer.

    Evaluate the evidence of ``Folded.model`` with a prior built on it (``GaussianPrior(folded.model)``):
    its parameters are the folded layers' weights and biases and every other parameter, without the
    folded norms' ``weight`` and ``bias``.

    Args:
        model: The network (its running statistics are the ones folded).
        inputs: One batch of model inputs: the analysis of which layer feeds which norm runs on it, and
            the eval-mode outputs before and after are compared on it.

    Returns:
        The folded copy and what was folded (nothing, for a network without such a norm).

    Raises:
        ValueError: If the eval-mode outputs on ``inputs`` are not finite.
        RuntimeError: If the eval-mode outputs on ``inputs`` changed by more than ``OUTPUT_TOLERANCE``
            (relative), e.g. a ``forward`` that reads a folded norm's parameters elsewhere.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
        >>> folded = fold_batchnorm(net.eval(), torch.randn(8, 1, 4, 4))
        >>> folded.folded, type(folded.model[1]).__name__
        ({'0': '1'}, 'Identity')
    """
    folded_model = copy.deepcopy(model).eval()
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
    report.output_change = relative_change(before, eval_outputs(folded_model, inputs))
    if not report.output_change <= OUTPUT_TOLERANCE:
        raise RuntimeError(
            f"folding the BatchNorms {sorted(report.folded.values())} changed the eval-mode outputs by "
            f"{report.output_change:.2e} (relative): the model's forward uses them other than as the layer's only "
            "consumer. Evaluate the evidence of the model as it is."
        )
    return report
