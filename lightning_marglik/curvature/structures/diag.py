"""The exact diagonal of the curvature: ``structure="diag"``, and the diagonal blocks of ``kron``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..layers import layer_diagonal
from ..options import CurvatureOptions
from ..statistics import BatchCurvature, InverseFn, LayerPlan, Structure

if TYPE_CHECKING:
    from ...hyperparameters import GaussianPrior
from .derivatives import LogDetDerivatives, separable_terms

__all__ = ["DiagStructure"]


class DiagStructure(Structure):
    """``diag(C)`` over its tensors: hooked layers' diagonals and the exact path's squared rows.

    Args:
        indices: Prior indices of the covered tensors.
        sizes: Sizes of all prior tensors.
        layers: Hooked layers whose (covered) parameters this structure takes.
        exact: Prior indices on the exact path, in the order of the columns of ``BatchCurvature.rows``.
    """

    name = "diag"
    training_statistics = True  # the layers' diagonals from the training gradients, rescalable

    def __init__(self, indices: Sequence[int], sizes: Sequence[int], layers: List[LayerPlan], exact: List[int]) -> None:
        super().__init__(indices, sizes)
        self.layers = [layer for layer in layers if any(i in self.indices for i in layer.roles.values())]
        self.exact = list(exact)
        self.offsets: Dict[int, Tuple[int, int]] = {}
        start = 0
        for i in self.indices:
            self.offsets[i] = (start, start + self.sizes[i])
            start += self.sizes[i]
        self.add_state("diag", torch.zeros(start, dtype=torch.float64))

    @classmethod
    def from_plan(
        cls, layers: List[LayerPlan], exact: List[int], prior: "GaussianPrior", options: CurvatureOptions
    ) -> List[Structure]:
        return [cls(range(len(prior.param_sizes)), prior.param_sizes, layers, exact)]

    def _add_slice(self, index: int, value: Tensor) -> None:
        lo, hi = self.offsets[index]
        self.state("diag")[lo:hi] += value.reshape(-1).to(torch.float64)

    def accumulate(self, batch: BatchCurvature) -> None:
        names = {layer.name for layer in self.layers}
        for layer, a, g in batch.layers:
            if layer.name not in names:
                continue
            diag = layer_diagonal(layer.module, a, g)
            for role, index in layer.roles.items():
                if index in self.offsets:
                    self._add_slice(index, diag[role])
        if batch.rows is not None and self.exact:
            squares = batch.rows.pow(2).sum(0)
            for index, value in zip(self.exact, torch.split(squares, [self.sizes[i] for i in self.exact])):
                self._add_slice(index, value)

    def rescale(self, factor: float) -> None:
        self.state("diag").mul_(factor)

    def diagonal(self) -> Dict[int, Tensor]:
        return {i: self.state("diag")[lo:hi] for i, (lo, hi) in self.offsets.items()}

    def prepare(self) -> None:
        self._blocks = self.diagonal()

    def inverse(self, scale: Tensor, delta: List[Tensor]) -> InverseFn:
        """``H_b^-1`` elementwise: ``1 / (s c + delta)`` per covered tensor.

        Args:
            scale: Curvature scale ``s`` (0-dim).
            delta: Prior precision of every prior tensor: 0-dim or ``(numel,)`` (a diagonal prior).

        Returns:
            The map from the covered tensors' flat pieces, in :attr:`indices` order, to ``H_b^-1``
            applied to them, in the same order.
        """
        diagonal = self.diagonal()
        inverses = [1 / (scale * diagonal[i] + delta[i]) for i in self.indices]
        return lambda pieces: [piece * inverse for piece, inverse in zip(pieces, inverses)]

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        terms = [torch.log(scale * c + log_delta[i].exp()).sum() for i, c in self._blocks.items()]
        return torch.stack(terms).sum()

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        out = LogDetDerivatives.zero(scale)
        for i, c in self._blocks.items():
            out.add_terms(i, *separable_terms(scale * c, log_delta[i]))
        return out

    def covariance(self, jacobians: List[Tensor], scale: Tensor, delta: List[Tensor]) -> Tensor:
        cov = 0
        for i, c in self._blocks.items():
            variance = 1 / (scale * c + delta[i])
            cov = cov + torch.einsum("bcp,p,bdp->bcd", jacobians[i], variance.expand(c.shape), jacobians[i])
        return cov
