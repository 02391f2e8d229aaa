"""Inner solvers for a smooth scalar objective of a few log-hyperparameter tensors.

The evidence engine hands these functions a closure ``objective({name: tensor}) -> scalar`` (the
log marginal likelihood to *maximize*, differentiable in its inputs) and the starting log values.
The solvers know nothing of the evidence. Both keep the best point they have seen, so a solve
never returns a point worse than its (finite) start, and both treat an objective that is
non-finite or raises ``torch.linalg.LinAlgError`` (e.g. a failed Cholesky) at a trial point as a
rejected point instead of an error.

* :func:`adam`: ``steps`` Adam steps (the paper's inner loop), continuing moment estimates across
  calls through ``state``.
* :func:`newton`: Newton's method with exact second derivatives (autograd, or a closed form the
  caller supplies as ``derivatives``), modified to ascend, a trust region on the largest log
  change and an Armijo backtracking line search. It typically converges to machine precision in a
  handful of evaluations.

Both take an optional ``box`` of lower and upper bounds on some of the tensors: Adam clips every
iterate into it, Newton solves the box-constrained problem (projected Newton: the coordinates at a
bound whose gradient points out of the box are held, the Newton step is taken in the others and
projected onto the box).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .validators import integer, number

__all__ = ["Box", "Objective", "SecondOrder", "Solution", "adam", "newton", "DENSE_LIMIT"]

Objective = Callable[[Dict[str, Tensor]], Tensor]
# name -> (lower, upper) bounds of that tensor (same shape); names not given are unbounded
Box = Dict[str, Tuple[Tensor, Tensor]]


@dataclass
class SecondOrder:
    """An objective with its gradient and (arrowhead) Hessian at a point, in flat coordinates.

    The coordinates are the tensors of ``initial`` flattened in order. The Hessian is given by
    the full rows of the ``dense`` coordinates and the diagonal at all the others: exact when
    the other coordinates do not interact (e.g. the prior precisions of a ``kron`` or ``diag``
    log-determinant, with ``log_sigma`` / ``log_temperature`` dense).

    Attributes:
        value: The objective (0-dim).
        gradient: ``(n,)``.
        dense: Indices ``(k,)`` of the coordinates with full Hessian rows.
        rows: Their Hessian rows ``(k, n)``.
        diagonal: The Hessian diagonal at the other coordinates, in order, ``(n - k,)``.
    """

    value: Tensor
    gradient: Tensor
    dense: Tensor
    rows: Tensor
    diagonal: Tensor


Derivatives = Callable[[Dict[str, Tensor]], SecondOrder]

# Newton uses the exact dense Hessian up to this many coordinates (one Hessian-vector product per
# coordinate); beyond it, tensors larger than what fits are treated by their Hessian diagonal.
DENSE_LIMIT = 200
# Largest change of any log hyperparameter in one Newton step (a factor e^4 ~ 55): far from the
# optimum the evidence is log-linear in one direction and exponential in the other, where an
# undamped Newton step would overshoot by orders of magnitude.
TRUST_RADIUS = 4.0
# Armijo constant: accept a step that realizes this share of the increase its slope predicts.
ARMIJO = 1e-4
# Adam reports divergence when its last iterate lost more than this share of the gain it had made.
OSCILLATION_SHARE = 0.1
# The largest learning rate a divergence warning suggests. Adam moves every log hyperparameter by about lr per
# step, whatever the gradient's size: at 0.5 (a precision's factor e^0.5 ~ 1.6 per step) 100 steps still span
# e^50, while lr / 10 of an lr of 100 or more takes steps that diverge again.
SAFE_LR = 0.5


@dataclass
class Solution:
    """Result of an inner solve.

    Attributes:
        values: Best point seen (detached clones), same names, shapes and dtypes as ``initial``.
        value: Objective at ``values`` (detached, 0-dim); never below ``start`` when ``start`` is finite.
        start: Objective at ``initial`` (``-inf`` where it is non-finite or raised ``LinAlgError``).
        state: State to continue from: Adam's ``optimizer.state_dict()``; ``{}`` for Newton.
        evaluations: Objective evaluations. One Newton step's gradient and Hessian count with the
            evaluation at its point; every line-search trial counts as one.
        trace: Objective at each accepted iterate, starting with ``start``.
        converged: Newton: the predicted increase of a full Newton step fell below ``tol``. Adam (no
            tolerance): all steps ran finite without diverging and the last one changed the
            objective by less than ``1e-8`` relative (or a few ulps) -- a stall indicator.
        diverged: Adam: a step went non-finite, or the last iterate lost more than 10% of the gain
            over the start (any loss when nothing was gained). Newton: the start or the derivatives
            at an accepted point were non-finite (its line search never accepts a decrease).
        unbounded: The tensors whose best point lies at the edge of the range their buffers hold, the
            objective still rising toward it (set by :meth:`.LaplaceEvidence.optimize`; ``()`` otherwise).
    """

    values: Dict[str, Tensor]
    value: Tensor
    start: Tensor
    state: dict
    evaluations: int
    trace: List[float]
    converged: bool
    diverged: bool
    unbounded: Tuple[str, ...] = ()


def _evaluate(objective: Objective, point: Dict[str, Tensor]) -> Optional[Tensor]:
    """The objective at ``point``, or ``None`` where it is non-finite or its linear algebra fails."""
    try:
        value = objective(point)
    except torch.linalg.LinAlgError:
        return None
    if value.numel() != 1:
        raise ValueError(f"The objective must return a scalar, got shape {tuple(value.shape)}.")
    value = value.reshape(())
    return value if bool(torch.isfinite(value)) else None


def _detached(values: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return {n: t.detach().clone() for n, t in values.items()}


def _noise(value: Tensor) -> float:
    """Changes of a value below this are rounding, not progress (a few ulps of its dtype)."""
    return 16 * torch.finfo(value.dtype).eps * max(1.0, abs(value.item()))


def _failed_start(initial: Dict[str, Tensor], state: dict) -> Solution:
    template = next(iter(initial.values()), torch.zeros(()))
    start = torch.full((), -math.inf, dtype=template.dtype, device=template.device)
    warnings.warn("The objective is not finite at the initial point; returned it unchanged.")
    return Solution(_detached(initial), start, start, state, 1, [start.item()], False, True)


def _nothing_to_optimize(objective: Objective) -> Solution:
    value = _evaluate(objective, {})
    if value is None:
        return _failed_start({}, {})
    return Solution({}, value.detach(), value.detach(), {}, 1, [value.item()], True, False)


def _check_box(box: Optional[Box], initial: Dict[str, Tensor]) -> Box:
    """``box`` with its bounds in the dtype and device of ``initial``; refuses one that does not fit."""
    checked: Box = {}
    for name, bounds in (box or {}).items():
        if name not in initial:
            raise ValueError(f"`box` bounds {name!r}, which is not among the optimized tensors {list(initial)}.")
        if not (isinstance(bounds, tuple) and len(bounds) == 2):
            raise ValueError(f"`box[{name!r}]` must be a pair (lower, upper) of tensors, got {bounds!r}.")
        start = initial[name]
        lower, upper = (torch.as_tensor(b).to(start.device, start.dtype) for b in bounds)
        if {lower.shape, upper.shape} - {torch.Size(), start.shape}:
            raise ValueError(
                f"`box[{name!r}]` bounds of shapes {tuple(lower.shape)} and {tuple(upper.shape)} do not fit {name!r} of "
                f"shape {tuple(start.shape)}: give bounds of its shape, or scalars."
            )
        lower, upper = lower.expand(start.shape), upper.expand(start.shape)
        if not bool(((lower <= start) & (start <= upper)).all()):
            raise ValueError(f"`box[{name!r}]` does not contain the initial point: start the solve inside the box.")
        checked[name] = (lower, upper)
    return checked


# --- Adam ---------------------------------------------------------------------------------------


def _check_state(state: dict, initial: Dict[str, Tensor]) -> None:
    """Refuse Adam moments saved for other tensors (other names, count or shapes)."""
    groups = state.get("param_groups")
    one_group = isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0].get("params"), list)
    if not (one_group and "state" in state):
        raise ValueError("`state` is not the state_dict of a one-group Adam optimizer (as Solution.state holds).")
    names, shapes = list(initial), [tuple(t.shape) for t in initial.values()]
    saved_names = groups[0].get("param_names")
    if len(groups[0]["params"]) != len(names):
        raise ValueError(
            f"`state` holds moments for {len(groups[0]['params'])} tensors"
            f"{'' if saved_names is None else ' ' + str(saved_names)}, but `initial` has {len(names)} {names}."
        )
    if saved_names is not None and list(saved_names) != names:
        raise ValueError(f"`state` holds moments for tensors {list(saved_names)}, but `initial` has {names}.")
    for index, name, shape in zip(groups[0]["params"], names, shapes):
        moment = state["state"].get(index, {}).get("exp_avg")
        if moment is not None and tuple(moment.shape) != shape:
            raise ValueError(
                f"`state` holds moments of shape {tuple(moment.shape)} for {name!r}, "
                f"whose shape in `initial` is {shape}."
            )


def adam(
    objective: Objective,
    initial: Dict[str, Tensor],
    steps: int = 100,
    lr: float = 0.1,
    state: Optional[dict] = None,
    box: Optional[Box] = None,
) -> Solution:
    """Maximize ``objective`` by ``steps`` Adam steps, returning the best point seen.

    Adam runs on detached leaf clones of ``initial`` (the inputs are never modified). A step to a
    point where the objective is non-finite or raises ``torch.linalg.LinAlgError`` ends the run. One
    warning, with a safer learning rate, reports a run that went non-finite or whose last iterate
    fell far below its best one (see :class:`Solution` ``diverged``): both mean ``lr`` is too large.

    Args:
        objective: Maps ``{name: tensor}`` to a differentiable scalar to maximize.
        initial: Starting values; the order of the names is the order of the Adam parameters.
        steps: Number of Adam steps (``steps + 1`` evaluations: the start and each iterate).
        lr: Adam learning rate.
        state: ``Solution.state`` of an earlier call on tensors of the same names and shapes, to
            continue its moment estimates (the learning rate is still ``lr``).
        box: Bounds ``{name: (lower, upper)}`` on some tensors; every iterate is clipped into them.

    Returns:
        The best point seen, with ``state = optimizer.state_dict()`` after the last step taken.

    Raises:
        ValueError: On ``steps`` that is not an int >= 0, ``lr`` that is not positive and finite,
            a ``state`` for other tensors (count, names or shapes), a ``box`` that does not fit
            ``initial`` or does not contain it, or a non-scalar objective.

    Example:
        >>> import torch
        >>> objective = lambda v: -((v["x"] - 2.0) ** 2).sum()
        >>> solution = adam(objective, {"x": torch.zeros(1, dtype=torch.float64)}, steps=300, lr=0.1)
        >>> round(solution.values["x"].item(), 2), solution.value.item() >= solution.start.item()
        (2.0, True)
    """
    steps, lr = integer(steps, "steps", 0), number(lr, "lr")
    if state and initial:
        _check_state(state, initial)
    box = _check_box(box, initial)
    if not initial:
        return _nothing_to_optimize(objective)

    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in initial.items()}
    optimizer = torch.optim.Adam(list(leaves.items()), lr=lr, fused=True)  # one kernel; no device probing per step
    if state:
        optimizer.load_state_dict(state)
        for group in optimizer.param_groups:
            group["lr"] = lr
    start = best = None
    best_step, best_values = 0, _detached(leaves)
    trace: List[float] = []
    finite = True
    for step in range(steps + 1):
        value = _evaluate(objective, leaves)
        if value is None:
            finite = False
            break
        trace.append(value.item())
        if step == 0:
            start = value.detach()
        if best is None or trace[-1] > best.item():
            best, best_step, best_values = value.detach(), step, _detached(leaves)
        if step == steps:
            break
        optimizer.zero_grad()
        (-value).backward()
        optimizer.step()
        with torch.no_grad():  # projected Adam: the moments keep the unclipped gradients
            for name, (lower, upper) in box.items():
                leaves[name].clamp_(lower, upper)
    if best is None:
        return _failed_start(initial, state or {})

    lost = best.item() - trace[-1]
    # a loss of a billionth of the value is Adam's jitter at the optimum, not a too-large lr
    floor = max(_noise(best), 1e-9 * max(1.0, abs(best.item())))
    oscillated = lost > max(OSCILLATION_SHARE * (best.item() - trace[0]), floor)
    diverged = not finite or oscillated
    if diverged:
        what = "reached a non-finite objective" if not finite else f"ended {lost:.4g} below its best value"
        warnings.warn(
            f"Adam (lr={lr:g}) {what} after {len(trace) - 1} of {steps} steps; kept the best point "
            f"(step {best_step}). The learning rate is too large for this objective: try lr={min(lr / 10, SAFE_LR):g} or smaller, "
            "or solver='newton'."
        )
    stalled = len(trace) >= 2 and abs(trace[-1] - trace[-2]) <= max(1e-8 * abs(trace[-1]), _noise(best))
    return Solution(
        values=best_values,
        value=best,
        start=start,
        state=optimizer.state_dict(),
        evaluations=len(trace) + (0 if finite else 1),
        trace=trace,
        converged=finite and not diverged and len(trace) == steps + 1 and stalled,
        diverged=diverged,
    )


# --- Newton -------------------------------------------------------------------------------------


class _Flat:
    """Flattens a dict of tensors into one vector (promoted dtype) and back (original dtypes)."""

    def __init__(self, initial: Dict[str, Tensor]) -> None:
        self.names = list(initial)
        self.shapes = [t.shape for t in initial.values()]
        self.dtypes = [t.dtype for t in initial.values()]
        self.sizes = [t.numel() for t in initial.values()]
        self.vector = torch.cat([t.detach().reshape(-1) for t in initial.values()])

    def unflatten(self, vector: Tensor) -> Dict[str, Tensor]:
        parts = torch.split(vector, self.sizes)
        return {n: p.reshape(s).to(d) for n, p, s, d in zip(self.names, parts, self.shapes, self.dtypes)}

    def dense_coordinates(self) -> Tensor:
        """Coordinates with an exact Hessian: all of them up to ``DENSE_LIMIT``, else the smallest
        tensors that fit together (e.g. ``log_sigma`` and ``log_temperature`` next to a diagonal prior)."""
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        if offsets[-1] <= DENSE_LIMIT:
            return torch.arange(offsets[-1])
        chosen, total = [], 0
        for i in sorted(range(len(self.sizes)), key=lambda i: self.sizes[i]):
            if total + self.sizes[i] > DENSE_LIMIT:
                break
            chosen.append(torch.arange(offsets[i], offsets[i + 1]))
            total += self.sizes[i]
        return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)


def _restrict(
    grad: Tensor, rows: Tensor, diagonal: Tensor, dense: Tensor, free: Tensor
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The arrowhead derivatives (``_AscentStep``'s inputs) of the ``free`` coordinates only, with the
    dense indices renumbered among them."""
    rest = torch.ones_like(free)
    rest[dense] = False
    kept = free[dense]
    renumbered = torch.cumsum(free.long(), 0) - 1
    return grad[free], rows[kept][:, free], diagonal[free[rest]], renumbered[dense[kept]]


