"""``MargLikCallback``'s prior guard: the learned weight decay reaches training only while it scores better.

After each estimate within training, :func:`lightning_marglik.guard.approximate_cv` scores the training data's
approximate cross-validated log likelihood under the learned weight decay and under the declared one; the
learned one is fed back into the MAP loss only while it scores at least as well, otherwise the tensors the
evidence learns are decoupled (``prior.treatments["prior guard"]``): the evidence goes on learning its own
precisions (``prior.log_precision``, the evidence's own choice), training keeps the declared precision. Each
decision is recorded (``callback.guard_decisions``, the history's ``"guard"`` entries) and said at the end of
training. The estimate after training has no training to guard and is not scored, until a fit resumed from
it trains on: then it is scored when that training starts, as an uninterrupted run scored it.

The guard is off, with the reason said at set-up, under a strategy that shards the parameters (its folds'
gradients are whole-model vectors) and where the evidence learns no tensor's weight decay.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages

from ..curvature.batches import move, split_batch
from ..guard import FOLDS, approximate_cv
from ..hyperparameters import GaussianPrior
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
    """The prior as the last decision left it: a fresh fit starts with the learned weight decay fed back, a
    resumed one where its checkpoint's last decision left it."""
    declared = bool(decisions) and decisions[-1]["applied"] == "declared"
    _apply(prior, declared)


def _apply(prior: GaussianPrior, declared: bool) -> None:
    prior.treatments.pop(GUARD, None)
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
        The decision (``epoch``, the two scores, ``applied``: ``"learned"`` or ``"declared"``), also appended to
        ``callback.guard_decisions``; ``None`` where the guard does not run.
    """
    prior, _ = callback._hyperparameters()
    if callback.guard_off is not None or callback.evidence is None:
        return None
    prior.treatments.pop(GUARD, None)
    learned = prior.weight_decay_log_precision().detach()
    _apply(prior, declared=True)
    declared = prior.weight_decay_log_precision().detach()
    batches = device_batches(callback, trainer, pl_module)
    strategy = trainer.strategy
    try:
        scores = approximate_cv(callback.evidence, pl_module, batches, {"learned": learned, "declared": declared},
                                reduce=lambda t: strategy.reduce(t.to(strategy.root_device), reduce_op="sum").to(t.device))
    except (NotImplementedError, RuntimeError) as error:  # the same on every rank
        if not _no_forward_mode(error):
            raise
        callback.guard_off = f"off: the network's forward has no forward-mode derivative ({str(error).splitlines()[0]})"
        rank_zero_warn(f"MargLikCallback: prior guard {callback.guard_off}; the learned weight decay is fed back from "
                       "here on, as with guard=False.")
        _apply(prior, declared=False)
        return None
    applied = "learned" if scores["learned"] >= scores["declared"] else "declared"
    _apply(prior, declared=applied == "declared")
    decision = {"epoch": epoch, **scores, "applied": applied}
    callback.guard_decisions.append(decision)
    return decision


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
    return (f"prior guard: after each estimate in training, the learned weight decay is fed back only while its "
            f"approximate {FOLDS}-fold cross-validated log likelihood beats the declared precision's (guard=False "
            "feeds it back always)")


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
    if not summary["declared"]:
        at = "the one estimate" if summary["estimates"] == 1 else f"all {summary['estimates']} estimates"
        return f"prior guard: the learned weight decay scored at least as well at {at} ({scores})"
    return (f"prior guard: the declared weight decay kept for training at {summary['declared']} of "
            f"{summary['estimates']} estimates, where the learned one scored worse by approximate cross-validation "
            f"({scores}); the learned precisions are the evidence's own choice; at the end training applied the "
            f"{last['applied']} one")
