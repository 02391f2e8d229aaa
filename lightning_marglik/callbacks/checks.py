"""The callbacks' set-up checks: of their arguments, of the trainer, and of one evidence batch.

Each check raises (or warns) with a message that names the problem and the fix; the callbacks run
them at construction, in ``setup`` and in ``on_train_start``, before the first training step.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Mapping, Optional, Tuple

import torch
from torch import nn

from ..curvature import CurvatureOptions, eval_mode
from ..curvature.batches import call_model, move, non_finite_data_rows, split_batch
from ..curvature.scale_invariance import NORMS, find_scale_invariant
from ..curvature.structures import structure_class, structures_with
from ..hyperparameters import BIAS_NORMALIZATION, TREATMENTS, GaussianPrior, Likelihood, no_decay_names
from ..private import checkpoint_saves_at_epoch_end, early_stopping_checks_at_epoch_end
from ..validators import choice, number, suggestion
from .data import BatchFn
from .output_layer import OutputLayer, forward_finding_output_layer
from .package import MONITOR, LightningModule, LightningPackage, MargLikConfigurationError, Trainer

__all__ = [
    "STATISTICS",
    "check_finite_hyperparameters",
    "check_forward",
    "check_fraction",
    "check_model_forward",
    "check_output_layer",
    "check_processes",
    "check_statistics",
    "check_monitoring_schedulers",
    "check_stock_monitors",
    "check_training_statistics",
    "check_weight_decay",
    "follow_training_modes",
    "treat_scale_invariant",
]

STATISTICS = ("pass", "training")


def check_stock_monitors(trainer: Trainer, who: str, every_epoch: bool) -> None:
    """Refuse Lightning's own ``EarlyStopping`` and ``ModelCheckpoint`` on ``marglik`` where they would read it
    without a fresh estimate.

    Each reads it at the end of every training epoch, or after each validation, which runs before the epoch's
    estimate (``EarlyStopping(check_on_train_epoch_end=False)``, ``ModelCheckpoint``'s saves after validation,
    every ``every_n_train_steps`` or ``train_time_interval``, other validation intervals). Without an estimate
    early stopping raises "metric marglik ... not available" (``strict=True``) or counts the last estimate again
    towards its patience; a checkpoint is ranked, and named, by the last estimate's value while it holds later
    weights, or the fit ends in "could not find the monitored key".

    Args:
        trainer: The trainer whose callbacks are checked.
        who: The estimating callback's description, for the message.
        every_epoch: Whether every epoch ends with an estimate.

    Raises:
        MargLikConfigurationError: Naming ``MargLikEarlyStopping`` or ``MargLikCheckpoint``, which act on fresh
            estimates only.
    """
    for callback in trainer.callbacks:
        names = [cls.__name__ for cls in type(callback).__mro__]
        if "EarlyStoppingCore" in names or "CheckpointCore" in names or getattr(callback, "monitor", None) != MONITOR:
            continue
        if "EarlyStopping" in names:
            at_epoch_end, reads, fix = (early_stopping_checks_at_epoch_end(callback, trainer), "checks",
                                        "MargLikEarlyStopping(patience=...), which acts on fresh estimates only and "
                                        "counts patience in estimations")
            harm = f"fail with 'metric {MONITOR} ... not available' or count a stale estimate towards its patience"
        elif "ModelCheckpoint" in names:
            at_epoch_end, reads, fix = (checkpoint_saves_at_epoch_end(callback, trainer), "ranks its saves by",
                                        "MargLikCheckpoint(save_top_k=...), which saves at fresh estimates only")
            harm = ("rank and name a checkpoint by an earlier estimate than its weights', or fail with 'could not "
                    "find the monitored key'")
        else:
            continue
        if every_epoch and at_epoch_end:
            continue
        when = (f"after every training epoch, but {who} does not estimate it after every epoch" if at_epoch_end else
                "after validation or within the epoch, which runs before the epoch's estimate "
                "(check_on_train_epoch_end=False, save_on_train_epoch_end=False, every_n_train_steps, "
                "train_time_interval or validation intervals other than once per epoch)")
        raise MargLikConfigurationError(
            f"{type(callback).__name__}(monitor={MONITOR!r}) {reads} {MONITOR} {when}: Lightning's callback would "
            f"{harm}. Use {fix}."
        )


def check_statistics(statistics: Any, options: CurvatureOptions) -> str:
    """Validate ``statistics``: ``"training"`` takes the empirical Fisher of the structures that declare
    ``training_statistics`` (``diag``, ``kron``) only.

    Returns:
        The canonical spelling of ``statistics``.

    Raises:
        ValueError: On another value, or options the training passes cannot give.
    """
    statistics = choice(statistics, STATISTICS, "statistics")
    if statistics == "training" and (options.approx != "ef" or not structure_class(options.structure).training_statistics):
        takes = " or ".join(repr(name) for name in sorted(structures_with("training_statistics")))
        raise ValueError(
            f"statistics='training' takes structure={takes} with approx='ef', got structure="
            f"{options.structure!r}, approx={options.approx!r}: the training backward gives one gradient of the loss "
            "per example (the empirical Fisher), not the GGN's loss-Hessian columns, the full structure's per-example "
            "rows or EKFAC's second pass; use statistics='pass' for those."
        )
    if statistics == "training" and options.backend != "hooks":
        raise ValueError(f"statistics='training' takes backend='hooks', got backend={options.backend!r}.")
    return statistics


def check_fraction(fraction: Any, statistics: str) -> float:
    """Validate ``statistics_fraction``: a number in (0, 1], below 1 only with statistics='training'.

    Raises:
        ValueError: Naming the value and what it needs.
    """
    fraction = number(fraction, "statistics_fraction", 0, 1)
    if fraction < 1 and statistics != "training":
        raise ValueError(
            f"`statistics_fraction`={fraction} subsamples the training passes' sums: it needs statistics='training', "
            f"got statistics={statistics!r}."
        )
    return fraction


def check_output_layer(treatment: Any) -> str:
    """Validate ``output_layer``: a treatment; a value that reads as a module's name (``"net.2"``) is also told that
    the layer is found, and how to hold one of the user's choice.

    Raises:
        ValueError: Naming the value and the treatments.
    """
    named = isinstance(treatment, str) and re.fullmatch(r"\w+(\.\w+)*", treatment)
    named = named and not suggestion(treatment, TREATMENTS)
    return choice(treatment, TREATMENTS, "output_layer", what=(
        "It says how to treat the output layer, which is found from the network's output when training starts; to "
        f"hold a layer you choose at the declared precision, use GaussianPrior(fixed=['{treatment}.*']) (fnmatch "
        "patterns of prior.param_names, named within the module the prior covers)." if named else ""))


def check_training_statistics(trainer: Trainer, pl_module: LightningModule) -> None:
    """Refuse what statistics='training' cannot follow: manual optimization and float16 loss scaling.

    Raises:
        MargLikConfigurationError: Naming the fix.
    """
    if not pl_module.automatic_optimization:
        raise MargLikConfigurationError(
            "MargLikCallback(statistics='training') reads the gradients of the loss Lightning's automatic "
            "optimization backpropagates; with manual optimization (automatic_optimization = False, which several "
            "optimizers need) the callback cannot know which backward is the loss's or how it is scaled: use "
            "statistics='pass'."
        )
    if str(trainer.precision) == "16-mixed":
        raise MargLikConfigurationError(
            "MargLikCallback(statistics='training') with precision='16-mixed': the gradient scaler multiplies the "
            "loss by a changing factor and skips steps with overflowing gradients, which would enter the curvature; "
            "use precision='bf16-mixed' (no scaler) or statistics='pass'."
        )


def check_processes(options: CurvatureOptions, trainer: Trainer) -> None:
    """Refuse a structure whose evidence is not implemented across processes (e.g. EKFAC's second pass).

    Raises:
        MargLikConfigurationError: With such a structure on more than one process.
    """
    if trainer.world_size > 1 and not structure_class(options.structure).multi_process:
        raise MargLikConfigurationError(
            f"structure={options.structure!r} is not implemented across processes (ekfac needs the Kronecker factors "
            "summed over all processes before its second pass, so that the basis is the same on every rank); with "
            f"{trainer.world_size} processes use structure='kron' (or one of {structures_with('multi_process')}), or "
            f"compute this evidence after training in one process (LaplaceEvidence.fit(..., structure="
            f"{options.structure!r}))."
        )


def check_model_forward(pl_module: LightningModule, package: LightningPackage) -> None:
    """Refuse a LightningModule without its own ``forward``, which the evidence pass calls.

    Raises:
        MargLikConfigurationError: Saying what to add.
    """
    if type(pl_module).forward in (nn.Module.forward, package.lightning_module.forward):
        raise MargLikConfigurationError(
            f"{type(pl_module).__name__} defines no forward, which the evidence pass calls for the network "
            "outputs: add e.g. `def forward(self, x): return self.net(x)`."
        )


def check_monitoring_schedulers(trainer: Trainer, who: str, estimates_every: Callable[[int], bool]) -> None:
    """Refuse a learning-rate scheduler that monitors ``marglik`` (``ReduceLROnPlateau``) where it would step without
    a fresh estimate: it would read the last one again as an epoch without improvement and cut the learning rate
    while the evidence rises (``strict=False``), or fail with "conditioned on metric marglik which is not available".
    Lightning steps an ``interval="epoch"`` scheduler after the epoch's callbacks, so after its estimate.

    Args:
        trainer: The trainer whose schedulers (the optimizers' set up) are checked.
        who: The estimating callback's description, for the message.
        estimates_every: Whether every epoch whose number is a multiple of its argument ends with an estimate
            (the callback's ``schedule.estimates_every``).

    Raises:
        MargLikConfigurationError: Naming the scheduler configuration that steps where the callback estimates.
    """
    for config in trainer.lr_scheduler_configs:
        if config.monitor != MONITOR or (config.interval == "epoch" and estimates_every(config.frequency)):
            continue
        when = ("within the epoch (interval='step'), before the epoch's estimate" if config.interval != "epoch" else
                (f"every {config.frequency} epochs (frequency={config.frequency})" if config.frequency > 1
                 else "at the end of every epoch") + f", but {who} does not estimate at the end of each of them")
        raise MargLikConfigurationError(
            f"{type(config.scheduler).__name__} monitors {MONITOR!r} {when}: it would read the last estimate again as "
            "an epoch without improvement, or fail with 'metric marglik which is not available'. Step it with the "
            "estimates: return {'scheduler': ..., 'monitor': 'marglik', 'interval': 'epoch', 'frequency': F} from "
            "configure_optimizers with the callback's frequency=F (no settle, burnin below F), or monitor another "
            "metric."
        )


def check_weight_decay(trainer: Trainer, prior: GaussianPrior) -> None:
    """Refuse an optimizer's weight decay on tensors the prior covers (SGD, Adam, AdamW, any optimizer whose
    param groups have ``weight_decay``), each param group on its own: it counts a second prior the evidence does
    not know of, and a warning went unseen among Lightning's (AdamW's default 0.01 is weight decay too).

    Raises:
        MargLikConfigurationError: Naming each optimizer, group, value and tensors, and the fix.
    """
    covered = {id(p): name for name, p in zip(prior.param_names, prior.params)}
    found = []
    for optimizer in trainer.optimizers:
        kind = type(optimizer).__name__
        default = inspect.signature(type(optimizer)).parameters.get("weight_decay")
        for index, group in enumerate(optimizer.param_groups):
            names = [covered[id(p)] for p in group["params"] if id(p) in covered]
            decay = group.get("weight_decay", 0)
            if decay and names:
                own = f", {kind}'s default" if default is not None and default.default == decay else ""
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                found.append(f"{kind} param group {index} has weight_decay={decay}{own} ({shown})")
    if found:
        raise MargLikConfigurationError(
            f"{'; '.join(found)}: the GaussianPrior already is these tensors' weight decay (map_loss adds delta/N, "
            "delta learned by the evidence), so the optimizer's counts a second prior the evidence does not know of. "
            "Set weight_decay=0 in configure_optimizers (for every param group)."
        )


def check_finite_hyperparameters(prior: GaussianPrior, likelihood: Likelihood, dtype: torch.dtype) -> None:
    """Refuse hyperparameters ``h`` for which ``h`` or ``1/h`` is not finite in the module's ``dtype``.

    Raises:
        MargLikConfigurationError: Naming the hyperparameter, its value and the fix.
    """
    buffers = {"prior.log_precision": prior.log_precision, **{
        f"likelihood.{name}": buffer for name, buffer in likelihood.hyperparameters().items()
    }}
    for name, buffer in buffers.items():
        # h and 1/h must exist in the dtype the module computes in (the buffer may be float64)
        if not torch.isfinite(buffer.detach().to(dtype).abs().exp()).all():
            flat = buffer.detach().reshape(-1)
            value = flat[flat.abs().argmax()].double().exp().item()
            raise MargLikConfigurationError(
                f"MargLikCallback: {name} = {value:.3g} (or its inverse) is not finite in the module's dtype "
                f"{dtype}; choose a value within {dtype}'s range or train in float64 "
                "(Trainer(precision='64-true'))."
            )


def check_forward(
    pl_module: LightningModule, likelihood: Likelihood, batch: Any, batch_fn: BatchFn, device: torch.device,
    dtype: torch.dtype, output_layer: bool = False,
) -> Tuple[Any, torch.Tensor, Optional[OutputLayer]]:
    """One evidence batch through the eval-mode ``forward``: a single output tensor that fits the targets.

    Args:
        pl_module: The module.
        likelihood: The likelihood whose targets the outputs must fit.
        batch: One evidence batch.
        batch_fn: The module's ``marglik_batch`` (``None``: ``(inputs, targets)`` batches).
        device: The parameters' device.
        dtype: The parameters' dtype.
        output_layer: Whether the same forward also finds the output layer
            (:func:`.output_layer.forward_finding_output_layer`: with gradients on).

    Returns:
        The batch's inputs (on ``device``, in ``dtype``), the outputs, and the output layer found (``None``
        where not asked for).

    Raises:
        MargLikConfigurationError: On a batch or output the evidence cannot take, naming the fix.
    """
    found = None
    try:
        inputs, target = split_batch(batch, batch_fn)
        inputs = move(inputs, device, dtype)
        if output_layer:
            output, found = forward_finding_output_layer(pl_module, inputs)
        else:
            with eval_mode(pl_module), torch.no_grad():
                output = call_model(pl_module, inputs)
    except (MargLikConfigurationError, torch.OutOfMemoryError):  # out of memory is no form of forward to fix
        raise
    except Exception as err:  # whatever forward raised, the user needs to know it was the evidence's call
        raise MargLikConfigurationError(
            f"MargLikCallback, one evidence batch through forward: {type(err).__name__}: {str(err).rstrip('.')}. The "
            "evidence pass calls forward(x) for a tensor x, forward(*x) for a tuple and forward(**x) for a dict of the "
            "batch's inputs (of the training batches, or of `dataloader=`); where your forward takes another form, map "
            "batches with `marglik_batch(self, batch) -> (inputs, targets)` on the LightningModule."
        ) from err
    try:
        target = target.to(device)
        likelihood.check_target(output, target)
    except ValueError as err:
        raise MargLikConfigurationError(
            f"MargLikCallback, one evidence batch through forward: {err} forward must return outputs of shape "
            "(batch, outputs) that fit the targets; map batches with `marglik_batch(self, batch) -> "
            "(inputs, targets)` on the LightningModule, or pass `dataloader=`."
        ) from err
    _check_finite(likelihood, inputs, output.detach(), target)
    return inputs, output, found


def _check_finite(likelihood: Likelihood, inputs: Any, output: torch.Tensor, target: torch.Tensor) -> None:
    """Refuse a set-up batch whose kept terms' likelihood is not finite, naming the cause: NaN or inf in the
    inputs or targets, or outputs that are not finite at finite data (a forward that diverges at these weights).
    Only the terms the likelihood keeps are read: outputs at ignored positions may be anything."""
    with torch.no_grad():
        bad = ~torch.isfinite(likelihood.nll(output, target))
    if not bool(bad.any()):
        return
    bad_inputs, bad_targets = non_finite_data_rows(inputs), non_finite_data_rows(target)
    where = (f"its inputs hold NaN or inf (rows {bad_inputs}, the first of them)" if bad_inputs
             else f"its targets hold NaN or inf (rows {bad_targets}, the first of them)" if bad_targets
             else "its outputs are not finite at finite inputs and targets (a forward that diverges at these weights)")
    raise MargLikConfigurationError(
        f"MargLikCallback, one evidence batch through forward: the log-likelihood of {int(bad.sum())} of its "
        f"{bad.numel()} data is not finite: {where}. Clean the data (drop or impute those rows) before training: "
        "trained on, they make the weights NaN."
    )


def treat_biases(prior: GaussianPrior, biases: Optional[str]) -> None:
    """Give the biases and normalization parameters to the prior with the callback's ``biases`` treatment;
    ``None`` (the default): decoupled, no learned weight decay on them (``benchmarks/results/remedies.md``),
    unless the prior is scalar or the user declared them.

    Raises:
        MargLikConfigurationError: If the prior cannot take ``biases`` (a scalar prior), naming the fix.
    """
    if biases is not None:
        try:
            prior.treat(no_decay_names(prior), biases, BIAS_NORMALIZATION)
        except ValueError as err:
            raise MargLikConfigurationError(f"MargLikCallback(biases={biases!r}): {err}") from err
    elif prior.structure != "scalar" and BIAS_NORMALIZATION not in prior.treatments:
        prior.treat(no_decay_names(prior), "decoupled", BIAS_NORMALIZATION)


def treat_scale_invariant(
    pl_module: LightningModule, prior: GaussianPrior, inputs: Any, treatment: str,
    modes: Optional[Mapping[str, bool]] = None,
) -> Optional[str]:
    """Find the scale-invariant tensors (one forward in the modes training runs with) and give them to
    the prior with ``treatment``.

    Args:
        pl_module: The module (its ``forward`` is analysed).
        prior: The prior that takes the treatment.
        inputs: One batch of model inputs.
        treatment: ``scale_invariant`` of the callback.
        modes: The ``training`` flag of each module during training
            (:func:`~lightning_marglik.curvature.scale_invariance.training_modes`); default: every
            module in training mode, Lightning's own default.

    Returns:
        The one warning that names the tensors found and the treatment (``None`` if there are none);
        the caller warns once it knows the modes training really uses.
    """
    layers = find_scale_invariant(pl_module, inputs, modes)
    ours = {id(p): n for n, p in zip(prior.param_names, prior.params)}
    full = dict(pl_module.named_parameters())
    # the prior's names of each layer's tensors (the analysis names them from the LightningModule)
    named = [(layer, [ours[id(full[n])] for n in layer.params if id(full[n]) in ours]) for layer in layers]
    names = [n for _, group in named for n in group]
    applied, scalar = treatment, ""
    if names and applied != "learn" and prior.structure == "scalar":
        applied = "learn"
        scalar = (" needs one precision per tensor, but the prior is scalar (use GaussianPrior(structure="
                  "'layerwise')), so they are learned with the rest:")
    prior.treat_scale_invariant(names, applied)
    if not names:
        return None
    held = [n for n in names if n in prior.fixed]
    what = {
        "decoupled": "the evidence learns their precision, but their weight decay in map_loss stays at the prior's "
        f"initial precision {prior.initial_precision:g} (not fed back)",
        "fixed": f"their precision stays at its initial value {prior.initial_precision:g}",
        "learn": "their learned precision is fed back as weight decay and can grow without bound while they shrink",
    }[applied]
    groups = "; ".join(f"{', '.join(group)} -> {layer.norm}" for layer, group in named if group)
    return (
        f"MargLikCallback: the training loss is invariant to the scale of {len(named)} layer(s), each of whose output "
        f"feeds only a normalization with statistics of its input ({groups}), so the data do not determine their "
        f"prior precision. scale_invariant={treatment!r}{scalar or ':'} {what}"
        + (f"; {held} keep GaussianPrior(fixed=...)" if held else "")
        + ". Choose with MargLikCallback(scale_invariant='decoupled'|'fixed'|'learn')."
    )


def follow_training_modes(
    pl_module: LightningModule, prior: GaussianPrior, inputs: Any, treatment: str,
    assumed: Mapping[str, bool], modes: Mapping[str, bool],
) -> Optional[str]:
    """Decide the scale-invariant tensors again from the ``modes`` training really runs with, when they
    differ from the ``assumed`` ones (e.g. a BatchNorm a fine-tuning recipe keeps in eval mode, set
    in ``on_train_epoch_start``, after the set-up check).

    Returns:
        The warning for the tensors found now (as :func:`treat_scale_invariant`), preceded by one
        sentence naming the norms whose mode changed and the tensors this releases or adds.
    """
    before = set(prior.scale_invariant)
    found = treat_scale_invariant(pl_module, prior, inputs, treatment, modes)
    after = set(prior.scale_invariant)
    if before == after:
        return found
    modules = dict(pl_module.named_modules())
    changed = [f"{name} ({type(modules[name]).__name__}) in {'training' if modes[name] else 'eval'} mode"
               for name in modes if name in modules and isinstance(modules[name], NORMS)
               and modes[name] != assumed.get(name, True)]
    released, added = sorted(before - after, key=prior.param_names.index), sorted(after - before, key=prior.param_names.index)
    note = (
        f"MargLikCallback: training runs {', '.join(changed) or 'modules in other modes than at set-up'}"
        + (f"; {released} are not scale-invariant in these modes and are treated as every other tensor" if released else "")
        + (f"; {added} are scale-invariant in these modes" if added else "")
        + "."
    )
    return note if found is None else f"{note} {found}"
