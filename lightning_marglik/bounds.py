"""Lower bounds of the Laplace evidence from partitions of the data (Immer et al., ICML 2023).

Partition the data into ``M`` parts with curvatures ``C_m`` (``C = sum_m C_m``). For positive
semi-definite ``A``, ``B``: ``log|I + A + B| <= log|I + A| + log|I + B|`` (``|I + A||I + B| =
|I + A + B + AB|``), so with ``H_m = s C_m + D`` and ``D = diag(delta)``::

    log|H| - log|D|  <=  sum_m (log|H_m| - log|D|).

With ``E_m`` the Laplace evidence of part ``m`` alone (same prior, same weights) and
``q = sum_g delta_g ||theta_g||^2`` this gives the bound::

    log q(D)  >=  sum_m E_m + (M - 1) q / 2,       with equality for M = 1.

Two ways to compute the parts' log-determinants (``bound=``):

* ``"parametric"``: the curvature structure of each part (``kron``, ``diag``, ``full``). The bound
  is then of the evidence whose curvature is ``sum_m C_m``: the full-data one for ``diag`` and
  ``full`` (the curvature is a sum over data), for ``kron`` the sum of the parts' Kronecker
  products (not the Kronecker product of the sums).
* ``"ntk"``: parts of ``subset_size`` examples, each by its kernel
  ``log|D| + log|I + s R D^-1 R^T|`` with rows ``R = L^T J`` from ``torch.func`` (Sylvester's
  identity: the ``full`` structure of the part; Fischer's inequality on the kernel of the whole
  data). Exact curvature, no ``P x P`` matrix; its cost grows with ``(subset_size C)^2 P``.

A stochastic estimate: parts holding ``n`` of the ``N`` data give
``(N / n) sum_m (E_m + q / 2) - q / 2``, unbiased for the bound of a random partition into equal
parts. :class:`BoundOptimizer` takes one Adam step on the log hyperparameters along its gradient
per batch (all-reduced over processes, where each process's batch is its part). Knows nothing
of Lightning.
"""
from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .curvature import CurvatureOptions, CurvatureStatistics, collect_statistics, eval_mode, locate
from .curvature.batches import BatchFn, batch_dims, call_model, eager, examples, move, split_batch
from .curvature.estimator import resolved_options
from .curvature.functional import jacobian_rows
from .curvature.options import BACKENDS
from .curvature.statistics import BatchCurvature
from .curvature.structures import FullStructure, structure_class, structures_with
from .evidence import LaplaceEvidence
from .hyperparameters import (
    GaussianPrior, Likelihood, assign_hyperparameters, check_likelihood_and_prior, learnable_values,
)
from .validators import choice, integer, number, optional

__all__ = ["BOUNDS", "BoundOptimizer", "EvidenceBound"]

BOUNDS = ("parametric", "ntk")
AllReduce = Callable[[Tensor], Tensor]


def check_bound_options(bound: str, structure: str, subset_size: Optional[int], backend: str) -> None:
    """Refuse options the bounds do not take, naming the fix.

    Raises:
        ValueError: On an unknown bound, a structure the parametric bound does not take, a structure other than
            ``full`` (or the default) for the NTK bound, a ``backend`` other than ``hooks`` for the NTK bound (its
            Jacobians are torch.func's), or a ``subset_size`` for the parametric bound (its parts are the batches).
    """
    if bound not in BOUNDS:
        raise ValueError(f"`bound` must be one of {BOUNDS}, got {bound!r}.")
    if bound == "parametric":
        if not structure_class(structure).parametric_bound:  # the registry's capability; ekfac reads each batch twice
            raise ValueError(
                f"bound='parametric' takes structure in {structures_with('parametric_bound')}, got {structure!r} (it "
                "reads each batch more than once); use structure='kron'."
            )
        if subset_size is not None:
            raise ValueError(
                "`subset_size` splits batches for bound='ntk'; the parametric bound's parts are the batches themselves: "
                "choose their size with the data loader's batch_size, or use bound='ntk'."
            )
    else:
        if structure not in ("kron", "full"):  # "kron" is the default: left out, it is not the user's choice
            raise ValueError(
                f"bound='ntk' bounds each subset by its exact kernel (the `full` form), so structure={structure!r} "
                "would be ignored; `structure` applies to bound='parametric' only: leave it out, or use "
                "bound='parametric'."
            )
        if choice(backend, BACKENDS, "backend") != "hooks":  # "hooks" is the default: left out, it is not the user's
            raise ValueError(
                f"bound='ntk' computes its Jacobians with torch.func, so backend={backend!r} would be ignored; "
                "`backend` applies to bound='parametric' only: leave it out, or use bound='parametric'."
            )
        if subset_size is not None:
            integer(subset_size, "subset_size", 1)


