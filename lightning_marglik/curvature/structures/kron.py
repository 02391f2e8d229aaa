"""Kronecker-factored curvature per layer (paper Eq. 9, no damping), expand convention.

A Linear/Conv weight block is ``kron(G, A)`` (``G`` output side, ``A`` input side, one pair per
conv group), an Embedding weight block ``kron(A, G)`` with a diagonal ``A`` (token counts), a
bias block ``G``. ``log|s kron(G, A) + delta I| = sum_ij log(s q_i w_j + delta)`` from the
eigenvalues ``q``, ``w`` of the factors, cached once per estimate.

A layer with more outputs than ``CurvatureOptions.max_output_factor`` holds ``diag(G)`` in place of
``G`` (decided per layer before the pass, :attr:`KronStructure.diagonal`): ``out`` sums instead of
``out^2`` and no eigendecomposition, which at 10,000 classes (800 MB in float64, about 10^12
flops) would cost more than the rest of the estimate. Its block is ``kron(diag(G), A)``: the
eigenvalues ``q`` are ``G``'s diagonal entries and its eigenbasis ``U_G`` the identity, so the
log-determinant, its derivatives, ``H^-1`` and the covariance keep their forms with ``U_G = I``.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..exchange import Exchange
from ..layers import FactorMasks, KronShape, is_kron_layer, kron_masks, layer_kron, layer_rule
from ..rule_checks import check_kron_rule
from ..options import CurvatureOptions
from ..statistics import BatchCurvature, InverseFn, Jacobian, LayerPlan, RankOneJacobian, Structure
from .derivatives import LogDetDerivatives, separable_terms
from .diag import DiagStructure
from .sharded import ShardedStructure

if TYPE_CHECKING:
    from ...hyperparameters import GaussianPrior

__all__ = ["KronStructure"]

_TERMS = 1 << 20  # eigenvalue products a log-determinant evaluation forms at a time (8 MiB each array)


class _Products(NamedTuple):
    """The products ``q_i w_j`` of two factors' eigenvalues per matrix, held as the factors' ``(matrices, rows)`` and
    ``(matrices, columns)`` eigenvalues: formed whole they are as many as the weights (a 10,000-class head's: 41 MB
    in float64)."""

    q: Tensor
    w: Tensor


# a Kronecker-type block's left and right eigenbases (None: the identity) and its unit-scale eigenvalues, each a
# stack over the matrices the tensor is viewed as (_view): an array, or a Kronecker factor's products
Bases = Tuple[Optional[Tensor], Optional[Tensor], Union[Tensor, _Products]]


def _rows(values: Union[Tensor, _Products], start: int = 0, stop: Optional[int] = None) -> Tensor:
    """Rows ``start:stop`` of every matrix's unit-scale eigenvalues (a Kronecker factor's products formed here)."""
    if isinstance(values, _Products):
        return values.q[:, start:stop, None] * values.w[:, None, :]
    return values[:, start:stop]


def _eigvalsh(matrix: Tensor) -> Tensor:
    """Clamped eigenvalues; NaN where the curvature is not finite (the evidence reports it). A
    diagonal factor, held as the vector of its entries, is its own eigenvalues.

    A factor is a sum of outer products, so a zero diagonal entry means a zero row and column
    (an input feature that is zero in every row: the padding taps of a convolution on a map
    smaller than its kernel, e.g. resnet18's last stage at 1x1 on 32x32 inputs; a dead unit).
    Those contribute exact zero eigenvalues; the eigen-solve runs on the rest only, which cuts
    resnet18's 4608-wide factors to 512.
    """
    matrix = matrix.to(torch.float64)  # float32 sums (a sharded share's) are decomposed in float64 all the same
    if not Structure._guard(matrix):
        return torch.full(matrix.shape[:1], float("nan"), dtype=matrix.dtype, device=matrix.device)
    if matrix.dim() == 1:
        return matrix
    used = torch.diagonal(matrix) != 0
    if bool(used.all()):
        return torch.linalg.eigvalsh(matrix).clamp(min=0)
    values = torch.linalg.eigvalsh(matrix[used][:, used]).clamp(min=0)
    return torch.cat([values.new_zeros(int((~used).sum())), values])


def _eigh(matrix: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """Clamped eigenvalues and eigenvectors; a diagonal factor's (a vector): its entries and ``None`` (the identity)."""
    matrix = matrix.to(torch.float64)
    if matrix.dim() == 1:
        return matrix.clamp(min=0), None
    values, vectors = torch.linalg.eigh(matrix)
    return values.clamp(min=0), vectors


def _rotate(x: Tensor, basis: Optional[Tensor]) -> Tensor:
    """``x @ basis`` in ``x``'s dtype; ``x`` itself for the identity (``None``)."""
    return x if basis is None else x @ basis.to(x.dtype)


def _diagonal_output(shape: KronShape, max_output_factor: Optional[int]) -> bool:
    """Whether a layer of ``shape`` holds only the diagonal of its output-side factor."""
    return max_output_factor is not None and shape.out > max_output_factor


def _diagonal_note(structure: str, layers: List[LayerPlan], max_output_factor: Optional[int]) -> str:
    """The record of which layers hold ``diag(G)``, and why ("" where none does)."""
    outputs = [(layer.name, layer_rule(layer.module).kron_shape(layer.module)) for layer in layers]
    wide = [(name, shape.out) for name, shape in outputs if _diagonal_output(shape, max_output_factor)]
    if not wide:
        return ""
    largest = max(out for _, out in wide)
    named = ", ".join(f"'{name}' ({out:,} outputs)" for name, out in wide)
    return (f"{structure}: the diagonal of the output-side Kronecker factor of {named}, more outputs than "
            f"max_output_factor={max_output_factor} (an exact {largest:,} x {largest:,} factor takes "
            f"{8 * largest ** 2 / 1e6:,.0f} MB in float64 and an eigendecomposition of about {largest:,}^3 flops)")


def _stacked(bases: List[Optional[Tensor]]) -> Optional[Tensor]:
    """The bases of a tensor's matrices as one stack; ``None`` (the identity) where they are the identity."""
    return None if bases[0] is None else torch.stack(bases)  # type: ignore[arg-type]


def _nonzero_products(q: Tensor, w: Tensor) -> Tuple[Tensor, Tensor, int]:
    """The non-zero eigenvalues of two factors and the number of zero products among ``q_i w_j``:
    each zero product is a term ``log(0 + delta)``, summed in closed form instead of over a
    ``len(q) x len(w)`` outer product (most of it for a factor with many zero rows, see ``_eigvalsh``).
    NaN eigenvalues are kept, so a non-finite curvature still gives a NaN log-determinant."""
    q_kept, w_kept = q[q != 0], w[w != 0]
    return q_kept, w_kept, q.numel() * w.numel() - q_kept.numel() * w_kept.numel()


def _view(shape: KronShape, role: str) -> Tuple[Tuple[int, int, int], bool]:
    """A layer's tensor as the stack of matrices its block acts on, and whether it is stored transposed."""
    if role == "bias":
        return (1, shape.out, 1), False
    if shape.diagonal_input or shape.transposed:  # stored (in, out): an Embedding's kron(A, G) acts on it as it is,
        return (1, shape.inp, shape.out), not shape.diagonal_input  # an HF Conv1D's kron(G, A) on its transpose
    return (shape.groups, shape.out // shape.groups, shape.inp), False  # (out, in) per conv group


def _rotated_inverse(view: Tuple[int, int, int], transposed: bool, bases: Bases, scale: Tensor,
                     delta: Tensor) -> Callable[[Tensor], Tensor]:
    """``H^-1`` of a tensor whose block is diagonal in the basis ``L (x) R``: per matrix ``X`` of its
    ``view`` (``transposed``: the tensor stores ``X^T``), ``L ((L^T X R) / (s E + delta)) R^T``."""
    left, right, values = bases
    if left is None and not transposed:
        return _row_wise_inverse(view, right, values, scale, delta)
    inverse = 1 / (scale * _rows(values) + delta)

    def apply(vector: Tensor) -> Tensor:
        x = vector.reshape(view)
        x = x.transpose(1, 2) if transposed else x
        x = left.transpose(1, 2) @ x if left is not None else x
        x = (x @ right if right is not None else x) * inverse
        x = left @ x if left is not None else x
        x = x @ right.transpose(1, 2) if right is not None else x
        return (x.transpose(1, 2) if transposed else x).reshape(-1)

    return apply


def _row_wise_inverse(view: Tuple[int, int, int], right: Optional[Tensor], values: Union[Tensor, _Products],
                      scale: Tensor, delta: Tensor) -> Callable[[Tensor], Tensor]:
    """:func:`_rotated_inverse` where the left basis is the identity (a diagonal output factor, an Embedding's
    ``I (x) U_G``): the matrices' rows are independent, so they are solved a few at a time into the result, with
    no other array of the tensor's size (the whole-matrix form holds four more: 41 MB each for a 10,000-class head
    on 512 features, in float64)."""
    rows = max(1, _TERMS // view[2])

    def apply(vector: Tensor) -> Tensor:
        x = vector.reshape(view)
        out = torch.empty_like(x)
        for start in range(0, view[1], rows):
            piece, inverse = x[:, start:start + rows], 1 / (scale * _rows(values, start, start + rows) + delta)
            out[:, start:start + rows] = piece * inverse if right is None else (piece @ right) * inverse @ right.mT
        return out.reshape(-1)

    return apply


def _products(q: Tensor, w: Tensor, scale: Tensor) -> Iterator[Tensor]:
    """The products ``s q_i w_j`` in pieces of at most :data:`_TERMS`: each of an evaluation's arrays over them
    is as large as the layer's weight in float64 (a 50,000-class head on 512 features: 200 MB each)."""
    for piece in q.split(max(1, _TERMS // max(w.numel(), 1))):
        yield torch.outer(scale * piece, w)


def _add_zero_terms(out: LogDetDerivatives, index: int, zeros: int, log_delta: Tensor) -> None:
    """``zeros`` terms ``log delta``: derivative 1 in ``log delta`` each, no curvature, no ``s``."""
    if zeros:
        out.add_terms(index, zeros * log_delta, log_delta.new_tensor(float(zeros)), log_delta.new_zeros(()), zeros)


class KronStructure(Structure):
    """Kronecker blocks of hooked Linear, Conv1d, Conv2d and Embedding layers.

    A layer pruned by ``torch.nn.utils.prune`` sums the same factors as the un-pruned layer; the
    blocks of its pruned tensors take them scaled by the masks (:func:`..layers.kron_masks`).

    Args:
        indices: Prior indices of the covered tensors (the layers' trainable weights and biases).
        sizes: Sizes of all prior tensors.
        layers: The layers, each with the prior index of its covered parameters by role.
        max_output_factor: A layer with more outputs holds only the diagonal of its output-side
            factor (:attr:`diagonal`); ``None``: every factor exact.
        sum_dtype: The dtype the factors are summed in. float32 halves their memory (a sharded
            share's, :class:`.ShardedStructure`); each layer's are decomposed in float64 all the same.
    """

    name = "kron"
    per_tensor_prior = True
    training_statistics = True  # the factors from the training gradients, rescalable
    layer_owned = True

    def __init__(self, indices: Sequence[int], sizes: Sequence[int], layers: List[LayerPlan],
                 max_output_factor: Optional[int] = None, sum_dtype: torch.dtype = torch.float64) -> None:
        super().__init__(indices, sizes)
        self._reused: Optional[Dict[int, Dict[str, Bases]]] = None  # reusing_decompositions's eigenbases
        self.layers = layers
        self.max_output_factor = max_output_factor
        self.shapes = [layer_rule(layer.module).kron_shape(layer.module) for layer in layers]
        #: Per layer: whether it holds ``diag(G)`` (a vector) in place of ``G``.
        self.diagonal = [_diagonal_output(shape, max_output_factor) for shape in self.shapes]
        self.masks: List[Dict[str, FactorMasks]] = [kron_masks(layer.module) for layer in layers]  # as planned
        for j, layer in enumerate(layers):
            for key, (shape, dtype) in self.layer_states(layer, max_output_factor, sum_dtype).items():
                self.add_state(f"{j}.{key}", torch.zeros(shape, dtype=dtype))

    @staticmethod
    def layer_states(layer: LayerPlan, max_output_factor: Optional[int] = None, sum_dtype: torch.dtype = torch.float64
                     ) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each statistic of ``layer``: ``G`` (``out x out``, or ``(out,)`` above
        ``max_output_factor`` outputs), ``A`` (per conv group ``in x in``, or ``(in,)`` where diagonal), both in
        ``sum_dtype``, and the number of rows ``A`` is summed over."""
        shape = layer_rule(layer.module).kron_shape(layer.module)
        d = shape.inp
        a = (d,) if shape.diagonal_input else (shape.groups, d, d)
        g = (shape.out,) if _diagonal_output(shape, max_output_factor) else (shape.out, shape.out)
        return {"g": (g, sum_dtype), "a": (a, sum_dtype), "rows": ((), torch.int64)}

    @staticmethod
    def layer_sums(layer: LayerPlan, a: Tensor, g: Tensor, max_output_factor: Optional[int] = None
                   ) -> Dict[str, Tensor]:
        """One batch's statistics of ``layer`` from its recorded input ``a`` and output gradients ``g``
        (as :meth:`layer_states` lays them out)."""
        module = layer.module
        diagonal = _diagonal_output(layer_rule(module).kron_shape(module), max_output_factor)
        sums = layer_kron(module, a, g, diagonal)
        return {"g": sums.g, "a": sums.a, "rows": sums.rows}

    @classmethod
    def from_plan(
        cls, layers: List[LayerPlan], exact: List[int], prior: "GaussianPrior", options: CurvatureOptions,
        exchange: Optional[Exchange] = None,
    ) -> List[Structure]:
        """Kronecker blocks for the hooked layers whose rule has Kronecker factors (each layer's kept by
        its owning process where an ``exchange`` is given: :class:`.ShardedStructure`), an exact diagonal
        block (:class:`.DiagStructure`) for every other parameter.

        Raises:
            ValueError: For a registered rule with ``kron = True`` but no ``kron_shape`` or ``kron_sums``.
        """
        sizes = prior.param_sizes
        kron = [layer for layer in layers if is_kron_layer(layer.module)]
        for layer in kron:  # a registered rule's kron_shape is called from here on
            check_kron_rule(layer.name, layer.module)
        kron_indices = sorted(i for layer in kron for i in layer.roles.values())
        rest = [i for i in range(len(sizes)) if i not in set(kron_indices)]
        structures: List[Structure] = []
        if kron:
            limit = options.max_output_factor
            structures.append(cls(kron_indices, sizes, kron, limit) if exchange is None
                              else ShardedStructure(cls, kron, sizes, exchange, limit))
            structures[-1].note = _diagonal_note(cls.name or cls.__name__, kron, limit)
        if rest:
            others = [layer for layer in layers if not is_kron_layer(layer.module)]
            structures.append(DiagStructure(rest, sizes, others, exact))
        return structures

    def accumulate(self, batch: BatchCurvature) -> None:
        position = {layer.name: j for j, layer in enumerate(self.layers)}
        for layer, a, g in batch.layers:
            j = position.get(layer.name)
            if j is not None:
                self.add_layer(j, self.layer_sums(layer, a, g, self.max_output_factor))

    def add_layer(self, j: int, sums: Dict[str, Tensor]) -> None:
        """Add one batch's statistics of layer ``j`` (:meth:`layer_sums`)."""
        for key, value in sums.items():
            self.add(f"{j}.{key}", value)

    def rescale(self, factor: float) -> None:
        # the block is G kron (A / rows): A and the row count are a mean, G carries the sum
        for j in range(len(self.layers)):
            self.state(f"{j}.g").mul_(factor)

    def _factors(self, j: int, role: str = "weight") -> Tuple[Tensor, Tensor]:
        """``G`` and the input factor ``A`` of layer ``j`` as the block of its ``role`` takes them
        (:meth:`_output_factor`, :meth:`_input_factor`)."""
        return self._output_factor(j, role), self._input_factor(j, role)

    def _output_factor(self, j: int, role: str = "weight") -> Tensor:
        """``G`` of layer ``j`` as the block of its ``role`` takes it: a pruned tensor's scaled by its masks,
        ``D_r G D_r``; else the summed state itself (the same tensor for the weight and the bias, whose
        eigen-decomposition they then share). A diagonal ``G`` (:attr:`diagonal`) is the vector of its entries."""
        g = self.state(f"{j}.g")
        out_mask = self.masks[j].get(role, (None, None))[0]
        if out_mask is not None:
            g = g * (out_mask.pow(2) if g.dim() == 1 else torch.outer(out_mask, out_mask)).to(g)
        return g

    def _input_factor(self, j: int, role: str = "weight") -> Tensor:
        """``A`` of layer ``j`` (the mean over rows, float64) as the block of its ``role`` takes it: a pruned
        tensor's scaled by its masks, ``D_c A D_c``."""
        rows = max(int(self.state(f"{j}.rows")), 1)
        a = self.state(f"{j}.a").to(torch.float64, copy=True).div_(rows)
        in_mask = self.masks[j].get(role, (None, None))[1]
        if in_mask is not None:
            a = a * torch.outer(in_mask, in_mask).to(a)
        return a

    def _group_blocks(self, j: int, g: Tensor) -> List[Tensor]:
        """The output-side factor of every conv group: diagonal sub-blocks of ``G`` (pieces of a diagonal one)."""
        groups = self.shapes[j].groups
        size = g.shape[0] // groups
        pieces = [slice(k * size, (k + 1) * size) for k in range(groups)]
        return [g[piece] if g.dim() == 1 else g[piece, piece] for piece in pieces]

    def prepare(self, release: bool = False) -> None:
        """Cache each layer's eigenvalues, decomposed in float64 whatever dtype summed its factors.

        Args:
            release: Free each layer's sums once decomposed, so that a float32 share holds at most one
                layer in float64 (the sharded share: its evidence reads eigenvalues only).
        """
        self._weight: List[List[Tuple[Tensor, Tensor, int]]] = []
        self._bias: List[Optional[Tuple[Tensor, int]]] = []
        for j, layer in enumerate(self.layers):
            g, g_bias = self._output_factor(j), self._output_factor(j, "bias")
            blocks = self._group_blocks(j, g)
            q_full = _eigvalsh(g)
            q_bias = q_full if g_bias is g else _eigvalsh(g_bias)
            del g, g_bias
            a = self._input_factor(j)  # once G is decomposed: one float64 factor at a time
            if self.shapes[j].diagonal_input:
                pairs = [(q_full, a if Structure._guard(a) else a * float("nan"))]
            elif len(blocks) == 1:  # one group: the weight's output factor is G itself
                pairs = [(q_full, _eigvalsh(a[0]))]
            else:
                pairs = [(_eigvalsh(gk), _eigvalsh(ak)) for gk, ak in zip(blocks, a)]
            self._weight.append([_nonzero_products(q, w) for q, w in pairs] if "weight" in layer.roles else [])
            nonzero = q_bias[q_bias != 0]
            self._bias.append((nonzero, q_bias.numel() - nonzero.numel()) if "bias" in layer.roles else None)
            if release:
                del a, blocks
                for key in ("g", "a", "rows"):
                    del self._states[f"{j}.{key}"]

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        total = scale.new_zeros(())
        for layer, pairs, bias in zip(self.layers, self._weight, self._bias):
            if pairs:
                log_delta_w = log_delta[layer.roles["weight"]]
                for q, w, zeros in pairs:
                    total = total + sum(torch.log(p + log_delta_w.exp()).sum() for p in _products(q, w, scale))
                    total = total + zeros * log_delta_w
            if bias is not None:
                log_delta_b = log_delta[layer.roles["bias"]]
                total = total + torch.log(scale * bias[0] + log_delta_b.exp()).sum() + bias[1] * log_delta_b
        return total

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        out = LogDetDerivatives.zero(scale)
        for layer, pairs, bias in zip(self.layers, self._weight, self._bias):
            for q, w, zeros in pairs:
                index = layer.roles["weight"]
                for products in _products(q, w, scale):
                    out.add_terms(index, *separable_terms(products, log_delta[index]))
                _add_zero_terms(out, index, zeros, log_delta[index])
            if bias is not None:
                index = layer.roles["bias"]
                out.add_terms(index, *separable_terms(scale * bias[0], log_delta[index]))
                _add_zero_terms(out, index, bias[1], log_delta[index])
        return out

    def _eigenbases(self, j: int) -> Dict[str, Bases]:
        """Layer ``j``'s eigenbases and eigenvalue products by role, as :meth:`covariance` takes them."""
        layer, shape = self.layers[j], self.shapes[j]
        g, a = self._factors(j)
        g_bias = self._output_factor(j, "bias")
        q, u = _eigh(g)
        q_bias, u_bias = (q, u) if g_bias is g else _eigh(g_bias)
        bases: Dict[str, Bases] = {"bias": (_stacked([u_bias]), None, q_bias.reshape(1, -1, 1))}
        if "weight" not in layer.roles:
            return bases
        if shape.diagonal_input:  # kron(A, G) with A diagonal: the basis I (x) U_G
            bases["weight"] = (None, _stacked([u]), _Products(a[None], q[None]))
            return bases
        blocks = self._group_blocks(j, g)
        outs = [(q, u)] if len(blocks) == 1 else [_eigh(gk) for gk in blocks]
        ins = [_eigh(ak) for ak in a]
        bases["weight"] = (_stacked([u_g for _, u_g in outs]), _stacked([u_a for _, u_a in ins]),
                           _Products(torch.stack([q_g for q_g, _ in outs]), torch.stack([w_a for w_a, _ in ins])))
        return bases

    @contextlib.contextmanager
    def reusing_decompositions(self) -> Iterator[None]:
        """Inside, each layer's eigenbases are decomposed once for every :meth:`inverse` (they do not depend on the
        precision); released on leaving, so that no eigenbasis outlives the caller's use."""
        self._reused = {}
        try:
            yield
        finally:
            self._reused = None

    def _bases(self, j: int) -> Dict[str, Bases]:
        """:meth:`_eigenbases`, decomposed once inside :meth:`reusing_decompositions`."""
        if self._reused is None:
            return self._eigenbases(j)
        if j not in self._reused:
            self._reused[j] = self._eigenbases(j)
        return self._reused[j]

    def inverse(self, scale: Tensor, delta: List[Tensor]) -> InverseFn:
        """``H_b^-1`` per tensor in its block's eigenbasis: ``kron(G, A)``'s ``U_G (x) U_A`` as
        ``1 / (s q_i w_j + delta)`` (per conv group; an Embedding's ``I (x) U_G``), a bias's ``U_G``
        (EKFAC: its second moments in place of the products, :meth:`_eigenbases`).

        Args:
            scale: Curvature scale ``s`` (0-dim).
            delta: Prior precision of every prior tensor, 0-dim (one per tensor: Kronecker blocks
                refuse a diagonal prior).

        Returns:
            The map from the covered tensors' flat pieces, in :attr:`indices` order, to ``H_b^-1``
            applied to them, in the same order.
        """
        blocks: Dict[int, Callable[[Tensor], Tensor]] = {}
        for j, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            bases = self._bases(j)
            for role, index in layer.roles.items():
                blocks[index] = _rotated_inverse(*_view(shape, role), bases[role], scale, delta[index])
        operators = [blocks[i] for i in self.indices]
        return lambda pieces: [operator(piece) for operator, piece in zip(operators, pieces)]

    def covariance(self, jacobians: List[Jacobian], scale: Tensor, delta: List[Tensor]) -> Tensor:
        first = jacobians[self.indices[0]]
        first = first.g if isinstance(first, RankOneJacobian) else first
        b, c = first.shape[:2]
        cov = first.new_zeros(b, c, c)
        for j, layer in enumerate(self.layers):
            g, a = self._factors(j)
            if "weight" in layer.roles:
                jac = jacobians[layer.roles["weight"]]
                d_w = delta[layer.roles["weight"]]
                if isinstance(jac, RankOneJacobian):  # g a^T: each factor rotated into its own basis
                    left, right, values = self._bases(j)["weight"]  # one matrix: a Linear's groups are 1
                    inputs = _rotate(jac.a, None if right is None else right[0]).pow(2)  # (B, in)
                    weights = inputs @ (1 / (scale * _rows(values)[0] + d_w)).T  # (B, out)
                    rotated = _rotate(jac.g, None if left is None else left[0])
                    cov += torch.einsum("bci,bi,bdi->bcd", rotated, weights, rotated)
                elif self.shapes[j].diagonal_input:  # weight (vocabulary, dim): kron(A, G), A diagonal
                    q, vec = _eigh(g)
                    rotated = _rotate(jac.reshape(b, c, a.shape[0], -1), vec)
                    variance = 1 / (scale * torch.outer(a, q) + d_w)
                    cov += torch.einsum("bcij,ij,bdij->bcd", rotated, variance, rotated)
                else:
                    blocks = self._group_blocks(j, g)
                    if self.shapes[j].transposed:  # weight (in, out): to (out, in) order
                        jac = jac.reshape(b, c, a.shape[-1], -1).transpose(2, 3)
                    per_group = jac.reshape(b, c, len(blocks), -1, a.shape[-1])
                    for k, (gk, ak) in enumerate(zip(blocks, a)):
                        (q, vec_g), (w, vec_a) = _eigh(gk), _eigh(ak)
                        block = per_group[:, :, k] if vec_g is None else vec_g.T @ per_group[:, :, k]
                        rotated = block @ vec_a
                        variance = 1 / (scale * torch.outer(q, w) + d_w)
                        cov += torch.einsum("bcij,ij,bdij->bcd", rotated, variance, rotated)
            if "bias" in layer.roles:
                q, vec = _eigh(self._output_factor(j, "bias"))
                rotated = _rotate(jacobians[layer.roles["bias"]], vec)
                cov += torch.einsum("bci,i,bdi->bcd", rotated, 1 / (scale * q + delta[layer.roles["bias"]]), rotated)
        return cov