def _derivatives(value: Tensor, point: Tensor, dense: Tensor, probe: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradient, Hessian rows of the dense coordinates, and the Hessian diagonal of the others.

    The diagonal of the other (large) block is ``v * (H v)`` for a Rademacher ``v`` on that block:
    exact when the block is diagonal (a diagonal prior with diagonal curvature, the case that makes
    the dimension large), an unbiased estimate otherwise; the line search guards the step either way.
    """
    (grad,) = torch.autograd.grad(value, point, create_graph=True)
    n = point.numel()
    if not grad.requires_grad:  # the objective is linear in the point
        return grad.detach(), grad.new_zeros(len(dense), n), grad.new_zeros(n - len(dense))
    rest = probe != 0
    directions = torch.zeros(len(dense) + int(rest.any()), n, dtype=grad.dtype, device=grad.device)
    directions[torch.arange(len(dense)), dense] = 1
    if rest.any():
        directions[-1] = probe
    # one reverse-over-reverse product per direction: measured faster than vmap (is_grads_batched) or
    # forward-over-reverse (torch.func.hessian) once the objective holds a P x P Cholesky, and as fast below
    products = torch.stack([
        torch.autograd.grad(grad, point, d, retain_graph=True, allow_unused=True, materialize_grads=True)[0]
        for d in directions
    ]).detach()
    return grad.detach(), products[: len(dense)], (probe * products[-1])[rest] if rest.any() else grad.new_zeros(0)


class _AscentStep:
    """Steps ``d(mu) = -(A - mu I)^-1 g`` for a negative definite modification ``A`` of the Hessian.

    With ``S`` the dense coordinates and ``L`` the rest (Hessian diagonal ``D`` there), the Hessian
    is approximated by the arrowhead ``[[B, C], [C^T, diag(D)]]``. ``D`` is made negative by
    ``-|D|``, and the eigenvalues of the Schur complement ``B - C D^-1 C^T`` by ``-|lambda|``
    (saddle-free Newton: a direction of positive curvature is climbed as much as its curvature
    says, not descended), both floored relative to the largest curvature. Then ``A`` is negative
    definite, so ``d(mu)`` ascends for every ``mu >= 0`` (Levenberg damping: large ``mu`` tends to
    the gradient direction ``g / mu``). ``newton`` is the undamped step ``d(0)``.
    """

    def __init__(self, grad: Tensor, rows: Tensor, diagonal: Tensor, dense: Tensor) -> None:
        rest = torch.ones(grad.numel(), dtype=torch.bool, device=grad.device)
        rest[dense] = False
        self.dense, self.rest, self.grad = dense, rest, grad
        b, c = rows[:, dense], rows[:, rest]
        scale = torch.cat([b.abs().reshape(-1), diagonal.abs(), grad.new_zeros(1)]).max().item()
        floor = max(1e-10 * scale, torch.finfo(grad.dtype).tiny ** 0.5)
        self.d = -diagonal.abs().clamp(min=floor)
        self.c = c
        coupling = (c / self.d) @ c.T
        eigenvalues, vectors = torch.linalg.eigh(b - coupling)
        self.s_coupled = (vectors * -eigenvalues.abs().clamp(min=floor)) @ vectors.T + coupling
        self.g_s, self.g_l = grad[dense], grad[rest]
        self.eye = torch.eye(len(dense), dtype=grad.dtype, device=grad.device)
        self.newton = self(0.0)

    def __call__(self, mu: float) -> Tensor:
        d_mu = self.d - mu
        schur = self.s_coupled - mu * self.eye - (self.c / d_mu) @ self.c.T
        step_s = torch.linalg.solve(schur, -self.g_s + self.c @ (self.g_l / d_mu))
        step = torch.empty_like(self.grad)
        step[self.dense] = step_s
        step[self.rest] = (-self.g_l - self.c.T @ step_s) / d_mu
        return step

    def within(self, radius: float) -> Tensor:
        """The least damped step whose largest component is at most ``radius`` (bisection on log mu)."""
        if self.newton.abs().max() <= radius:
            return self.newton
        # ||d(mu)||_inf <= ||d(mu)||_2 <= ||g||_2 / mu: ``high`` is always inside the radius
        low, high = 0.0, self.grad.norm().item() / radius
        best = self(high)
        for _ in range(30):
            mid = math.sqrt(low * high) if low > 0 else high * 1e-6
            step = self(mid)
            size = step.abs().max().item()
            if size <= radius:
                high, best = mid, step
                if size >= 0.5 * radius:
                    break
            else:
                low = mid
        return best


class _Autograd:
    """Values at points as autograd graphs; derivatives of the last point by ``_derivatives``."""

    def __init__(self, objective: Objective, flat: _Flat) -> None:
        self.objective, self.flat = objective, flat
        self.dense = flat.dense_coordinates().to(flat.vector.device)
        # a fixed seed: the same problem always takes the same steps
        signs = torch.randint(0, 2, (flat.vector.numel(),), generator=torch.Generator().manual_seed(0))
        self.probe = (2 * signs - 1).to(flat.vector)
        self.probe[self.dense] = 0

    def value(self, vector: Tensor) -> Optional[Tensor]:
        self.point = vector.detach().clone().requires_grad_(True)
        self.last = _evaluate(self.objective, self.flat.unflatten(self.point))
        return None if self.last is None else self.last.detach()

    def derivatives(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        assert self.last is not None
        return (*_derivatives(self.last, self.point, self.dense, self.probe), self.dense)


class _ClosedForm:
    """Values and derivatives from one call of the caller's ``derivatives`` per point.

    The closed form may fail where the objective itself is finite (a factorisation of its own
    that breaks at extreme hyperparameters, or derivatives that underflow to 0/0 there, as at
    ``log sigma >= 180``): such a point is evaluated by ``fallback`` (autograd on the objective), so the closed form
    never rejects a point the objective accepts.
    """

    def __init__(self, derivatives: Derivatives, fallback: _Autograd) -> None:
        self.function, self.fallback = derivatives, fallback
        self.last: Optional[SecondOrder] = None

    def value(self, vector: Tensor) -> Optional[Tensor]:
        try:
            self.last = self.function(self.fallback.flat.unflatten(vector.detach()))
        except torch.linalg.LinAlgError:
            self.last = None
        last = self.last
        if last is not None and all(bool(torch.isfinite(t).all()) for t in (last.value, last.gradient, last.rows,
                                                                             last.diagonal)):
            return last.value.detach().reshape(())
        self.last = None
        return self.fallback.value(vector)

    def derivatives(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.last is None:
            return self.fallback.derivatives()
        last = self.last
        return last.gradient.detach(), last.rows.detach(), last.diagonal.detach(), last.dense


def newton(
    objective: Objective,
    initial: Dict[str, Tensor],
    tol: float = 1e-6,
    max_evaluations: int = 20,
    derivatives: Optional[Derivatives] = None,
    box: Optional[Box] = None,
) -> Solution:
    """Maximize ``objective`` by Newton's method with a line search in the (log) coordinates.

    All tensors of ``initial`` are flattened into one vector. At each accepted point the gradient
    and the Hessian come from ``derivatives`` where given (every evaluation then calls it instead
    of ``objective``, except at points where it fails and ``objective`` is finite), else from autograd: the exact Hessian by one Hessian-vector product per
    coordinate, and above ``DENSE_LIMIT`` coordinates (e.g. a diagonal prior over many
    parameters), the Hessian diagonal of the tensors that do not fit (one extra product, see
    ``_derivatives``), coupled exactly to the small ones. The Hessian is modified to be negative definite (absolute
    eigenvalues), the step is damped to change no coordinate by more than ``TRUST_RADIUS`` (after a
    backtracked step, by more than twice the change accepted; a full step doubles it back) and an
    Armijo backtracking line search accepts it only if the objective rises; trial points where the
    objective is non-finite or raises ``torch.linalg.LinAlgError`` are rejected like any other.
    With a ``box``, the coordinates at a bound whose gradient points out of the box are held, the
    step is taken in the others and every trial point is projected onto the box (projected Newton,
    Bertsekas 1982); at convergence the projected gradient vanishes.

    Args:
        objective: Maps ``{name: tensor}`` to a twice-differentiable scalar to maximize.
        initial: Starting values.
        tol: Stop when a full Newton step predicts an increase below ``tol`` (in the objective's
            units, nats for a log evidence), or below the objective's rounding error.
        max_evaluations: Budget of objective evaluations, start and line-search trials included.
        derivatives: Maps ``{name: tensor}`` to the objective with its gradient and Hessian
            (:class:`SecondOrder`, in the flat order of ``initial``); raising
            ``torch.linalg.LinAlgError`` or a non-finite value rejects the point.
        box: Bounds ``{name: (lower, upper)}`` on some tensors, containing ``initial``.

    Returns:
        The best point reached (the last accepted one), with ``state = {}``.

    Raises:
        ValueError: On a ``tol`` that is not finite and >= 0, ``max_evaluations`` that is not an
            int >= 1, a ``box`` that does not fit ``initial`` or does not contain it, or a
            non-scalar objective.

    Example:
        >>> import torch
        >>> objective = lambda v: -((v["x"] - 2.0) ** 2).sum()
        >>> solution = newton(objective, {"x": torch.zeros(1, dtype=torch.float64)})
        >>> solution.values["x"].item(), solution.evaluations, solution.converged
        (2.0, 2, True)
    """
    tol, max_evaluations = number(tol, "tol", 0, low_open=False), integer(max_evaluations, "max_evaluations", 1)
    box = _check_box(box, initial)
    if not initial:
        return _nothing_to_optimize(objective)

    flat = _Flat(initial)
    unbounded = {n: torch.full_like(t, math.inf) for n, t in initial.items()}
    lower = torch.cat([box[n][0].reshape(-1) if n in box else -unbounded[n].reshape(-1) for n in flat.names])
    upper = torch.cat([box[n][1].reshape(-1) if n in box else unbounded[n].reshape(-1) for n in flat.names])
    oracle = _Autograd(objective, flat) if derivatives is None else _ClosedForm(derivatives, _Autograd(objective, flat))
    point = flat.vector.clone()
    value = oracle.value(point)
    if value is None:
        return _failed_start(initial, {})
    start, evaluations, trace = value.detach(), 1, [value.item()]
    converged = diverged = False
    radius = TRUST_RADIUS
    while True:
        grad, rows, diagonal, dense = oracle.derivatives()
        if not (torch.isfinite(grad).all() and torch.isfinite(rows).all() and torch.isfinite(diagonal).all()):
            diverged = True
            break
        # held: at a bound with the gradient pointing out of the box (their KKT condition holds)
        free = ~(((point <= lower) & (grad < 0)) | ((point >= upper) & (grad > 0)))
        if not bool(free.any()):
            converged = True
            break
        ascent = _AscentStep(*_restrict(grad, rows, diagonal, dense, free))
        predicted = 0.5 * float(grad[free] @ ascent.newton)  # increase a full modified-Newton step predicts
        if predicted <= max(tol, _noise(value)):
            converged = True
            break
        if evaluations >= max_evaluations:
            break
        step = torch.zeros_like(point)
        step[free] = ascent.within(radius)
        slope = float(grad @ step)
        alpha, accepted = 1.0, None
        while evaluations < max_evaluations and alpha * step.abs().max().item() > _noise(point.abs().max()):
            trial = torch.minimum(torch.maximum(point + alpha * step, lower), upper)
            trial_value = oracle.value(trial)
            evaluations += 1
            # the increase the slope predicts along the projected path (alpha * slope without a box)
            gain = max(float(grad @ (trial - point)), 0.0)
            if trial_value is not None and trial_value.item() >= value.item() + ARMIJO * gain:
                accepted = trial, trial_value
                break
            if trial_value is None:
                alpha *= 0.25
            else:
                # maximum of the quadratic through value, slope and the trial, kept in [0.1, 0.5] alpha
                curvature = (trial_value.item() - value.item() - slope * alpha) / alpha**2
                alpha = min(max(-slope / (2 * curvature), 0.1 * alpha), 0.5 * alpha)
        if accepted is None:
            break
        point, value = accepted
        trace.append(value.item())
        # a backtracked step means the quadratic model held only that far: the next step stays within
        # twice the distance that was accepted (an exponential in a log hyperparameter, e.g. sigma's
        # data term, would otherwise be overshot and backtracked again); a full step lets it grow back
        taken = alpha * step.abs().max().item()
        radius = min(TRUST_RADIUS, 2 * taken if alpha < 1 else max(radius, 2 * taken))

    return Solution(
        values=_detached(flat.unflatten(point)),
        value=value.detach(),
        start=start,
        state={},
        evaluations=evaluations,
        trace=trace,
        converged=converged,
        diverged=diverged,
    )
