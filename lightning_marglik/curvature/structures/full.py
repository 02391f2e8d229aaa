"""The full ``P x P`` curvature, decomposed once per estimate.

While fewer rows ``L_nk^T J_n`` than parameters were seen, the rows ``U`` are kept and the
determinant lemma ``|s U^T U + D| = |D| |I + s U D^-1 U^T|`` (paper Eq. 8) gives ``log|H|`` from
``R x R`` matrices (per-tensor Gram matrices ``U_t U_t^T`` make a step ``O(T R^2 + R^3)``);
otherwise the Gram matrix ``G = U^T U``. With a scalar prior its eigenvalues give every step in
``O(P)``; with one precision per tensor, the largest tensor's block ``G_11 = V diag(l) V^T`` is
decomposed once and the rest enters through the Schur complement
``S = s G_22 + D_2 - s^2 M diag(1 / (s l + delta_1)) M^T`` with ``M = G_21 V``, so a step costs
``O(P_2^2 P_1 + P_2^3)`` instead of ``O(P^3)``. A diagonal prior refactorises ``s G + D``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..options import CurvatureOptions
from ..statistics import BatchCurvature, GatherFn, InverseFn, LayerPlan, Structure, SumFn

if TYPE_CHECKING:
    from ...hyperparameters import GaussianPrior
from .derivatives import LogDetDerivatives, separable_terms

__all__ = ["FullStructure"]

BYTES = 8  # float64


def _log_det_chol(matrix: Tensor) -> Tensor:
    """``log|matrix|`` by Cholesky; NaN if the factorisation fails (a non-finite step)."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0:
        return matrix.sum() * float("nan")
    return 2 * torch.log(torch.diagonal(chol)).sum()


def _size(n_bytes: float) -> str:
    """Bytes in GiB to a tenth, or in MiB where a tenth of a GiB would read as zero."""
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 / 10 else f"{n_bytes / 2**20:.3g} MiB"


