"""One class per curvature structure, and the registry the ``structure=`` options read.

What the protocol can carry
    Every structure computes the log-determinant and the posterior covariance of

        H = s C + diag(delta),

    ``C`` the unit-scale curvature (GGN or empirical Fisher) its statistics describe, ``s`` ONE
    scalar curvature scale supplied by the likelihood (``1 / sigma^2`` of a Gaussian, the
    temperature; :meth:`~lightning_marglik.Likelihood.curvature_scale`), and ``delta`` the prior
    precision: one per prior tensor (0-dim ``log_delta[t]``: scalar and layerwise priors) or one
    per scalar parameter (``(numel,)``: a diagonal prior). Hyperparameters that enter ``H`` any
    other way (a per-output noise that weights the curvature's rows, a non-diagonal prior, a
    prior mean) cannot be expressed without changing :class:`~..statistics.Structure`'s methods
    (``log_det(scale, log_delta)``, ``log_det_derivatives``, ``covariance(jacobians, scale,
    delta)``) and every structure with them.

Adding a structure
    One file here (or in your own package) with a :class:`~..statistics.Structure` subclass that

    * declares its ``name`` (the ``structure=`` value) and the capabilities it has, as class
      attributes (``passes``, ``hook_path``, ``per_tensor_prior``, ``multi_process``,
      ``training_statistics``, ``parametric_bound``, ``rank_by``; see ``Structure``);
    * declares its statistics (``add_state``) and implements ``accumulate``, ``prepare``,
      ``log_det``, ``log_det_derivatives`` and ``covariance`` (``rescale``, ``start_pass``,
      ``reduce_extra`` and ``diagonal`` where its capabilities need them; ``inverse`` where ``H_b^-1``
      has a cheaper form than the dense one the base class takes from ``covariance``);
    * builds itself with the uniform constructor ``from_plan(layers, exact, prior, options)``,
      which receives the hooked layers and the exact path's parameters :func:`..plan.make_plan`
      decided (a structure may cover some tensors itself and hand the rest to another, as
      ``kron`` hands non-Kronecker layers to :class:`DiagStructure`);

    and one :func:`register_structure` call: a built-in in the tuple below, your own after its
    class. ``CurvatureOptions``, ``LaplaceEvidence.fit``, ``MargLikCallback`` and
    ``select_models(rank_by=...)`` then accept its name. ``tests/test_structure_registry.py``
    registers a toy structure this way.

Registry functions: :func:`register_structure`, :func:`unregister_structure`,
:func:`structure_class` (the class of a name, case-insensitive with "did you mean"),
:func:`structure_names` and :func:`structures_with` (the names with a capability).
"""
from .diag import DiagStructure
from .ekfac import EKFACStructure
from .full import FullStructure
from .kron import KronStructure
from .registry import (
    CAPABILITIES,
    register_structure,
    structure_class,
    structure_names,
    structures_with,
    unregister_structure,
)

for _builtin in (FullStructure, KronStructure, EKFACStructure, DiagStructure):  # the order of the messages' lists
    register_structure(_builtin)

__all__ = [
    "CAPABILITIES",
    "DiagStructure",
    "EKFACStructure",
    "FullStructure",
    "KronStructure",
    "register_structure",
    "structure_class",
    "structure_names",
    "structures_with",
    "unregister_structure",
]
