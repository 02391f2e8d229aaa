"""Eigenvalue-corrected Kronecker curvature (EKFAC, George et al. 2018): ``structure="ekfac"``.

Each Kronecker block keeps the eigenbasis ``U = U_G (x) U_A`` of its factors (per conv group; an
Embedding's diagonal input factor has the identity basis), and the eigenvalue products
``q_i w_j`` are replaced by the exact second moments of the per-example gradients in that basis:

    s_ij = sum_{n,k} ((U_G^T G_nk U_A)_ij)^2,   G_nk = sum_r g_nkr a_nr^T

(``k`` a loss-Hessian factor column, ``r`` a weight-sharing row), i.e. ``diag(U^T C U)`` of the
exact curvature block ``C``; a bias takes ``s_i = sum_{n,k} ((U_G^T sum_r g_nkr)_i)^2``. Then
``log|s_c C~ + delta I| = sum_ij log(s_c s_ij + delta)`` and ``H^-1 = U (s_c s + delta)^-1 U^T``.
A layer above ``max_output_factor`` outputs holds only ``G``'s diagonal (:mod:`.kron`): its basis is
``I (x) U_A``, the moments taken in it alike.

The basis needs the factors first, so the structure reads the data twice (``passes = 2``): the
first pass accumulates the Kronecker factors exactly as ``kron`` does, the second the second
moments in their eigenbasis, all at the current weights. (The previous estimate's basis would save
the second pass but is stale by ``frequency`` epochs, depends on the training history and does
not exist for a post-hoc evidence at trained weights.) The loader must therefore be re-iterable.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..layers import layer_rule
from ..rows import embedding_diagonal
from ..statistics import BatchCurvature, LayerPlan, Structure
from .derivatives import LogDetDerivatives, separable_terms
from .kron import Bases, KronStructure, _rotate, _stacked

__all__ = ["EKFACStructure"]


def _basis(matrix: Tensor) -> Optional[Tensor]:
    """Eigenvectors of a symmetric factor; NaN where it is not finite (the evidence then reports NaN). A diagonal
    factor (a vector: a layer above ``max_output_factor`` outputs) has the identity, ``None``."""
    if matrix.dim() == 1:
        return None
    if not Structure._guard(matrix):
        return torch.full_like(matrix, float("nan"))
    return torch.linalg.eigh(matrix)[1]


class EKFACStructure(KronStructure):
    """Second moments in the Kronecker eigenbasis of hooked Linear, Conv1d/2d, HF Conv1D and Embedding layers.

    Args:
        indices: Prior indices of the covered tensors (the layers' trainable weights and biases).
        sizes: Sizes of all prior tensors.
        layers: The layers, each with the prior index of its covered parameters by role.
        max_output_factor: A layer with more outputs holds only the diagonal of its output-side factor: its
            basis is ``I (x) U_A`` (``None``: every factor exact).

    Raises:
        ValueError: For a registered Kronecker layer rule without ``input_rows``/``grad_rows``
            (the per-example gradients in the basis need the layer's rows).
    """

    name = "ekfac"
    passes = 2
    # the basis must be the same on every rank: the factors would have to be summed across processes
    # between the passes, which is not implemented
    multi_process = False
    training_statistics = False  # the second pass is not the training backward
    parametric_bound = False  # the bound's parts are read once each

    def __init__(self, indices: Sequence[int], sizes: Sequence[int], layers: List[LayerPlan],
                 max_output_factor: Optional[int] = None) -> None:
        super().__init__(indices, sizes, layers, max_output_factor)
        for j, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            rule = layer_rule(layer.module)
            if not shape.diagonal_input and not (hasattr(rule, "input_rows") and hasattr(rule, "grad_rows")):
                raise ValueError(
                    f"structure='ekfac': the layer rule of '{layer.name}' ({type(rule).__name__}) gives Kronecker "
                    "factors but not the layer's rows (input_rows/grad_rows), which the second moments need; "
                    "use structure='kron' for this model."
                )
            if "weight" in layer.roles:
                moments = (1, shape.inp, shape.out) if shape.diagonal_input else (
                    shape.groups, shape.out // shape.groups, shape.inp)
                self.add_state(f"{j}.s", torch.zeros(moments, dtype=torch.float64))
            if "bias" in layer.roles:
                self.add_state(f"{j}.s_bias", torch.zeros(shape.out, dtype=torch.float64))
        self._pass = 0
        self.bases: List[Dict[str, object]] = []

    def rescale(self, factor: float) -> None:
        super().rescale(factor)  # the factors: their eigenbasis does not change
        for j in range(len(self.layers)):
            for name in (f"{j}.s", f"{j}.s_bias"):
                if name in self.states():
                    self.state(name).mul_(factor)

    # --- the two passes -------------------------------------------------------------------------

    def start_pass(self, index: int) -> None:
        """Before the second pass: the eigenbases of the (summed) factors of the first."""
        self._pass = index
        self.bases = []
        for j in range(len(self.layers)):
            g, a = self._factors(j)
            g_bias = self._output_factor(j, "bias")
            basis: Dict[str, object] = {"bias": _basis(g_bias)}
            whole = basis["bias"] if g_bias is g else _basis(g)  # the weight's output factor: un-pruned, the bias's
            if self.shapes[j].diagonal_input:
                basis["g"] = [whole]
            else:
                blocks = self._group_blocks(j, g)
                basis["g"] = [whole] if len(blocks) == 1 else [_basis(gk) for gk in blocks]
                basis["a"] = [_basis(ak) for ak in a]
            self.bases.append(basis)

    def accumulate(self, batch: BatchCurvature) -> None:
        if self._pass == 0:
            super().accumulate(batch)
            return
        position = {layer.name: j for j, layer in enumerate(self.layers)}
        for layer, a, g in batch.layers:
            j = position.get(layer.name)
            if j is not None:
                self._second_moments(j, layer, a, g)

    def _second_moments(self, j: int, layer: LayerPlan, a: Tensor, g: Tensor) -> None:
        module, shape, basis = layer.module, self.shapes[j], self.bases[j]
        rule = layer_rule(module)
        if shape.diagonal_input:  # Embedding: basis I (x) U_G, the exact diagonal of the rotated gradients
            idx, g_rows = rule._rows(a, g)
            if "weight" in layer.roles:
                self.add(f"{j}.s", embedding_diagonal(module, idx, _rotate(g_rows, basis["g"][0])).unsqueeze(0))
            return
        a_rows, g_rows = rule.input_rows(module, a), rule.grad_rows(module, g)  # (B, R, in), (K, B, R, out)
        # a pruned tensor's per-example gradients: its masks scale the rows (the gradient of weight_orig is
        # D_r (sum_r g a^T) D_c, of bias_orig D_m sum_r g)
        out_mask, in_mask = self.masks[j].get("weight", (None, None))
        bias_mask = self.masks[j].get("bias", (None, None))[0]
        g_weight = g_rows if out_mask is None else g_rows * out_mask.to(g_rows)
        g_bias = g_rows if bias_mask is None else g_rows * bias_mask.to(g_rows)
        a_rows = a_rows if in_mask is None else a_rows * in_mask.to(a_rows).repeat(shape.groups)
        if shape.groups == 1:
            g_rotated = [_rotate(g_weight, basis["g"][0])]
        else:
            g_rotated = [_rotate(gk, u_g) for gk, u_g in zip(g_weight.chunk(shape.groups, dim=3), basis["g"])]
        if "bias" in layer.roles:
            # one rotation of the gradients serves the weight and the bias where they share it (the K B R out^2 part)
            shared = shape.groups == 1 and g_bias is g_weight and basis["g"][0] is basis["bias"]
            bias_rotated = g_rotated[0].sum(2) if shared else _rotate(g_bias.sum(2), basis["bias"])
            self.add(f"{j}.s_bias", bias_rotated.pow(2).sum((0, 1)))  # (K, B, out) summed over K and B
        if "weight" not in layer.roles:
            return
        moments = []
        for g_rot, ak, u_a in zip(g_rotated, a_rows.chunk(shape.groups, dim=2), basis["a"]):
            a_rot = ak @ u_a.to(ak.dtype)
            if a_rot.shape[1] == 1:  # no weight sharing: the per-example gradient is an outer product
                moments.append(g_rot[:, :, 0].pow(2).sum(0).T @ a_rot[:, 0].pow(2))
            else:  # one factor column at a time: at most B x out x in values alive
                moments.append(sum(torch.bmm(col.transpose(1, 2), a_rot).pow_(2).sum(0) for col in g_rot))
        self.add(f"{j}.s", torch.stack(moments))

    # --- the evidence ---------------------------------------------------------------------------

    def prepare(self) -> None:
        self._weight_moments = [self.state(f"{j}.s") if "weight" in layer.roles else None
                                for j, layer in enumerate(self.layers)]
        self._bias_moments = [self.state(f"{j}.s_bias") if "bias" in layer.roles else None
                              for j, layer in enumerate(self.layers)]

    def _eigenbases(self, j: int) -> Dict[str, Bases]:
        """Layer ``j``'s eigenbases (of its Kronecker factors) and second moments in them, by role: the
        inherited :meth:`~.KronStructure.inverse` then takes ``1 / (s s_ij + delta)`` in them."""
        layer, shape, basis = self.layers[j], self.shapes[j], self.bases[j]
        bases: Dict[str, Bases] = {}
        if "bias" in layer.roles:
            bases["bias"] = (_stacked([basis["bias"]]), None, self.state(f"{j}.s_bias").reshape(1, -1, 1))
        if "weight" in layer.roles:
            moments = self.state(f"{j}.s")
            bases["weight"] = ((None, _stacked(basis["g"]), moments) if shape.diagonal_input
                               else (_stacked(basis["g"]), torch.stack(basis["a"]), moments))
        return bases

    def _terms(self) -> List[Tuple[int, Tensor]]:
        """``(prior index, second moments)`` of every covered tensor."""
        terms = []
        for layer, weight, bias in zip(self.layers, self._weight_moments, self._bias_moments):
            if weight is not None:
                terms.append((layer.roles["weight"], weight))
            if bias is not None:
                terms.append((layer.roles["bias"], bias))
        return terms

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        total = scale.new_zeros(())
        for index, moments in self._terms():
            total = total + torch.log(scale * moments + log_delta[index].exp()).sum()
        return total

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        out = LogDetDerivatives.zero(scale)
        for index, moments in self._terms():
            out.add_terms(index, *separable_terms(scale * moments, log_delta[index]))
        return out

    def covariance(self, jacobians: List[Tensor], scale: Tensor, delta: List[Tensor]) -> Tensor:
        b, c = jacobians[self.indices[0]].shape[:2]
        cov = jacobians[self.indices[0]].new_zeros(b, c, c)
        for j, layer in enumerate(self.layers):
            shape, basis = self.shapes[j], self.bases[j]
            if "weight" in layer.roles:
                jac, d_w = jacobians[layer.roles["weight"]], delta[layer.roles["weight"]]
                moments = self._weight_moments[j]
                if shape.diagonal_input:  # weight (vocabulary, dim)
                    rotated = [_rotate(jac.reshape(b, c, shape.inp, shape.out), basis["g"][0])]
                else:
                    if shape.transposed:  # weight (in, out): to (out, in) order
                        jac = jac.reshape(b, c, shape.inp, shape.out).transpose(2, 3)
                    per_group = jac.reshape(b, c, shape.groups, shape.out // shape.groups, shape.inp)
                    rotated = [(per_group[:, :, k] if u_g is None else u_g.T @ per_group[:, :, k]) @ u_a
                               for k, (u_g, u_a) in enumerate(zip(basis["g"], basis["a"]))]
                for rot, s_k in zip(rotated, moments):
                    cov += torch.einsum("bcij,ij,bdij->bcd", rot, 1 / (scale * s_k + d_w), rot)
            if "bias" in layer.roles:
                rot = _rotate(jacobians[layer.roles["bias"]], basis["bias"])
                variance = 1 / (scale * self._bias_moments[j] + delta[layer.roles["bias"]])
                cov += torch.einsum("bci,i,bdi->bcd", rot, variance, rot)
        return cov
