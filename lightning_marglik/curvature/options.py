"""The curvature options, validated once in one frozen object."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["APPROXIMATIONS", "BACKENDS", "STRUCTURES", "CurvatureOptions"]

STRUCTURES = ("full", "kron", "ekfac", "diag")
APPROXIMATIONS = ("ggn", "ef")
BACKENDS = ("hooks", "backpack")


@dataclass(frozen=True)
class CurvatureOptions:
    """What curvature the evidence pass computes.

    Args:
        structure: ``"kron"`` (Kronecker factors for Linear/Conv/Embedding layers, an exact
            diagonal for every other parameter), ``"ekfac"`` (the same blocks with the Kronecker
            eigenvalues replaced by the exact second moments in their eigenbasis, George et al.
            2018; two passes over the data, see :mod:`.structures.ekfac`), ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` (generalized Gauss-Newton) or ``"ef"`` (empirical Fisher).
        mc_samples: Monte-Carlo samples per example for the GGN; 0 for the exact GGN.
        max_memory: Largest size in bytes the ``full`` structure may allocate for its ``P x P``
            matrices (the Gram matrix and its factorisation).
        backend: ``"hooks"`` (ours: any network) or ``"backpack"`` (optional extra; Sequential
            networks of Linear/Conv2d layers, see :mod:`.backpack`).

    Raises:
        ValueError: Naming the bad option and the accepted values.

    Example:
        >>> CurvatureOptions("diag", "ef").structure
        'diag'
    """

    structure: str = "kron"
    approx: str = "ggn"
    mc_samples: int = 0
    max_memory: int = 4 * 2**30
    backend: str = "hooks"

    def __post_init__(self) -> None:
        if self.structure not in STRUCTURES:
            raise ValueError(f"`structure` must be one of {STRUCTURES}, got {self.structure!r}.")
        if self.approx not in APPROXIMATIONS:
            raise ValueError(f"`approx` must be one of {APPROXIMATIONS}, got {self.approx!r}.")
        if isinstance(self.mc_samples, bool) or not isinstance(self.mc_samples, int) or self.mc_samples < 0:
            raise ValueError(f"`mc_samples` must be an int >= 0 (0 = exact GGN), got {self.mc_samples!r}.")
        if self.mc_samples and self.approx != "ggn":
            raise ValueError(f"`mc_samples` applies to approx='ggn' only, got approx={self.approx!r}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {self.backend!r}.")
        if isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int) or self.max_memory <= 0:
            raise ValueError(f"`max_memory` must be a positive number of bytes, got {self.max_memory!r}.")
