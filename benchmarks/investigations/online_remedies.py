"""The remedies of issue 52 (item 2) not measured as such before: stochastic bounds, mode-corrected online
Laplace and the conditional marginal likelihood, each learning during training (Algorithm 1).

Each is one change to the evidence's own choice (``MargLikCallback(guard=False)``, the defaults before the
guard), measured beside ``delta=1``, that choice (``no guard``) and the defaults (the guard on), all on one
library commit:

* ``bound``: ``MargLikBoundCallback(mc_samples="auto")``, the library's parametric kron-GGN bound (Immer et
  al., ICML 2023) with one hyperparameter step after every training batch instead of an estimate per epoch.
* ``mode-corrected``: the evidence of the quadratic model at its own mode (Lin, Antoran and Hernandez-Lobato,
  2023). The online estimate reads the weights as if they were the mode of the objective at every prior
  precision it tries; the correction moves them there by one Newton step of the current curvature. For the
  MAP objective's gradient ``r = g + delta theta`` (``g``: the negative log likelihood's gradient at the
  current weights) the quadratic model's minimum lies ``r^T (H + delta)^-1 r / 2`` below its value at
  ``theta``, so (:class:`ModeCorrectedEvidence`)::

      log Z_corrected(delta) = log Z_laplace(delta) + r^T (H + delta)^-1 r / 2

  exact for a linear-Gaussian model at any ``theta`` (``tests/test_online_remedies.py``).
* ``mode-corrected + guard``: the same with the library's guard on (the defaults' guard, scoring the learned
  weight decay of the corrected evidence against the declared one).
* ``conditional``: the conditional marginal likelihood ``log p(D_2 | D_1)`` (Lotfi et al., ICML 2022) with
  ``D_1`` 80 % of the evidence batches, as the difference of two mode-corrected Laplace evidences, that of all
  data and that of ``D_1`` (:class:`ConditionalEvidence`; exact for a linear-Gaussian model, tested too).

Cells: full MNIST with the paper's MLP at ``prior_guard.py``'s 12 epochs (delta = 1, the defaults and the
mode-corrected evidence behind the guard; cross-validation on seed 0), the 100-class MLP family's noise members
(``prior_strength.py``; delta = 1 fits at noise 1 and overfits at 2 and 3), and three of the never-worse study's
cells (``vs_cross_validation.py``'s recipes): the two the guard misses there (bars / MLP, bars / Fixup ResNet) and
digits / CNN, the one the evidence's own choice misses; 3 seeds. The prototypes run on one process (no DDP).
Runs are cached in ``outputs/online_remedies/runs`` and name their library (``_zoo``'s harness).

Usage::

    python benchmarks/investigations/online_remedies.py --plan
    python benchmarks/investigations/online_remedies.py --shard 0/2 & ... --shard 1/2
    python benchmarks/investigations/online_remedies.py --analyse   # writes benchmarks/results/online_remedies.md
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import _zoo  # noqa: E402
import prior_guard  # noqa: E402
import prior_strength as family  # noqa: E402
from _common import RESULTS, hand_written, write_with_data  # noqa: E402

from lightning_marglik import LaplaceEvidence, MargLikBoundCallback, MargLikCallback, guard, solvers  # noqa: E402
from lightning_marglik.callbacks.prior_guard import device_batches  # noqa: E402
from lightning_marglik.curvature import eval_mode  # noqa: E402

NAME = "online_remedies"
SEEDS = family.SEEDS
ARMS = ("delta=1", "defaults", "no guard", "bound", "mode-corrected", "conditional", "mode-corrected + guard")
HELD_IN = 0.8  # Lotfi et al.'s share of the data conditioned on


# --- the objectives -------------------------------------------------------------------------------


def nll_gradient(model: torch.nn.Module, batches: Iterable[Tuple[Any, Tensor]],
                 evidence: LaplaceEvidence) -> List[Tensor]:
    """The gradient of the (tempered) negative log likelihood of ``batches`` in the prior's tensors, flat, float64
    (summed as the guard sums a fold's)."""
    params = evidence.prior.params
    total = params[0].new_zeros(sum(p.numel() for p in params), dtype=torch.float64)
    with eval_mode(model):
        guard._add_fold_gradient(total, model, params, evidence.likelihood, list(batches))
    inverse_temperature = float(evidence.likelihood.temperature.detach().reciprocal())
    return list((total * inverse_temperature).split([p.numel() for p in params]))


class ModeCorrectedEvidence(LaplaceEvidence):
    """The Laplace evidence of the quadratic model at its own mode: ``log_marglik_at`` adds
    ``r^T (H + delta)^-1 r / 2`` with ``r = g + delta theta``. The likelihood's gradient ``g`` scales with its
    curvature scale ``s`` (``1 / (sigma^2 T)`` for a Gaussian, ``1 / T`` for a categorical), so it is kept per unit
    of ``s`` (:attr:`unit_gradient`) and scaled at every point the solver tries, as the curvature is. The solver
    takes the gradient and Hessian by autograd (the library's closed form is the plain evidence's)."""

    unit_gradient: List[Tensor]

    @classmethod
    def of(cls, evidence: LaplaceEvidence, gradient: List[Tensor]) -> "ModeCorrectedEvidence":
        """``evidence`` (made this class, in place) with the likelihood's ``gradient`` at its current
        hyperparameters."""
        evidence.__class__ = cls
        scale = evidence._scale(evidence._current())
        evidence.unit_gradient = [g / scale for g in gradient]  # type: ignore[attr-defined]
        return evidence  # type: ignore[return-value]

    def correction(self, values: Dict[str, Tensor]) -> Tensor:
        """``r^T (H + delta)^-1 r / 2`` at the log hyperparameters ``values`` (every name), differentiable."""
        delta = [d.exp() for d in self.prior.tensor_log_precisions(values["log_precision"].to(torch.float64))]
        scale = self._scale({k: v.to(torch.float64) for k, v in values.items()})
        theta = [p.detach().reshape(-1).to(torch.float64) for p in self.prior.params]
        r = [scale * g + d * t for g, d, t in zip(self.unit_gradient, delta, theta)]
        total = torch.zeros((), dtype=torch.float64)
        for structure in self.structures:
            solved = structure.inverse(scale, delta)([r[i] for i in structure.indices])
            total = total + sum((r[i] * x).sum() for i, x in zip(structure.indices, solved))
        return 0.5 * total

    def log_marglik_at(self, values: Dict[str, Tensor]) -> Tensor:
        return super().log_marglik_at(values) + self.correction(values)

    def _second_order(self, current: Dict[str, Tensor], learned: Tensor,
                      values: Dict[str, Tensor]) -> solvers.SecondOrder:
        names = list(values)
        sizes = [values[n].numel() for n in names]

        def objective(flat: Tensor) -> Tensor:
            pieces = {n: p.view_as(values[n]) for n, p in zip(names, flat.split(sizes))}
            return self.log_marglik_at(self._with_fixed(current, pieces))

        start = torch.cat([values[n].detach().reshape(-1).to(torch.float64) for n in names])
        value = objective(start).detach()
        gradient = torch.autograd.functional.jacobian(objective, start)
        hessian = torch.autograd.functional.hessian(objective, start)
        if not (torch.isfinite(value) and torch.isfinite(gradient).all() and torch.isfinite(hessian).all()):
            raise torch.linalg.LinAlgError("the corrected evidence is not finite at this point")
        return solvers.SecondOrder(value, gradient, torch.arange(len(start)), hessian, gradient.new_zeros(0))

    def optimize(self, *args: Any, **kwargs: Any) -> solvers.Solution:
        with self._reusing():
            return super().optimize(*args, **kwargs)

    def _reusing(self) -> contextlib.ExitStack:
        """The factors' eigendecompositions taken once for every solve of :meth:`correction`."""
        stack = contextlib.ExitStack()
        for structure in self.structures:
            stack.enter_context(structure.reusing_decompositions())
        return stack


class ConditionalEvidence(ModeCorrectedEvidence):
    """``log p(D_2 | D_1) = log Z(D) - log Z(D_1)``, both mode-corrected Laplace evidences at the same weights
    and hyperparameters (:attr:`held_in` is ``D_1``'s)."""

    held_in: ModeCorrectedEvidence

    def log_marglik_at(self, values: Dict[str, Tensor]) -> Tensor:
        return super().log_marglik_at(values) - self.held_in.log_marglik_at(values)

    def _reusing(self) -> contextlib.ExitStack:
        stack = super()._reusing()
        stack.enter_context(self.held_in._reusing())
        return stack


# --- the callbacks ----------------------------------------------------------------------------------


class ModeCorrectedCallback(MargLikCallback):
    """``MargLikCallback`` whose estimates maximize the mode-corrected evidence (the study runs it with
    ``guard=False``, one change to the evidence's own choice, and with the guard on)."""

    def _evidence(self, trainer: Any, pl_module: Any, options: Any, generator: Any,
                  folded: Any = None) -> LaplaceEvidence:
        evidence = super()._evidence(trainer, pl_module, options, generator, folded)
        return self._corrected(evidence, pl_module, device_batches(self, trainer, pl_module), options)

    def _corrected(self, evidence: LaplaceEvidence, pl_module: Any, batches: List[Tuple[Any, Tensor]],
                   options: Any) -> LaplaceEvidence:
        return ModeCorrectedEvidence.of(evidence, nll_gradient(pl_module, batches, evidence))


class ConditionalCallback(ModeCorrectedCallback):
    """``MargLikCallback`` whose estimates maximize the conditional marginal likelihood of the last fifth of the
    evidence batches given the rest."""

    def _corrected(self, evidence: LaplaceEvidence, pl_module: Any, batches: List[Tuple[Any, Tensor]],
                   options: Any) -> LaplaceEvidence:
        conditional = ConditionalEvidence.of(evidence, nll_gradient(pl_module, batches, evidence))
        first = batches[:max(1, round(HELD_IN * len(batches)))]
        prior, n_data = conditional.prior, conditional.prior.n_data  # fit counts its data into the prior
        held_in = LaplaceEvidence.fit(pl_module, first, conditional.likelihood, prior, structure=options.structure,
                                      approx=options.approx, mc_samples=options.mc_samples,
                                      generator=torch.Generator().manual_seed(self.seed))
        prior.n_data = n_data
        conditional.held_in = ModeCorrectedEvidence.of(held_in, nll_gradient(pl_module, first, held_in))
        return conditional


def bound_callback(dataloader: Any = None, seed: int = 0, **options: Any) -> MargLikBoundCallback:
    """The library's bound callback as the harness builds callbacks (it steps on the training batches: no
    evidence data)."""
    return MargLikBoundCallback(seed=seed, **options)


_zoo.CALLBACKS.update({"mode-corrected": ModeCorrectedCallback, "conditional": ConditionalCallback,
                       "bound": bound_callback, "mode-corrected + guard": ModeCorrectedCallback})
CALLBACK_OPTIONS = {"bound": {"mc_samples": "auto"}, "mode-corrected": {"guard": False},
                    "conditional": {"guard": False}, "mode-corrected + guard": {}}


# --- the study ----------------------------------------------------------------------------------------

FAMILY = family.MEMBERS[:3]  # noise 1 (delta = 1 fits), 2 and 3 (it overfits), at the N and depth
CELLS = (("bars", "mlp"), ("digits", "cnn"), ("bars", "fixup_resnet"))  # the guard's misses and digits / CNN


def cache_dir() -> str:
    return os.path.join(_zoo.output_dir(NAME), "runs")


def _arm(base: _zoo.RunSpec, arm: str) -> _zoo.RunSpec:
    if arm in CALLBACK_OPTIONS:
        return replace(base, callback=dict(CALLBACK_OPTIONS[arm]), callback_class=arm)
    return base


def family_spec(member: family.Member, seed: int, arm: str) -> _zoo.RunSpec:
    return _arm(prior_guard.family_spec(member, seed, "defaults" if arm in CALLBACK_OPTIONS else arm), arm)


def cell_spec(dataset: str, network: str, seed: int, arm: str) -> _zoo.RunSpec:
    return _arm(prior_guard.cell_spec(dataset, network, seed, "defaults" if arm in CALLBACK_OPTIONS else arm), arm)


MNIST_ARMS = ("delta=1", "defaults", "mode-corrected + guard")


def mnist_spec(seed: int, arm: str) -> _zoo.RunSpec:
    """Full MNIST with the paper's MLP at ``prior_guard``'s short schedule (``cv delta=<d>``: its grid's split runs)."""
    return _arm(prior_guard.mnist_spec(seed, "defaults" if arm in CALLBACK_OPTIONS else arm), arm)


def plan() -> List[_zoo.RunSpec]:
    """Every run: full MNIST and the cells' ResNet first (the longest), then the rest."""
    specs = [mnist_spec(s, arm) for s in SEEDS for arm in MNIST_ARMS]
    specs += [mnist_spec(0, arm) for arm in prior_guard.grid_arms(prior_guard.MNIST_GRID)]
    specs += [cell_spec(d, n, s, arm) for d, n in sorted(CELLS, key=lambda c: "resnet" not in c[1])
              for s in SEEDS for arm in ARMS]
    specs += [family_spec(m, s, arm) for m in FAMILY for s in SEEDS for arm in ARMS]
    return list({s.key(): s for s in specs}.values())


def analyse() -> None:
    path = RESULTS / f"{NAME}.md"
    cache = cache_dir()
    every = [_zoo.cached(s, cache) for s in plan()]
    libraries = sorted({r["library"] for r in every})
    rows = [(m.cell, {arm: [_zoo.cached(family_spec(m, s, arm), cache) for s in SEEDS] for arm in ARMS}, None)
            for m in FAMILY]
    rows += [(f"{d} / {n}", {arm: [_zoo.cached(cell_spec(d, n, s, arm), cache) for s in SEEDS] for arm in ARMS}, None)
             for d, n in CELLS]
    lines = [f"# {__doc__.splitlines()[0]} {__doc__.splitlines()[1]}", "",
             _zoo.study_provenance(NAME, every, SEEDS) + "; `cost`: process CPU over the same seed's delta = 1 "
             "run.", "",
             "Targets (issue 52) against delta = 1: NLL at most delta = 1's + 0.02, accuracy at most 1 point below, "
             "cost at most 2x one run; where delta = 1 overfits, at least cross-validation's level: on full MNIST "
             "below (seed 0), for the family and bars / MLP in `prior_guard.md` (not rerun here). `no guard` is the "
             "evidence's own choice, `defaults` the library's guard.", ""]
    lines += prior_guard.table(rows, ARMS)
    mnist = {arm: [_zoo.cached(mnist_spec(s, arm), cache) for s in SEEDS] for arm in MNIST_ARMS}
    mnist_cv = family.cross_validation(mnist_spec, prior_guard.MNIST_GRID, cache, seeds=(0,))
    lines += [f"## Full MNIST, the paper's MLP, {prior_guard.MNIST_EPOCHS} epochs (cross-validation on seed 0)", ""]
    lines += prior_guard.table([("mnist-60k / paper MLP", mnist, mnist_cv)], MNIST_ARMS)
    text = "\n".join(lines) + "\n\n" + hand_written(path)
    write_with_data(path, text, {"libraries": libraries})


def main(argv: Optional[Sequence[str]] = None) -> None:
    _zoo.study_main(None if argv is None else list(argv), __doc__, NAME, plan, cache_dir(), analyse)


if __name__ == "__main__":
    main()
