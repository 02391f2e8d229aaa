"""``MargLikCallback``'s prior guard: the learned weight decay reaches training only while it scores better.

After each estimate within training, :func:`lightning_marglik.guard.approximate_cv` scores the training data's
approximate cross-validated log likelihood under three weight decays of the tensors the evidence learns: the
learned one, the declared one, and halfway between them (the geometric mean of the two precisions). Training
applies the best scoring (ties go to the learned one, then halfway): the learned one is fed back into the MAP
loss as before, otherwise those tensors are treated apart (``prior.treatments["prior guard"]``: ``"decoupled"``
for the declared, ``"halfway"``): the evidence goes on learning its own precisions (``prior.log_precision``, the
evidence's own choice), training applies the chosen one. Each decision is recorded (``callback.guard_decisions``)
and said at the end of training. The estimate after training has no training to guard and is not scored.

The guard is off, with the reason said at set-up, under a strategy that shards the parameters (its folds'
gradients are whole-model vectors) and where the evidence learns no tensor's weight decay.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages

from ..curvature.batches import move, split_batch
from ..guard import FOLDS, approximate_cv
from ..hyperparameters import GaussianPrior
from .data import isolate_rng
from .package import LightningModule, Trainer
from .sharding import shards_parameters

__all__ = ["CANDIDATES", "GUARD", "guard_off_reason", "guard_phrase", "guard_summary", "guard_words", "restore_guard", "run_guard"]

#: The prior's treatment reason for the tensors whose learned weight decay the guard keeps out of training.
GUARD = "prior guard"
#: The weight decays scored, in the order ties are decided, with the treatment that applies each.
CANDIDATES = {"learned": "learn", "halfway": "halfway", "declared": "decoupled"}


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
    return None


def restore_guard(prior: GaussianPrior, decisions: List[Dict[str, Any]]) -> None:
    """The prior as the last decision left it: a fresh fit starts with the learned weight decay fed back, a
    resumed one where its checkpoint's last decision left it."""
    _apply(prior, decisions[-1]["applied"] if decisions else "learned")


def _apply(prior: GaussianPrior, applied: str) -> None:
    prior.treatments.pop(GUARD, None)
    if applied != "learned":
        prior.treat(_guarded(prior), CANDIDATES[applied], GUARD)


def run_guard(callback: Any, trainer: Trainer, pl_module: LightningModule, epoch: int) -> Optional[Dict[str, Any]]:
    """Score the learned against the declared weight decay at the current weights and apply the better one.

    Args:
        callback: The ``MargLikCallback`` whose estimate has just run (``callback.evidence``).
        trainer: The trainer (its strategy sums the scores over processes).
        pl_module: The module the evidence was taken of.
        epoch: The epoch (from 1) the estimate followed.

    Returns:
        The decision (``epoch``, the score of each of :data:`CANDIDATES`, ``applied``: the best of them), also
        appended to ``callback.guard_decisions``; ``None`` where the guard does not run.
    """
    prior, _ = callback._hyperparameters()
    if callback.guard_off is not None or callback.evidence is None:
        return None
    candidates = {}
    for name in CANDIDATES:
        _apply(prior, name)
        candidates[name] = prior.weight_decay_log_precision().detach()
    param = prior.params[0]
    batch_fn = callback._batch_fn(pl_module)
    with isolate_rng():  # reading the training loader must not move the training's random state
        batches = [split_batch(batch, batch_fn) for batch in callback._evidence_batches(trainer, pl_module)]
    batches = [(move(inputs, param.device, param.dtype), target.to(param.device)) for inputs, target in batches]
    strategy = trainer.strategy
    try:
        scores = approximate_cv(callback.evidence, pl_module, batches, candidates,
                                reduce=lambda t: strategy.reduce(t.to(strategy.root_device), reduce_op="sum").to(t.device))
    except NotImplementedError as error:  # an operation without a forward-mode derivative: the same on every rank
        callback.guard_off = f"off: the network's forward has no forward-mode derivative ({str(error).splitlines()[0]})"
        rank_zero_warn(f"MargLikCallback: prior guard {callback.guard_off}; the learned weight decay is fed back from "
                       "here on, as with guard=False.")
        _apply(prior, "learned")
        return None
    applied = max(CANDIDATES, key=scores.__getitem__)  # the first of equal scores: ties go to the learned one
    _apply(prior, applied)
    decision = {"epoch": epoch, **scores, "applied": applied}
    callback.guard_decisions.append(decision)
    return decision


def guard_phrase(callback: Any) -> str:
    """The set-up line's phrase: what the guard does, or why it is off."""
    if callback.guard_off is not None:
        return f"prior guard {callback.guard_off}"
    return (f"prior guard: after each estimate in training, the learned weight decay, the declared one and halfway "
            f"between them are scored by the approximate {FOLDS}-fold cross-validated log likelihood, and training "
            "applies the best (guard=False feeds the learned one back always)")


def guard_summary(decisions: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The end of training's facts of the guard: ``estimates`` scored, how many applied each candidate
    (``learned``, ``halfway``, ``declared``) and the ``last`` decision; ``None`` if it never ran."""
    if not decisions:
        return None
    counts = {name: sum(d["applied"] == name for d in decisions) for name in CANDIDATES}
    return {"estimates": len(decisions), **counts, "last": dict(decisions[-1])}


def guard_words(summary: Dict[str, Any]) -> str:
    """The end-of-training phrase of :func:`guard_summary`'s facts."""
    last = summary["last"]
    scores = ", ".join(f"{name} {last[name]:.4g}" for name in CANDIDATES if name in last)  # a checkpoint of the two-candidate guard has no halfway
    scores = f"log likelihood per datum at epoch={last['epoch']}: {scores}"
    if summary["learned"] == summary["estimates"]:
        return f"prior guard: the learned weight decay scored best at all {summary['estimates']} estimates ({scores})"
    kept = " and ".join(f"the {name} one at {summary[name]}" for name in ("declared", "halfway") if summary[name])
    return (f"prior guard: training applied {kept} of {summary['estimates']} estimates, where the learned one "
            f"scored worse by approximate cross-validation ({scores}); the learned precisions are the evidence's own "
            f"choice; at the end training applied the {last['applied']} one")