def check_no_hyperprior(prior: GaussianPrior) -> None:
    """Refuse a prior with a hyperprior: every part's evidence holds its term, which the sum would count per part.

    Raises:
        ValueError: Naming the hyperprior and what takes one.
    """
    if prior.hyperprior is not None:
        raise ValueError(
            f"The evidence bound does not take a hyperprior on the prior precisions (the prior has "
            f"{prior.hyperprior!r}); use GaussianPrior(..., hyperprior=None) for the bound, or the full "
            "evidence (LaplaceEvidence, MargLikCallback)."
        )


def check_n_data(n_data: int, n_seen: int) -> None:
    """Refuse an ``N`` below the data of the parts: the weight ``(N / n M - 1) / 2`` of ``q`` could turn negative,
    and the value would no longer bound the evidence.

    Raises:
        ValueError: Naming ``N`` and the parts' count of data.
    """
    if n_data < n_seen:
        raise ValueError(
            f"`n_data` = {n_data} is below the {n_seen} data of the parts; pass the number of training data."
        )


class EvidenceBound:
    """A lower bound of the Laplace evidence from the evidence of each part of the data.

    Build it with :meth:`fit`. Each part is a :class:`LaplaceEvidence` of its own data; the bound
    combines them as in the module docstring. With ``n_data`` larger than the parts' count of
    data it is the stochastic estimate ``(N / n) sum_m (E_m + q/2) - q/2``.

    Args:
        parts: The evidence of each part (the same prior, likelihood and weights).
        n_data: The number ``N`` of data the bound is for (default: the parts' count).

    Raises:
        ValueError: Without parts, with ``n_data`` not an int >= 1 or below the parts' count of data, or with a
            prior that has a hyperprior (each part's evidence holds its term, which the sum would count per part).

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_marglik import GaussianLikelihood, GaussianPrior
        >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> data = DataLoader(TensorDataset(torch.randn(32, 1), torch.randn(32, 1)), batch_size=8)
        >>> prior, lik = GaussianPrior(net), GaussianLikelihood()
        >>> bound = EvidenceBound.fit(net, data, lik, prior, bound="parametric", structure="diag")
        >>> exact = LaplaceEvidence.fit(net, data, lik, prior, structure="diag")
        >>> bool(bound.log_marglik() <= exact.log_marglik())
        True
    """

    def __init__(self, parts: Sequence[LaplaceEvidence], n_data: Optional[int] = None) -> None:
        if not parts:
            raise ValueError("The bound needs at least one part of the data holding a datum.")
        self.parts = list(parts)
        self.prior, self.likelihood = self.parts[0].prior, self.parts[0].likelihood
        check_no_hyperprior(self.prior)
        self.n_seen = sum(part.n_data for part in self.parts)
        # an int as BoundOptimizer takes it: int() would truncate 64.7 and read '100'
        self.n_data = self.n_seen if n_data is None else integer(n_data, "n_data", 1)
        check_n_data(self.n_data, self.n_seen)
        prior = self.prior
        with torch.no_grad():
            self._sq_norms = prior.group_sq_norms([p.detach() for p in prior.params], torch.float64).to(
                prior.log_precision.device)

    @classmethod
    def fit(
        cls,
        model: nn.Module,
        batches: Iterable,
        likelihood: Likelihood,
        prior: GaussianPrior,
        bound: str = "parametric",
        structure: str = "kron",
        approx: str = "ggn",
        mc_samples: Union[int, str] = 0,
        subset_size: Optional[int] = None,
        n_data: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        batch_fn: Optional[BatchFn] = None,
        backend: str = "hooks",
    ) -> "EvidenceBound":
        """The bound at the model's current weights, each batch a part (``"ntk"``: split into subsets).

        Args:
            model: Network mapping inputs to outputs ``(B, ..., C)``.
            batches: Iterable of ``(inputs, targets)`` batches (e.g. ``[batch]`` for one batch).
            likelihood: ``GaussianLikelihood`` or ``CategoricalLikelihood``.
            prior: ``GaussianPrior`` over the network's trainable parameters.
            bound: ``"parametric"`` or ``"ntk"``.
            structure: The parts' curvature structure for ``"parametric"``: ``"kron"``, ``"diag"``
                or ``"full"`` (ignored for ``"ntk"``).
            approx: ``"ggn"`` or ``"ef"``.
            mc_samples: Monte-Carlo samples per example for the GGN; 0 for the exact GGN; ``"auto"``: decided
                from each batch's outputs as for the evidence (:mod:`.curvature.estimator`).
            subset_size: ``"ntk"``: examples per part (default: the whole batch).
            n_data: Number ``N`` of data the bound is for (default: those of ``batches``).
            generator: Random generator of the Monte-Carlo samples.
            batch_fn: Maps a batch to ``(inputs, targets)``.
            backend: ``"hooks"`` or ``"backpack"`` (``"parametric"`` only).

        Returns:
            The bound.

        Raises:
            ValueError: On bad options (named), or batches without a datum.
            TypeError: If ``likelihood`` or ``prior`` is not one (e.g. the two passed in the other order).
        """
        check_likelihood_and_prior(likelihood, prior, "EvidenceBound.fit(model, batches, likelihood, prior)")
        check_bound_options(bound, structure, subset_size, backend)
        optional(integer, n_data, "n_data", 1)  # refused before the parts are computed (the constructor checks it too)
        parts: List[LaplaceEvidence] = []
        for batch in batches:
            if bound == "parametric":
                options = CurvatureOptions(structure, approx, mc_samples, backend=backend)
                stats = [collect_statistics(model, [batch], likelihood, prior, generator=generator, batch_fn=batch_fn, options=options)]
            else:
                stats = _kernel_statistics(model, batch, likelihood, prior, approx, mc_samples, subset_size, generator, batch_fn)
            for part in stats:
                if part.n_data > 0:
                    parts.append(LaplaceEvidence.from_statistics(part, likelihood, prior))
                    if bound == "ntk":
                        _drop_rows(part)
        return cls(parts, n_data)

    # --- evaluation ---------------------------------------------------------------------------

    @property
    def n_partitions(self) -> int:
        """Number of parts ``M``."""
        return len(self.parts)

    def hyperparameters(self) -> Dict[str, Tensor]:
        """The current log hyperparameter buffers by name."""
        return self.parts[0].hyperparameters()

    def partition_sum_at(self, values: Dict[str, Tensor]) -> Tensor:
        """``sum_m E_m`` at log hyperparameters ``values`` (every name of :meth:`hyperparameters`)."""
        return torch.stack([part.log_marglik_at(values) for part in self.parts]).sum()

    def prior_quadratic_at(self, values: Dict[str, Tensor]) -> Tensor:
        """``q = sum_g delta_g ||theta_g||^2`` at log hyperparameters ``values``."""
        return (values["log_precision"].to(torch.float64).exp() * self._sq_norms).sum()

    @staticmethod
    def combine(partition_sum: Tensor, quadratic: Tensor, n_seen: float, n_partitions: float, n_data: float) -> Tensor:
        """The bound (or its stochastic estimate) from its pieces: ``c sum_m E_m + (c M - 1) q / 2``
        with ``c = N / n``; pieces summed over processes combine the same way."""
        factor = n_data / n_seen
        return factor * partition_sum + 0.5 * (factor * n_partitions - 1) * quadratic

    def log_marglik_at(self, values: Dict[str, Tensor]) -> Tensor:
        """The bound at log hyperparameters ``values``, differentiable in them."""
        return self.combine(
            self.partition_sum_at(values), self.prior_quadratic_at(values), self.n_seen, self.n_partitions, self.n_data
        )

    def log_marglik(self) -> Tensor:
        """The bound at the current hyperparameters (total, not per datum; float64, 0-dim)."""
        return self.log_marglik_at(self.hyperparameters())

    def gradient(self) -> Dict[str, Tensor]:
        """Gradient of the bound in each learnable log hyperparameter (the prior's learned groups only)."""
        part = self.parts[0]
        leaves = {n: t.requires_grad_(True) for n, t in part._learnable_values().items()}
        if not leaves:
            return {}
        value = self.log_marglik_at(part._with_fixed(part._current(), leaves))
        return dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))


