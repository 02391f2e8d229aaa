"""``MargLikCallback``'s prior guard: the learned weight decay reaches training only while it scores better.

After each estimate within training, :func:`lightning_marglik.guard.approximate_cv` scores the training data's
approximate cross-validated log likelihood under the learned weight decay and under the declared one. The learned
candidate of a layerwise prior takes per group the weaker of the evidence's own precision and the mode-corrected
evidence's (:mod:`lightning_marglik.mode_correction`, solved from the estimate's precisions, with the gradient the
folds' gradients sum to: the evidence of the quadratic model at its own mode, not at weights trained at another
precision; why the weaker: :func:`_corrected`). It is fed back into the MAP loss
(``prior.weight_decay_override``) only while it scores at least as well; otherwise the tensors the evidence learns
are decoupled (``prior.treatments["prior guard"]``) and training keeps the declared precision. Either way the
evidence goes on learning and reporting its own precisions (``prior.log_precision``: the plain evidence's choice,
whose ``marglik`` the checkpoint, early stopping and model comparison read). Each decision is recorded
(``callback.guard_decisions``) and said at the end of training. The estimate after training has no training to
guard and is not scored, until a fit resumed from it trains on: then it is scored when that training starts, as an
uninterrupted run scored it.

The guard is off, with the reason said at set-up, under a strategy that shards the parameters (its folds'
gradients are whole-model vectors) and where the evidence learns no tensor's weight decay.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages

from ..curvature.batches import move, split_batch
from ..guard import FOLDS, approximate_cv, fold_calls, fold_gradients
from ..hyperparameters import GaussianPrior
from ..mode_correction import ModeCorrectedEvidence
from .data import isolate_rng
from .package import LightningModule, Trainer
from .sharding import shards_parameters

__all__ = [
    "GUARD", "device_batches", "drop_unguarded_decision", "guard_off_reason", "guard_phrase", "guard_summary",
    "guard_words", "restore_guard", "run_guard",
]

#: The prior's treatment reason for the tensors whose learned weight decay the guard keeps out of training.
GUARD = "prior guard"


def _guarded(prior: GaussianPrior) -> List[str]:
    """The tensors whose weight decay the evidence would set without the guard."""
    own = prior.treatments.pop(GUARD, None)
    names = prior.treated("learn")
    if own is not None:
        prior.treatments[GUARD] = own
    return names


def guard_off_reason(trainer: Trainer, prior: GaussianPrior) -> Optional[str]:
    """Why the guard cannot run in this fit (``None``: it runs)."""
    if prior.structure == "scalar":
        return "off: a scalar prior's one precision cannot be kept from training apart (a layerwise prior's can)"
    if shards_parameters(trainer):
        return "off under a strategy that shards the parameters (its folds' gradients are whole-model vectors)"
    if not _guarded(prior):
        return "off: the evidence sets no tensor's weight decay"
    if int(prior.n_data) < FOLDS:  # a fold would hold no example
        return f"off: {int(prior.n_data)} data, fewer than the {FOLDS} folds of its cross-validation"
    return None


def restore_guard(prior: GaussianPrior, decisions: List[Dict[str, Any]]) -> None:
    """The prior as the last decision left it: a fresh fit starts with the evidence's learned weight decay fed
    back, a resumed one where its checkpoint's last decision left it."""
    last = decisions[-1] if decisions else {}
    corrected = last.get("learned_log_precision")
    _apply(prior, last.get("applied") == "declared", None if corrected is None else torch.tensor(corrected))


def _apply(prior: GaussianPrior, declared: bool, corrected: Optional[torch.Tensor] = None) -> None:
    """Training's weight decay: the declared one, else ``corrected`` (``None``: the evidence's own)."""
    prior.treatments.pop(GUARD, None)
    prior.weight_decay_override = None if declared or corrected is None else corrected.to(prior.log_precision)
    if declared:
        prior.treat(_guarded(prior), "decoupled", GUARD)


