"""One point per rescaling orbit of a network, so that its evidence does not depend on where training left it.

Two kinds of rescaling leave a network's function unchanged while they move its weights:

* **Positively homogeneous units.** A unit ``c`` of a layer ``A`` (row ``c`` of ``A``'s weight and
  its bias, or channel ``c`` of a BatchNorm's affine map) whose output goes through elementwise
  positively homogeneous maps (ReLU, leaky ReLU, max or average pooling, dropout, flatten) into a
  layer ``B``: scaling the unit's incoming parameters by ``a > 0`` and ``B``'s weights that read
  it by ``1 / a``. Found in ``nn.Sequential`` containers, whose children pass their output to the
  next one only.
* **Channels feeding a per-channel normalization** (BatchNorm, InstanceNorm): scaling channel
  ``c`` of the layer (:func:`.curvature.scale_invariance.find_scale_invariant`) by ``s > 0``. The
  training-mode function is invariant; in eval mode the running statistics are rescaled with it
  (``mean * s``, ``var -> s^2 (var + eps) - eps``), so the eval-mode function is unchanged exactly.

The likelihood is constant along these orbits, the Laplace evidence is not: the prior term and the
curvature move with the weights (for a normalized channel the curvature scales as ``1 / s^2``).
:func:`canonicalize` moves the network, in place, to one representative per orbit:

* units: the point of highest prior density on the orbit (least ``sum_p delta_p theta_p^2``). The
  likelihood being constant there, it is also the posterior's highest point on the orbit, where an
  exact MAP of the training objective sits; each unit is balanced, ``a^4 = e_out / e_in`` (prior
  energies of its outgoing and incoming parameters), by sweeps over the layers until no unit moves
  (a convex problem in the log scales, solved exactly per layer);
* normalized channels: along such an orbit the prior density rises towards the origin, so there is
  no highest point. The representative gives every channel of the tensor the same prior energy and
  keeps the tensor's total. What remains is one scale per tensor, and under a layerwise (or
  diagonal) prior a per-tensor rescaling by ``s`` is the same evidence as a precision ``delta s^2``:
  the evidence maximized over the precisions (``LaplaceEvidence.optimize``) does not depend on it.

The evidence at the canonical point is then invariant to every rescaling above (tested against the
dense ``full`` evidence in float64). Under a scalar prior one precision spans all tensors and the
per-tensor scale of normalized layers is not absorbed. The balance uses the prior's current
precisions; optimizing them afterwards does not move the weights again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .curvature import eval_mode
from .curvature.batches import Inputs, call_model
from .curvature.scale_invariance import find_scale_invariant
from .hyperparameters import GaussianPrior
from .private import conv_base, norm_base

_ConvNd, _NormBase = conv_base(), norm_base()  # torch's private base classes: lightning_marglik.private

__all__ = ["Canonicalization", "canonicalize", "eval_outputs", "reference_outputs", "relative_change"]

# maps between two layers that commute with a positive scale per channel
HOMOGENEOUS = (
    nn.ReLU, nn.LeakyReLU, nn.Identity, nn.Flatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
SWEEPS = 200
TOLERANCE = 1e-9  # largest |log a| of a sweep at which the balance has converged (float64; float32: 100 eps)
OUTPUT_TOLERANCE = 1e-4  # relative change of the outputs on the given batch above which nothing is kept


@dataclass
class Canonicalization:
    """What :func:`canonicalize` moved.

    Attributes:
        units: ``"A -> B"`` (module names of the two layers) -> number of units balanced between them.
        channels: Layer name -> number of its channels in front of a per-channel normalization.
        sweeps: Sweeps over all of them until none moved by more than ``TOLERANCE`` in log scale (100
            rounding units of the parameters' dtype for float32).
        converged: Whether that happened within ``SWEEPS`` sweeps.
        output_change: Largest change of the outputs on the batch, relative to their largest magnitude.
    """

    units: Dict[str, int] = field(default_factory=dict)
    channels: Dict[str, int] = field(default_factory=dict)
    sweeps: int = 0
    converged: bool = True
    output_change: float = 0.0


@dataclass
class _Units:
    """The units between layer ``source`` and layer ``target``: rows of the one, column blocks of the other."""

    name: str
    source: nn.Module
    target: nn.Module
    channels: int


@dataclass
class _Channels:
    """The channels of ``layer`` in front of the per-channel normalization ``norm``."""

    name: str
    layer: nn.Module
    norm: _NormBase
    channels: int


def _out_channels(module: nn.Module) -> Optional[int]:
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, _ConvNd) and module.groups == 1 and not module.transposed:
        return module.out_channels
    if isinstance(module, _NormBase) and module.affine:
        return module.num_features
    return None


def _in_features(module: nn.Module) -> Optional[int]:
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, _ConvNd) and module.groups == 1 and not module.transposed:
        return module.in_channels
    return None


def _sequences(model: nn.Module) -> List[List[Tuple[str, nn.Module]]]:
    """The children of every outermost plain ``nn.Sequential``, nested ones spliced in, in call order."""
    def flatten(prefix: str, sequential: nn.Sequential) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for key, child in sequential.named_children():
            name = f"{prefix}.{key}" if prefix else key
            out += flatten(name, child) if type(child) is nn.Sequential else [(name, child)]
        return out

    sequentials = [(n, m) for n, m in model.named_modules() if type(m) is nn.Sequential]
    inner = {id(c) for _, m in sequentials for c in m.children() if type(c) is nn.Sequential}
    return [flatten(n, m) for n, m in sequentials if id(m) not in inner]


def _unit_pairs(model: nn.Module, held: Dict[int, Tensor]) -> List[_Units]:
    """Every (source, homogeneous maps, target) run of a sequence whose parameters the prior all holds."""
    uses: Dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1

    def own(module: nn.Module) -> bool:  # called once, with parameters of its own that the prior holds
        params = list(module.parameters(recurse=False))
        return uses[id(module)] == 1 and bool(params) and all(id(p) in held and uses[id(p)] == 1 for p in params)

    pairs = []
    for sequence in _sequences(model):
        for i, (name, source) in enumerate(sequence):
            channels = _out_channels(source)
            if channels is None or not own(source):
                continue
            j = i + 1
            while j < len(sequence) and isinstance(sequence[j][1], HOMOGENEOUS):
                j += 1
            if j == len(sequence):
                continue
            target_name, target = sequence[j]
            fan_in = _in_features(target)
            flattened = any(isinstance(m, nn.Flatten) for _, m in sequence[i + 1:j])
            # a flattened map is channel-major only where channels come first (convolutions, BatchNorm);
            # a Linear's features come last, so a flattened sequence of them interleaves its units
            blocks = flattened and isinstance(source, (_ConvNd, _NormBase))
            if fan_in is None or not own(target) or fan_in % channels or (fan_in != channels and not blocks):
                continue
            pairs.append(_Units(f"{name} -> {target_name}", source, target, channels))
    return pairs


def _normalized(model: nn.Module, inputs: Inputs, held: Dict[int, Tensor]) -> List[_Channels]:
    """The layers in front of a per-channel normalization; a norm over whole feature vectors (LayerNorm,
    GroupNorm) leaves one scale per tensor, which the precisions absorb."""
    modules = dict(model.named_modules())
    found = []
    for entry in find_scale_invariant(model, inputs):
        layer, norm = modules[entry.layer], modules[entry.norm]
        channels = _out_channels(layer)
        if (channels is not None and not isinstance(layer, _NormBase) and isinstance(norm, _NormBase)
                and norm.num_features == channels and all(id(p) in held for p in layer.parameters(recurse=False))):
            found.append(_Channels(entry.layer, layer, norm, channels))
    return found


def _energy(values: List[Tensor], held: Dict[int, Tensor], channels: int, columns: bool = False) -> Tensor:
    """Prior energy ``sum delta theta^2`` per unit: per row of each tensor, or (``columns``) per block of
    columns of a target weight ``(out, channels * block, ...)``."""
    total = torch.zeros(channels, dtype=torch.float64, device=values[0].device)
    for value in values:
        energy = held[id(value)].double() * value.detach().double().pow(2)
        total = total + (energy.reshape(energy.shape[0], channels, -1).sum((0, 2)) if columns
                         else energy.reshape(channels, -1).sum(1))
    return total


def _scale(value: Tensor, log_factor: Tensor, columns: bool = False) -> None:
    """Multiply the rows (or column blocks) of ``value`` in place by ``exp(log_factor)``, one per unit."""
    factor = log_factor.exp().to(value.dtype)
    with torch.no_grad():
        if columns:
            value.view(value.shape[0], factor.numel(), -1).mul_(factor.reshape(1, -1, 1))
        else:
            value.mul_(factor.reshape((-1,) + (1,) * (value.dim() - 1)))


def _balance(unit: _Units, held: Dict[int, Tensor]) -> Tensor:
    """Balance every unit between ``source`` and ``target``; returns ``log a`` per unit (0: dead, left alone)."""
    incoming = list(unit.source.parameters(recurse=False))
    e_in = _energy(incoming, held, unit.channels)
    e_out = _energy([unit.target.weight], held, unit.channels, columns=True)
    alive = (e_in > 0) & (e_out > 0)
    log_a = torch.where(alive, 0.25 * (e_out.clamp_min(1e-300).log() - e_in.clamp_min(1e-300).log()),
                        torch.zeros_like(e_in))
    for value in incoming:
        _scale(value, log_a)
    _scale(unit.target.weight, -log_a, columns=True)
    return log_a


def _equalize(group: _Channels, held: Dict[int, Tensor]) -> Tensor:
    """Give every channel the tensor's mean prior energy; returns ``log s`` per channel (0: left alone)."""
    params = list(group.layer.parameters(recurse=False))
    energy = _energy(params, held, group.channels)
    log_s = torch.where(energy > 0, 0.5 * (energy.mean().log() - energy.clamp_min(1e-300).log()),
                        torch.zeros_like(energy))
    norm = group.norm
    if norm.track_running_stats and norm.running_var is not None:
        variance = (2 * log_s).exp() * (norm.running_var.double() + norm.eps) - norm.eps
        log_s = torch.where(variance > 0, log_s, torch.zeros_like(log_s))  # a variance that cannot follow: stays
        with torch.no_grad():
            norm.running_mean.mul_(log_s.exp().to(norm.running_mean.dtype))
            norm.running_var.copy_(torch.where(variance > 0, variance, norm.running_var.double()))
    for value in params:
        _scale(value, log_s)
    return log_s


def eval_outputs(model: nn.Module, inputs: Inputs) -> Tensor:
    """The eval-mode outputs of ``model`` on ``inputs``, every module's own training flag restored afterwards."""
    with eval_mode(model), torch.no_grad():
        return call_model(model, inputs).detach()


def reference_outputs(model: nn.Module, inputs: Inputs) -> Tensor:
    """:func:`eval_outputs` before a function-preserving move, which they are checked against afterwards.

    Raises:
        ValueError: If they are not finite: there is nothing to compare the moved model with.
    """
    outputs = eval_outputs(model, inputs)
    if not bool(torch.isfinite(outputs).all()):
        raise ValueError("The model's eval-mode outputs on `inputs` are not finite (NaN or inf in the batch or the "
                         "weights), so no move of its weights can be checked against them: pass a batch of real data.")
    return outputs


def relative_change(before: Tensor, after: Tensor) -> float:
    """Largest change between two output tensors, relative to the largest magnitude of ``before``: what a
    function-preserving move of the weights is checked by."""
    return float((after - before).abs().max() / before.abs().max().clamp_min(1e-30))


def canonicalize(model: nn.Module, prior: GaussianPrior, inputs: Inputs, units: bool = True,
                 channels: bool = True) -> Canonicalization:
    """Move ``model`` in place to the canonical point of its rescaling orbits (see the module docstring).

    Evaluate the evidence afterwards as usual (``LaplaceEvidence.fit`` on the same model and prior).
    Work on a copy to keep the trained weights: ``copy.deepcopy`` the network and build the prior
    on the copy, or save and reload its ``state_dict`` (buffers included: the running statistics move).

    Args:
        model: The network; its parameters must be the ones ``prior`` was built on.
        prior: Its Gaussian prior (the precisions weigh the prior energy; only tensors it holds move).
        inputs: One batch of model inputs: the scale-invariance analysis runs on it, and the
            outputs before and after are compared on it (eval mode).
        units: Balance positively homogeneous units.
        channels: Equalize channels in front of per-channel normalizations.

    Returns:
        What moved.

    Raises:
        ValueError: If ``prior`` was not built on ``model``'s parameters, or the outputs on ``inputs``
            are not finite.
        RuntimeError: If the outputs on ``inputs`` changed by more than ``OUTPUT_TOLERANCE``
            (relative) -- a ``forward`` that does not call its ``nn.Sequential`` children in order;
            the model is then restored as it was.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> prior = GaussianPrior(net)
        >>> canonicalize(net, prior, torch.randn(4, 3)).units
        {'0 -> 2': 8}
    """
    named = dict(model.named_parameters())
    if any(named.get(n) is not p for n, p in zip(prior.param_names, prior.params)):
        raise ValueError("`prior` was not built on this model's parameters: build it with GaussianPrior(model).")
    precision = torch.split(prior.per_parameter(prior.log_precision.detach()).exp(), prior.param_sizes)
    held = {id(p): d.reshape(p.shape) for p, d in zip(prior.params, precision)}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = reference_outputs(model, inputs)
    # a rescaled float32 tensor's energies are off by rounding: the sweeps cannot settle below its precision
    tolerance = max(TOLERANCE, 100 * torch.finfo(prior.params[0].dtype).eps)
    groups = _normalized(model, inputs, held) if channels else []
    pairs = _unit_pairs(model, held) if units else []
    report = Canonicalization(units={u.name: u.channels for u in pairs}, channels={g.name: g.channels for g in groups})
    while (groups or pairs) and report.sweeps < SWEEPS:
        report.sweeps += 1
        moves = [_equalize(g, held) for g in groups] + [_balance(u, held) for u in pairs]
        if max(float(m.abs().max()) for m in moves) < tolerance:
            break
    else:
        report.converged = not (groups or pairs)
    report.output_change = relative_change(before, eval_outputs(model, inputs))
    if not report.output_change <= OUTPUT_TOLERANCE:
        model.load_state_dict(state)
        raise RuntimeError(
            f"canonicalize changed the model's outputs by {report.output_change:.2e} (relative): its forward does not "
            "pass each nn.Sequential child's output to the next one only; the model was restored. Call it with "
            "units=False (and channels=False) for this model."
        )
    return report
