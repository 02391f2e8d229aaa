"""Learned prior precisions that run away, and the warning that names them.

A group the data barely determine (a zero-initialised bias, a Fixup scalar, an attention key's
bias, whose softmax does not see it) has its evidence optimum at ``delta -> inf`` once its norm
shrinks: ``delta* ~ sqrt(sum lambda) / ||theta||``, and a prior that shrinks the group further
raises ``delta*`` again (the ARD feedback loop, ``benchmarks/results/runaway_mechanism.md``). The
evidence then prunes the group. Where the learned precision is the group's weight decay this
switches the group off in training; where it is not (``"decoupled"``), training keeps the group
and only the evidence counts it as pruned, which matters when models are compared by it.

:func:`runaway_precisions` finds such tensors, :func:`runaway_message` says what it means for each.

Example:
    >>> import torch
    >>> from lightning_marglik import GaussianPrior
    >>> prior = GaussianPrior(torch.nn.Linear(3, 2))
    >>> prior.log_precision[1] = 9.0  # the bias
    >>> runaway_precisions(prior)
    {'bias': 9.0}
"""
from __future__ import annotations

import math
from typing import Dict, Mapping

from .hyperparameters import GaussianPrior, no_decay_names
from .validators import number

__all__ = ["RUNAWAY_LOG_RISE", "runaway_message", "runaway_precisions"]

# e^8 ~ 3000 times the declared precision: far past any weight decay a recipe uses (issue 23's target)
RUNAWAY_LOG_RISE = 8.0


def runaway_precisions(prior: GaussianPrior, threshold: float = RUNAWAY_LOG_RISE) -> Dict[str, float]:
    """The learned tensors whose log precision is more than ``threshold`` above the declared one, or above 1
    where the declared one is smaller (a weak declared prior, e.g. ``precision=1e-4``, makes an ordinary learned
    precision no runaway).

    Args:
        prior: The prior; its declared precision (``GaussianPrior(precision=...)``) is the start.
        threshold: Largest rise of ``log delta`` that is not reported.

    Returns:
        Tensor name (``"every parameter"`` for a scalar prior) -> its rise of ``log delta`` over that start (the
        largest over its entries for a diagonal prior), in ``param_names`` order.

    Raises:
        ValueError: On a ``threshold`` that is not a positive finite number.
    """
    threshold = number(threshold, "threshold", what="the largest rise of log delta not reported, e.g. 8.0")
    rise = (prior.log_precision.detach().double() - max(math.log(prior.initial_precision), 0.0)).cpu()
    if prior.structure == "scalar":
        value = float(rise[0])
        return {"every parameter": value} if prior.learn and value > threshold else {}
    per_tensor = prior.tensor_log_precisions(rise)  # not expanded per scalar: a model's size in float64
    learned = set(prior.learned_names())
    rises = {name: float(values.max()) for name, values in zip(prior.param_names, per_tensor)}
    return {name: value for name, value in rises.items() if name in learned and value > threshold}


def runaway_message(prior: GaussianPrior, rises: Mapping[str, float], who: str = "MargLikCallback") -> str:
    """One warning naming the tensors of ``rises`` (from :func:`runaway_precisions`) and what their
    precision does: shrink them to zero in training, or only count them as pruned in the evidence.

    Args:
        prior: The prior the rises were read from (its treatments tell the two cases apart).
        rises: Tensor name -> rise of ``log delta``.
        who: Who warns, for the message's first words.

    Returns:
        The message; ``""`` for no rises.
    """
    if not rises:
        return ""
    decoupled = set(prior.treated("decoupled"))
    trained = [name for name in rises if name not in decoupled]
    counted = [name for name in rises if name in decoupled]

    def listed(names: list) -> str:
        return ", ".join(f"{name} (+{rises[name]:.1f})" for name in names)

    parts = [
        f"{who}: the learned prior precision of some tensors rose more than e^{RUNAWAY_LOG_RISE:g} above its start "
        "(log delta rise in brackets): the evidence prunes them, as ARD does with a group the data barely determine "
        "(benchmarks/results/runaway_mechanism.md)."
    ]
    if prior.structure == "scalar":
        parts.append(
            f"One precision for every parameter ({listed(trained)}) shrinks them all: use structure='layerwise', whose "
            "biases and normalization parameters the callback decouples, or GaussianPrior(learn=False)."
        )
    elif trained:
        biases = set(no_decay_names(prior)) & set(trained)  # biases learned and fed back: biases='learn'
        parts.append(
            f"Trained with that weight decay, these are being switched off: {listed(trained)}. To keep them, hold "
            f"their precision: GaussianPrior(fixed={trained!r})"
            + (", or MargLikCallback(biases='decoupled') for the biases and normalization parameters among them."
               if biases else ".")
        )
    if counted:
        parts.append(
            f"Training keeps its weight decay for these (biases='decoupled'), so the network is unchanged, but the "
            f"evidence counts them as pruned: {listed(counted)}. Compare models by it with that in mind, or pass "
            "biases='fixed' to leave them out of what the evidence learns."
        )
    return " ".join(parts)
