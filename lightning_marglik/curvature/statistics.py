"""The sum-reduced statistics one curvature pass produces (ready to be all-reduced across ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor

STRUCTURES = ("full", "kron", "diag")


@dataclass
class KronLayer:
    """Where one layer's Kronecker blocks sit in the prior's parameter list.

    Attributes:
        name: Module name, for messages.
        weight: Index of the weight tensor in ``GaussianPrior.param_names``.
        bias: Index of the bias tensor, or ``None``.
    """

    name: str
    weight: int
    bias: Optional[int]


@dataclass
class CurvatureStatistics:
    """Everything the evidence needs from the data, as sums over examples.

    The curvature is taken at unit noise and temperature; the evidence rescales it. Every tensor in
    ``sums`` is a plain sum over examples, so statistics from several data shards (processes)
    combine by adding them; ``rows`` (the stacked ``L_n^T J_n`` of the full structure in its
    low-rank form) combine by concatenation.

    Attributes:
        structure: ``"full"``, ``"kron"`` or ``"diag"``.
        approx: ``"ggn"`` or ``"ef"``.
        n_params: Number of scalar parameters ``P`` covered by the prior.
        sums: ``n_data``, the likelihood's statistics (``lik.*``) and the curvature sums:
            ``diag`` (P,); ``kron.{j}.G``, ``kron.{j}.A``, ``kron.{j}.count`` per layer ``j``;
            ``gram`` (P, P) for the full structure.
        rows: Full structure only, while fewer rows than parameters were seen: ``(R, P)``.
        layers: Kronecker layout, one entry per layer.
    """

    structure: str
    approx: str
    n_params: int
    sums: Dict[str, Tensor] = field(default_factory=dict)
    rows: Optional[Tensor] = None
    layers: List[KronLayer] = field(default_factory=list)

    def add(self, key: str, value: Tensor) -> None:
        if key in self.sums:
            self.sums[key] += value
        else:
            self.sums[key] = value.clone()

    def add_rows(self, rows: Tensor) -> None:
        """Accumulate full-structure rows; switch to the ``P x P`` Gram sum once rows outnumber ``P``."""
        if "gram" in self.sums:
            self.add("gram", rows.T @ rows)
            return
        self.rows = rows if self.rows is None else torch.cat([self.rows, rows])
        if self.rows.shape[0] >= self.n_params:
            self.to_gram()

    def to_gram(self) -> None:
        """Replace the stored rows by their Gram matrix ``U^T U``."""
        if self.rows is not None:
            self.add("gram", self.rows.T @ self.rows)
            self.rows = None

    def likelihood_stats(self) -> Dict[str, Tensor]:
        return {k[len("lik."):]: v for k, v in self.sums.items() if k.startswith("lik.")}
