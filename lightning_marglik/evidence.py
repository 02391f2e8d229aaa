"""The Laplace estimate of the log marginal likelihood from cached curvature statistics.

``log q(D|M) = log p(D|theta)/T + log p(theta|delta) + P/2 log(2 pi) - 1/2 log|H|`` with
``H = s C + diag(delta)``, plus ``log p(log delta)`` where the prior has a hyperprior (type-II MAP). After the one expensive pass over the data, every evaluation reuses
the structures' cached decompositions, so hyperparameter steps are cheap. All of it runs in
float64 whatever the model's dtype. Knows nothing of Lightning.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from . import solvers
from .curvature import CurvatureOptions, CurvatureStatistics, collect_statistics
from .curvature.batches import BatchFn, non_finite_data_rows, split_batch
from .curvature.statistics import Jacobian
from .denormals import DenormalFlush
from .hyperparameters import (
    GaussianPrior, Likelihood, assign_hyperparameters, check_likelihood_and_prior, learnable_values,
)
from .likelihoods import LOG_LIMIT
from .validators import choice, flag, number, optional

__all__ = ["LaplaceEvidence", "SOLVERS", "require_data"]

SOLVERS = ("adam", "newton")


def weights_fingerprint(params: List[Tensor]) -> Tensor:
    """Per tensor its sum and sum of squares in float64: two numbers that change when the weights do (an
    optimizer step, a loaded checkpoint), one cheap pass over them; of this rank's shard where FSDP2 shards a
    tensor (a DTensor), so that no rank waits on another."""
    rows = []
    with torch.no_grad():
        for p in params:
            local = (p.to_local() if hasattr(p, "to_local") else p).detach().double()
            rows.append(torch.stack([local.sum(), local.pow(2).sum()]).to(rows[0].device if rows else local.device))
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 2, dtype=torch.float64)  # one sync on a GPU


def function_buffers(prior: GaussianPrior) -> List[Tensor]:
    """The floating buffers of the prior's network outside the hyperparameter modules (e.g. BatchNorm's running
    statistics): with the weights, what the network computes in eval mode."""
    hyper = [m for m in prior.model.modules() if isinstance(m, (GaussianPrior, Likelihood))]
    skip = {id(b) for m in hyper for b in m.buffers()}
    return [b for b in prior.model.buffers() if b.is_floating_point() and id(b) not in skip]


def _refuse_non_finite_data(dataloader: Iterable, batch_fn: Optional[BatchFn]) -> int:
    """Name the first batch whose inputs or targets hold NaN or inf (read again: only where the evidence is not
    finite); returns the number of batches read (0: a one-pass iterable, already spent).

    Raises:
        ValueError: Naming the batch, the rows and the fix.
    """
    index = -1
    for index, batch in enumerate(dataloader):
        inputs, target = split_batch(batch, batch_fn)
        for part, rows in (("inputs", non_finite_data_rows(inputs)), ("targets", non_finite_data_rows(target))):
            if rows:
                raise ValueError(f"LaplaceEvidence.fit: batch {index}'s {part} hold NaN or inf (rows {rows}, the "
                                 "first of them), so the evidence is not finite: clean the data (drop or impute those "
                                 "rows).")
    return index + 1


def require_data(n_data: int, likelihood: Likelihood) -> None:
    """Refuse evidence data without a datum: neither the evidence nor ``map_loss`` is defined there.

    Raises:
        ValueError: If ``n_data`` is 0 (e.g. every label is ``ignore_index``), naming the fix.
    """
    if n_data == 0:
        ignore = getattr(likelihood, "ignore_index", None)
        every = f": every label equals ignore_index={ignore}" if ignore is not None else ""
        raise ValueError(
            f"The evidence data hold no datum (n_data = 0){every}; the evidence needs at least one. Check the "
            "labels (e.g. a collator that masks them all, or the wrong ignore_index)."
        )


def _first_process() -> bool:
    """Whether this is the only process or the first of a process group."""
    return not torch.distributed.is_available() or not torch.distributed.is_initialized() or (
        torch.distributed.get_rank() == 0)


def _unbounded_message(names: Tuple[str, ...], limits: Dict[str, float], buffers: Dict[str, Tensor]) -> str:
    """Why the evidence ran ``names`` to the edge of their buffers' range, and the fix."""
    said = []
    for name in names:
        edge = f"the edge of what {buffers[name].dtype} holds (|log| = {limits[name]:.1f})"
        if name == "log_sigma":
            said.append(f"sigma ran to {edge}, the evidence still rising: the network fits its training data exactly "
                        "(residuals ~0), where the evidence has no optimum in sigma; hold sigma at the noise you "
                        "expect: GaussianLikelihood(sigma=..., learn_sigma=False)")
        elif name == "log_precision":
            said.append(f"prior precisions ran to {edge}, the evidence still rising (their weights are ~0); hold "
                        "them: GaussianPrior(fixed=[...]) with those tensors' names")
        else:
            said.append(f"{name} ran to {edge}, the evidence still rising: it has no finite optimum; hold it fixed")
    return "LaplaceEvidence.optimize: " + "; ".join(said) + "."


