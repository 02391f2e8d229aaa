"""One class per curvature structure; :func:`..plan.make_plan` chooses them for a model.

A new structure is one file here: a :class:`..statistics.Structure` subclass declaring its
statistics (``add_state``) and implementing ``accumulate``, ``prepare``, ``log_det`` and
``covariance``; ``make_plan`` decides which parameters it covers."""
from .diag import DiagStructure
from .ekfac import EKFACStructure
from .full import FullStructure
from .kron import KronStructure

__all__ = ["DiagStructure", "EKFACStructure", "FullStructure", "KronStructure"]
