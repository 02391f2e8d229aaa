"""One pass over a data loader that accumulates sum-reduced curvature statistics.

Structures ``full | kron | diag`` x approximations ``ggn | ef`` (the GGN exact, or Monte-Carlo
with ``mc_samples > 0``). Layers ``nn.Linear``/``nn.Conv2d`` go through module hooks
(:mod:`.layers`); anything else through torch.func (:mod:`.functional`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from ..hyperparameters import APPROXIMATIONS, GaussianPrior, Likelihood
from .functional import jacobian_rows
from .layers import LayerHooks, layer_diagonal, layer_gradient, layer_kron, unsupported_reason
from .statistics import STRUCTURES, CurvatureStatistics, KronLayer

__all__ = ["CurvatureStatistics", "KronLayer", "Plan", "check_model", "check_options", "collect_statistics", "eval_mode"]


def check_options(structure: str, approx: str, mc_samples: int) -> None:
    """Validate the curvature options.

    Raises:
        ValueError: Naming the bad option and the accepted values.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"`structure` must be one of {STRUCTURES}, got {structure!r}.")
    if approx not in APPROXIMATIONS:
        raise ValueError(f"`approx` must be one of {APPROXIMATIONS}, got {approx!r}.")
    if not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"`mc_samples` must be an int >= 0 (0 = exact GGN), got {mc_samples!r}.")
    if mc_samples and approx != "ggn":
        raise ValueError(f"`mc_samples` applies to approx='ggn' only, got approx={approx!r}.")


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode and restore each one's own flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _locate(model: nn.Module, prior: GaussianPrior) -> Tuple[List[str], List[Tuple[str, nn.Module, str]]]:
    """Names of the prior's parameters in ``model`` and, for each, its owning module and role."""
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
    owners = {}
    for mod_name, module in model.named_modules():
        for role, p in module.named_parameters(recurse=False):
            owners[id(p)] = (mod_name, module, role)
    return [names[id(p)] for p in params], [owners[id(p)] for p in params]


def _batches(dataloader: Iterable, device: torch.device, dtype: torch.dtype) -> Iterator[Tuple[Tensor, Tensor]]:
    """``(x, y)`` on the parameters' device; floating inputs in their dtype (e.g. a float64 model)."""
    for batch in dataloader:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                "The evidence pass needs batches that are (x, y) pairs, got "
                f"{type(batch).__name__}; pass a DataLoader that yields (inputs, targets)."
            )
        x, y = batch
        yield x.to(device, dtype if x.is_floating_point() else None), y.to(device)


def collect_statistics(
    model: nn.Module,
    dataloader: Iterable,
    likelihood: Likelihood,
    prior: GaussianPrior,
    structure: str = "kron",
    approx: str = "ggn",
    mc_samples: int = 0,
    generator: Optional[torch.Generator] = None,
) -> CurvatureStatistics:
    """Accumulate the curvature and likelihood statistics over one pass of ``dataloader``.

    The pass runs in eval mode (no dropout, BatchNorm on running statistics); every module's mode
    is restored afterwards. No ``.grad`` is written and no hook stays installed.

    Args:
        model: Network mapping ``x`` to outputs ``(B, C)``.
        dataloader: Iterable of ``(x, y)`` batches.
        likelihood: Defines the loss-Hessian factor and the likelihood statistics.
        prior: Defines which parameters the curvature covers.
        structure: ``"full"``, ``"kron"`` or ``"diag"``.
        approx: ``"ggn"`` or ``"ef"``.
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact).
        generator: Random generator for the Monte-Carlo samples.

    Returns:
        The sum-reduced statistics.

    Raises:
        ValueError: On bad options, parameters the prior does not cover, or a layer the chosen
            structure cannot handle (naming the module and a structure that works).
        TypeError: On batches that are not ``(x, y)`` pairs.
    """
    check_options(structure, approx, mc_samples)
    plan = check_model(model, prior, structure)
    names, layers, use_hooks = plan.names, plan.layers, plan.use_hooks
    params = prior.params
    stats = CurvatureStatistics(structure, approx, prior.n_params)
    if structure == "kron":
        stats.layers = [KronLayer(n, roles["weight"], roles.get("bias")) for n, (_, roles) in layers.items()]
    device = params[0].device
    hooks = LayerHooks({n: m for n, (m, _) in layers.items()} if use_hooks else {})
    verified = False
    with eval_mode(model), torch.enable_grad(), hooks:
        for x, y in _batches(dataloader, device, params[0].dtype):
            if use_hooks:
                output = model(x)
                factor = _factor(likelihood, output, y, approx, mc_samples, generator, stats)
                if not verified:
                    verified = True
                    missed = _missed_use(layers, hooks, params, output, factor)
                    if missed and structure == "kron":
                        raise ValueError(
                            f"structure='kron': the parameters of '{missed}' are used outside its forward call "
                            "(shared or functional weights); use structure='diag' or 'full'."
                        )
                    if missed:  # the diagonal falls back to exact per-example Jacobians
                        use_hooks = False
                        hooks.__exit__()
                if use_hooks:
                    _accumulate_layers(stats, layers, hooks, hooks.backprop(output, factor))
                    hooks.clear()
                    continue
            else:
                with torch.no_grad():
                    output = model(x)
                factor = _factor(likelihood, output, y, approx, mc_samples, generator, stats)
            rows = jacobian_rows(model, names, params, x, factor)
            if structure == "diag":
                stats.add("diag", rows.pow(2).sum(0))
            else:
                stats.add_rows(rows)
    if "n_data" not in stats.sums:
        raise ValueError("The data loader yielded no batches.")
    return stats