class FullStructure(Structure):
    """The full curvature over all of the prior's tensors.

    Args:
        indices: Prior indices of all tensors.
        sizes: Their sizes.
        prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diagonal"`` (chooses the decomposition).
        max_memory: Bytes the ``P x P`` matrices may take.

    Raises:
        ValueError: If the Gram matrix and its factorisation would exceed ``max_memory``.
    """

    name = "full"
    hook_path = False  # per-example rows of every parameter: the exact path

    def __init__(self, indices: Sequence[int], sizes: Sequence[int], prior_structure: str, max_memory: int) -> None:
        super().__init__(indices, sizes)
        self.n_params = sum(sizes[i] for i in self.indices)
        need = 2 * BYTES * self.n_params**2
        if need > max_memory:
            raise ValueError(
                f"structure='full' needs about {_size(need)} for P={self.n_params:,} parameters (a P x P "
                f"Gram matrix and its factorisation), above max_memory={_size(max_memory)}; use "
                "structure='kron' or 'diag', or raise max_memory."
            )
        self.prior_structure = prior_structure
        self.rows: Optional[Tensor] = None
        self.gram: Optional[Tensor] = None
        self.add_state("n_rows", torch.zeros((), dtype=torch.int64))

    @classmethod
    def check(cls, prior: "GaussianPrior", options: CurvatureOptions) -> None:
        """Refuse a curvature above ``options.max_memory`` before any data."""
        cls.from_plan([], [], prior, options)

    @classmethod
    def from_plan(
        cls, layers: List[LayerPlan], exact: List[int], prior: "GaussianPrior", options: CurvatureOptions
    ) -> List[Structure]:
        return [cls(range(len(prior.param_sizes)), prior.param_sizes, prior.structure, options.max_memory)]

    def accumulate(self, batch: BatchCurvature) -> None:
        assert batch.rows is not None
        rows = batch.rows.detach().to(torch.float64)
        self.add("n_rows", torch.tensor(rows.shape[0]))
        if self.gram is not None:
            self.gram += rows.T @ rows
            return
        self.rows = rows if self.rows is None else torch.cat([self.rows, rows])
        if self.rows.shape[0] >= self.n_params:
            self._to_gram()

    def _to_gram(self) -> None:
        if self.gram is None:
            self.gram = torch.zeros(self.n_params, self.n_params, dtype=torch.float64, device=self._device())
        if self.rows is not None:
            self.gram += self.rows.T @ self.rows
            self.rows = None

    def _device(self) -> torch.device:
        return self.state("n_rows").device  # moved with the declared states to the parameters' device

    def reduce_extra(self, sum_fn: SumFn, gather_fn: GatherFn) -> None:
        """Sum the Gram matrices, or gather the rows while the global count stays below ``P``.

        The choice depends on the global row count only (the same on every rank).
        """
        if int(self.state("n_rows")) >= self.n_params or self.gram is not None:
            self._to_gram()
            assert self.gram is not None
            self.gram = sum_fn(self.gram.reshape(-1)).reshape(self.n_params, self.n_params)
            return
        local = self.rows if self.rows is not None else torch.zeros(0, self.n_params, dtype=torch.float64, device=self._device())
        lengths = [int(n) for n in gather_fn(torch.tensor([local.shape[0]], device=local.device))]
        if len(lengths) == 1:
            return
        padded = local.new_zeros(max(lengths), self.n_params)
        padded[: local.shape[0]] = local
        self.rows = torch.cat([block[:n] for block, n in zip(gather_fn(padded), lengths)])

    # --- decomposition ------------------------------------------------------------------------

    def _tensor_slices(self) -> List[slice]:
        out, start = [], 0
        for i in self.indices:
            out.append(slice(start, start + self.sizes[i]))
            start += self.sizes[i]
        return out

    def prepare(self) -> None:
        self._finite = True
        self._basis: Optional[Tuple[int, List[int], Tensor, Tensor]] = None
        if self.gram is None:
            rows = self.rows if self.rows is not None else torch.zeros(0, self.n_params, dtype=torch.float64, device=self._device())
            self._finite = Structure._guard(rows)
            self.rows = rows
            if self.prior_structure != "diagonal" and self._finite:
                blocks = torch.split(rows, [self.sizes[i] for i in self.indices], dim=1)
                self._row_grams = torch.stack([b @ b.T for b in blocks])
            return
        self._finite = Structure._guard(self.gram)
        if not self._finite or self.prior_structure == "diagonal":
            return
        if self.prior_structure == "scalar":
            self._eig = torch.linalg.eigvalsh(self.gram).clamp(min=0)
            return
        slices = self._tensor_slices()
        self._first = max(range(len(slices)), key=lambda t: slices[t].stop - slices[t].start)
        keep = torch.ones(self.n_params, dtype=torch.bool)
        keep[slices[self._first]] = False
        g11 = self.gram[slices[self._first], slices[self._first]]
        values, vectors = torch.linalg.eigh(g11)
        self._eig, self._rest = values.clamp(min=0), keep
        self._m = self.gram[keep][:, slices[self._first]] @ vectors
        self._g22 = self.gram[keep][:, keep]

    def _per_parameter(self, log_delta: List[Tensor], only: Optional[Sequence[int]] = None) -> Tensor:
        positions = range(len(self.indices)) if only is None else only
        return torch.cat([log_delta[self.indices[t]].expand(self.sizes[self.indices[t]]) for t in positions])

    def log_det(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        if not self._finite:
            return scale * float("nan")
        if self.gram is None:
            return self._log_det_low_rank(scale, log_delta)
        if self.prior_structure == "diagonal":
            return _log_det_chol(scale * self.gram + torch.diag(self._per_parameter(log_delta).exp()))
        if self.prior_structure == "scalar":
            return torch.log(scale * self._eig + log_delta[self.indices[0]].exp()).sum()
        delta_1 = log_delta[self.indices[self._first]].exp()
        head = scale * self._eig + delta_1
        rest = [t for t in range(len(self.indices)) if t != self._first]
        if not rest:
            return torch.log(head).sum()
        schur = scale * self._g22 + torch.diag(self._per_parameter(log_delta, rest).exp())
        schur = schur - (scale**2) * (self._m / head) @ self._m.T
        return torch.log(head).sum() + _log_det_chol(schur)

    def _log_det_low_rank(self, scale: Tensor, log_delta: List[Tensor]) -> Tensor:
        assert self.rows is not None
        if self.prior_structure != "diagonal":
            tensor_log_delta = torch.stack([log_delta[i].reshape(()) for i in self.indices])
            inner = self._low_rank_inner(scale * torch.exp(-tensor_log_delta))
            sizes = torch.tensor([self.sizes[i] for i in self.indices], dtype=scale.dtype, device=scale.device)
            log_det_prior = (sizes * tensor_log_delta).sum()
        else:
            per_param = self._per_parameter(log_delta)
            scaled = self.rows * torch.sqrt(scale * torch.exp(-per_param))
            inner = torch.eye(self.rows.shape[0], dtype=self.rows.dtype, device=self.rows.device) + scaled @ scaled.T
            log_det_prior = per_param.sum()
        return log_det_prior + _log_det_chol(inner)

    def _low_rank_inner(self, w: Tensor) -> Tensor:
        """``K = I + sum_t w_t K_t`` (``R x R``) from the tensors' row Grams ``K_t = U_t U_t^T``."""
        return torch.eye(self._row_grams.shape[1], dtype=w.dtype, device=w.device) + torch.einsum(
            "t,trs->rs", w, self._row_grams
        )

    def log_det_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        """Closed-form derivatives: from the eigenvalues with a scalar prior (``O(P)``), else from
        ``X = H^-1`` (``O(P^3)``, or ``O(P^2 R)`` by Woodbury in the low-rank form).

        With ``d_i = delta_i X_ii``: ``d log|H| / d rho_t = sum_{i in t} d_i``, ``d/du = P - sum d``,
        ``d2 / drho_t drho_r = [t = r] sum_{i in t} d_i - sum_{i in t, j in r} delta_i delta_j X_ij^2``,
        ``d2 / drho_t du = -sum_{i in t} f_i`` and ``d2/du2 = sum f`` with
        ``f_i = d_i - delta_i sum_j X_ij^2 delta_j``.
        """
        out = LogDetDerivatives.zero(scale)
        if self.gram is not None and self.prior_structure == "scalar" and self._finite:
            index = self.indices[0]
            out.add_terms(index, *separable_terms(scale * self._eig, log_delta[index]))
            return out
        if self.gram is None and self.prior_structure != "diagonal" and self._finite:
            return self._low_rank_derivatives(scale, log_delta)
        if self.prior_structure == "diagonal":
            per_param = self._per_parameter(log_delta)
            inverse = self._inverse(scale, per_param) if self._finite else None
        else:  # one precision per tensor, Gram form: the Schur decomposition cached by ``prepare``
            inverse = self._schur_inverse(scale, log_delta) if self._finite else None
        if inverse is None:
            out.value = scale * float("nan")
            return out
        x, out.value, per_param, owner = inverse
        delta = per_param.exp()
        d = delta * torch.diagonal(x)
        squares = x * x
        f = d - delta * (squares @ delta)
        out.u, out.uu = self.n_params - d.sum(), f.sum()
        if self.prior_structure == "diagonal":
            self_terms = delta.pow(2) * torch.diagonal(squares)
            for t, part in zip(self.indices, self._tensor_slices()):
                out.rho[t], out.rho_u[t], out.rho_rho[t] = d[part], -f[part], d[part] - self_terms[part]
            out.exact_diagonal = False
            return out
        # per-tensor sums of d and f, and block sums of delta_i delta_j X_ij^2: traces and Frobenius
        # norms of blocks, unchanged by the rotation of the first block in the Schur form
        one_hot = torch.nn.functional.one_hot(owner, len(self.indices)).to(x.dtype)
        blocks = one_hot.T @ (squares * delta * delta.unsqueeze(1)) @ one_hot
        d_sums, f_sums = d @ one_hot, f @ one_hot
        for k, t in enumerate(self.indices):
            out.rho[t], out.rho_u[t], out.rho_rho[t] = d_sums[k], -f_sums[k], d_sums[k] - blocks[k, k]
        out.cross = (list(self.indices), -(blocks - torch.diag(torch.diagonal(blocks))))
        return out

    def _schur_inverse(self, scale: Tensor, log_delta: List[Tensor]) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
        """``H^-1`` with the first block in the eigenbasis of ``G_11`` (``prepare``), ``log|H|``, the
        log precisions and the tensor (position in ``indices``) of each row of that layout.

        With ``h = s l + delta_1`` and the Schur complement ``S``: ``X_22 = S^-1``,
        ``X_12 = -s diag(1/h) M^T S^-1``, ``X_11 = diag(1/h) - X_12 s M diag(1/h)``: ``O(P_1^2 P_2 + P_2^3)``.
        """
        first = self._first
        rest = [t for t in range(len(self.indices)) if t != first]
        delta_1 = log_delta[self.indices[first]].exp()
        head = scale * self._eig + delta_1
        log_rest = self._per_parameter(log_delta, rest) if rest else head[:0]
        schur = scale * self._g22 + torch.diag(log_rest.exp()) - (scale**2) * (self._m / head) @ self._m.T
        chol, info = torch.linalg.cholesky_ex(schur)
        if int(info) != 0:
            return None
        x22 = torch.cholesky_inverse(chol)
        x12 = -(scale * (self._m / head).T) @ x22
        x11 = torch.diag(1 / head) - x12 @ (scale * self._m / head)
        x = torch.cat([torch.cat([x11, x12], 1), torch.cat([x12.T, x22], 1)])
        value = torch.log(head).sum() + 2 * torch.log(torch.diagonal(chol)).sum()
        per_param = torch.cat([log_delta[self.indices[first]].expand(len(head)), log_rest])
        sizes = torch.tensor([self.sizes[self.indices[t]] for t in [first] + rest], device=x.device)
        owner = torch.repeat_interleave(torch.tensor([first] + rest, device=x.device), sizes)
        return x, value, per_param, owner

    def _low_rank_basis(self) -> Tuple[int, List[int], Tensor, Tensor]:
        """Once per estimate: ``K_1 = U_1 U_1^T = V diag(l) V^T`` of the tensor with the most
        parameters, and the other tensors' rows in its eigenbasis, ``V^T U_rest`` ``(R, m)``."""
        if self._basis is None:
            assert self.rows is not None
            sizes = [self.sizes[i] for i in self.indices]
            first = max(range(len(sizes)), key=lambda t: sizes[t])
            rest = [t for t in range(len(sizes)) if t != first]
            values, vectors = torch.linalg.eigh(self._row_grams[first])
            blocks = torch.split(self.rows, sizes, dim=1)
            rotated = vectors.T @ torch.cat([blocks[t] for t in rest], dim=1) if rest else self.rows[:, :0]
            self._basis = (first, rest, values.clamp(min=0), rotated)
        return self._basis

    def _low_rank_form(self) -> str:
        """The cheaper way to the low-rank derivatives: ``"woodbury"`` in the largest tensor's
        eigenbasis, ``O(R m^2 + m^3)`` per evaluation for ``m`` parameters outside it, or ``"grams"``
        from the ``R x R`` row Gram of every tensor, ``O(n R^3 + n^2 R^2)`` for ``n`` tensors (several
        tensors of similar size, e.g. an MLP's hidden layers, make ``m`` about ``P / 2``)."""
        assert self.rows is not None
        rows, n = self.rows.shape[0], len(self.indices)
        m = self.n_params - max(self.sizes[i] for i in self.indices)
        return "woodbury" if rows * m * m + m**3 <= n * rows**3 + n * n * rows * rows else "grams"

    def _low_rank_derivatives(self, scale: Tensor, log_delta: List[Tensor]) -> LogDetDerivatives:
        """Derivatives of ``log|H| = sum_t P_t rho_t + log|K|``, ``K = I + sum_t w_t K_t``,
        ``w_t = s / delta_t``, ``K_t = U_t U_t^T`` (determinant lemma, rows ``R < P``).

        With ``phi_t = w_t tr(K^-1 K_t)`` and ``psi_tr = [t = r] phi_t - w_t w_r tr(K^-1 K_t K^-1 K_r)``
        (derivatives of ``log|K|`` in ``log w``); the traces by :meth:`_low_rank_form`'s cheaper way.
        """
        out = LogDetDerivatives.zero(scale)
        sizes = torch.tensor([self.sizes[i] for i in self.indices], dtype=scale.dtype, device=scale.device)
        rho = torch.stack([log_delta[i].reshape(()) for i in self.indices])
        w = scale * torch.exp(-rho)
        traced = self._woodbury_traces(w) if self._low_rank_form() == "woodbury" else self._gram_traces(w)
        if traced is None:
            out.value = scale * float("nan")
            return out
        log_det_k, traces, products = traced  # log|K|, tr(K^-1 K_t), tr(K^-1 K_t K^-1 K_r)
        out.value = (sizes * rho).sum() + log_det_k
        phi = w * traces
        psi = torch.diag(phi) - torch.outer(w, w) * products
        out.u, out.uu = phi.sum(), psi.sum()
        for k, t in enumerate(self.indices):
            out.rho[t], out.rho_u[t], out.rho_rho[t] = sizes[k] - phi[k], -psi[k].sum(), psi[k, k]
        out.cross = (list(self.indices), psi - torch.diag(torch.diagonal(psi)))
        return out

    def _gram_traces(self, w: Tensor) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """``log|K|`` and the traces from the cached row Grams: ``A_t = K^-1 K_t`` by one Cholesky."""
        chol, info = torch.linalg.cholesky_ex(self._low_rank_inner(w))
        if int(info) != 0:
            return None
        a = torch.cholesky_solve(self._row_grams, chol)  # (n, R, R)
        flat = a.reshape(len(a), -1)
        products = flat @ a.transpose(1, 2).reshape(len(a), -1).T  # tr(A_t A_r) = sum_ij A_t[i, j] A_r[j, i]
        return 2 * torch.log(torch.diagonal(chol)).sum(), torch.diagonal(a, dim1=1, dim2=2).sum(1), products

    def _woodbury_traces(self, w: Tensor) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """``log|K|`` and the traces in the eigenbasis of the largest tensor's ``K_1 = V diag(l) V^T``:
        ``V^T K V = diag(g) + U~ W U~^T`` with ``g = 1 + w_1 l`` and the other ``m`` columns ``U~``, whose
        inverse is ``m x m`` by Woodbury (``B = W^-1 + U~^T diag(g)^-1 U~``)."""
        first, rest, values, rotated = self._low_rank_basis()
        g = 1 + w[first] * values
        rest_sizes = torch.tensor([self.sizes[self.indices[t]] for t in rest], dtype=torch.long, device=w.device)
        w_cols = torch.repeat_interleave(w[rest], rest_sizes)
        f = rotated / g.unsqueeze(1)  # diag(g)^-1 U~
        a = rotated.T @ f
        chol, info = torch.linalg.cholesky_ex(torch.diag(1 / w_cols) + a)
        if int(info) != 0:
            return None
        b_inv = torch.cholesky_inverse(chol)
        log_det_k = torch.log(g).sum() + torch.log(w_cols).sum() + 2 * torch.log(torch.diagonal(chol)).sum()
        n = len(self.indices)
        traces, products = w.new_zeros(n), w.new_zeros(n, n)
        fb = f @ b_inv
        diag_fbf = (fb * f).sum(1)
        traces[first] = (values * (1 / g - diag_fbf)).sum()
        q = f.T @ (values.unsqueeze(1) * f)
        bq = b_inv @ q
        products[first, first] = (values**2 / g**2).sum() - 2 * (values**2 / g * diag_fbf).sum() + (bq * bq.T).sum()
        if rest:
            owner = torch.repeat_interleave(torch.arange(len(rest), device=w.device), rest_sizes)
            one_hot = torch.nn.functional.one_hot(owner, len(rest)).to(w.dtype)  # (m, tensors)
            z = a - a @ b_inv @ a  # U~^T K^-1 U~
            k_inv_u = f - fb @ a  # K^-1 U~ in the rotated basis
            index = torch.tensor(rest, device=w.device)
            traces[index] = torch.diagonal(z) @ one_hot
            products[index.unsqueeze(1), index.unsqueeze(0)] = one_hot.T @ (z * z) @ one_hot
            with_first = (values.unsqueeze(1) * k_inv_u * k_inv_u).sum(0) @ one_hot
            products[first, index], products[index, first] = with_first, with_first
        return log_det_k, traces, products

    def _inverse(self, scale: Tensor, per_param: Tensor) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
        """``(H^-1, log|H|, per_param, owner)`` with ``H = s C + diag(exp(per_param))`` in prior order (see
        :meth:`_schur_inverse`); ``None`` if a Cholesky fails."""
        if self.gram is not None:
            chol, info = torch.linalg.cholesky_ex(scale * self.gram + torch.diag(per_param.exp()))
            if int(info) != 0:
                return None
            return torch.cholesky_inverse(chol), 2 * torch.log(torch.diagonal(chol)).sum(), per_param, self._owner()
        # Woodbury: H^-1 = D^-1 - D^-1 U^T (I/s + U D^-1 U^T)^-1 U D^-1, |H| = |D| |s| ^R |I/s + U D^-1 U^T|
        assert self.rows is not None
        inv_delta = torch.exp(-per_param)
        ud = self.rows * inv_delta
        n_rows = self.rows.shape[0]
        inner = torch.eye(n_rows, dtype=ud.dtype, device=ud.device) / scale + ud @ self.rows.T
        chol, info = torch.linalg.cholesky_ex(inner)
        if int(info) != 0:
            return None
        half = torch.linalg.solve_triangular(chol, ud, upper=False)
        log_det = per_param.sum() + n_rows * torch.log(scale) + 2 * torch.log(torch.diagonal(chol)).sum()
        return torch.diag(inv_delta) - half.T @ half, log_det, per_param, self._owner()

    def inverse(self, scale: Tensor, delta: List[Tensor]) -> InverseFn:
        """``H_b^-1`` as an operator, without its dense ``P x P`` form: one Cholesky factor of ``s G + D`` where the
        Gram matrix ``G`` is held (a solve per application), else Woodbury over the ``R < P`` rows ``U`` held,
        ``H^-1 v = D^-1 v - D^-1 U^T (I/s + U D^-1 U^T)^-1 U D^-1 v`` (``O(R P)`` per application). The default's
        dense form multiplies ``P x P`` identities: seconds a call at the toy regression's 5,251 weights, where the
        prior guard asks for two per estimate.

        Args:
            scale: Curvature scale ``s`` (0-dim).
            delta: Prior precision of every prior tensor: 0-dim or ``(numel,)`` (a diagonal prior).

        Returns:
            The map from the covered tensors' flat pieces, in :attr:`indices` order, to ``H_b^-1`` applied to their
            concatenation, split into pieces in the same order.
        """
        own = [self.sizes[i] for i in self.indices]
        per_param = torch.cat([delta[i].expand(self.sizes[i]) for i in self.indices])
        if self.gram is not None:
            chol = torch.linalg.cholesky(scale * self.gram + torch.diag(per_param))

            def solve(v: Tensor) -> Tensor:
                return torch.cholesky_solve(v[:, None], chol)[:, 0]
        else:
            rows = self.rows if self.rows is not None else per_param.new_zeros(0, self.n_params)
            scaled = rows / per_param
            inner = torch.linalg.cholesky(
                torch.eye(rows.shape[0], dtype=rows.dtype, device=rows.device) / scale + scaled @ rows.T
            )

            def solve(v: Tensor) -> Tensor:
                return v / per_param - scaled.T @ torch.cholesky_solve((scaled @ v)[:, None], inner)[:, 0]
        return lambda pieces: list(solve(torch.cat(pieces)).split(own))

    def _owner(self) -> Tensor:
        """The tensor (position in ``indices``) of every parameter, in prior order."""
        sizes = torch.tensor([self.sizes[i] for i in self.indices], device=self._device())
        return torch.repeat_interleave(torch.arange(len(self.indices), device=sizes.device), sizes)

    def covariance(self, jacobians: List[Tensor], scale: Tensor, delta: List[Tensor]) -> Tensor:
        flat = torch.cat([jacobians[i] for i in self.indices], dim=2)
        b, c, p = flat.shape
        flat = flat.reshape(b * c, p)
        per_param = torch.cat([delta[i].expand(self.sizes[i]) for i in self.indices])
        if self.gram is not None:
            chol = torch.linalg.cholesky(scale * self.gram + torch.diag(per_param))
            half = torch.linalg.solve_triangular(chol, flat.T, upper=False)
            cov = half.T @ half
        else:  # Woodbury: H^-1 = D^-1 - D^-1 U^T (I/s + U D^-1 U^T)^-1 U D^-1
            assert self.rows is not None
            ud = self.rows / per_param
            inner = torch.eye(ud.shape[0], dtype=ud.dtype, device=ud.device) / scale + ud @ self.rows.T
            projected = flat @ ud.T
            cov = (flat / per_param) @ flat.T - projected @ torch.linalg.solve(inner, projected.T)
        return torch.stack([cov[i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(b)])
