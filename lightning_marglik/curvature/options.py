"""The curvature options, validated once in one frozen object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..structure_options import prior_elsewhere, structure_names
from ..validators import choice, integer, optional

__all__ = ["APPROXIMATIONS", "BACKENDS", "STRUCTURES", "CurvatureOptions"]

APPROXIMATIONS = ("ggn", "ef")
BACKENDS = ("hooks", "backpack")
def __getattr__(name: str) -> Any:
    # STRUCTURES is read from the registry when asked, so that it includes structures registered later
    if name == "STRUCTURES":
        return structure_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class CurvatureOptions:
    """What curvature the evidence pass computes.

    Args:
        structure: A registered structure (:mod:`.structures`; matched case-insensitively):
            ``"kron"`` (Kronecker factors for Linear/Conv/Embedding layers, an exact
            diagonal for every other parameter), ``"ekfac"`` (the same blocks with the Kronecker
            eigenvalues replaced by the exact second moments in their eigenbasis, George et al.
            2018; two passes over the data, see :mod:`.structures.ekfac`), ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` (generalized Gauss-Newton) or ``"ef"`` (empirical Fisher).
        mc_samples: Monte-Carlo samples per example for the GGN; 0 for the exact GGN; ``"auto"``:
            exact while the exact GGN takes few backward passes per batch, else sampled
            (:mod:`.estimator`; resolved on an evidence pass's first batch).
        max_memory: Largest size in bytes the ``full`` structure may allocate for its ``P x P``
            matrices (the Gram matrix and its factorisation).
        backend: ``"hooks"`` (ours: any network) or ``"backpack"`` (optional extra; Sequential
            networks of Linear/Conv2d layers, see :mod:`.backpack`).
        max_output_factor: Most outputs of a layer whose output-side Kronecker factor ``G``
            (``out x out``, eigendecomposed once per estimate) ``kron`` and ``ekfac`` hold exactly; a
            layer with more (a 10,000-class or 50,257-token head) holds only ``diag(G)``, whose
            eigenbasis is the identity (:mod:`.structures.kron`). ``None``: every factor exact.

    Raises:
        ValueError: Naming the bad option and the accepted values, with a "did you mean" for a
            near miss.

    Example:
        >>> CurvatureOptions("Diag", "EF").structure
        'diag'
        >>> CurvatureOptions("kfac")
        Traceback (most recent call last):
        ...
        ValueError: `structure` must be one of ('full', 'kron', 'ekfac', 'diag'), got 'kfac' (did you mean 'kron'?).
    """

    structure: str = "kron"
    approx: str = "ggn"
    mc_samples: Union[int, str] = 0
    max_memory: int = 4 * 2**30
    backend: str = "hooks"
    max_output_factor: Optional[int] = 4096

    def __post_init__(self) -> None:
        # canonical spellings ("KRON" -> "kron"): the frozen dataclass takes them through object.__setattr__
        object.__setattr__(self, "structure", choice(self.structure, structure_names(), "structure", elsewhere=prior_elsewhere()))
        object.__setattr__(self, "approx", choice(self.approx, APPROXIMATIONS, "approx"))
        if isinstance(self.mc_samples, str):
            # a count given as a string ("1") is told that counts are ints
            auto = choice(self.mc_samples, ("auto",), "mc_samples", what="Or an int >= 0: Monte-Carlo samples, 0 = exact GGN.")
            object.__setattr__(self, "mc_samples", auto)
        else:
            integer(self.mc_samples, "mc_samples", minimum=0, what="0 = exact GGN, or 'auto'")
        if self.mc_samples and self.mc_samples != "auto" and self.approx != "ggn":
            raise ValueError(f"`mc_samples` applies to approx='ggn' only, got approx={self.approx!r}.")
        object.__setattr__(self, "backend", choice(self.backend, BACKENDS, "backend"))
        integer(self.max_memory, "max_memory", minimum=1, what="a number of bytes")
        optional(integer, self.max_output_factor, "max_output_factor", minimum=0,
                 what="the most outputs of an exact Kronecker output factor, or None: every factor exact")