def run_guard(callback: Any, trainer: Trainer, pl_module: LightningModule, epoch: int) -> Optional[Dict[str, Any]]:
    """Score the learned against the declared weight decay at the current weights and apply the better one.

    Args:
        callback: The ``MargLikCallback`` whose estimate has just run (``callback.evidence``).
        trainer: The trainer (its strategy sums the scores over processes).
        pl_module: The module the evidence was taken of.
        epoch: The epoch (from 1) the estimate followed.

    Returns:
        The decision (``epoch``, the two scores, ``applied``: ``"learned"`` or ``"declared"``, and for a layerwise
        prior ``learned_log_precision``: the learned candidate's log precision per group), also appended to
        ``callback.guard_decisions``; ``None`` where the guard does not run.
    """
    prior, _ = callback._hyperparameters()
    if callback.guard_off is not None or callback.evidence is None:
        return None
    batches = device_batches(callback, trainer, pl_module)
    strategy = trainer.strategy

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return strategy.reduce(t.to(strategy.root_device), reduce_op="sum").to(t.device)

    gradients = fold_gradients(callback.evidence, pl_module, fold_calls(batches, FOLDS), reduce)
    try:
        with callback.evidence.reusing_decompositions():  # the candidate's solve and the scores share them
            corrected = _corrected(callback, trainer, gradients.sum(0))
            _apply(prior, declared=False, corrected=corrected)
            learned = prior.weight_decay_log_precision().detach()
            _apply(prior, declared=True)
            declared = prior.weight_decay_log_precision().detach()
            scores = approximate_cv(callback.evidence, pl_module, batches,
                                    {"learned": learned, "declared": declared}, reduce=reduce, gradients=gradients)
    except (NotImplementedError, RuntimeError) as error:  # the same on every rank
        if not _no_forward_mode(error):
            raise
        callback.guard_off = f"off: the network's forward has no forward-mode derivative ({str(error).splitlines()[0]})"
        rank_zero_warn(f"MargLikCallback: prior guard {callback.guard_off}; the learned weight decay is fed back from "
                       "here on, as with guard=False.")
        _apply(prior, declared=False)
        return None
    applied = "learned" if scores["learned"] >= scores["declared"] else "declared"
    _apply(prior, declared=applied == "declared", corrected=corrected)
    decision: Dict[str, Any] = {"epoch": epoch, **scores, "applied": applied}
    if corrected is not None:
        decision["learned_log_precision"] = corrected.tolist()
    callback.guard_decisions.append(decision)
    return decision


def _corrected(callback: Any, trainer: Trainer, gradient: torch.Tensor) -> Optional[torch.Tensor]:
    """The learned candidate's log precision per group: per group the weaker of the evidence's own precision and the
    mode-corrected evidence's (solved from the estimate's; rank 0's on every rank); ``None`` for a diagonal prior,
    whose candidate is the evidence's own choice.

    The weaker, because the correction is trusted one way only. Where the weights are not the mode, the plain
    evidence reads their shrunken norms as a call for a stronger prior (issue 52's mechanism), which the correction
    undoes. As one tensor's precision grows, though, its quadratic model's mode moves to zero and the corrected
    evidence tends to the likelihood of the network's linearization there, ``f(theta) - J theta`` (fit to the data by
    training), with no Occam factor left: it asks for a stronger prior than any evidence of the trained network
    warrants (``benchmarks/results/online_remedies.md``: log delta 19 where delta = 1 fits; the toy regression's
    depth 3 at 15-22, where the guard's linearized refits read the same intercept and let it through, and training
    collapsed: test RMSE 0.73 against 0.11)."""
    evidence = callback.evidence
    if evidence.prior.structure != "layerwise":
        return None
    solution = ModeCorrectedEvidence(evidence, gradient).maximize(max_step=callback.max_step,
                                                                  max_evaluations=max(callback.steps, 1))
    own = evidence.prior.log_precision.detach().to(solution.values["log_precision"])
    return trainer.strategy.broadcast(torch.minimum(solution.values["log_precision"], own), src=0)


