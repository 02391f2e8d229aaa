"""Layer-owned curvature for sharded training: each process keeps and decomposes its own layers only.

Under FSDP the weights are split across processes, but replicated curvature would hold every
layer's statistics on every process: a Kronecker factor pair is as large as its layer's weight,
in float64, so the estimate would need a whole model's worth of memory per rank, what FSDP
avoids. A :class:`ShardedStructure` covers the layers of a structure whose statistics split by
layer (:attr:`~..statistics.Structure.layer_owned`): every layer has one owning rank
(:func:`balanced_owners`); after each batch, each layer's sums of that batch are summed onto its
owner (an :class:`Exchange`), so a rank holds the running sums of its own layers and one layer's
batch sums at a time. Only the owner decomposes a layer. The log-determinant is a sum over
layers, so every evaluation sums the ranks' shares, its value and closed-form derivatives in one
all-reduce of ``3 + 3T`` numbers (``T``: the prior tensors covered).

Ranks may hold different numbers of batches (the evidence data split without padding), so each
batch begins with a round in which the ranks agree whether any still sends and whether any
failed; a rank that has run out sends zeros while another sends (:meth:`Exchange.finish`), and a
failure on one rank ends the exchange on all, so that none waits for a partner. After the pass
every evaluation is a collective: all ranks evaluate alike (the solvers do: their decisions follow
the summed values). The posterior covariance needs every layer in one process and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor

from ..statistics import BatchCurvature, InverseFn, LayerPlan, ReduceFn, Structure, SumFn
from .derivatives import LogDetDerivatives

if TYPE_CHECKING:
    from .kron import KronStructure

__all__ = ["Exchange", "ShardedStructure", "balanced_owners"]

_WHOLE = (
    "needs every layer's curvature in one process, but under sharded training (FSDP) each rank holds only the "
    "layers it owns: load a checkpoint of the fit into a plain module and build the evidence there "
    "(LaplaceEvidence.fit), or evaluate it with MargLikCallback.evidence_with(..., structure='diag')"
)
_ELSEWHERE = "The evidence pass failed on another process; see that process's error."


def balanced_owners(costs: Sequence[int], world_size: int) -> List[int]:
    """The owning rank of each item: the largest first, each to the least loaded rank (ties: the lower
    rank); a function of ``costs`` only, so every rank computes the same owners.

    Example:
        >>> balanced_owners([4, 4, 4, 2], 2)
        [0, 1, 0, 1]
    """
    loads = [0] * world_size
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += costs[j]
    return owners


@dataclass
class Exchange:
    """The collectives of a sharded evidence pass, given by its caller (the callbacks: the trainer's strategy).

    One per pass: the agreement rounds end it (:meth:`finish`).

    Attributes:
        rank: This process's global rank.
        world_size: Number of processes.
        reduce: Sum a tensor of every rank into rank ``dst``'s, in place there.
        sum: All-reduce (sum) of a 1-D float64 tensor; returns the sum.
    """

    rank: int
    world_size: int
    reduce: ReduceFn
    sum: SumFn
    closed: bool = field(default=False, init=False)  # set once a round ended the exchange on every rank

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"Exchange(world_size={self.world_size!r}): the number of processes, an int >= 1.")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"Exchange(rank={self.rank!r}): this process's rank, an int in [0, {self.world_size}).")
        if not (callable(self.reduce) and callable(self.sum)):
            raise TypeError("Exchange(reduce=..., sum=...) take the collectives as callables.")

    def round(self, sending: bool, failed: bool = False) -> bool:
        """One agreement round: whether any rank sends a batch now.

        Raises:
            RuntimeError: If another rank's pass failed (every rank learns it in the same round).
        """
        flags = self.sum(torch.tensor([float(sending), float(failed)], dtype=torch.float64))
        if float(flags[1]) > 0:
            self.closed = True
            if not failed:
                raise RuntimeError(_ELSEWHERE)
        return float(flags[0]) > 0

    def finish(self, structure: Optional["ShardedStructure"], failed: bool) -> None:
        """End the pass on this rank: send zeros while another rank still sends, or tell every rank of this
        rank's failure; nothing if a round already ended the exchange. Every rank calls it once after its pass.

        Raises:
            RuntimeError: If another rank's pass failed.
        """
        while not self.closed:
            if not self.round(False, failed) or failed:
                self.closed = True
            else:
                assert structure is not None  # a rank sends only what every rank planned alike
                structure.send_zeros()


class ShardedStructure(Structure):
    """The layers of a layer-owned structure, each summed onto its owning rank, the log-determinant summed
    across ranks.

    Args:
        cls: The layer-owned structure class (``KronStructure``): its ``layer_states``, ``layer_sums`` and
            its constructor over the layers this rank owns.
        layers: Every layer the structure covers, alike on every rank.
        sizes: Sizes of all prior tensors.
        exchange: The pass's collectives.
        max_output_factor: The class's limit above which a layer holds a diagonal output-side factor.
    """

    def __init__(self, cls: Type["KronStructure"], layers: List[LayerPlan], sizes: Sequence[int],
                 exchange: Exchange, max_output_factor: Optional[int] = None) -> None:
        super().__init__(sorted(i for layer in layers for i in layer.roles.values()), sizes)  # no states of its own
        self.cls, self.layers, self.exchange = cls, layers, exchange
        self.max_output_factor = max_output_factor
        # a float32 model's factors summed in float32: a rank's owned factors and the layer in flight take half the
        # memory of float64 (decomposed in float64 at prepare; the evidence moves by under 1e-4 relative,
        # tests/test_distributed_sharded.py); a float64 model keeps float64 sums
        float64 = any(p.dtype == torch.float64 for layer in layers for p in layer.module.parameters())
        self.sum_dtype = torch.float64 if float64 else torch.float32
        self.states_of = [cls.layer_states(layer, max_output_factor, self.sum_dtype) for layer in layers]
        costs = [sum(torch.Size(shape).numel() for shape, _ in states.values()) for states in self.states_of]
        self.owners = balanced_owners(costs, exchange.world_size)
        mine = [j for j, owner in enumerate(self.owners) if owner == exchange.rank]
        self._position = {j: k for k, j in enumerate(mine)}  # a layer's place in this rank's share
        self.share = cls(sorted(i for j in mine for i in layers[j].roles.values()), sizes, [layers[j] for j in mine],
                         max_output_factor, self.sum_dtype)
        self._device: Optional[torch.device] = None
        self._prepared = False

    def to(self, device: torch.device) -> "ShardedStructure":
        self._device = torch.device(device)
        self.share.to(device)
        return self

    def accumulate(self, batch: BatchCurvature) -> None:
        self.exchange.round(True)
        recorded = {layer.name: (a, g) for layer, a, g in batch.layers}
        sent = 0
        try:
            for j, layer in enumerate(self.layers):
                self._send(j, self.cls.layer_sums(layer, *recorded[layer.name], self.max_output_factor))
                sent += 1
        except Exception:
            for j in range(sent, len(self.layers)):  # complete the round, so that no rank waits for this one
                self._send(j, None)
            raise

    def send_zeros(self) -> None:
        """This rank's part of a round in which it has no batch: zeros for every layer."""
        for j in range(len(self.layers)):
            self._send(j, None)

    def _send(self, j: int, sums: Optional[Dict[str, Tensor]]) -> None:
        """Sum layer ``j``'s batch statistics (zeros for ``None``) onto its owner, which adds them to its share."""
        total: Dict[str, Tensor] = {}
        for key, (shape, dtype) in self.states_of[j].items():
            tensor = (torch.zeros(shape, dtype=dtype, device=self._device) if sums is None  # the batch's own freed:
                      else sums.pop(key).to(self._device or "cpu", dtype))  # one copy at a time
            self.exchange.reduce(tensor, self.owners[j])
            total[key] = tensor
        if j in self._position:
            self.share.add_layer(self._position[j], total)

    def prepare(self) -> None:
        """Decompose this rank's layers once, then free their sums: the evidence reads the eigenvalues only
        (the covariance, which would read the factors, is refused here)."""
        if not self._prepared:
            self.share.prepare(release=True)
            self._prepared = True

    def rescale(self, factor: float) -> None:
        if self._prepared:
            raise RuntimeError("A sharded structure's sums are freed once the evidence is built: rescale them before.")
        self.share.rescale(factor)

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        return _SummedLogDet.apply(self, scale, *log_delta)

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        own = self.share.log_det_derivatives(scale, log_delta)
        zero = scale.new_zeros(())
        stores = (own.rho, own.rho_u, own.rho_rho)
        per_tensor = (store.get(t, zero).reshape(()) for store in stores for t in self.indices)
        flat = torch.stack([own.value, own.u, own.uu, *per_tensor])
        total = self.exchange.sum(flat.detach()).to(flat)
        n = len(self.indices)
        rho, rho_u, rho_rho = (dict(zip(self.indices, total[3 + k * n : 3 + (k + 1) * n].unbind())) for k in range(3))
        return LogDetDerivatives(total[0], total[1], total[2], rho, rho_u, rho_rho)

    def covariance(self, jacobians: List[Tensor], scale: Tensor, delta: List[Tensor]) -> Tensor:
        raise RuntimeError(f"The posterior covariance {_WHOLE}.")

    def inverse(self, scale: Tensor, delta: List[Tensor]) -> InverseFn:
        raise RuntimeError(f"The posterior precision's inverse {_WHOLE}.")


class _SummedLogDet(torch.autograd.Function):
    """The summed log-determinant of a :class:`ShardedStructure`, differentiable once in ``scale`` and the
    ``log_delta``: its gradient is the summed closed form, taken in the same collective as the value. Second
    derivatives come from :meth:`ShardedStructure.log_det_derivatives` (Newton's closed form); a graph for them
    through this function is refused, since its gradient is a constant there."""

    @staticmethod
    def forward(ctx: Any, structure: ShardedStructure, scale: Tensor, *log_delta: Tensor) -> Tensor:
        parts = structure.log_det_derivatives(scale.detach(), [d.detach() for d in log_delta])
        ctx.scale_grad = parts.u / scale.detach()  # d/ds = (d/du) / s with u = log s
        ctx.rho = parts.rho
        ctx.shapes = [d.shape for d in log_delta]
        return parts.value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        if torch.is_grad_enabled():  # create_graph=True: the next derivative would silently miss this term
            raise RuntimeError(
                "The log-determinant of a sharded structure (FSDP) is differentiable once: take its second "
                "derivatives in closed form (LaplaceEvidence.optimize(solver='newton')), not by autograd."
            )
        rho = [grad * ctx.rho[t].reshape(shape) if t in ctx.rho else None for t, shape in enumerate(ctx.shapes)]
        return (None, grad * ctx.scale_grad, *rho)
