"""The optional BackPACK backend (``backend="backpack"``, ``pip install lightning_marglik[backpack]``).

BackPACK's extensions on an ``extend``ed copy of the prior's network fill the same declared
statistics as the hook backend, so the evidence is the same (tested in float64): ``diag`` with
``DiagGGNExact`` / ``DiagGGNMC`` / ``SumGradSquared`` (EF), ``kron`` with ``KFLR`` / ``KFAC`` (MC).
Supported: an ``nn.Sequential`` whose parameters all belong to ``nn.Linear`` layers (``kron``) or
``nn.Linear``/``nn.Conv2d`` layers (``diag``; BackPACK's Conv2d Kronecker factors use another
convention than the expand one), ``(B, C)`` outputs. The Monte-Carlo draws come from torch's
global generator. Everything else is refused with the reason; the default hook backend takes it.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..hyperparameters import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, Likelihood
from .batches import BatchFn, call_model, move, split_batch
from .estimator import resolved_options
from .options import CurvatureOptions
from .plan import locate
from .statistics import CurvatureStatistics, LayerPlan, Structure
from .structures import DiagStructure, KronStructure

__all__ = ["backpack_statistics"]


def _unsupported(net: nn.Module, owners: List[Tuple[str, nn.Module, str]], options: CurvatureOptions, likelihood: Likelihood) -> Optional[str]:
    if not isinstance(net, nn.Sequential):
        return f"the prior's network is a {type(net).__name__}, BackPACK's second-order extensions need an nn.Sequential"
    layers = (nn.Linear,) if options.structure == "kron" else (nn.Linear, nn.Conv2d)
    for name, module, role in owners:
        if type(module) not in layers:  # a subclass may compute another function (BackPACK maps exact types)
            return f"module '{name}' ({type(module).__name__}) is not one of {[t.__name__ for t in layers]}"
        if role not in ("weight", "bias"):
            return f"parameter '{name}.{role}' is not a layer's weight or bias (torch.nn.utils.prune, weight_norm)"
    if options.structure in ("full", "ekfac"):
        return f"structure={options.structure!r} has no BackPACK extension here"
    if options.structure == "kron" and options.approx == "ef":
        return "BackPACK has no Kronecker-factored empirical Fisher"
    if not isinstance(likelihood, (GaussianLikelihood, CategoricalLikelihood)):
        return f"{type(likelihood).__name__} has no BackPACK loss"
    return None


def _extension(options: CurvatureOptions):
    from backpack import extensions

    if options.structure == "diag":
        if options.approx == "ef":
            return extensions.SumGradSquared(), "sum_grad_squared"
        if options.mc_samples:
            return extensions.DiagGGNMC(mc_samples=options.mc_samples), "diag_ggn_mc"
        return extensions.DiagGGNExact(), "diag_ggn_exact"
    if options.mc_samples:
        return extensions.KFAC(mc_samples=options.mc_samples), "kfac"
    return extensions.KFLR(), "kflr"


def backpack_statistics(
    model: nn.Module,
    dataloader: Iterable,
    likelihood: Likelihood,
    prior: GaussianPrior,
    options: CurvatureOptions,
    batch_fn: Optional[BatchFn] = None,
    on_batch: Optional[Callable[[int], None]] = None,
) -> CurvatureStatistics:
    """The statistics of :func:`lightning_marglik.curvature.collect_statistics` from BackPACK.

    BackPACK evaluates ``prior.model`` (an ``extend``ed deep copy); ``model``'s output on the first
    batch must equal it (e.g. a LightningModule whose ``forward`` calls that network).

    Raises:
        ImportError: If BackPACK is not installed (names the extra).
        ValueError: If the network, structure or likelihood is not supported (names the reason and
            ``backend="hooks"``), or ``model`` computes something else than ``prior.model``.
    """
    try:
        from backpack import backpack, extend
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("backend='backpack' needs BackPACK: pip install 'lightning_marglik[backpack]'.") from err
    net = prior.model
    names, owners = locate(net, prior)
    locate(model, prior)
    reason = _unsupported(net, owners, options, likelihood)
    if reason is not None:
        raise ValueError(f"backend='backpack' cannot take this model: {reason}; use backend='hooks' (the default).")
    gaussian = isinstance(likelihood, GaussianLikelihood)
    # BackPACK differentiates sum-reduced losses: MSE's Hessian is 2 I (its gradient 2 (f - y)), so the
    # GGN and the MC GGN carry a factor 2 and the squared gradients (EF) a factor 4 against ours.
    factor = (4.0 if options.approx == "ef" else 2.0) if gaussian else 1.0
    loss_fn = extend(nn.MSELoss(reduction="sum") if gaussian else nn.CrossEntropyLoss(reduction="sum"))
    copy_ = extend(copy.deepcopy(net))
    params = dict(copy_.named_parameters())
    sizes = prior.param_sizes
    everything = list(range(len(sizes)))
    layers: Dict[str, LayerPlan] = {}
    for index, (name, module, role) in enumerate(owners):
        layers.setdefault(name, LayerPlan(name, module, {})).roles[role] = index
    structure: Structure
    if options.structure == "diag":
        structure = DiagStructure(everything, sizes, [], [])
    else:
        structure = KronStructure(everything, sizes, list(layers.values()))
    device, dtype = prior.params[0].device, prior.params[0].dtype
    stats: Optional[CurvatureStatistics] = None
    for batch_index, batch in enumerate(dataloader):
        inputs, target = split_batch(batch, batch_fn)
        inputs, target = move(inputs, device, dtype), target.to(device)
        output = copy_(inputs)
        if batch_index == 0:
            with torch.no_grad():
                if not torch.allclose(call_model(model, inputs), output, rtol=1e-5, atol=1e-6):
                    raise ValueError("backend='backpack' evaluates the prior's network directly, and the model's forward "
                                     "computes something else; use backend='hooks'.")
        if output.dim() != 2:
            raise ValueError(f"backend='backpack' needs outputs (batch, outputs), got {tuple(output.shape)}; use backend='hooks'.")
        if stats is None:  # mc_samples='auto' is decided by the output size
            options, estimator = resolved_options(options, likelihood, output.shape)
            extension, field = _extension(options)
            stats = CurvatureStatistics(options, names, [structure.to(device)], estimator=estimator)
        stats.add_likelihood(likelihood.statistics(output.detach(), target))
        checked = likelihood.check_target(output, target)
        with backpack(extension), warnings.catch_warnings():
            # the inputs need no gradient: torch notes that the layers' full backward hooks fire anyway
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss_fn(output, checked).backward()
        for j, layer in enumerate(layers.values()):
            for role, index in layer.roles.items():
                value = getattr(params[names[index]], field)
                if isinstance(structure, DiagStructure):
                    structure._add_slice(index, value.detach() / factor)
                elif role == "weight":
                    g, a = value
                    structure.add(f"{j}.g", g.detach() / factor)
                    structure.add(f"{j}.a", (a.detach() * output.shape[0]).unsqueeze(0))  # BackPACK's A is a batch mean
                    structure.add(f"{j}.rows", torch.tensor(output.shape[0]))
                elif "weight" not in layer.roles:  # a bias alone: G from its own factor
                    structure.add(f"{j}.g", value[0].detach() / factor)
        for p in params.values():
            p.grad = None
        if on_batch is not None:
            on_batch(batch_index)
    if stats is None:
        raise ValueError("The data loader yielded no batches.")
    return stats