def _kernel_statistics(
    model: nn.Module,
    batch: Any,
    likelihood: Likelihood,
    prior: GaussianPrior,
    approx: str,
    mc_samples: Union[int, str],
    subset_size: Optional[int],
    generator: Optional[torch.Generator],
    batch_fn: Optional[BatchFn],
) -> List[CurvatureStatistics]:
    """Per subset of ``subset_size`` examples of ``batch``: its likelihood statistics and its rows
    ``L^T J`` (one ``vmap`` of vector-Jacobian products per subset: ``subset_size K x P`` rows at a
    time) in a ``full`` structure, which takes the kernel form while it holds fewer rows than
    parameters. ``mc_samples="auto"`` is decided from the batch's outputs, as every evidence pass decides it."""
    names, _ = locate(model, prior)
    params = prior.params
    device, dtype = params[0].device, params[0].dtype
    inputs, target = split_batch(batch, batch_fn)
    inputs, target = move(inputs, device, dtype), target.to(device)
    n = examples(inputs, target)
    dims = batch_dims(inputs, n)
    size = n if subset_size is None else subset_size
    requested = CurvatureOptions("full", approx, mc_samples, max_memory=sys.maxsize)
    out = []
    with eval_mode(model), eager():
        with torch.no_grad():
            output = call_model(model, inputs)
        options, estimator = resolved_options(requested, likelihood, output.shape)
        factor = likelihood.hessian_sqrt(output, target, options.approx, options.mc_samples, generator)
        for start in range(0, n, size):
            part = slice(start, start + size)
            rows = jacobian_rows(model, names, params, _take(inputs, dims, part), factor[part]).detach()
            # P x P only when a subset has at least P rows, i.e. for networks smaller than the subset's kernel
            structure = FullStructure(range(len(prior.param_sizes)), prior.param_sizes, prior.structure, options.max_memory)
            structure.to(device).accumulate(BatchCurvature([], rows))
            stats = CurvatureStatistics(options, names, [structure], estimator=estimator)
            stats.add_likelihood(likelihood.statistics(output[part], target[part]))
            out.append(stats)
    return out