class Plan(NamedTuple):
    """How the curvature pass treats a model: parameter names, hooked layers, backend."""

    names: List[str]
    layers: Dict[str, Tuple[nn.Module, Dict[str, int]]]
    use_hooks: bool


def check_model(model: nn.Module, prior: GaussianPrior, structure: str) -> Plan:
    """Check that ``structure`` can handle ``model`` under ``prior`` and plan the curvature pass.

    Args:
        model: The network the evidence pass calls.
        prior: The prior over (all) its trainable parameters.
        structure: ``"full"``, ``"kron"`` or ``"diag"``.

    Returns:
        The plan of the pass.

    Raises:
        ValueError: If the prior does not cover exactly the trainable parameters of ``model``, or a
            layer (or the prior's structure) does not fit ``structure``; the message names the
            module and a structure that works.
    """
    names, owners = _locate(model, prior)
    bad = {n: r for n, r in ((n, unsupported_reason(m)) for n, m, _ in owners) if r is not None}
    layers = _layer_map(owners)
    if structure == "kron":
        if bad:
            name, reason = next(iter(bad.items()))
            raise ValueError(
                f"structure='kron' cannot handle module '{name}' ({reason}); use structure='diag' or 'full', "
                "or freeze its parameters."
            )
        frozen = [n for n, (_, roles) in layers.items() if "weight" not in roles]
        if frozen:
            raise ValueError(f"structure='kron' needs the weight of '{frozen[0]}' trainable; use structure='diag'.")
        prior.per_tensor(prior.log_precision)  # raises for a diagonal prior, with the explanation
    return Plan(names, layers, structure != "full" and not bad)


def _layer_map(owners: List[Tuple[str, nn.Module, str]]) -> Dict[str, Tuple[nn.Module, Dict[str, int]]]:
    """Per owning module: the module and the prior index of each of its parameters by role."""
    layers: Dict[str, Tuple[nn.Module, Dict[str, int]]] = {}
    for index, (mod_name, module, role) in enumerate(owners):
        layers.setdefault(mod_name, (module, {}))[1][role] = index
    return layers


def _factor(
    likelihood: Likelihood,
    output: Tensor,
    y: Tensor,
    approx: str,
    mc_samples: int,
    generator: Optional[torch.Generator],
    stats: CurvatureStatistics,
) -> Tensor:
    """Record the batch's likelihood statistics and return its loss-Hessian factor."""
    detached = output.detach()
    stats.add("n_data", torch.tensor(float(output.shape[0]), dtype=detached.dtype, device=detached.device))
    for key, value in likelihood.statistics(detached, y).items():
        stats.add(f"lik.{key}", value.to(detached))
    return likelihood.hessian_sqrt(detached, y, approx, mc_samples, generator)


def _missed_use(
    layers: Dict[str, Tuple[nn.Module, Dict[str, int]]],
    hooks: LayerHooks,
    params: List[Tensor],
    output: Tensor,
    factor: Tensor,
) -> Optional[str]:
    """Name of a hooked layer whose parameters act outside its own forward call, if any.

    Compares, for the first factor column, the parameter gradients that the hooks imply with
    autograd's: they differ when a weight is tied, reused functionally or never called.
    """
    missing = [n for n in layers if n not in hooks.outputs]
    if missing:
        return missing[0]
    column = factor[:, :, 0]
    expected = torch.autograd.grad(output, params, grad_outputs=column, retain_graph=True, allow_unused=True)
    outputs = [hooks.outputs[n] for n in layers]
    seen = torch.autograd.grad(output, outputs, grad_outputs=column, retain_graph=True, allow_unused=True)
    tolerance = torch.finfo(output.dtype).eps ** 0.5  # far above rounding, far below a missed use
    for (name, (module, roles)), z, g in zip(layers.items(), outputs, seen):
        g = torch.zeros_like(z) if g is None else g
        implied = dict(zip(("weight", "bias"), layer_gradient(module, hooks.inputs[name], g)))
        for role, index in roles.items():
            truth = expected[index]
            truth = torch.zeros_like(implied[role]) if truth is None else truth
            if not torch.isfinite(truth).all():  # nothing to compare: the evidence reports it
                continue
            scale = torch.maximum(truth.norm(), implied[role].norm())
            if (implied[role] - truth).norm() > tolerance * scale:
                return name
    return None


def _accumulate_layers(
    stats: CurvatureStatistics,
    layers: Dict[str, Tuple[nn.Module, Dict[str, int]]],
    hooks: LayerHooks,
    grads: Dict[str, Tensor],
) -> None:
    if stats.structure == "kron":
        for j, (name, (module, _)) in enumerate(layers.items()):
            g_sum, a_sum, count = layer_kron(module, hooks.inputs[name], grads[name])
            stats.add(f"kron.{j}.G", g_sum)
            stats.add(f"kron.{j}.A", a_sum)
            stats.add(f"kron.{j}.count", count)
        return
    pieces: Dict[int, Tensor] = {}
    for name, (module, roles) in layers.items():
        diag = dict(zip(("weight", "bias"), layer_diagonal(module, hooks.inputs[name], grads[name])))
        for role, index in roles.items():
            pieces[index] = diag[role].reshape(-1)
    stats.add("diag", torch.cat([pieces[i] for i in range(len(pieces))]))
