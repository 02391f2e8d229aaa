"""Declared, sum-reduced statistics: the structures' common base and the container of one pass.

Every statistic is declared next to its definition with :meth:`Structure.add_state` (as
torchmetrics' ``add_state(..., dist_reduce_fx="sum")``) and accumulated in float64, counts as
integers, whatever the model's dtype. :meth:`CurvatureStatistics.reduce` sums all of them across
processes in ONE flattened collective.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING, Callable, ClassVar, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union,
)

import torch
from torch import Tensor, nn

from .options import CurvatureOptions

if TYPE_CHECKING:
    from ..hyperparameters import GaussianPrior
    from .structures.derivatives import LogDetDerivatives

__all__ = ["BatchCurvature", "CurvatureStatistics", "LayerPlan", "RankOneJacobian", "Structure", "with_notes"]

SumFn = Callable[[Tensor], Tensor]
GatherFn = Callable[[Tensor], List[Tensor]]
InverseFn = Callable[[List[Tensor]], List[Tensor]]  # a structure's H_b^-1 on its tensors' flat pieces
ReduceFn = Callable[[Tensor, int], None]  # sum a tensor of every rank into rank dst's, in place


@dataclass
class LayerPlan:
    """A layer on the hook path: its module and the prior index of each own parameter by role."""

    name: str
    module: nn.Module
    roles: Dict[str, int]


@dataclass
class BatchCurvature:
    """What the evidence pass computed for one batch, for the structures to accumulate.

    Attributes:
        layers: Per hooked layer: its plan, recorded input ``a`` and output gradients ``g``
            ``(K, *output.shape)`` (one slice per column of the loss-Hessian factor).
        rows: Per-example rows ``L_nk^T J_n`` ``(B K, P_exact)`` of the parameters on the exact
            path, in the plan's order (``None`` if there are none).
    """

    layers: List[Tuple[LayerPlan, Tensor, Tensor]]
    rows: Optional[Tensor]


class RankOneJacobian(NamedTuple):
    """The Jacobian of an ``nn.Linear`` weight on inputs ``(B, in)``, ``(B, C, out, in)``, as its factors: per input
    and output, the output's gradient in the layer's output ``g[b, c]`` (the bias's Jacobian) times the layer's input
    ``a[b]`` (``J[b, c] = g[b, c] a[b]^T``). A Kronecker block's covariance takes it in ``B (C out^2 + in^2)``
    operations where the whole Jacobian takes ``B C out in (out + in)``.

    Attributes:
        g: ``(B, C, out)``.
        a: ``(B, in)``.
    """

    g: Tensor
    a: Tensor


Jacobian = Union[Tensor, RankOneJacobian]  # a tensor's output Jacobian as Structure.covariance takes it


class Structure:
    """Curvature of one structure over some of the prior's parameter tensors.

    Owns its whole life: declared statistics, accumulation from a batch, the decomposition cached
    once per estimate, ``log_det``, the posterior covariance and ``H_b^-1``. Parameters of different
    structures are independent blocks of ``H``.

    A class that a ``structure=`` option selects declares its :attr:`name` and capabilities below
    and is registered with :func:`.structures.register_structure`; the options, the plan, the
    bounds, the callbacks and ``rank_by`` read them there (:mod:`.structures` says what a new
    structure needs).

    Args:
        indices: Prior indices (positions in ``GaussianPrior.param_names``) of the tensors covered.
        sizes: Number of scalars of every prior tensor (all of them, in prior order).
    """

    #: The ``structure=`` value that selects this class; ``None`` for a block only another structure's plan uses.
    name: ClassVar[Optional[str]] = None
    #: Passes over the data the statistics need (EKFAC: the factors, then moments in their eigenbasis).
    passes: ClassVar[int] = 1
    #: Whether hooked layers may feed it (``False``: every parameter takes the exact per-example path).
    hook_path: ClassVar[bool] = True
    #: Whether it needs one prior precision per tensor (Kronecker blocks cannot hold a diagonal prior).
    per_tensor_prior: ClassVar[bool] = False
    #: Whether its statistics sum across processes (DDP) into the single-process ones.
    multi_process: ClassVar[bool] = True
    #: Whether ``statistics="training"`` (the empirical Fisher from the training backward) can feed it.
    training_statistics: ClassVar[bool] = False
    #: Whether ``EvidenceBound(bound="parametric")`` can take it (one read of each batch).
    parametric_bound: ClassVar[bool] = True
    #: Whether ``select_models(rank_by="<name>-<approx>")`` offers it.
    rank_by: ClassVar[bool] = True
    #: Whether its statistics split by layer across processes under sharded training (:mod:`.structures.sharded`:
    #: ``from_plan`` then takes ``exchange=``, and the class gives ``layer_states`` and ``layer_sums``).
    layer_owned: ClassVar[bool] = False
    #: A choice its plan made from the options, with the reason, for the record (``CurvatureStatistics.estimator``).
    note: str = ""

    def __init__(self, indices: Sequence[int], sizes: Sequence[int]) -> None:
        self.indices = list(indices)
        self.sizes = list(sizes)
        self._states: Dict[str, Tensor] = {}

    # --- the registered structure's plan ------------------------------------------------------

    @classmethod
    def check(cls, prior: "GaussianPrior", options: CurvatureOptions) -> None:
        """Refuse, before any data, a prior or options this structure cannot take (``check_model``).

        Raises:
            ValueError: For a diagonal prior where :attr:`per_tensor_prior` (the prior's message).
        """
        if cls.per_tensor_prior:
            prior.per_tensor(prior.log_precision)  # raises for a diagonal prior, with the explanation

    @classmethod
    def from_plan(
        cls, layers: List["LayerPlan"], exact: List[int], prior: "GaussianPrior", options: CurvatureOptions
    ) -> List["Structure"]:
        """The structures that cover every prior tensor for ``structure=cls.name``: the uniform
        constructor :func:`.plan.make_plan` calls once the paths are decided.

        Args:
            layers: Layers on the hook path (empty where :attr:`hook_path` is ``False``).
            exact: Prior indices on the exact path, in the order of ``BatchCurvature.rows``' columns.
            prior: The prior (its tensor sizes and structure).
            options: The curvature options (e.g. ``max_memory``).

        Returns:
            Disjoint structures covering every prior tensor once.
        """
        raise NotImplementedError(f"{cls.__name__} is not a registered structure: it has no plan of its own")

    def zeroed(self) -> "Structure":
        """A copy whose declared statistics are zero, sharing the layers and layout (new sums of the same plan)."""
        fresh = copy.copy(self)
        fresh._states = {name: torch.zeros_like(value) for name, value in self._states.items()}
        return fresh

    def diagonal(self) -> Dict[int, Tensor]:
        """The unit-scale curvature diagonal of every covered tensor, by prior index (float64, flat).

        Raises:
            NotImplementedError: For a structure that does not hold the exact diagonal.
        """
        raise NotImplementedError(f"{type(self).__name__} does not hold the curvature diagonal; use structure='diag'")

    # --- declared statistics ------------------------------------------------------------------

    def add_state(self, name: str, default: Tensor) -> None:
        """Declare a sum-reduced statistic (float64, or int64 for counts; float32 for a sharded share's
        factor sums, which the owner sums and never enter the flat reduction)."""
        if default.dtype not in (torch.float64, torch.float32, torch.int64):
            raise TypeError(f"State {name!r} must be float64, float32 or int64, got {default.dtype}.")
        self._states[name] = default

    def state(self, name: str) -> Tensor:
        return self._states[name]

    def add(self, name: str, value: Tensor) -> None:
        """Add one batch's contribution; it is summed in the state's dtype (float64 or int64)."""
        target = self._states[name]
        target += value.to(target.device, target.dtype)

    def states(self) -> Dict[str, Tensor]:
        return self._states

    def to(self, device: torch.device) -> "Structure":
        """Move the declared statistics to ``device`` (where the parameters live)."""
        self._states = {name: value.to(device) for name, value in self._states.items()}
        return self

    def reduce_extra(self, sum_fn: SumFn, gather_fn: GatherFn) -> None:
        """Reductions beyond the flat sum (the full structure's rows); nothing by default."""

    # --- the evidence ---------------------------------------------------------------------------

    def accumulate(self, batch: BatchCurvature) -> None:
        raise NotImplementedError

    def rescale(self, factor: float) -> None:
        """Multiply the curvature these sums describe by ``factor`` (a subsample's sums taken to the
        whole data). Only the EF structures of ``statistics="training"`` subsample.

        Raises:
            NotImplementedError: For a structure without it.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot rescale its sums")

    def start_pass(self, index: int) -> None:
        """Before pass ``index`` (from 1) over the data, for a structure with ``passes > 1``; its
        ``accumulate`` then sees that pass's batches (without the exact path's rows)."""

    def prepare(self) -> None:
        """Cache the decomposition every evaluation reuses (after the reduction)."""
        raise NotImplementedError

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        """``log|s C_b + diag(delta_b)|`` of this structure's block.

        Args:
            scale: Curvature scale ``s`` (0-dim).
            log_delta: Log prior precision of every prior tensor: 0-dim (one per tensor) or
                ``(numel,)`` (a diagonal prior).
        """
        raise NotImplementedError

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> "LogDetDerivatives":
        """:meth:`log_det` with its first and second derivatives in ``log s`` and the ``log_delta``
        (closed form from the cached decomposition; see :mod:`.structures.derivatives`)."""
        raise NotImplementedError

    def covariance(self, jacobians: List[Jacobian], scale: Tensor, delta: List[Tensor]) -> Tensor:
        """``sum_t J_t H_b^-1 J_t^T`` over the covered tensors; ``jacobians[t]`` is ``(B, C, numel_t)``, or a
        :class:`RankOneJacobian` where the tensor is an ``nn.Linear`` weight a ``KronStructure`` covers."""
        raise NotImplementedError

    def inverse(self, scale: Tensor, delta: List[Tensor]) -> InverseFn:
        """``H_b^-1`` of this structure's block as an operator, its decomposition computed once, here.

        The default is the dense ``P_b x P_b`` matrix :meth:`covariance` gives for identity Jacobians
        (for ``full``, the size of the Gram matrix it holds); a structure with a blockwise form of its
        inverse overrides it. It prepares the structure first (:meth:`prepare`): the operator may be
        wanted before the evidence's own preparation (as by :func:`~lightning_marglik.linearized_evidence`).

        Args:
            scale: Curvature scale ``s`` (0-dim).
            delta: Prior precision of every prior tensor: 0-dim (one per tensor) or ``(numel,)`` (a
                diagonal prior).

        Returns:
            The map from the covered tensors' flat pieces, in :attr:`indices` order, to ``H_b^-1``
            applied to their concatenation, split into pieces in the same order.
        """
        self.prepare()  # the decomposition covariance reads
        own = [self.sizes[i] for i in self.indices]
        identity = torch.eye(sum(own), dtype=torch.float64, device=delta[self.indices[0]].device)
        jacobians: List[Optional[Tensor]] = [None] * len(self.sizes)
        for i, columns in zip(self.indices, identity.split(own, dim=1)):
            jacobians[i] = columns.unsqueeze(0)
        dense = self.covariance(jacobians, scale, delta)[0]  # type: ignore[arg-type]
        return lambda pieces: list((dense @ torch.cat(pieces)).split(own))

    def reusing_decompositions(self) -> ContextManager[None]:
        """Inside, :meth:`inverse` at several precisions decomposes each factor once (the prior guard scores
        two); released on leaving. The default has nothing to reuse: its decomposition is :meth:`prepare`'s."""
        return contextlib.nullcontext()

    @staticmethod
    def _guard(matrix: Tensor) -> bool:
        """Whether ``matrix`` is finite (a decomposition of non-finite curvature would raise)."""
        return bool(torch.isfinite(matrix).all())


def with_notes(estimator: str, structures: Sequence["Structure"]) -> str:
    """The estimator's record followed by the structures' own choices (:attr:`Structure.note`), ``"; "``-separated."""
    return "; ".join([estimator] + [s.note for s in structures if s.note])


@dataclass
class CurvatureStatistics:
    """Everything the evidence needs from the data, as sums over examples.

    The curvature is taken at unit noise and temperature; the evidence rescales it.

    Attributes:
        options: The curvature options of the pass.
        names: Prior parameter names.
        structures: The structures covering the prior's tensors (disjoint).
        likelihood: The likelihood's summed statistics (float64; counts int64), with ``n_data``.
        slow: Modules on the exact per-example path, with the reason.
        estimator: Which GGN estimator ran and why (:func:`.estimator.resolve_mc_samples`), then the
            structures' own choices and their reasons (:attr:`Structure.note`), ``"; "``-separated.
    """

    options: CurvatureOptions
    names: List[str]
    structures: List[Structure]
    likelihood: Dict[str, Tensor] = field(default_factory=dict)
    slow: Dict[str, str] = field(default_factory=dict)
    estimator: str = ""

    @property
    def n_data(self) -> int:
        """Number of data terms: examples, or kept positions of sequence outputs."""
        return int(self.likelihood["n_data"]) if "n_data" in self.likelihood else 0

    def add_likelihood(self, stats: Dict[str, Tensor]) -> None:
        for key, value in stats.items():
            value = value.detach().cpu()
            value = value.to(torch.int64 if not value.is_floating_point() else torch.float64)
            self.likelihood[key] = self.likelihood[key] + value if key in self.likelihood else value

    def reduce(self, sum_fn: SumFn, gather_fn: GatherFn) -> "CurvatureStatistics":
        """Sum every declared statistic across processes in ONE collective (``sum_fn`` on a flat
        float64 vector; counts travel exactly up to 2^53), then the structures' extra reductions.

        Args:
            sum_fn: All-reduce (sum) of a 1-D float64 tensor.
            gather_fn: All-gather of a tensor with the same shape on every rank.

        Returns:
            ``self``, now holding the global sums.
        """
        entries = [(self.likelihood, k) for k in sorted(self.likelihood)]
        entries += [(s.states(), k) for s in self.structures for k in s.states()]
        flat = torch.cat([store[k].reshape(-1).to(torch.float64).cpu() for store, k in entries])
        total = sum_fn(flat).cpu()
        offset = 0
        for store, k in entries:
            old = store[k]
            n = old.numel()
            piece = total[offset : offset + n].reshape(old.shape)
            store[k] = piece.round().to(torch.int64) if old.dtype == torch.int64 else piece.to(old.device)
            offset += n
        for structure in self.structures:
            structure.reduce_extra(sum_fn, gather_fn)
        return self

    def prepare(self) -> None:
        for structure in self.structures:
            structure.prepare()
