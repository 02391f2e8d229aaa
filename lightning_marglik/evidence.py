"""The Laplace estimate of the log marginal likelihood from cached curvature statistics.

``log q(D|M) = log p(D|theta)/T + log p(theta|delta) + P/2 log(2 pi) - 1/2 log|H|`` with
``H = s C + diag(delta)``. After the one expensive pass over the data, every evaluation reuses
the cached eigenvalues, diagonals, Gram matrices and sums, so hyperparameter steps are cheap.
Knows nothing of Lightning.
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, Iterable, List, Optional

import torch
from torch import Tensor, nn

from .curvature import CurvatureStatistics, collect_statistics
from .hyperparameters import GaussianPrior, Likelihood

__all__ = ["LaplaceEvidence"]


class LaplaceEvidence:
    """Laplace evidence of a network at its current weights, differentiable in the log hyperparameters.

    Build it with :meth:`fit` (one pass over the data) or :meth:`from_statistics` (statistics
    gathered elsewhere, e.g. summed over processes).

    Args:
        stats: Curvature and likelihood statistics of the whole training set.
        likelihood: The likelihood whose ``log_sigma``/``log_temperature`` enter the evidence.
        prior: The prior whose ``log_precision`` enters the evidence.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_marglik import GaussianLikelihood, GaussianPrior
        >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> data = DataLoader(TensorDataset(torch.randn(32, 1), torch.randn(32, 1)), batch_size=8)
        >>> prior, lik = GaussianPrior(net), GaussianLikelihood()
        >>> evidence = LaplaceEvidence.fit(net, data, lik, prior, structure="kron")
        >>> before = evidence.log_marglik().item()
        >>> evidence.optimize(steps=50, lr=0.1).item() > before
        True
    """

    def __init__(self, stats: CurvatureStatistics, likelihood: Likelihood, prior: GaussianPrior) -> None:
        self.likelihood = likelihood
        self.prior = prior
        self.structure = stats.structure
        self.approx = stats.approx
        self.n_data = int(round(stats.sums["n_data"].item()))
        device, dtype = prior.log_precision.device, prior.log_precision.dtype
        self._lik_stats = {k: v.to(device, dtype) for k, v in stats.likelihood_stats().items()}
        with torch.no_grad():
            self._sq_norms = prior.group_sq_norms().to(device, dtype)
        self._group_sizes = prior.group_sizes()
        self._tensor_sizes = torch.tensor(prior.param_sizes, dtype=dtype, device=device)
        self.trace: List[float] = []
        self.optimizer_state: dict = {}
        self._prepare(stats, device, dtype)

    @classmethod
    def fit(
        cls,
        model: nn.Module,
        dataloader: Iterable,
        likelihood: Likelihood,
        prior: GaussianPrior,
        structure: str = "kron",
        approx: str = "ggn",
        mc_samples: int = 0,
        generator: Optional[torch.Generator] = None,
    ) -> "LaplaceEvidence":
        """One pass over ``dataloader`` at the model's current weights.

        Args:
            model: Network mapping ``x`` to outputs ``(B, C)``.
            dataloader: Iterable of ``(x, y)`` batches covering the training set once.
            likelihood: ``GaussianLikelihood`` or ``CategoricalLikelihood``.
            prior: ``GaussianPrior`` over the network's parameters.
            structure: ``"full"``, ``"kron"`` or ``"diag"``.
            approx: ``"ggn"`` (generalized Gauss-Newton) or ``"ef"`` (empirical Fisher).
            mc_samples: Monte-Carlo samples per example for the GGN; 0 for the exact GGN.
            generator: Random generator for the Monte-Carlo samples.

        Returns:
            The evidence object.

        Raises:
            ValueError: On bad options or a model the structure cannot handle.
            TypeError: On batches that are not ``(x, y)`` pairs.
        """
        stats = collect_statistics(model, dataloader, likelihood, prior, structure, approx, mc_samples, generator)
        return cls(stats, likelihood, prior)

    @classmethod
    def from_statistics(cls, stats: CurvatureStatistics, likelihood: Likelihood, prior: GaussianPrior) -> "LaplaceEvidence":
        """Build the evidence from statistics already gathered (e.g. all-reduced across processes)."""
        return cls(stats, likelihood, prior)

    def _prepare(self, stats: CurvatureStatistics, device: torch.device, dtype: torch.dtype) -> None:
        """Cache what every evaluation reuses: eigenvalues, diagonals, Gram matrix or rows."""
        sums = {k: v.to(device, dtype) for k, v in stats.sums.items()}
        if self.structure == "diag":
            self._diag = sums["diag"]
        elif self.structure == "kron":
            self._layers = stats.layers
            self._factors = [
                (sums[f"kron.{j}.G"], sums[f"kron.{j}.A"] / sums[f"kron.{j}.count"]) for j in range(len(stats.layers))
            ]
            self._eig_g = [torch.linalg.eigvalsh(g).clamp(min=0) for g, _ in self._factors]
            self._eig_a = [torch.linalg.eigvalsh(a).clamp(min=0) for _, a in self._factors]
        else:
            self._gram = sums.get("gram")
            self._rows = None if stats.rows is None else stats.rows.to(device, dtype)
            self._row_grams = None
            if self._rows is not None and self.prior.structure != "diagonal":
                # U D^-1 U^T = sum_t U_t U_t^T / delta_t: one R x R Gram per tensor makes a step O(T R^2 + R^3)
                blocks = torch.split(self._rows, self.prior.param_sizes, dim=1)
                self._row_grams = torch.stack([b @ b.T for b in blocks])

    # --- evaluation ---------------------------------------------------------------------------

    def _hyper(self) -> Dict[str, Tensor]:
        values = {"log_precision": self.prior.log_precision}
        values.update(self.likelihood.hyperparameters())
        return values

    def _log_likelihood(self, h: Dict[str, Tensor]) -> Tensor:
        return self.likelihood.log_likelihood(self._lik_stats, h.get("log_sigma"), h["log_temperature"])

    def _log_prior(self, h: Dict[str, Tensor]) -> Tensor:
        log_prec = h["log_precision"]
        return (
            0.5 * (self._group_sizes * log_prec).sum()
            - 0.5 * (log_prec.exp() * self._sq_norms).sum()
            - 0.5 * self.prior.n_params * math.log(2 * math.pi)
        )

    def _log_det(self, h: Dict[str, Tensor]) -> Tensor:
        scale = self.likelihood.curvature_scale(self.approx, h.get("log_sigma"), h["log_temperature"])
        log_prec = h["log_precision"]
        if self.structure == "diag":
            if self.prior.structure == "diagonal":
                return torch.log(scale * self._diag + log_prec.exp()).sum()
            # one precision per tensor: add it blockwise instead of expanding it to P entries
            delta = self.prior.per_tensor(log_prec).exp()
            blocks = torch.split(self._diag, self.prior.param_sizes)
            return torch.stack([torch.log(scale * c + d).sum() for c, d in zip(blocks, delta)]).sum()
        if self.structure == "kron":
            delta = self.prior.per_tensor(log_prec).exp()
            total = log_prec.new_zeros(())
            for layer, q, w in zip(self._layers, self._eig_g, self._eig_a):
                total = total + torch.log(scale * torch.outer(q, w) + delta[layer.weight]).sum()
                if layer.bias is not None:
                    total = total + torch.log(scale * q + delta[layer.bias]).sum()
            return total
        if self._gram is not None:
            matrix = scale * self._gram + torch.diag(self.prior.per_parameter(log_prec).exp())
            return 2 * torch.log(torch.diagonal(torch.linalg.cholesky(matrix))).sum()
        # determinant lemma: |s U^T U + D| = |D| |I + s U D^-1 U^T|, for fewer rows than parameters
        eye = torch.eye(self._rows.shape[0], dtype=self._rows.dtype, device=self._rows.device)
        if self._row_grams is not None:
            log_delta = self.prior.per_tensor(log_prec)
            inner = eye + scale * torch.einsum("t,trs->rs", torch.exp(-log_delta), self._row_grams)
            log_det_prior = (self._tensor_sizes * log_delta).sum()
        else:
            scaled = self._rows * torch.sqrt(scale * torch.exp(-log_prec))
            inner = eye + scaled @ scaled.T
            log_det_prior = log_prec.sum()
        return log_det_prior + 2 * torch.log(torch.diagonal(torch.linalg.cholesky(inner))).sum()

    def _log_marglik(self, h: Dict[str, Tensor]) -> Tensor:
        return (
            self._log_likelihood(h)
            + self._log_prior(h)
            + 0.5 * self.prior.n_params * math.log(2 * math.pi)
            - 0.5 * self._log_det(h)
        )

    def log_likelihood(self) -> Tensor:
        """Tempered log-likelihood ``log p(D|theta) / T`` at the current hyperparameters."""
        return self._log_likelihood(self._hyper())

    def log_prior(self) -> Tensor:
        """Normalized log prior density ``log p(theta|delta)``."""
        return self._log_prior(self._hyper())

    def log_det(self) -> Tensor:
        """``log|H|`` of the posterior precision ``H = s C + diag(delta)``."""
        return self._log_det(self._hyper())

    def log_marglik(self) -> Tensor:
        """Total (not per-datum) Laplace log marginal likelihood as a 0-dim tensor.

        Differentiable w.r.t. ``prior.log_precision``, ``likelihood.log_sigma`` and
        ``likelihood.log_temperature`` wherever those require grad.
        """
        return self._log_marglik(self._hyper())

    # --- posterior ----------------------------------------------------------------------------

    def jacobian_covariance(self, jacobians: Tensor) -> Tensor:
        """``J H^-1 J^T`` for each row block of ``jacobians``, with ``H`` at the current hyperparameters.

        The posterior covariance has the structure of the evidence (full, Kronecker, diagonal).

        Args:
            jacobians: Output Jacobians ``(B, C, P)``, parameters flattened in the prior's order.

        Returns:
            Covariances ``(B, C, C)`` of the linearized outputs.
        """
        h = {n: t.detach() for n, t in self._hyper().items()}
        scale = self.likelihood.curvature_scale(self.approx, h.get("log_sigma"), h["log_temperature"])
        jacobians = jacobians.to(h["log_precision"].dtype)
        if self.structure == "diag":
            variance = 1 / (scale * self._diag + self.prior.per_parameter(h["log_precision"]).exp())
            return torch.einsum("bcp,p,bdp->bcd", jacobians, variance, jacobians)
        if self.structure == "kron":
            return self._kron_covariance(jacobians, scale, self.prior.per_tensor(h["log_precision"]).exp())
        delta = self.prior.per_parameter(h["log_precision"]).exp()
        flat = jacobians.reshape(-1, jacobians.shape[2])
        if self._gram is not None:
            chol = torch.linalg.cholesky(scale * self._gram + torch.diag(delta))
            half = torch.linalg.solve_triangular(chol, flat.T, upper=False)
            cov = half.T @ half
        else:  # Woodbury: H^-1 = D^-1 - D^-1 U^T (I/s + U D^-1 U^T)^-1 U D^-1
            ud = self._rows / delta
            inner = torch.eye(ud.shape[0], dtype=ud.dtype, device=ud.device) / scale + ud @ self._rows.T
            projected = flat @ ud.T
            cov = (flat / delta) @ flat.T - projected @ torch.linalg.solve(inner, projected.T)
        b, c = jacobians.shape[:2]
        return torch.stack([cov[i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(b)])

    def _kron_covariance(self, jacobians: Tensor, scale: Tensor, delta: Tensor) -> Tensor:
        offsets = [0]
        for size in self.prior.param_sizes:
            offsets.append(offsets[-1] + size)
        b, c = jacobians.shape[:2]
        cov = jacobians.new_zeros(b, c, c)
        for layer, (g, a) in zip(self._layers, self._factors):
            q, vec_g = torch.linalg.eigh(g)
            w, vec_a = torch.linalg.eigh(a)
            q, w = q.clamp(min=0), w.clamp(min=0)
            j_w = jacobians[:, :, offsets[layer.weight] : offsets[layer.weight + 1]].reshape(b, c, len(q), len(w))
            rotated = vec_g.T @ j_w @ vec_a
            cov += torch.einsum("bcij,ij,bdij->bcd", rotated, 1 / (scale * torch.outer(q, w) + delta[layer.weight]), rotated)
            if layer.bias is not None:
                rotated_b = jacobians[:, :, offsets[layer.bias] : offsets[layer.bias + 1]] @ vec_g
                cov += torch.einsum("bci,i,bdi->bcd", rotated_b, 1 / (scale * q + delta[layer.bias]), rotated_b)
        return cov

    # --- optimization -------------------------------------------------------------------------

    def _learnable(self) -> Dict[str, Tensor]:
        buffers = self._hyper()
        names = (["log_precision"] if self.prior.learn else []) + self.likelihood.learnable()
        return {n: buffers[n] for n in names}

    def optimize(self, steps: int = 100, lr: float = 0.1, state: Optional[dict] = None) -> Tensor:
        """Take ``steps`` Adam steps on the learnable log hyperparameters, reusing the cached curvature.

        The results are written back into the prior and likelihood buffers. A step that would make
        the evidence non-finite is not taken: the optimization stops at the last finite point
        with a warning. ``trace`` records the log marglik before every step and at the end.

        Args:
            steps: Number of Adam steps ``K``.
            lr: Adam learning rate ``gamma`` (in log space).
            state: Adam state from an earlier call (``optimizer_state``), to continue its moment
                estimates across estimations as one optimizer would.

        Returns:
            The log marginal likelihood at the final hyperparameters (detached).

        Raises:
            ValueError: On a negative ``steps`` or non-positive ``lr``.
        """
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"`steps` must be an int >= 0, got {steps!r}.")
        if not lr > 0:
            raise ValueError(f"`lr` must be positive, got {lr!r}.")
        buffers = self._learnable()
        fixed = {n: t.detach() for n, t in self._hyper().items()}
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in buffers.items()}
        optimizer = torch.optim.Adam(list(leaves.values()), lr=lr, fused=True) if leaves else None
        if optimizer is not None and state:
            optimizer.load_state_dict(state)
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.trace = []
        last_good = {n: t.detach().clone() for n, t in leaves.items()}
        for _ in range(steps if optimizer else 0):
            value = self._log_marglik({**fixed, **leaves})
            if not torch.isfinite(value):
                warnings.warn("Non-finite log marginal likelihood; stopped the hyperparameter steps early.")
                break
            self.trace.append(value.item())
            last_good = {n: t.detach().clone() for n, t in leaves.items()}
            optimizer.zero_grad()
            (-value).backward()
            optimizer.step()
        final = self._log_marglik({**fixed, **{n: t.detach() for n, t in leaves.items()}})
        if not torch.isfinite(final):
            final = self._log_marglik({**fixed, **last_good})
            leaves = last_good
        with torch.no_grad():
            for name, buffer in buffers.items():
                buffer.copy_(leaves[name].detach())
        self.trace.append(final.item())
        self.optimizer_state = optimizer.state_dict() if optimizer is not None else {}
        return final.detach()

    def gradient(self) -> Dict[str, Tensor]:
        """Gradient of the log marglik w.r.t. each learnable log hyperparameter (for diagnostics)."""
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in self._learnable().items()}
        fixed = {n: t.detach() for n, t in self._hyper().items()}
        value = self._log_marglik({**fixed, **leaves})
        grads = torch.autograd.grad(value, list(leaves.values())) if leaves else []
        return dict(zip(leaves, grads))
