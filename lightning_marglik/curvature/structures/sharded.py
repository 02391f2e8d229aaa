"""Layer-owned curvature for sharded training: each process keeps and decomposes its own layers only.

Under FSDP the weights are split across processes, but replicated curvature would hold every
layer's statistics on every process: a Kronecker factor pair is as large as its layer's weight,
in float64, so the estimate would need a whole model's worth of memory per rank, what FSDP
avoids. A :class:`ShardedStructure` covers the layers of a structure whose statistics split by
layer (:attr:`~..statistics.Structure.layer_owned`): every layer has one owning rank; after each batch,
each layer's sums of that batch are summed onto its owner, so a rank holds the running sums of its own layers
and one layer's batch sums at a time, in float32 for a float32 model (half of float64's memory). Only the owner
decomposes a layer, in float64, one factor at a time, and frees its sums. The log-determinant is a sum over
layers, so every evaluation sums the ranks' shares, its value and closed-form derivatives in one
all-reduce of ``3 + 3T`` numbers (``T``: the prior tensors covered). The protocol between the ranks (the
owners, the agreement rounds, the reduce onto owners, a failure on one rank) is :mod:`..exchange`'s. After the
pass every evaluation is a collective: all ranks evaluate alike (the solvers do: their decisions follow
the summed values). The posterior covariance needs every layer in one process and is refused.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor

from ..exchange import Exchange, balanced_owners
from ..statistics import BatchCurvature, InverseFn, LayerPlan, Structure
from .derivatives import LogDetDerivatives

__all__ = ["ShardedStructure"]

_WHOLE = (
    "needs every layer's curvature in one process, but under sharded training (FSDP) each rank holds only the "
    "layers it owns: load a checkpoint of the fit into a plain module and build the evidence there "
    "(LaplaceEvidence.fit), or evaluate it with MargLikCallback.evidence_with(..., structure='diag')"
)


class ShardedStructure(Structure):
    """The layers of a layer-owned structure, each summed onto its owning rank, the log-determinant summed
    across ranks.

    Args:
        cls: The layer-owned structure class (:attr:`~..statistics.Structure.layer_owned`: ``KronStructure``): its
            ``layer_states``, ``layer_sums`` and its constructor over the layers this rank owns.
        layers: Every layer the structure covers, alike on every rank.
        sizes: Sizes of all prior tensors.
        exchange: The pass's collectives.
        max_output_factor: The class's limit above which a layer holds a diagonal output-side factor.
    """

    def __init__(self, cls: Type[Any], layers: List[LayerPlan], sizes: Sequence[int],
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
        exchange.send_zeros = self.send_zeros  # a rank that has run out of batches sends zeros while others send

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
