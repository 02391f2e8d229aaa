"""What a resumed fit does when the learnable hyperparameters changed since its checkpoint."""
from __future__ import annotations

from typing import List, Optional, Sequence

from lightning_utilities.core.rank_zero import rank_zero_warn  # one rank state for both packages

from ..hyperparameters import GaussianPrior, Likelihood, assign_hyperparameters

__all__ = ["follow_changed_learnables"]


def follow_changed_learnables(
    prior: GaussianPrior, likelihood: Likelihood, saved: Optional[Sequence[Sequence]], signature: List[tuple],
    has_optimizer_state: bool,
) -> bool:
    """After a resume: tensors whose precision the checkpoint learned and the prior now fixes take the
    declared ``precision``; a changed set of learned hyperparameters restarts the Adam state. Both with
    a warning (identical on every rank: the checkpoint's state is).

    Args:
        prior: The callback's prior (written for the newly fixed tensors).
        likelihood: The callback's likelihood.
        saved: The checkpoint's signature of the learned hyperparameters (``None``: no checkpoint state).
        signature: Today's signature (the callback's ``_learnable_signature``).
        has_optimizer_state: Whether the checkpoint holds an Adam state of the hyperparameter steps.

    Returns:
        Whether the Adam state must start afresh.
    """
    if saved is None:
        return False
    learned_before = next((entry[2] for entry in saved if entry[0] == "log_precision" and len(entry) > 2), [])
    newly_fixed = [name for name in prior.fixed_names() if name in learned_before]
    if newly_fixed:
        assign_hyperparameters(prior, likelihood, {"log_precision": prior.declared_log_precision(newly_fixed)})
        rank_zero_warn(
            f"MargLikCallback: the checkpoint learned the prior precision of {newly_fixed}, which the prior now "
            f"fixes (GaussianPrior(fixed=...)): they take the declared precision={prior.initial_precision:g}."
        )
    if has_optimizer_state and [tuple(entry) for entry in saved] != signature:
        rank_zero_warn(
            f"MargLikCallback: the learnable hyperparameters changed since the checkpoint "
            f"({saved} -> {signature}): the Adam state of the hyperparameter steps starts "
            "afresh; the evidence history and best value are kept."
        )
        return True
    return False
