"""Rules that decide *when* the hyperparameters are estimated, as pure functions of the training history.

A burn-in of a fixed number of epochs ``B`` has to be guessed per problem. A settle rule waits
instead until the training loss has flattened: far from a MAP, the prior precision of a group
that is still moving (e.g. a zero-initialised bias) is estimated from weights that are not yet
determined by the data, and a converged estimate there starts the ARD feedback loop
(``benchmarks/results/runaway_mechanism.md``, :mod:`lightning_marglik.runaway`). Knows nothing of Lightning.
"""
from __future__ import annotations

import math
from typing import Sequence

from .validators import integer, number

__all__ = ["loss_has_settled"]


def loss_has_settled(history: Sequence[float], window: int, rel_tol: float) -> bool:
    """Whether the training loss, once it has fallen, changed by at most ``rel_tol`` (relatively) over the last
    ``window`` epochs.

    With ``L`` the losses of the epochs so far (one per epoch, the last one most recent), the loss
    has settled when ``|L[-1] - L[-1 - window]| <= rel_tol * |L[-1 - window]|`` and
    ``L[0] - L[-1] >= rel_tol * |L[0]|`` (a loss may be negative, e.g. a Gaussian's with a small sigma). The second condition tells a plateau at the start (a network
    whose head or branches start at zero, e.g. Fixup, sits at ``log C`` for its first epochs) from
    training that has settled. Until ``window + 1`` losses exist it has not; a non-finite loss in the
    window has not settled.

    Args:
        history: The training loss of every epoch so far, in order.
        window: Number of epochs ``F >= 1`` the change is taken over.
        rel_tol: Largest relative change ``eps > 0`` that counts as settled (e.g. 0.05).

    Returns:
        ``True`` once the loss has settled.

    Raises:
        ValueError: On a ``window`` that is not an int >= 1 or a ``rel_tol`` that is not positive
            and finite.

    Example:
        >>> loss_has_settled([2.0, 1.0, 0.6, 0.59, 0.585], window=2, rel_tol=0.05)
        True
        >>> loss_has_settled([2.0, 1.0, 0.6], window=2, rel_tol=0.05)
        False
        >>> loss_has_settled([2.3, 2.3, 2.29], window=2, rel_tol=0.05)  # flat, but not yet fallen
        False
    """
    window = integer(window, "window", minimum=1, what="epochs over which the loss must have settled")
    rel_tol = number(rel_tol, "rel_tol", what="the largest relative change of the loss, e.g. 0.05")
    if len(history) <= window:
        return False
    then, now = float(history[-1 - window]), float(history[-1])
    recent = [float(value) for value in history[-1 - window:]]
    if not all(math.isfinite(value) for value in recent):
        return False
    first = float(history[0])
    return abs(now - then) <= rel_tol * abs(then) and math.isfinite(first) and first - now >= rel_tol * abs(first)
