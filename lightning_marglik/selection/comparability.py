"""Which candidates ``select_models`` cannot compare by their evidence: networks of different likelihoods
(refused), networks with normalization layers against networks without, evidences that are not finite, and
candidates trained for different numbers of epochs (warnings).

The evidence of a discrete likelihood (``CategoricalLikelihood``) is a probability of the labels, that of a
continuous one (``GaussianLikelihood``) a density of the targets: the two are on no common scale, and
likelihoods of one kind model different targets.

A weight whose output goes into a normalization (BatchNorm, GroupNorm, LayerNorm, RMSNorm, InstanceNorm)
is scale-invariant in training: the data do not resist its shrinking, and the Laplace evidence of the
trained network does not measure a posterior volume for it (Antorán et al., ICML 2022). Measured in
``examples/results/ranking_study.md``: the BatchNorm ResNets tested as well as the best CNNs and every
approximation ranked them last (rho 0.29 over MLPs, CNNs and BatchNorm ResNets with the default ranking,
their BatchNorms folded); ``docs/selection.md``, "When to trust Step 2". GroupNorm, LayerNorm and RMSNorm
were not measured; they count as normalization all the same: the same scale invariance, and unlike a
BatchNorm's running statistics theirs depend on the input, so no folding removes them.

Example:
    >>> from torch import nn
    >>> normalization_layers(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4)))
    ['BatchNorm2d', 'GroupNorm']
    >>> mixed_normalization_message({"cnn": [], "mlp": []})
    ''
    >>> mixed_normalization_message({"cnn": [], "resnet": ["BatchNorm2d"]}).startswith("select_models cannot")
    True
    >>> mixed_likelihood_message({"mlp": "CategoricalLikelihood", "cnn": "CategoricalLikelihood"})
    ''
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

from torch import nn

from ..curvature.scale_invariance import NORMS

__all__ = ["mixed_likelihood_message", "mixed_normalization_message", "non_finite_message", "normalization_layers",
           "unequal_epochs_message"]


def normalization_layers(module: nn.Module) -> List[str]:
    """The class names of the normalization layers in ``module``, sorted, each once (empty: none)."""
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, NORMS)})


def mixed_normalization_message(normalizations: Mapping[str, Optional[Sequence[str]]]) -> str:
    """The warning for candidates with and without normalization layers side by side; ``""`` if they
    are all of one kind.

    Args:
        normalizations: Candidate name to its :func:`normalization_layers` (``None``: not known, e.g. a
            result stored by an older version; left out).

    Returns:
        One message naming the candidates of both kinds and why their evidences do not compare, or ``""``.
    """
    normalized = {name: layers for name, layers in normalizations.items() if layers}
    free = [name for name, layers in normalizations.items() if layers is not None and not layers]
    if not normalized or not free:
        return ""
    with_norms = ", ".join(f"{name!r} ({', '.join(layers)})" for name, layers in normalized.items())
    return (
        f"select_models cannot compare candidates with normalization layers ({with_norms}) and without "
        f"({', '.join(map(repr, free))}) by their evidence; the ranking below mixes them all the same. The weights "
        "that feed a normalization are scale-invariant in training, so the Laplace evidence does not measure their "
        "posterior volume: in the project's ranking study the BatchNorm ResNets tested as well as the best CNNs and "
        "every approximation ranked them last, BatchNorms folded or not (docs/selection.md, 'When to trust Step 2'). "
        "Rank each kind on its own, or compare across kinds on held-out data."
    )


def mixed_likelihood_message(likelihoods: Mapping[str, str]) -> str:
    """The refusal of candidates whose likelihoods differ; ``""`` if they share one.

    Args:
        likelihoods: Candidate name to the class name of its likelihood.

    Returns:
        One message naming the candidates of each likelihood, or ``""``.

    Example:
        >>> print(mixed_likelihood_message({"cat": "CategoricalLikelihood", "reg": "GaussianLikelihood"})[:96])
        select_models cannot rank candidates of different likelihoods by their evidence: 'cat' (Categori
    """
    groups: Dict[str, List[str]] = {}
    for name, likelihood in likelihoods.items():
        groups.setdefault(likelihood, []).append(name)
    if len(groups) < 2:
        return ""
    listed = "; ".join(f"{', '.join(map(repr, names))} ({likelihood})" for likelihood, names in groups.items())
    return (f"select_models cannot rank candidates of different likelihoods by their evidence: {listed}; a probability "
            "of labels and a density of targets are on no common scale. Give every candidate the same likelihood, or "
            "rank each group on its own.")


def non_finite_message(evidences: Mapping[str, float]) -> str:
    """The warning for candidates whose ranking evidence is not finite; ``""`` if every one is.

    Example:
        >>> print(non_finite_message({"mlp": -0.4, "wide": float("nan")})[:79])
        select_models: the evidence of candidate 'wide' is not finite (wide=nan); it is
    """
    bad = {name: value for name, value in evidences.items() if not math.isfinite(value)}
    if not bad:
        return ""
    one = len(bad) == 1
    listed = ", ".join(map(repr, bad))
    return (f"select_models: the evidence of candidate{'' if one else 's'} {listed} is not finite "
            f"({', '.join(f'{name}={value}' for name, value in bad.items())}); {'it is' if one else 'they are'} ranked "
            "last, written as null in results.json and trained again by a re-run. Check the training (a diverged loss, "
            "weights or precisions at their limits) or rank by another rank_by.")


def unequal_epochs_message(epochs: Mapping[str, int]) -> str:
    """The warning for candidates trained for different numbers of epochs (``max_time``, early stopping); ``""`` if
    they all trained for the same.

    Example:
        >>> unequal_epochs_message({"mlp": 8, "cnn": 8})
        ''
        >>> print(unequal_epochs_message({"mlp": 8, "cnn": 3})[:87])
        select_models ranks candidates trained for different numbers of epochs (mlp: 8, cnn: 3)
    """
    if len(set(epochs.values())) < 2:
        return ""
    listed = ", ".join(f"{name}: {count}" for name, count in epochs.items())
    return (f"select_models ranks candidates trained for different numbers of epochs ({listed}): the evidence judges "
            "each where its training stopped, so an under-trained candidate is ranked by its early weights. Compare "
            "candidates at the same fraction of training (the same max_epochs, without max_time or early stopping).")