def device_batches(callback: Any, trainer: Trainer, pl_module: LightningModule) -> List[Tuple[Any, torch.Tensor]]:
    """This rank's evidence batches as ``(inputs, targets)`` on the prior's device and dtype, read without moving
    training's random state."""
    param = callback._hyperparameters()[0].params[0]
    batch_fn = callback._batch_fn(pl_module)
    with isolate_rng():  # reading the training loader must not move the training's random state
        batches = [split_batch(batch, batch_fn) for batch in callback._evidence_batches(trainer, pl_module)]
    return [(move(inputs, param.device, param.dtype), target.to(param.device)) for inputs, target in batches]


def _no_forward_mode(error: Exception) -> bool:
    """Whether ``error`` says the forward has no forward-mode derivative: an operation without one
    (``NotImplementedError``), or an ``autograd.Function`` of the legacy form (``forward(ctx, ...)``), which torch.func
    refuses (a ``RuntimeError`` naming its transforms); not out of memory or the forward's own errors."""
    if isinstance(error, NotImplementedError):
        return True
    return not isinstance(error, torch.OutOfMemoryError) and "functorch transforms" in str(error)


def guard_phrase(callback: Any) -> str:
    """The set-up line's phrase: what the guard does, or why it is off."""
    if callback.guard_off is not None:
        return f"prior guard {callback.guard_off}"
    return ("prior guard: after each estimate in training, the learned weight decay (a layerwise prior's: per tensor "
            "the weaker of the evidence's and the mode-corrected evidence's) is fed back only while its approximate "
            f"{FOLDS}-fold cross-validated log likelihood beats the declared precision's (guard=False feeds the "
            "evidence's own choice back always)")


def drop_unguarded_decision(callback: Any, trainer: Trainer) -> None:
    """When training ends right after a guarded estimate (``MargLikEarlyStopping``, ``max_steps`` at an epoch's end),
    that decision guarded no training: it is dropped, and the prior is left as the decision before it, so that the
    end line and ``applied_precision`` say what training applied, as where the last epoch of ``max_epochs`` is not
    scored. A checkpoint saved at that epoch keeps it: a fit resumed from there trains on with it, as an
    uninterrupted run would have. Call it before the estimate at the end of training, if any."""
    decisions, history = callback.guard_decisions, callback.history
    last_followed = bool(decisions) and bool(history) and decisions[-1]["epoch"] == history[-1]["epoch"]
    if last_followed and callback.schedule.is_current(trainer):
        decisions.pop()
        restore_guard(callback._hyperparameters()[0], decisions)


def guard_summary(decisions: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The end of training's facts of the guard: ``estimates`` scored, ``declared`` (how many kept the declared
    weight decay) and the ``last`` decision; ``None`` if it never ran."""
    if not decisions:
        return None
    declared = sum(d["applied"] == "declared" for d in decisions)
    return {"estimates": len(decisions), "declared": declared, "last": dict(decisions[-1])}


def guard_words(summary: Dict[str, Any]) -> str:
    """The end-of-training phrase of :func:`guard_summary`'s facts."""
    last = summary["last"]
    # epoch= counts from 0 in the end line, as Lightning's checkpoint names and the best epoch do (the decision's
    # epoch counts the epochs the estimate followed, from 1, as the history's)
    scores = (f"log likelihood per datum at epoch={last['epoch'] - 1}: learned {last['learned']:.4g}, "
              f"declared {last['declared']:.4g}")
    # where the learned candidate was corrected, the precisions the evidence reports are not it
    whose = (" (mode-corrected, prior.applied_precision; prior.precision is the evidence's own choice)"
             if "learned_log_precision" in last else "")
    if not summary["declared"]:
        at = "the one estimate" if summary["estimates"] == 1 else f"all {summary['estimates']} estimates"
        return f"prior guard: the learned weight decay{whose} scored at least as well at {at} ({scores})"
    return (f"prior guard: the declared weight decay kept for training at {summary['declared']} of "
            f"{summary['estimates']} estimates, where the learned one{whose} scored worse by approximate "
            f"cross-validation ({scores}); the learned precisions are the evidence's own choice; at the end training "
            f"applied the {last['applied']} one")
