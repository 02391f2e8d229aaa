"""The values of the two ``structure=`` options: the prior's and the curvature's.

``GaussianPrior(structure=...)`` says how many precisions the prior has (:data:`PRIOR_STRUCTURES`); the
curvature's ``structure=`` (``MargLikCallback``, ``LaplaceEvidence.fit``, ``select_models``) names a
registered structure class (:mod:`lightning_marglik.curvature.structures` registers them in the table kept
here). "diag" and "diagonal" are easy to swap, so each option's message names the other's values: both sit
here, below the prior and the curvature, so that neither imports the other for its message.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

__all__ = ["PRIOR_STRUCTURES", "curvature_elsewhere", "prior_elsewhere", "registered_structures", "structure_names"]

PRIOR_STRUCTURES = ("scalar", "layerwise", "diagonal")

#: ``structure=`` value -> its structure class, in registration order (written by
#: :func:`lightning_marglik.curvature.structures.register_structure` only).
registered_structures: Dict[str, Any] = {}


def structure_names() -> Tuple[str, ...]:
    """The registered ``structure=`` values of the curvature, in registration order."""
    return tuple(registered_structures)


def prior_elsewhere() -> Tuple[Sequence[str], str]:
    """The prior's ``structure`` values, for the curvature's message on one of them ("diagonal" for "diag")."""
    return PRIOR_STRUCTURES, (
        "a prior structure, GaussianPrior(structure=...): how many precisions the prior has; this `structure` is the "
        "curvature's (MargLikCallback, LaplaceEvidence.fit, select_models)"
    )


def curvature_elsewhere() -> Tuple[Sequence[str], str]:
    """The curvature's ``structure`` values, for the prior's message on one of them ("diag" for "diagonal")."""
    return structure_names(), (
        "a curvature structure, MargLikCallback(structure=...) or LaplaceEvidence.fit(structure=...); "
        "GaussianPrior's `structure` is how many precisions the prior has"
    )
