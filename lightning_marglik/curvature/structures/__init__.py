"""One class per curvature structure; :func:`build` chooses them for a plan."""
from .diag import DiagStructure
from .full import FullStructure
from .kron import KronStructure

__all__ = ["DiagStructure", "FullStructure", "KronStructure"]