def _drop_rows(stats: CurvatureStatistics) -> None:
    """Free a prepared kernel part's ``R x P`` rows where its log-determinant no longer reads them:
    with one precision per tensor it reads the per-tensor ``R x R`` Gram matrices and the row count
    only (:meth:`FullStructure._log_det_low_rank`), so a bound over many subsets of a large network
    holds ``T R^2`` numbers per subset instead of ``R P``."""
    for structure in stats.structures:
        if isinstance(structure, FullStructure) and structure.gram is None and structure.prior_structure != "diagonal":
            if structure.rows is not None:
                structure.rows = structure.rows.new_zeros(structure.rows.shape[0], 0)


def _take(inputs: Any, dims: Any, part: slice) -> Any:
    """The examples ``part`` of ``inputs`` (tensors with the batch dimension are sliced, the rest kept)."""
    if isinstance(inputs, Tensor):
        return inputs[part] if dims == 0 else inputs
    if isinstance(inputs, tuple):
        return tuple(_take(v, d, part) for v, d in zip(inputs, dims))
    if isinstance(inputs, dict):
        return {k: _take(v, dims[k], part) for k, v in inputs.items()}
    return inputs


class BoundOptimizer:
    """Learn the hyperparameters by one Adam step per batch on a stochastic evidence bound.

    Each :meth:`step` computes the bound on one batch at the model's current weights (its part of
    the data, or its subsets for ``"ntk"``), its gradient in the learnable log hyperparameters,
    sums the pieces over processes in ONE all-reduce (``all_reduce``; each process's batch is a
    part), takes one Adam step (ascent) and writes the result into the prior and likelihood. The
    network's weights are untouched. Usable from a plain PyTorch loop.

    Args:
        likelihood: The likelihood whose hyperparameters are learned (and enter the bound).
        prior: The prior whose precisions are learned.
        n_data: The number ``N`` of training data (default: ``prior.n_data``, as counted by
            ``MargLikCallback`` or ``LaplaceEvidence.fit``).
        bound: ``"parametric"`` or ``"ntk"``.
        structure: The parametric bound's curvature structure (``"kron"``, ``"diag"``, ``"full"``).
        approx: ``"ggn"`` or ``"ef"``.
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact; ``"auto"``: decided from each batch's
            outputs, as for the evidence).
        subset_size: ``"ntk"``: examples per kernel (default: the whole batch).
        lr: Adam learning rate on the log hyperparameters.
        batch_fn: Maps a batch to ``(inputs, targets)``.
        backend: ``"hooks"`` or ``"backpack"`` (parametric only).

    Raises:
        ValueError: On bad options (named), or a prior with a hyperprior (the bound would count its term per part).
        TypeError: If ``likelihood`` or ``prior`` is not one (e.g. the two passed in the other order).

    Example:
        >>> from lightning_marglik import GaussianLikelihood, GaussianPrior, map_loss
        >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> prior, lik = GaussianPrior(net), GaussianLikelihood()
        >>> hyper = BoundOptimizer(lik, prior, n_data=64, bound="parametric", structure="kron", lr=0.1)
        >>> optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        >>> x, y = torch.randn(64, 1), torch.randn(64, 1)
        >>> for batch in zip(x.split(16), y.split(16)):
        ...     optimizer.zero_grad()
        ...     map_loss(net(batch[0]), batch[1], lik, prior, n_data=64).backward()
        ...     optimizer.step()
        ...     per_datum = hyper.step(net, batch)   # the bound on this batch, per datum
        >>> bool(torch.isfinite(prior.log_precision).all())
        True
    """

    def __init__(
        self,
        likelihood: Likelihood,
        prior: GaussianPrior,
        n_data: Optional[int] = None,
        bound: str = "parametric",
        structure: str = "kron",
        approx: str = "ggn",
        mc_samples: Union[int, str] = 0,
        subset_size: Optional[int] = None,
        lr: float = 0.1,
        batch_fn: Optional[BatchFn] = None,
        backend: str = "hooks",
    ) -> None:
        check_likelihood_and_prior(likelihood, prior, "BoundOptimizer(likelihood, prior)")
        check_no_hyperprior(prior)  # now, not at the first step inside training
        check_bound_options(bound, structure, subset_size, backend)
        CurvatureOptions(structure if bound == "parametric" else "full", approx, mc_samples, backend=backend)
        lr = number(lr, "lr")
        if n_data is not None:
            integer(n_data, "n_data", 1)
        self.likelihood, self.prior, self._n_data = likelihood, prior, n_data
        self.options = dict(bound=bound, structure=structure, approx=approx, mc_samples=mc_samples, subset_size=subset_size, backend=backend)
        self.lr = float(lr)
        self.batch_fn = batch_fn
        self._optimizer: Optional[torch.optim.Adam] = None
        self._leaves: Dict[str, Tensor] = {}
        self._pending_state: Optional[dict] = None

    @property
    def n_data(self) -> int:
        """``N``: the given count, else the prior's."""
        n_data = self._n_data if self._n_data is not None else int(self.prior.n_data)
        if n_data <= 0:
            raise ValueError(
                "BoundOptimizer needs the number of training data N: pass `n_data=` (or count it with "
                "LaplaceEvidence.fit / MargLikCallback, which store it on the prior)."
            )
        return n_data

    def _leaves_for(self, values: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Adam's leaves holding ``values``; a new optimizer where the learnable hyperparameters changed."""
        if [(n, t.shape) for n, t in self._leaves.items()] != [(n, t.shape) for n, t in values.items()]:
            self._leaves = {n: t.detach().to(torch.float64).clone().requires_grad_(True) for n, t in values.items()}
            self._optimizer = torch.optim.Adam(list(self._leaves.items()), lr=self.lr)  # named, as solvers.adam's
            if self._pending_state:
                self._optimizer.load_state_dict(self._pending_state)
            self._pending_state = None
        with torch.no_grad():
            for name, leaf in self._leaves.items():
                leaf.copy_(values[name])
        return self._leaves

    def _local_pieces(self, model: nn.Module, batch: Any, leaves: Dict[str, Tensor], generator: Optional[torch.Generator]) -> Tuple[Tensor, "EvidenceBound"]:
        """This process's ``[grad of sum_m E_m, sum_m E_m, n, M]`` and its bound."""
        bound = EvidenceBound.fit(model, [batch], self.likelihood, self.prior, generator=generator, batch_fn=self.batch_fn, **self.options)
        part = bound.parts[0]
        with torch.enable_grad():
            value = bound.partition_sum_at(part._with_fixed(part._current(), leaves))
            grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True) if leaves else ()
        flat = [g.reshape(-1) for g in grads] + [value.detach().reshape(1)]
        counts = torch.tensor([bound.n_seen, bound.n_partitions], dtype=torch.float64, device=value.device)
        return torch.cat(flat + [counts]), bound

    def step(
        self,
        model: nn.Module,
        batch: Any,
        generator: Optional[torch.Generator] = None,
        all_reduce: Optional[AllReduce] = None,
    ) -> float:
        """One hyperparameter step on the bound of ``batch``; returns the bound estimate per datum.

        A non-finite bound or gradient leaves the hyperparameters unchanged (with a warning) and
        returns NaN. An error in one process is raised in every process (after the all-reduce).

        Args:
            model: The network at its current weights.
            batch: One ``(inputs, targets)`` batch (or what ``batch_fn`` maps).
            generator: Random generator of the Monte-Carlo samples: one per step for fresh draws, as
                ``MargLikBoundCallback`` seeds by the step (without one the parametric bound draws seed 0's).
            all_reduce: Sum of a 1-D float64 tensor over processes (default: one process).

        Returns:
            The stochastic bound ``(N/n) sum_m (E_m + q/2) - q/2`` before the step, divided by ``N``.

        Raises:
            ValueError: On a batch the bound cannot take (named), ``N`` not known, or ``N`` below the data of the
                batches (every process's together).
            RuntimeError: If the bound failed in another process.
        """
        prior, likelihood = self.prior, self.likelihood
        n_data = self.n_data
        values = {n: t.to(torch.float64) for n, t in learnable_values(prior, likelihood).items()}
        leaves = self._leaves_for(values)
        size = sum(t.numel() for t in leaves.values())
        error: Optional[BaseException] = None
        bound: Optional[EvidenceBound] = None
        try:
            local, bound = self._local_pieces(model, batch, leaves, generator)
        except (ValueError, TypeError, RuntimeError) as err:  # raised below, after the other processes know
            error = err
            local = torch.zeros(size + 3, dtype=torch.float64, device=prior.log_precision.device)
        failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=local.device)
        total = torch.cat([local, failed])
        total = all_reduce(total) if all_reduce is not None else total
        if error is not None:
            raise error
        if float(total[-1]) > 0:
            raise RuntimeError("The evidence bound failed in another process; see that process's error.")
        assert bound is not None
        grad_sum, partition_sum, n_seen, n_partitions = total[:size], total[size], float(total[size + 1]), float(total[size + 2])
        # on the data of every process's batch: each may hold fewer than N while together they hold more
        check_n_data(n_data, int(n_seen))
        part = bound.parts[0]
        current = part._current()
        with torch.enable_grad():
            quadratic = bound.prior_quadratic_at(part._with_fixed(current, leaves))
            grad_q = torch.autograd.grad(quadratic, list(leaves.values()), allow_unused=True, materialize_grads=True) if leaves else ()
        weight = 0.5 * (n_data / n_seen * n_partitions - 1)
        value = EvidenceBound.combine(partition_sum, quadratic.detach(), n_seen, n_partitions, n_data)
        gradient = n_data / n_seen * grad_sum + weight * torch.cat([g.reshape(-1) for g in grad_q] or [grad_sum.new_zeros(0)])
        if not (torch.isfinite(value) and torch.isfinite(gradient).all()):
            warnings.warn("The evidence bound or its gradient is not finite at the current weights; hyperparameters unchanged.")
            return math.nan
        if leaves:
            assert self._optimizer is not None
            offset = 0
            for leaf in leaves.values():
                leaf.grad = -gradient[offset : offset + leaf.numel()].reshape(leaf.shape).to(leaf.device)  # ascent
                offset += leaf.numel()
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            assign_hyperparameters(prior, likelihood, {n: t.detach() for n, t in part._with_fixed(current, leaves).items()})
        return value.item() / n_data

    def state_dict(self) -> dict:
        """Adam's state (empty before the first step)."""
        if self._optimizer is None:
            return dict(self._pending_state or {})
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue Adam's moments from :meth:`state_dict` (taken at the first step; ``{}``: afresh).

        Raises:
            ValueError: If ``state`` is not an optimizer's state (a dict with ``state`` and ``param_groups``).
        """
        # refused now: Adam reads it only at the next step, where a KeyError would not say whose state it was
        if state and not isinstance(state, Mapping):
            raise ValueError(
                f"`state` must be BoundOptimizer.state_dict()'s dict, or {{}} to start afresh, got {state!r}."
            )
        missing = " and ".join(repr(key) for key in ("state", "param_groups") if key not in state) if state else ""
        if missing:
            raise ValueError(
                f"`state` is not an optimizer state: it lacks {missing} (keys {list(state)!r}); pass what "
                "BoundOptimizer.state_dict() returned, or {} to start afresh."
            )
        self._pending_state = dict(state) if state else None
        self._leaves, self._optimizer = {}, None

