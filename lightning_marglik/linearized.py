"""The Laplace evidence of the linearized network at its own optimum (Antorán et al., ICML 2022).

A network trained by stochastic or early-stopped optimization is not at the optimum of its
linearization ``f_lin(x; theta) = f(x; theta*) + J(x; theta*) (theta - theta*)``, yet the Laplace
evidence treats ``theta*`` as the mode. :func:`linearized_evidence` first takes the linear model to
its MAP under the current prior and likelihood, by full-batch L-BFGS (strong Wolfe line search) on

    -log p(D | f_lin(theta)) / T + 1/2 sum_t delta_t ||theta_t||^2,

starting from ``theta*`` (``J v`` by ``torch.func.jvp``; a convex problem for the Gaussian and
categorical likelihoods), then returns the Laplace evidence of the linear model there: the data
fit ``log p(D | f_lin(theta_lin)) / T`` and the prior term at ``theta_lin``, the curvature of the
network at ``theta*`` (the linear model's Jacobian is ``J(theta*)`` everywhere). For a Gaussian
likelihood that is the linear model's exact GGN; for a categorical one its loss Hessian is taken
at the network's outputs ``f(theta*)``, not at ``f_lin(theta_lin)`` (the approximation of
Antorán et al.; ``approx="ef"`` likewise uses the residuals at ``theta*``).

The linear model is ill-conditioned where the tensors' curvatures and precisions differ by orders
of magnitude (the ranking study's learned layerwise precisions span e^6.6). By default the
iterations are preconditioned by the evidence's own posterior precision at ``theta*``,
``H = s C + diag(delta)`` of ``structure`` (the linear model's Jacobian is ``J(theta*)`` everywhere,
so the evidence pass, taken first, serves both): every two-loop recursion starts from
``gamma H^-1`` instead of ``gamma I``, i.e. L-BFGS in the coordinates ``u = H^(1/2) (theta - theta*)``.
``H^-1`` is applied blockwise, each structure's block by its own ``inverse`` from the decompositions
it holds: a Kronecker block ``kron(G, A)`` in the eigenbasis ``U_G (x) U_A`` as
``1 / (s q_i w_j + delta)``, EKFAC's with its second moments, a diagonal block (e.g. a norm's
parameters under ``kron``) as ``1 / (s c + delta)``, a ``full`` curvature as its dense inverse. A
block-diagonal ``H`` holds no coupling between layers (a BatchNorm's scale against the weights in
front of it, the branches of a residual block), which is what keeps a BatchNorm ResNet's linear
model slow to solve (see ``precondition``).

Nothing is written into the model or the hyperparameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .curvature import CurvatureOptions, collect_statistics, eval_mode, locate
from .curvature.batches import BatchFn, move, split_batch
from .curvature.forward_mode import output_and_change
from .curvature.statistics import Structure
from .evidence import LaplaceEvidence
from .hyperparameters import GaussianPrior, Likelihood, check_likelihood_and_prior
from .private import strong_wolfe
from .validators import flag, integer, number, optional

__all__ = ["LinearizedEvidence", "linearized_evidence"]

Operator = Callable[[Tensor], Tensor]
TOLERANCE_CHANGE = 1e-14  # smallest directional derivative, step and change of the objective L-BFGS goes on with


@dataclass
class LinearizedEvidence:
    """The linear model's optimum and its Laplace evidence.

    Attributes:
        evidence: Laplace evidence of the linear model at ``params`` (optimize its
            hyperparameters as any :class:`LaplaceEvidence`; the optimum ``params`` stays).
        params: ``theta_lin`` per prior tensor, in ``prior.param_names`` order.
        objective: The linear model's negative log joint (the minimized objective) at ``theta*``
            and at ``theta_lin``.
        gradient_norm: Max-norm of that objective's gradient at ``theta_lin`` (how far from the
            optimum the steps stopped).
        converged: Whether that norm fell to ``tol`` times its value at ``theta*`` (always ``False``
            without a ``tol``).
        iterations: L-BFGS iterations taken.
    """

    evidence: LaplaceEvidence
    params: List[Tensor]
    objective: "tuple[float, float]"
    gradient_norm: float
    converged: bool = False
    iterations: int = 0


def linearized_evidence(
    model: nn.Module,
    dataloader: Iterable,
    likelihood: Likelihood,
    prior: GaussianPrior,
    structure: str = "kron",
    approx: str = "ggn",
    steps: int = 20,
    mc_samples: int = 0,
    generator: Optional[torch.Generator] = None,
    batch_fn: Optional[BatchFn] = None,
    tol: Optional[float] = None,
    history: int = 20,
    precondition: bool = True,
) -> LinearizedEvidence:
    """Laplace evidence of the network's linearization at the linear model's MAP (see the module docstring).

    Cost: one evidence pass of ``structure`` at ``theta*`` (two for ``ekfac``), then each L-BFGS
    evaluation is one pass over ``dataloader`` with a forward-mode Jacobian-vector product and its
    backward (about three to four forward passes per batch); ``steps`` iterations take at most
    ``1.25 steps`` evaluations. With ``tol`` the iterations stop once the objective's gradient has
    fallen to ``tol`` times its value at ``theta*`` (Antorán et al.'s recommendation: the convex
    problem solved to convergence; ``steps`` is then the budget, and ``converged`` says whether it
    sufficed).

    Args:
        model: The network at its trained weights ``theta*`` (evaluated in eval mode).
        dataloader: Batches covering the training set once; read once and held in memory (on the
            parameters' device) for the L-BFGS evaluations and the evidence pass.
        likelihood: The likelihood (its temperature and noise enter the objective).
        prior: The prior (its current precisions enter the objective).
        structure: Curvature structure of the evidence (``"kron"``, ``"ekfac"``, ``"diag"``, ``"full"``).
        approx: ``"ggn"`` or ``"ef"``.
        steps: L-BFGS iterations (``0``: the evidence at ``theta*``, as :meth:`LaplaceEvidence.fit`).
        mc_samples: Monte-Carlo samples for the GGN, 0 for the exact GGN.
        generator: Random generator for the Monte-Carlo samples.
        batch_fn: Maps a batch to ``(inputs, targets)``.
        tol: Relative gradient tolerance of the linear model's optimum (``None``: run all ``steps``).
        history: L-BFGS's memory, in steps: two vectors of the parameters' size each. A longer
            memory reaches the optimum of an ill-conditioned linear model in fewer passes over the
            data (measured on a BatchNorm ResNet of the ranking study: 200 steps with 100 end at a
            third lower objective than with 20).
        precondition: Whether L-BFGS is preconditioned by the evidence's posterior precision
            ``s C + diag(delta)`` at ``theta*`` (see the module docstring; from the evidence pass, no
            extra one; for ``full`` a dense ``P x P`` inverse). It removes the ill-conditioning within
            tensors and between their precisions (a small BatchNorm network under precisions spread
            over e^8: 37 iterations instead of 348), not the couplings between layers. On the ranking
            study's seed-0 networks (kron-GGN, ``tol=1e-3``, ``history=100``, 100 steps;
            ``benchmarks/results/linearized_convergence.md``): res8x1 takes all 100 iterations either
            way and ends at 2.9e-3 instead of 1.8e-2 of its starting gradient (objective 227 instead of
            335, optimum 205) in the same CPU time; cnn32x1 converges in 72 iterations instead of 66.
            ``False``: plain ``torch.optim.LBFGS``, as before the option existed.

    Returns:
        The evidence, ``theta_lin``, the objective before and after, the final gradient norm, whether
        it converged and the iterations taken (all in the original coordinates).

    Raises:
        ValueError: On a negative ``steps``, a ``tol`` that is not a number in (0, 1), a ``history``
            below 1, a ``precondition`` that is not a bool, bad curvature options, or data without a
            datum.
        TypeError: If ``likelihood`` or ``prior`` is not one (e.g. the two passed in the other order).
    """
    check_likelihood_and_prior(likelihood, prior, "linearized_evidence(model, dataloader, likelihood, prior)")
    steps = integer(steps, "steps", 0, what="L-BFGS iterations")
    tol = optional(number, tol, "tol", 0.0, 1.0, high_open=True, what="relative gradient tolerance")
    history = integer(history, "history", 1, what="L-BFGS memory in steps")
    precondition = flag(precondition, "precondition", what="L-BFGS preconditioned by the posterior precision")
    options = CurvatureOptions(structure, approx, mc_samples)
    names, _ = locate(model, prior)
    star = [p.detach().clone() for p in prior.params]
    sizes = prior.param_sizes
    device, dtype = star[0].device, star[0].dtype
    batches = [split_batch(batch, batch_fn) for batch in dataloader]
    batches = [(move(inputs, device, dtype), target.to(device)) for inputs, target in batches]
    precision = torch.split(prior.per_parameter(prior.log_precision.detach()).exp(), sizes)
    diagonal = [d.reshape(p.shape) for d, p in zip(precision, star)]
    inverse_temperature = likelihood.temperature.detach().reciprocal()
    theta = [p.clone().requires_grad_(True) for p in star]

    def outputs(inputs, params: List[Tensor]) -> Tensor:
        f0, jv = output_and_change(model, names, star, [p - s for p, s in zip(params, star)], inputs)
        return f0.detach() + jv

    def objective() -> Tensor:
        total = sum(0.5 * (d.to(torch.float64) * p.double().pow(2)).sum() for d, p in zip(diagonal, theta))
        for inputs, target in batches:
            total = total + likelihood.nll(outputs(inputs, theta), target).double().sum() * inverse_temperature
        return total

    def closure() -> Tensor:
        for p in theta:
            p.grad = None
        value = objective()
        value.backward()
        return value

    def evaluate(point: Tensor) -> Tuple[float, Tensor]:
        """The objective and its gradient at the flat ``point``, which ``theta`` then holds."""
        with torch.no_grad():
            for p, piece in zip(theta, point.split(sizes)):
                p.copy_(piece.view_as(p))
        value = float(closure().detach())
        return value, torch.cat([p.grad.reshape(-1) for p in theta])

    with eval_mode(model):
        # the curvature at theta* (the linear model's everywhere): the preconditioner's and the evidence's
        stats = collect_statistics(model, batches, likelihood, prior, generator=generator, options=options)
        point = torch.cat([p.reshape(-1) for p in star])
        start, gradient = evaluate(point)
        threshold = tol * float(gradient.abs().max()) if tol is not None else 1e-12
        iterations = 0
        if steps and precondition:
            hyper = {name: value.detach().double() for name, value in likelihood.hyperparameters().items()}
            inverse = _inverse_precision(stats.structures, sizes, likelihood.curvature_scale(options.approx, hyper),
                                         _structure_delta(prior))
            point, iterations = _preconditioned_lbfgs(evaluate, point, start, gradient, inverse, steps, history,
                                                      threshold)
        elif steps:
            point, iterations = _lbfgs(closure, theta, steps, history, threshold)
        final, gradient = evaluate(point)
        gradient_norm = float(gradient.abs().max())
        optimum = [p.detach() for p in theta]
        stats.likelihood = {}
        with torch.no_grad():
            for inputs, target in batches:
                stats.add_likelihood(likelihood.statistics(outputs(inputs, optimum), target))
    evidence = LaplaceEvidence.from_statistics(stats, likelihood, prior, params=optimum)
    prior.record_n_data(evidence.n_data)
    converged = tol is not None and gradient_norm <= threshold
    return LinearizedEvidence(evidence, optimum, (start, final), gradient_norm, converged, iterations)


# --- the unpreconditioned iterations: torch.optim.LBFGS ----------------------------------------------


def _lbfgs(closure: Callable[[], Tensor], theta: List[Tensor], steps: int, history: int,
           threshold: float) -> Tuple[Tensor, int]:
    """``torch.optim.LBFGS`` (strong Wolfe) on ``theta`` from where it is.

    Returns:
        The last point (flat) and the iterations taken.
    """
    optimizer = torch.optim.LBFGS(theta, lr=1.0, max_iter=steps, history_size=history, line_search_fn="strong_wolfe",
                                  tolerance_grad=threshold, tolerance_change=TOLERANCE_CHANGE)
    optimizer.step(closure)
    return torch.cat([p.detach().reshape(-1) for p in theta]), int(optimizer.state[theta[0]].get("n_iter", 0))


# --- the preconditioned iterations -------------------------------------------------------------------


def _preconditioned_lbfgs(evaluate: Callable[[Tensor], Tuple[float, Tensor]], point: Tensor, value: float,
                          gradient: Tensor, inverse: Operator, steps: int, history: int,
                          threshold: float) -> Tuple[Tensor, int]:
    """L-BFGS whose initial inverse Hessian is ``gamma H^-1``, ``gamma = s.y / y.H^-1 y`` of the last pair.

    That is L-BFGS (with ``gamma I``) in the coordinates ``u = H^(1/2) (theta - theta*)``, written in ``theta``:
    the same steps, so the stopping rules read the gradient in the original coordinates. The rules
    and the line search are ``torch.optim.LBFGS``'s, except the first step: ``-H^-1 g`` at length 1
    (a Newton step of the model ``H``) instead of ``-g`` at ``min(1, 1 / |g|_1)``.

    Args:
        evaluate: The objective and its gradient at a flat point.
        point: The start (flat), with its ``value`` and ``gradient``.
        value: The objective at ``point``.
        gradient: Its gradient at ``point``.
        inverse: ``v -> H^-1 v``.
        steps: Most iterations; at most ``1.25 steps`` evaluations, as ``torch.optim.LBFGS``.
        history: Most ``(s, y)`` pairs kept.
        threshold: The iterations stop once the gradient's max-norm is at most this.

    Returns:
        The last point and the iterations taken.
    """
    line_search = strong_wolfe()  # torch.optim.LBFGS's: the same in both paths
    pairs: List[Tuple[Tensor, Tensor, float]] = []  # (step s, gradient change y, 1 / y.s), oldest first
    gamma, iterations, evaluations = 1.0, 0, 1
    while iterations < steps and float(gradient.abs().max()) > threshold:
        direction = _two_loop(gradient, pairs, lambda v: gamma * inverse(v))
        slope = gradient.dot(direction)
        if not slope < -TOLERANCE_CHANGE:  # no descent left at the objective's precision (or a non-finite H)
            break
        last = value
        value, new_gradient, length, used = line_search(lambda x, t, d: evaluate(x + t * d), point, 1.0, direction,
                                                        value, gradient, slope, tolerance_change=TOLERANCE_CHANGE)
        step, change = direction * length, new_gradient - gradient
        point, gradient = point + step, new_gradient
        iterations, evaluations = iterations + 1, evaluations + used
        curvature = float(change.dot(step))
        if curvature > 1e-10:  # torch.optim.LBFGS's rule: a pair that keeps the inverse Hessian positive definite
            pairs = (pairs + [(step, change, 1.0 / curvature)])[-history:]
            gamma = curvature / float(change.dot(inverse(change)))
        if evaluations >= steps * 5 // 4 or float(step.abs().max()) <= TOLERANCE_CHANGE \
                or abs(value - last) < TOLERANCE_CHANGE:
            break
    return point, iterations


def _two_loop(gradient: Tensor, pairs: Sequence[Tuple[Tensor, Tensor, float]], initial: Operator) -> Tensor:
    """The L-BFGS direction ``-H_k g`` by the two-loop recursion from ``H_0 = initial`` over ``pairs``."""
    q = gradient.clone()
    alphas = []
    for s, y, rho in reversed(pairs):
        alphas.append(rho * float(s.dot(q)))
        q -= alphas[-1] * y
    r = initial(q)
    for (s, y, rho), alpha in zip(pairs, reversed(alphas)):
        r += (alpha - rho * float(y.dot(r))) * s
    return -r


# --- the preconditioner: H^-1 from the structures' decompositions -------------------------------------


def _structure_delta(prior: GaussianPrior) -> List[Tensor]:
    """The prior precision as the structures take it (float64): 0-dim per tensor, ``(numel,)`` for a diagonal prior."""
    return [d.exp() for d in prior.tensor_log_precisions(prior.log_precision.detach().double())]


def _inverse_precision(structures: Sequence[Structure], sizes: Sequence[int], scale: Tensor,
                       delta: List[Tensor]) -> Operator:
    """``v -> H^-1 v`` for ``H = s C + diag(delta)`` over every prior tensor (``v`` flat, in prior order).

    Args:
        structures: The evidence pass's structures (disjoint, covering every prior tensor).
        sizes: The prior tensors' sizes.
        scale: The curvature scale ``s``.
        delta: The prior precision of every prior tensor (:func:`_structure_delta`).

    Returns:
        The operator (float64 inside, the vector's dtype out); each structure's block is decomposed
        once, here (:meth:`Structure.inverse`).
    """
    blocks = [(structure.indices, structure.inverse(scale, delta)) for structure in structures]

    def apply(vector: Tensor) -> Tensor:
        pieces = list(vector.double().split(list(sizes)))
        result = list(pieces)
        for indices, block in blocks:
            for i, piece in zip(indices, block([pieces[i] for i in indices])):
                result[i] = piece
        return torch.cat(result).to(vector.dtype)

    return apply