class LaplaceEvidence:
    """Laplace evidence of a network at its current weights, differentiable in the log hyperparameters.

    Build it with :meth:`fit` (one pass over the data) or :meth:`from_statistics` (statistics
    gathered elsewhere, e.g. summed over processes).

    Args:
        stats: Curvature and likelihood statistics of the whole training set.
        likelihood: The likelihood; its hyperparameters (e.g. ``log_sigma``, ``log_temperature``)
            enter the evidence.
        prior: The prior whose ``log_precision`` enters the evidence.
        params: The weights of the prior term ``||theta||^2`` (default: the prior's parameters, at
            which the statistics were gathered); e.g. the linearized model's optimum
            (:func:`lightning_marglik.linearized.linearized_evidence`).

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_marglik import GaussianLikelihood, GaussianPrior
        >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> data = DataLoader(TensorDataset(torch.randn(32, 1), torch.randn(32, 1)), batch_size=8)
        >>> prior, lik = GaussianPrior(net), GaussianLikelihood()
        >>> evidence = LaplaceEvidence.fit(net, data, lik, prior, structure="kron")
        >>> solution = evidence.optimize(solver="newton")
        >>> bool(solution.value >= evidence.log_marglik())
        True
        >>> evidence.set_hyperparameters(solution.values)   # write them into prior and likelihood
    """

    def __init__(
        self, stats: CurvatureStatistics, likelihood: Likelihood, prior: GaussianPrior,
        params: Optional[List[Tensor]] = None,
    ) -> None:
        self.likelihood = likelihood
        self.prior = prior
        self.options = stats.options
        self.structure = stats.options.structure
        self.approx = stats.options.approx
        self.n_data = stats.n_data
        self.estimator = stats.estimator  # which GGN estimator the pass ran, and why
        require_data(self.n_data, likelihood)
        self.slow = dict(stats.slow)
        stats.prepare()
        self.structures = stats.structures
        device = prior.log_precision.device
        self._lik_stats = {k: v.to(device) for k, v in stats.likelihood.items()}
        with torch.no_grad():
            weights = prior.params if params is None else params
            self._sq_norms = prior.group_sq_norms([p.detach() for p in weights], torch.float64).to(device)
            # the weights (and running statistics) the statistics were gathered at
            self._fingerprint = weights_fingerprint(prior.params + function_buffers(prior))
        self._group_sizes = prior.group_sizes().to(torch.float64)
        self._tensor_groups = self._groups_of_tensors()

    @classmethod
    def fit(
        cls,
        model: nn.Module,
        dataloader: Iterable,
        likelihood: Likelihood,
        prior: GaussianPrior,
        structure: str = "kron",
        approx: str = "ggn",
        mc_samples: Union[int, str] = "auto",
        generator: Optional[torch.Generator] = None,
        batch_fn: Optional[BatchFn] = None,
        max_memory: int = CurvatureOptions.max_memory,
        backend: str = "hooks",
        flush_denormals: bool = True,
        max_output_factor: Optional[int] = CurvatureOptions.max_output_factor,
    ) -> "LaplaceEvidence":
        """One pass over ``dataloader`` at the model's current weights; stores the count of data on the
        prior (``prior.n_data``, the default ``N`` of :func:`map_loss`).

        Args:
            model: Network mapping inputs to outputs ``(B, ..., C)``.
            dataloader: Iterable of batches covering the training set once.
            likelihood: ``GaussianLikelihood`` or ``CategoricalLikelihood``.
            prior: ``GaussianPrior`` over the network's trainable parameters.
            structure: ``"full"``, ``"kron"``, ``"ekfac"`` (reads ``dataloader`` twice) or ``"diag"``.
            approx: ``"ggn"`` (generalized Gauss-Newton) or ``"ef"`` (empirical Fisher).
            mc_samples: Monte-Carlo samples per example for the GGN; 0 for the exact GGN; ``"auto"``
                (default): exact while it takes at most 10 backward passes per batch (up to 11 classes), one
                sample beyond, so that the pass's backward passes do not grow with the number of outputs
                (:mod:`.curvature.estimator`; which ran and why: :attr:`estimator`).
            generator: Random generator for the Monte-Carlo samples (default: one seeded 0, so that the same
                call gives the same evidence, whether ``mc_samples=k`` or ``"auto"`` chose to sample).
            batch_fn: Maps a batch to ``(inputs, targets)``; inputs a tensor, tuple or dict.
            max_memory: Bytes the ``full`` structure may allocate for its ``P x P`` matrices.
            backend: ``"hooks"`` or ``"backpack"`` (optional extra, see :mod:`.curvature.backpack`).
            flush_denormals: Flush denormal floats to zero on the CPU during the pass, then restore the
                setting found (:class:`~lightning_marglik.denormals.DenormalFlush`: weights the evidence
                shrank make the pass many times slower otherwise). Wrap a plain training loop in
                ``with DenormalFlush():`` to speed up its epochs alike.
            max_output_factor: ``kron``/``ekfac``: a layer with more outputs (a 10,000-class or 50,257-token
                head) holds only the diagonal of its output-side Kronecker factor, whose exact ``out x out``
                form and eigendecomposition would dominate the estimate; ``None``: every factor exact. Which
                layers and why: :attr:`estimator`.

        Returns:
            The evidence object.

        Raises:
            ValueError: On bad options, a model the structure cannot handle, bad targets, data
                without a datum (every label ``ignore_index``), or data holding NaN or inf that make the
                evidence not finite (named by batch and rows).
            TypeError: On batches that are not ``(inputs, targets)`` pairs, or a ``likelihood`` or ``prior`` that is
                not one (e.g. the two passed in the other order).
        """
        check_likelihood_and_prior(likelihood, prior, "LaplaceEvidence.fit(model, dataloader, likelihood, prior)")
        options = CurvatureOptions(structure, approx, mc_samples, max_memory, backend, max_output_factor)
        with DenormalFlush(flag(flush_denormals, "flush_denormals")):
            stats = collect_statistics(
                model, dataloader, likelihood, prior, generator=generator, batch_fn=batch_fn, options=options
            )
        evidence = cls(stats, likelihood, prior)
        prior.record_n_data(evidence.n_data)
        if not bool(torch.isfinite(evidence.log_marglik().detach())):
            if _refuse_non_finite_data(dataloader, batch_fn):
                cause = "though the data are: NaN or inf weights, or a forward that diverges at them"
            else:  # a generator: nothing left to read
                cause = ("NaN or inf in the data or the weights; the data were a one-pass iterable, which could not be "
                         "read again to tell which (pass a list or a DataLoader)")
            warnings.warn(f"LaplaceEvidence.fit: the evidence is not finite at the model's current weights, {cause}.",
                          stacklevel=2)
        return evidence

    @classmethod
    def from_statistics(
        cls, stats: CurvatureStatistics, likelihood: Likelihood, prior: GaussianPrior,
        params: Optional[List[Tensor]] = None,
    ) -> "LaplaceEvidence":
        """Build the evidence from statistics already gathered (e.g. all-reduced across processes);
        ``params``: the weights of the prior term (default: the prior's parameters)."""
        return cls(stats, likelihood, prior, params)

    # --- hyperparameters -----------------------------------------------------------------------

    def hyperparameters(self) -> Dict[str, Tensor]:
        """The current log hyperparameter buffers by name (the prior's, then the likelihood's own)."""
        return {"log_precision": self.prior.log_precision, **self.likelihood.hyperparameters()}

    def learnable(self) -> List[str]:
        """Names of the log hyperparameters the evidence optimizes."""
        return list(learnable_values(self.prior, self.likelihood))

    def _current(self) -> Dict[str, Tensor]:
        """The hyperparameter buffers as float64 constants."""
        return {n: t.detach().to(torch.float64) for n, t in self.hyperparameters().items()}

    def _learnable_values(self) -> Dict[str, Tensor]:
        """The optimized variables as float64 copies (the prior's restricted to its learned groups)."""
        return {n: t.to(torch.float64).clone() for n, t in learnable_values(self.prior, self.likelihood).items()}

    def _with_fixed(self, current: Dict[str, Tensor], values: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Every hyperparameter: ``values`` where learned, the current value where fixed (differentiable)."""
        full = {**current, **values}
        if "log_precision" in values:
            full["log_precision"] = current["log_precision"].masked_scatter(
                self.prior.learned_groups(), values["log_precision"]
            )
        return full

    def set_hyperparameters(self, values: Dict[str, Tensor]) -> None:
        """Write log hyperparameters (e.g. ``optimize(...).values``) into the prior and likelihood."""
        assign_hyperparameters(self.prior, self.likelihood, values)

    # --- evaluation ---------------------------------------------------------------------------

    def _scale(self, values: Dict[str, Tensor]) -> Tensor:
        return self.likelihood.curvature_scale(self.approx, values)

    def _groups_of_tensors(self) -> List[Tensor]:
        """Per prior tensor, the entries of ``log_precision`` its log precision comes from."""
        device = self.prior.log_precision.device
        if self.prior.structure == "diagonal":
            ends = torch.tensor(self.prior.param_sizes).cumsum(0).tolist()
            return [torch.arange(end - size, end, device=device) for end, size in zip(ends, self.prior.param_sizes)]
        scalar = self.prior.structure == "scalar"
        return [torch.tensor([0 if scalar else t], device=device) for t in range(len(self.prior.param_sizes))]

    def _pieces(self, values: Dict[str, Tensor]) -> Dict[str, Tensor]:
        values = {k: v.to(torch.float64) for k, v in values.items()}
        log_prec = values["log_precision"]
        log_delta = self.prior.tensor_log_precisions(log_prec)
        log_det = sum(s.log_det(self._scale(values), log_delta) for s in self.structures)
        log_prior = (
            0.5 * (self._group_sizes * log_prec).sum()
            - 0.5 * (log_prec.exp() * self._sq_norms).sum()
            - 0.5 * self.prior.n_params * math.log(2 * math.pi)
        )
        return {
            "log_likelihood": self.likelihood.log_likelihood(self._lik_stats, values),
            "log_prior": log_prior,
            "log_det": log_det,
            "log_hyperprior": self.prior.log_hyperprior(log_prec),
        }

    def log_marglik_at(self, values: Dict[str, Tensor]) -> Tensor:
        """The log marginal likelihood at log hyperparameters ``values`` (every name of
        :meth:`hyperparameters`), differentiable in them: the objective of the inner solvers.
        With a hyperprior (``GaussianPrior(hyperprior=...)``) its log density is included."""
        pieces = self._pieces(values)
        return (
            pieces["log_likelihood"]
            + pieces["log_prior"]
            + 0.5 * self.prior.n_params * math.log(2 * math.pi)
            - 0.5 * pieces["log_det"]
            + pieces["log_hyperprior"]
        )

    @property
    def likelihood_statistics(self) -> Dict[str, Tensor]:
        """The likelihood's summed statistics of the data (``n_data`` among them; a copy), e.g. for
        :func:`lightning_marglik.diagnostics.traces_from_statistics`."""
        return dict(self._lik_stats)

    def log_likelihood(self) -> Tensor:
        """Tempered log-likelihood ``log p(D|theta) / T`` at the current hyperparameters."""
        return self._pieces(self.hyperparameters())["log_likelihood"]

    def log_prior(self) -> Tensor:
        """Normalized log prior density ``log p(theta|delta)``."""
        return self._pieces(self.hyperparameters())["log_prior"]

    def log_det(self) -> Tensor:
        """``log|H|`` of the posterior precision ``H = s C + diag(delta)``."""
        return self._pieces(self.hyperparameters())["log_det"]

    def log_hyperprior(self) -> Tensor:
        """``sum_g log p(log delta_g)`` over the learned groups (0 without a hyperprior)."""
        return self._pieces(self.hyperparameters())["log_hyperprior"]

    def log_marglik(self) -> Tensor:
        """Total (not per-datum) Laplace log marginal likelihood as a 0-dim float64 tensor; with a
        hyperprior, ``log q(D|delta) + log p(log delta)`` (the type-II MAP objective).

        Differentiable w.r.t. the hyperparameter buffers wherever those require grad. NaN where
        the curvature is not finite or a factorisation fails.
        """
        return self.log_marglik_at(self.hyperparameters())

    def _likelihood_derivatives(
        self, full: Dict[str, Tensor], names: List[str], ld_u: Tensor, ld_uu: Tensor
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The tempered log-likelihood ``L``; the gradient and Hessian of ``L - log|H| / 2`` in the
        likelihood's learned log hyperparameters ``names`` (at most two scalars: autograd), which
        enter ``log|H|`` through ``u = log s`` only (``ld_u``, ``ld_uu``: its derivatives in ``u``);
        and the gradient of ``u``."""
        if not names:
            empty = full["log_precision"].new_zeros(0)
            return self.likelihood.log_likelihood(self._lik_stats, full), empty, empty.reshape(0, 0), empty
        leaves = [full[n].detach().reshape(()).requires_grad_(True) for n in names]
        point = {**full, **dict(zip(names, leaves))}
        with torch.enable_grad():
            loglik = self.likelihood.log_likelihood(self._lik_stats, point)
            log_scale = torch.log(self._scale(point))
            grad_l = torch.autograd.grad(loglik, leaves, create_graph=True, allow_unused=True, materialize_grads=True)
            grad_u = torch.autograd.grad(log_scale, leaves, create_graph=True, allow_unused=True, materialize_grads=True)
            combined = [gl - 0.5 * ld_u * gu for gl, gu in zip(grad_l, grad_u)]  # ld_u held fixed: its own change is ld_uu
            rows = [
                torch.stack(torch.autograd.grad(c, leaves, retain_graph=True, allow_unused=True, materialize_grads=True))
                if c.requires_grad else torch.zeros_like(c).expand(len(leaves))
                for c in combined
            ]
        u_grad = torch.stack(grad_u).detach()
        hessian = torch.stack(rows).detach() - 0.5 * ld_uu * torch.outer(u_grad, u_grad)
        return loglik.detach(), torch.stack(combined).detach(), hessian, u_grad

    def _second_order(self, current: Dict[str, Tensor], learned: Tensor, values: Dict[str, Tensor]) -> solvers.SecondOrder:
        """The log marglik with its gradient and Hessian in the learnable ``values`` (flat, in their
        order), in closed form from the structures' :meth:`log_det_derivatives`: diagonal in the
        prior precisions (plus their coupling under a full curvature) with a border for the
        likelihood's hyperparameters, which enter the log-determinant through ``u = log s``."""
        names = [n for n in values if n != "log_precision"]
        full = {k: v.detach() for k, v in self._with_fixed(current, values).items()}
        log_prec = full["log_precision"]
        log_delta = self.prior.tensor_log_precisions(log_prec)
        parts = [s.log_det_derivatives(self._scale(full), log_delta) for s in self.structures]
        if not all(bool(torch.isfinite(p.value)) for p in parts):
            # non-finite curvature or a failed factorisation: no derivatives, the solver rejects the point
            raise torch.linalg.LinAlgError("the log-determinant is not finite at this point")
        ld_u, ld_uu = sum(p.u for p in parts), sum(p.uu for p in parts)
        loglik, grad_lik, hess_lik, u_grad = self._likelihood_derivatives(full, names, ld_u, ld_uu)
        first, mixed, second = (log_prec.new_zeros(log_prec.numel()) for _ in range(3))
        index = torch.cat([self._tensor_groups[t] for p in parts for t in p.rho])
        for total, store in ((first, "rho"), (mixed, "rho_u"), (second, "rho_rho")):
            total.index_add_(0, index, torch.cat([v.reshape(-1) for p in parts for v in getattr(p, store).values()]))
        cross = None
        for part in parts:
            if part.cross is not None:
                cross = log_prec.new_zeros(log_prec.numel(), log_prec.numel()) if cross is None else cross
                at = torch.cat([self._tensor_groups[t] for t in part.cross[0]])
                cross.index_put_((at.unsqueeze(1), at.unsqueeze(0)), part.cross[1], accumulate=True)
        delta_norms = log_prec.exp() * self._sq_norms
        hyper, hyper_first, hyper_second = self.prior.log_hyperprior_derivatives(log_prec)
        value = (
            loglik + 0.5 * (self._group_sizes * log_prec).sum() - 0.5 * delta_norms.sum()
            - 0.5 * sum(p.value for p in parts) + hyper
        )
        if "log_precision" not in values:
            learned = torch.zeros_like(learned)
        grad_rho = (0.5 * self._group_sizes - 0.5 * delta_norms - 0.5 * first + hyper_first)[learned]
        hess_rho = (-0.5 * delta_norms - 0.5 * second + hyper_second)[learned]
        border = (-0.5 * mixed[learned]).unsqueeze(1) * u_grad.unsqueeze(0)  # (groups, likelihood names)
        n_rho, n = len(grad_rho), len(grad_rho) + len(names)
        gradient = torch.cat([grad_rho, grad_lik])
        if cross is not None and n <= solvers.DENSE_LIMIT:
            hessian = torch.diag(torch.cat([hess_rho, hess_lik.new_zeros(len(names))]))
            hessian[:n_rho, :n_rho] -= 0.5 * cross[learned][:, learned]
            hessian[:n_rho, n_rho:], hessian[n_rho:, :n_rho], hessian[n_rho:, n_rho:] = border, border.T, hess_lik
            return solvers.SecondOrder(value, gradient, torch.arange(n, device=gradient.device), hessian, gradient.new_zeros(0))
        if cross is not None:  # too many coupled precisions for a dense Hessian: its diagonal (the line search guards)
            hess_rho = hess_rho - 0.5 * torch.diagonal(cross)[learned]
        rows = torch.cat([border.T, hess_lik], dim=1)
        return solvers.SecondOrder(value, gradient, torch.arange(n_rho, n, device=gradient.device), rows, hess_rho)

    # --- posterior ----------------------------------------------------------------------------

    def fitted_at(self, params: List[Tensor]) -> bool:
        """Whether ``params`` (the prior's tensors, in its order) and the network's buffers
        (:func:`function_buffers`: BatchNorm's running statistics) are those the curvature was gathered at (their
        sums and sums of squares, to float64 rounding): the posterior covariance belongs to them only, e.g. not to
        a checkpoint loaded after the estimate, to weights trained further, or to running statistics updated by
        forwards in train mode."""
        now = weights_fingerprint(list(params) + function_buffers(self.prior))
        return now.shape == self._fingerprint.shape and bool(torch.allclose(now, self._fingerprint, rtol=1e-9, atol=1e-12))

    def jacobian_covariance(self, jacobians: Tensor) -> Tensor:
        """``J H^-1 J^T`` for each row block of ``jacobians``, with ``H`` at the current hyperparameters.

        The posterior covariance has the structure of the evidence (full, Kronecker, diagonal).

        Args:
            jacobians: Output Jacobians ``(B, C, P)``, parameters flattened in the prior's order.

        Returns:
            Covariances ``(B, C, C)`` of the linearized outputs.
        """
        return self._block_covariance(list(torch.split(jacobians.to(torch.float64), self.prior.param_sizes, dim=2)))

    def _block_covariance(self, blocks: List[Jacobian]) -> Tensor:
        """:meth:`jacobian_covariance` of the Jacobians per prior tensor: ``(B, C, numel_t)`` in float64, or a
        :class:`~.curvature.statistics.RankOneJacobian` for an ``nn.Linear`` weight a ``kron`` structure covers."""
        values = self._current()
        scale = self._scale(values)
        delta = [d.exp() for d in self.prior.tensor_log_precisions(values["log_precision"])]
        return sum(s.covariance(blocks, scale, delta) for s in self.structures)

    # --- optimization -------------------------------------------------------------------------

    def optimize(
        self,
        steps: int = 100,
        lr: float = 0.1,
        state: Optional[dict] = None,
        solver: str = "newton",
        tol: float = 1e-6,
        max_evaluations: int = 20,
        max_step: Optional[float] = None,
    ) -> solvers.Solution:
        """Optimize the learnable log hyperparameters on the cached curvature; nothing is written.

        The result is never worse than the start (the best point seen is kept); a step that makes
        the evidence non-finite or a factorisation fail is rejected. Write the result with
        :meth:`set_hyperparameters`.

        ``max_step`` bounds the move of this one solve: every learned ``log delta_g`` stays within
        ``max_step`` of its start (a box; Newton solves the box-constrained problem by projection,
        Adam clips each iterate into it), as the paper's ``K`` Adam steps bound each estimate's
        move implicitly. The likelihood's hyperparameters (``sigma``, ``T``) are not bounded by it.

        Every value stays within what its buffer holds (:data:`.likelihoods.LOG_LIMIT`: ``|log h| <= 42.67``
        in float32), so that :meth:`set_hyperparameters` takes any solution. Where the evidence still rises at
        that edge (in the last tenth of the range) it has no finite optimum (e.g. ``sigma -> 0`` where the network fits
        its data exactly): a warning names the cause and ``Solution.unbounded`` the tensors.

        Args:
            steps: Adam steps ``K`` (``solver="adam"``).
            lr: Adam learning rate ``gamma`` in log space (``solver="adam"``).
            state: Adam state from an earlier call (``Solution.state``), to continue its moment
                estimates across estimations as one optimizer would.
            solver: ``"newton"`` (converged, see :mod:`.solvers`) or ``"adam"`` (the paper's K steps).
            tol: Newton's tolerance (predicted increase of a full step, nats).
            max_evaluations: Newton's evaluation budget.
            max_step: Largest change of any learned ``log delta_g`` from its start (e.g. 1: a factor
                ``e``); ``None``: unbounded.

        Returns:
            The solution: ``values`` (all learnable log hyperparameters, float64), ``value``
            (total log marglik there), ``state``, ``trace``, ``unbounded``.

        Raises:
            ValueError: On an unknown solver or bad solver options, a ``max_step`` that is not
                positive and finite, or an Adam ``state`` that does not fit the learnable
                hyperparameters.
        """
        solver = choice(solver, SOLVERS, "solver")
        max_step = optional(number, max_step, "max_step", what="the largest change of log delta per solve, or None")
        current = self._current()
        learnable = self._learnable_values()
        limits = {name: LOG_LIMIT[self.hyperparameters()[name].dtype] for name in learnable}
        # every value the buffers can hold, so that set_hyperparameters takes any solution
        box = {name: (start.clamp(max=-limits[name]), start.clamp(min=limits[name]))
               for name, start in learnable.items()}
        if max_step is not None and "log_precision" in learnable:
            start, (lower, upper) = learnable["log_precision"], box["log_precision"]
            box["log_precision"] = (torch.maximum(start - max_step, lower), torch.minimum(start + max_step, upper))

        def objective(values: Dict[str, Tensor]) -> Tensor:
            return self.log_marglik_at(self._with_fixed(current, values))

        if solver == "adam":
            solution = solvers.adam(objective, learnable, steps=steps, lr=lr, state=state, box=box)
        else:
            learned = self.prior.learned_groups()
            solution = solvers.newton(
                objective, learnable, tol=tol, max_evaluations=max_evaluations,
                derivatives=lambda values: self._second_order(current, learned, values), box=box,
            )
        full = self._with_fixed(current, solution.values)
        # in the last tenth of the range: in float64 the curvature's scale (1 / sigma^2 times the GGN) overflows
        # before the edge itself, and the solve stops short of it (log sigma -351.5 of -353.2)
        unbounded = tuple(n for n, v in solution.values.items() if bool((v.abs() >= 0.9 * limits[n]).any()))
        if unbounded and _first_process():  # one warning, not one per DDP rank (the callback's are rank 0's too)
            warnings.warn(_unbounded_message(unbounded, limits, self.hyperparameters()), stacklevel=2)
        return dataclasses.replace(solution, values={n: full[n].detach() for n in solution.values}, unbounded=unbounded)

    def gradient(self) -> Dict[str, Tensor]:
        """Gradient of the log marglik w.r.t. each learnable log hyperparameter (for diagnostics;
        the prior's learned groups only)."""
        current = self._current()
        leaves = {n: t.requires_grad_(True) for n, t in self._learnable_values().items()}
        if not leaves:
            return {}
        value = self.log_marglik_at(self._with_fixed(current, leaves))
        grads = torch.autograd.grad(value, list(leaves.values()))
        return dict(zip(leaves, grads))
