"""Why the learned prior is too strong where delta = 1 already fits (issue 52, items 1 and 2).

A family of 100-class MLPs on generated data: 100 class means drawn once from N(0, I_64), each input a
class mean plus Gaussian noise of standard deviation ``noise`` (``gauss100``). Small noise separates the
classes (delta = 1 fits: the issue's 64-256-256-100 MLP reaches test accuracy 0.995); large noise makes
them overlap, and an MLP trained at delta = 1 memorises its training set (delta = 1 overfits). Members
(``MEMBERS``): noise, the number of training points N (2,000 to 10,000), depth (2 or 3 hidden layers of
256), recipe: Adam 1e-3 constant, batch 128, a layerwise prior from delta = 1.

Arms (``ARMS``): ``delta=<d>`` (the prior fixed), ``defaults`` (``MargLikCallback()``), and the remedies of
issue 52 that the library already offers as options, each one change to the defaults. Every run is
traced (``_zoo.Trace``: per epoch the test metrics, every tensor's log delta and squared norm, and after
each estimate its curvature trace and effective number of parameters gamma), cached in
``outputs/prior_strength/runs`` and names its library.

The mechanism (``--mechanism``), post hoc at saved weights: for the runs at delta = 1 stopped after
``SNAPSHOTS`` epochs (Adam at a constant learning rate and a fixed batch order: the weights of a shorter run
are the longer run's weights at that epoch), the precision the evidence would choose there (kron-GGN, exact,
Newton from delta = 1) per tensor, and where its Occam factor sits: the Kronecker eigendirections of the first
layer binned by their curvature ``lambda`` against the chosen ``delta``, with each bin's count, share of the
effective parameters ``gamma = sum lambda / (lambda + delta)`` and share of ``||theta||^2``. At the evidence's
stationary point ``delta = gamma / ||theta||^2`` (MacKay): directions the data determine (lambda >> delta)
each add one to gamma whatever the weights' size in them, so a layer whose weights stay small in the
directions the data determine gets a large delta.

Usage::

    python benchmarks/investigations/prior_strength.py --plan
    python benchmarks/investigations/prior_strength.py --shard 0/2 & ... --shard 1/2
    python benchmarks/investigations/prior_strength.py --mechanism   # post hoc, on the cached delta = 1 runs
    python benchmarks/investigations/prior_strength.py --analyse     # writes benchmarks/results/prior_strength.md
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _zoo  # noqa: E402
from _common import RESULTS, hand_written, write_with_data  # noqa: E402

NAME = "prior_strength"
SEEDS = (0, 1, 2)
INPUTS, CLASSES, N_TEST = 64, 100, 5000
EPOCHS = 60
SNAPSHOTS = (5, 10, 20, 40, 60, 120)


def gauss100(noise: float):
    """The loader of the family's data at one ``noise`` (``_zoo.DATA_LOADERS``' signature)."""

    def load(n_train: int, n_test: int, split_seed: int) -> _zoo.Data:
        means = torch.randn(CLASSES, INPUTS, generator=torch.Generator().manual_seed(52))

        def draw(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            y = torch.arange(n) % CLASSES
            y = y[torch.randperm(n, generator=g)]
            return means[y] + noise * torch.randn(n, INPUTS, generator=g), y

        x_tr, y_tr = draw(n_train, 1 + split_seed)
        x_te, y_te = draw(n_test, 1001 + split_seed)
        return _zoo.Data(x_tr, y_tr, x_te, y_te, 0, CLASSES)

    return load


def mlp(depth: int, width: int = 256):
    """The builder of an MLP with ``depth`` hidden ReLU layers of ``width`` (``_zoo.NETWORK_BUILDERS``)."""

    def build(image_size: int, n_classes: int) -> nn.Module:
        layers: List[nn.Module] = []
        fan_in = INPUTS
        for _ in range(depth):
            layers += [nn.Linear(fan_in, width), nn.ReLU()]
            fan_in = width
        return nn.Sequential(*layers, nn.Linear(fan_in, n_classes))

    return build


NOISES = (1.0, 2.0, 3.0)
for _noise in NOISES:
    _zoo.DATA_LOADERS[f"gauss100_{_noise:g}"] = gauss100(_noise)
for _depth in (2, 3):
    _zoo.NETWORK_BUILDERS[f"mlp{_depth}x256"] = mlp(_depth)


@dataclass(frozen=True)
class Member:
    """One member of the family."""

    noise: float
    n_train: int
    depth: int

    @property
    def cell(self) -> str:
        return f"noise {self.noise:g}, N={self.n_train}, {self.depth} hidden"


# the core members (noise from fitting to overfitting at the N and depth), then N and depth varied where
# delta = 1 fits
MEMBERS = (Member(1.0, 5000, 2), Member(2.0, 5000, 2), Member(3.0, 5000, 2),
           Member(1.0, 2000, 2), Member(1.0, 10000, 2), Member(1.0, 5000, 3))

ARMS: Dict[str, Dict[str, Any]] = {
    "delta=0.1": {"precision": 0.1},
    "delta=1": {},
    "delta=10": {"precision": 10.0},
    "delta=100": {"precision": 100.0},
    "defaults": {"callback": {}},
    # a prior for the evidence kept apart from the MAP's: every tensor's learned delta counts in the evidence
    # only, training keeps the declared delta = 1 (Antoran et al. 2022's separation, by the library's option)
    "remedy: evidence prior apart": {"callback": {"biases": "decoupled", "output_layer": "decoupled"},
                                     "prior_setup": "decouple_all"},
    "remedy: learned temperature": {"callback": {}, "learn_temperature": True},
    "remedy: settle rule": {"callback": {"settle": 0.05}},
    "remedy: burn-in 30": {"callback": {"burnin": 30}},
    "remedy: trust region": {"callback": {"max_step": 0.5}},
}
# the arms in every member; the others only where delta = 1 fits at the N (the mechanism's questions)
CORE_ARMS = ("delta=1", "delta=10", "defaults")


def _decouple_all(prior: Any) -> None:
    prior.treat(list(prior.param_names), "decoupled", "evidence prior apart")


_zoo.PRIOR_SETUPS["decouple_all"] = _decouple_all


def spec(member: Member, seed: int, arm: str, epochs: int = EPOCHS) -> _zoo.RunSpec:
    """The run of one arm of one member."""
    options = dict(ARMS[arm])
    callback = options.pop("callback", None)
    return _zoo.RunSpec(network=f"mlp{member.depth}x256", dataset=f"gauss100_{member.noise:g}", seed=seed,
                        epochs=epochs, n_train=member.n_train, n_test=N_TEST, batch_size=128, lr=1e-3,
                        callback=None if callback is None else dict(callback), **options)




# --- a guard by approximate cross-validation (issue 52's fifth remedy, a prototype on the benchmark side) --------

GUARD_FOLDS = 5
GUARD = "guard"  # the prior's treatment reason


def approximate_cv(module: Any, batches: List[Tuple[torch.Tensor, torch.Tensor]], candidates: Dict[str, torch.Tensor],
                   generator: torch.Generator, folds: int = GUARD_FOLDS, mc_samples: int = 0) -> Dict[str, float]:
    """The training data's K-fold cross-validated log likelihood of the MAP under each candidate weight decay,
    each fold's refit approximated by one Newton step from the current weights on the other folds' objective
    (kron-GGN, the MAP loss in sum form), the left-out fold scored by the linearized network at the step.

    Args:
        module: The trained module (``net``, ``prior``, ``likelihood``).
        batches: The evidence batches ``(x, y)``; fold ``k`` takes every ``folds``-th example from the ``k``-th.
        candidates: Name -> the weight-decay log precision per prior group.
        generator: Seeds the Monte-Carlo curvature.
        folds: K.
        mc_samples: Of the GGN (0: exact; one sample's noise made the Newton steps overshoot: train log likelihood
            per datum -5.2 after a full-data step where the exact GGN's kept -0.006).

    Returns:
        Name -> the summed held-out log likelihood per datum.
    """
    from torch.func import functional_call, jvp

    from lightning_marglik.curvature import CurvatureOptions, collect_statistics
    from lightning_marglik.linearized import _inverse_precision

    net, prior, likelihood = module.net, module.prior, module.likelihood
    names, params = list(prior.param_names), [p.detach() for p in prior.params]
    options = CurvatureOptions("kron", "ggn", mc_samples)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    size = max(len(b[1]) for b in batches)
    parts = []
    for k in range(folds):  # fold k: every folds-th example from the k-th, in batches as large as the evidence's
        index = torch.arange(k, len(y), folds)
        parts.append([(x[index[i:i + size]], y[index[i:i + size]]) for i in range(0, len(index), size)])
    stats, flats, grads = [], [], []
    for part in parts:
        st = collect_statistics(net, part, likelihood, prior, generator=generator, options=options)
        captured: List[torch.Tensor] = []
        st.reduce(lambda flat: captured.append(flat) or flat, lambda t: [t])
        stats.append(st)
        flats.append(captured[0])
        total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        for x, y in part:
            with torch.enable_grad():
                loss = torch.nn.functional.cross_entropy(net(x), y, reduction="sum")
                for t, g in zip(total, torch.autograd.grad(loss, list(prior.params))):
                    t += g.double()
        grads.append(torch.cat([t.reshape(-1) for t in total]))
    all_flat, all_grad = sum(flats), sum(grads)
    theta = torch.cat([p.double().reshape(-1) for p in params])
    scale = torch.ones((), dtype=torch.float64)
    n = sum(len(y) for _, y in batches)
    scores = {}
    for name, log_delta in candidates.items():
        delta = [d.exp().double() for d in prior.tensor_log_precisions(log_delta.double())]
        delta_flat = torch.cat([d.expand(size) for d, size in zip(delta, prior.param_sizes)])
        total_ll = 0.0
        for k, part in enumerate(parts):
            rest = copy.deepcopy(stats[k])
            rest.reduce(lambda flat: all_flat - flat, lambda t: [t])
            rest.prepare()
            inverse = _inverse_precision(rest.structures, prior.param_sizes, scale, delta)
            step = -inverse(all_grad - grads[k] + delta_flat * theta)
            tangent = dict(zip(names, (piece.reshape(p.shape).to(p.dtype) for piece, p in
                                       zip(step.split(prior.param_sizes), params))))
            primal = dict(zip(names, params))
            for x, y in part:
                f, df = jvp(lambda ps: functional_call(net, ps, (x,)), (primal,), (tangent,))
                total_ll += -torch.nn.functional.cross_entropy(f + df, y, reduction="sum").item()
        scores[name] = total_ll / n
    return scores


class GuardedCallback(_zoo.MargLikCallback):
    """The defaults, then after each estimate the guard: the learned weight decay reaches the MAP loss only while
    its approximate cross-validated log likelihood (:func:`approximate_cv`) beats the declared prior's; the
    evidence keeps learning its own precisions either way (``decisions``: the record)."""

    def _reset_state(self) -> None:
        super()._reset_state()
        self.decisions: List[Dict[str, Any]] = []

    def estimate(self, trainer: Any, pl_module: Any, epoch: int) -> float:
        marglik = super().estimate(trainer, pl_module, epoch)
        prior = pl_module.prior
        body = [n for n in prior.param_names if n not in prior.treated("fixed")]
        prior.treat(body, "learn", GUARD)
        learned = prior.weight_decay_log_precision()
        declared = torch.full_like(learned, math.log(prior.initial_precision))
        batches = [(x.to(prior.params[0].dtype), y) for x, y in self._evidence_batches(trainer, pl_module)]
        with _zoo.eval_mode(pl_module):
            scores = approximate_cv(pl_module, batches, {"learned": learned, "declared": declared},
                                    torch.Generator().manual_seed(self.seed + epoch))
        keep = scores["learned"] >= scores["declared"]
        prior.treat(body if not keep else [], "decoupled", GUARD)
        self.decisions.append({"epoch": epoch, **scores, "applied": "learned" if keep else "declared"})
        self.history[-1]["guard"] = self.decisions[-1]
        return marglik


_zoo.CALLBACKS["guarded"] = GuardedCallback
GUARD_ARM = "remedy: approximate-CV guard"
ARMS[GUARD_ARM] = {"callback": {}, "callback_class": "guarded"}


CV_GRID = (0.1, 1.0, 10.0, 100.0)
VALIDATION = 0.2
for _d in CV_GRID:
    ARMS[f"cv delta={_d:g}"] = {"precision": _d, "validation": VALIDATION}
CV_MEMBERS = MEMBERS[:3]  # cross-validation's choice where noise goes from fitting to overfitting


def arms_of(member: Member) -> List[str]:
    """Every arm in the three noise members, the core arms elsewhere."""
    return list(ARMS) if member in CV_MEMBERS else list(CORE_ARMS)


def plan(seeds: Sequence[int] = SEEDS) -> List[_zoo.RunSpec]:
    """Every run: all arms in the three noise members, the core arms in the N and depth members, the defaults
    over 120 epochs in the first member, and the delta = 1 snapshots of the post-hoc mechanism (seed 0)."""
    specs = []
    for member in MEMBERS:
        specs += [spec(member, s, arm) for s in seeds for arm in arms_of(member)]
    specs += [spec(MEMBERS[0], s, "defaults", 2 * EPOCHS) for s in seeds]
    specs += [spec(MEMBERS[0], 0, "delta=1", e) for e in SNAPSHOTS if e != EPOCHS]
    return specs


# --- the guard in cells of the never-worse study (vs_cross_validation.py's recipes) ---------------------------

# every cell of the never-worse study (its three failing ones first: digits/CNN, where delta = 1 fits and the defaults
# cost NLL; bars/MLP, where delta = 1 overfits and the defaults' win must be kept; bars/CNN), cross-validation in
# bars/MLP only
STUDY_CELLS = (("digits", "cnn"), ("bars", "mlp"), ("bars", "cnn"), ("bars", "fixup_resnet"), ("mnist", "mlp"),
               ("mnist", "cnn"), ("digits", "mlp"), ("mnist", "fixup_resnet"), ("digits", "fixup_resnet"),
               ("mnist", "bn_resnet"), ("digits", "bn_resnet"), ("bars", "bn_resnet"))
STUDY_ARMS = ("delta=1", "defaults", GUARD_ARM)


def study_spec(dataset: str, network: str, seed: int, arm: str) -> _zoo.RunSpec:
    """A run of vs_cross_validation.py's cell (its recipe, data and epochs); the guard as one change to its defaults."""
    import vs_cross_validation as study

    if arm == GUARD_ARM:
        return replace(study.spec(dataset, network, seed, "defaults"), callback_class="guarded")
    return study.spec(dataset, network, seed, arm)


def study_plan() -> List[_zoo.RunSpec]:
    import vs_cross_validation as study

    arms = {cell: list(STUDY_ARMS) + ([study.fixed(d, cv=True) for d in study.GRID] + [study.fixed(d) for d in study.GRID]
                                      if cell == ("bars", "mlp") else []) for cell in STUDY_CELLS}
    return [study_spec(d, n, s, arm) for (d, n), cell_arms in arms.items() for s in SEEDS for arm in dict.fromkeys(cell_arms)]


def cache_dir() -> str:
    return os.path.join(_zoo.output_dir(NAME), "runs")


# --- the mechanism, post hoc ------------------------------------------------------------------------

BINS = ((0.0, 0.01), (0.01, 1.0), (1.0, 100.0), (100.0, math.inf))


def load_module(s: _zoo.RunSpec) -> Any:
    """The cached run's final module (weights and hyperparameters)."""
    data = _zoo.load(s.dataset, s.n_train, s.n_test)
    module = _zoo.make_module(s, data, len(data.y_train))
    module.load_state_dict(torch.load(_zoo.weights_path(s, cache_dir()), weights_only=False)["final"])
    return module, data


def mechanism_at(s: _zoo.RunSpec) -> Dict[str, Any]:
    """At the run's final weights: the exact kron-GGN evidence's Newton optimum per tensor (from the run's own
    precisions, the output layer held at them as the defaults hold it), and the first layer's Kronecker
    eigendirections binned by lambda / delta at that optimum."""
    from lightning_marglik import LaplaceEvidence
    from lightning_marglik.curvature.structures import KronStructure

    from lightning_marglik import GaussianPrior

    module, data = load_module(s)
    learned = module.prior.log_precision.detach().clone()
    # a learnable prior from the run's precisions (a fixed-delta run's prior is not), the output layer held as the
    # defaults hold it
    module.prior = prior = GaussianPrior(module.net, precision=s.precision)
    with torch.no_grad():
        prior.log_precision.copy_(learned)
    prior.treat(prior.param_names[-2:], "fixed", "output layer")
    likelihood = module.likelihood
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    before = prior.per_tensor(prior.log_precision).tolist()
    evidence = LaplaceEvidence.fit(module, loader, likelihood, prior, "kron", "ggn", mc_samples=0)
    solution = evidence.optimize(solver="newton", max_evaluations=50)
    evidence.set_hyperparameters(solution.values)
    chosen = prior.per_tensor(prior.log_precision).tolist()
    structure = next(st for st in evidence.structures if isinstance(st, KronStructure))
    j = next(i for i, layer in enumerate(structure.layers) if layer.roles.get("weight") == 0)
    g, a = structure._factors(j)
    a = a[0] if isinstance(a, (list, tuple)) or a.dim() == 3 else a
    q, u = torch.linalg.eigh(g.double())
    w, v = torch.linalg.eigh(a.double())
    weight = prior.params[0].detach().double()
    projected = (u.T @ weight @ v) ** 2  # (out, in): theta's square in each eigendirection
    lam = torch.outer(q, w).clamp_min(0)
    delta = math.exp(chosen[0])
    gamma = lam / (lam + delta)
    rows = []
    for low, high in BINS:
        mask = (lam / delta >= low) & (lam / delta < high)
        rows.append({"bin": [low, high], "count": int(mask.sum()), "gamma": float(gamma[mask].sum()),
                     "sq_norm": float(projected[mask].sum()),
                     # the bin's pull on log delta at the optimum: d log q / d log delta = (gamma - delta ||theta||^2) / 2
                     "pull": float(0.5 * (gamma[mask].sum() - delta * projected[mask].sum()))})
    return {"key": s.key(), "epochs": s.epochs, "arm_precision": s.precision, "names": prior.param_names,
            "log_delta_run": before, "log_delta_chosen": chosen, "marglik": solution.value.item() / evidence.n_data,
            "sq_norm": [p.detach().double().pow(2).sum().item() for p in prior.params],
            "first_layer": {"delta": delta, "gamma": float(gamma.sum()), "sq_norm": float(projected.sum()),
                            "input_eigenvalues": w.tolist(), "bins": rows}}


def mechanism_specs() -> List[_zoo.RunSpec]:
    """The delta = 1 snapshots of the first member (seed 0) and the defaults' final weights (60 and 120 epochs)."""
    return ([spec(MEMBERS[0], 0, "delta=1", e) for e in SNAPSHOTS]
            + [spec(MEMBERS[0], 0, "defaults", e) for e in (EPOCHS, 2 * EPOCHS)]
            + [spec(m, 0, "delta=1") for m in MEMBERS[1:3]])


def mechanism() -> List[Dict[str, Any]]:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    return [mechanism_at(s) for s in mechanism_specs()]


# --- analysis ----------------------------------------------------------------------------------------

NLL_SLACK, ACC_SLACK = 0.02, 0.01  # issue 52's targets against delta = 1


def _runs(member: Member, arm: str, epochs: int = EPOCHS) -> List[Dict[str, Any]]:
    return [_zoo.cached(spec(member, s, arm, epochs), cache_dir()) for s in SEEDS]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def cross_validation(run_of: Callable[[int, str], _zoo.RunSpec], grid: Sequence[float], cache: Optional[str] = None,
                     seeds: Sequence[int] = SEEDS) -> Tuple[List[float], List[Dict[str, Any]], List[float]]:
    """Per seed: the grid delta with the lowest validation NLL on the 80 % split, its run on all the data, and
    the process CPU of the split runs and that run (``run_of(seed, arm)``: the run of an arm ``"cv delta=<d>"`` or
    ``"delta=<d>"``; the runs in ``cache``, by default this study's)."""
    cache = cache or cache_dir()
    chosen, picked, cpu = [], [], []
    for s in seeds:
        split = {d: _zoo.cached(run_of(s, f"cv delta={d:g}"), cache) for d in grid}
        best = min(split, key=lambda d: split[d]["validation"]["nll"])
        run = _zoo.cached(run_of(s, f"delta={best:g}"), cache)
        chosen.append(best)
        picked.append(run)
        cpu.append(run["cpu_seconds"] + sum(r["cpu_seconds"] for r in split.values()))
    return chosen, picked, cpu


def _row(name: str, runs: List[Dict[str, Any]], one: List[Dict[str, Any]], cpu: Optional[List[float]] = None,
         cv: Optional[Dict[str, float]] = None) -> Tuple[str, Dict[str, Any]]:
    acc, nll = _mean([r["final"]["acc"] for r in runs]), _mean([r["final"]["nll"] for r in runs])
    acc1, nll1 = _mean([r["final"]["acc"] for r in one]), _mean([r["final"]["nll"] for r in one])
    seconds = cpu if cpu is not None else [r["cpu_seconds"] for r in runs]
    cost = _mean([c / r["cpu_seconds"] for c, r in zip(seconds, one)])
    names = runs[0]["param_names"]
    weights = [i for i, n in enumerate(names) if n.endswith("weight")]
    deltas = np.mean([r["log_delta"] for r in runs], axis=0)
    missed = []
    if nll > nll1 + NLL_SLACK:
        missed.append("NLL")
    if acc < acc1 - ACC_SLACK:
        missed.append("acc")
    if cv is not None and cv["overfits"] and (nll > cv["nll"] or acc < cv["acc"]):
        missed.append("CV")
    if cost > 2:
        missed.append("cost")
    text = (f"| {name} | {acc:.4f} | {nll:.4f} | {nll - nll1:+.3f} | {100 * (acc - acc1):+.1f} | "
            + " / ".join(f"{deltas[i]:.2f}" for i in weights) + f" | {cost:.2f} | {', '.join(missed) or 'all met'} |")
    return text, {"acc": acc, "nll": nll, "cost": cost, "missed": missed}


def member_table(member: Member) -> List[str]:
    one = _runs(member, "delta=1")
    lines = [f"### {member.cell}", "",
             "| arm | acc | NLL | NLL - delta=1 | acc - delta=1 (points) | log delta of the weights, input to output | "
             "cost | targets missed |", "|---|---:|---:|---:|---:|---|---:|---|"]
    cv = None
    if member in CV_MEMBERS:
        chosen, picked, cpu = cross_validation(lambda seed, arm: spec(member, seed, arm), CV_GRID)
        cv_text, cv_row = _row("cross-validation (chose " + ", ".join(f"{d:g}" for d in chosen) + ")", picked, one, cpu)
        cv = {**cv_row, "overfits": sum(d > 1.0 for d in chosen) * 2 > len(chosen)}
    for arm in (a for a in arms_of(member) if not a.startswith("cv ")):
        text, _ = _row(arm, _runs(member, arm), one, cv=None if arm.startswith("delta=") else cv)
        lines.append(text)
    if cv is not None:
        lines.append(cv_text)
        lines += ["", f"delta = 1 {'overfits' if cv['overfits'] else 'fits'} here (cross-validation chose a stronger "
                  f"prior in {'most' if cv['overfits'] else 'few'} seeds)."]
    return lines + [""]


def growth_table() -> List[str]:
    """The defaults' learned log delta after each estimate over 120 epochs, beside delta = 1's test NLL."""
    runs = _runs(MEMBERS[0], "defaults", 2 * EPOCHS)
    reference = _zoo.cached(spec(MEMBERS[0], 0, "delta=1", 2 * EPOCHS), cache_dir())["trace"]
    names = runs[0]["param_names"]
    weights = [i for i, n in enumerate(names) if n.endswith("weight")]
    lines = ["| epoch | log delta of the weights (mean over seeds) | first layer: gamma / ||theta||^2 / MacKay "
             "gamma/||theta||^2 | test NLL, defaults | test NLL, delta = 1 (seed 0) |", "|---:|---|---|---:|---:|"]
    for row_index, row in enumerate(runs[0]["trace"]):
        if "marglik" not in row:
            continue
        rows = [r["trace"][row_index] for r in runs]
        deltas = np.mean([r["log_delta"] for r in rows], axis=0)
        gamma, norm = _mean([r["gamma"][0] for r in rows]), _mean([r["sq_norm"][0] for r in rows])
        lines.append(f"| {row['epoch']} | " + " / ".join(f"{deltas[i]:.2f}" for i in weights)
                     + f" | {gamma:.0f} / {norm:.1f} / {math.log(gamma / norm):.2f} (log) | "
                     f"{_mean([r['test_nll'] for r in rows]):.4f} | {reference[row_index]['test_nll']:.4f} |")
    return lines + [""]


def mechanism_tables(found: List[Dict[str, Any]]) -> List[str]:
    lines = ["| weights | log delta the evidence chooses (weights, input to output; Newton, exact kron-GGN) | "
             "first layer: ||theta||^2 / gamma | marglik / N |", "|---|---|---|---:|"]
    for m in found:
        weights = [i for i, n in enumerate(m["names"]) if n.endswith("weight")]
        first = m["first_layer"]
        lines.append(f"| {m['key'].split('_s')[0]} s0, {m['epochs']} epochs, "
                     + ("delta = 1" if not any(m["log_delta_run"]) else "defaults") + " | "
                     + " / ".join(f"{m['log_delta_chosen'][i]:.2f}" for i in weights)
                     + f" | {first['sq_norm']:.1f} / {first['gamma']:.0f} | {m['marglik']:.4f} |")
    lines += ["", "Where the first layer's Occam factor sits, at the evidence's choice: its Kronecker eigendirections "
              "binned by lambda / delta; `pull`: the bin's part of d log q / d log delta = (gamma - delta ||theta||^2) / 2 "
              "(positive: the bin pushes delta up; the parts sum to zero at the optimum).", "",
              "| weights | lambda / delta | directions | gamma | ||theta||^2 in them | pull |", "|---|---|---:|---:|---:|---:|"]
    for m in found:
        for b in m["first_layer"]["bins"]:
            lines.append(f"| {m['key'].split('_s')[0]}, {m['epochs']} ep, "
                         + ("delta = 1" if not any(m["log_delta_run"]) else "defaults")
                         + f" | {b['bin'][0]:g} to {b['bin'][1]:g} | {b['count']} | {b['gamma']:.0f} | {b['sq_norm']:.2f} | "
                         f"{b['pull']:+.1f} |")
    return lines + [""]


def study_table() -> List[str]:
    """The guard against the defaults and delta = 1 in the never-worse study's cells (and cross-validation where
    that study found delta = 1 overfitting)."""
    import vs_cross_validation as study

    lines = ["| cell | arm | acc | NLL | NLL - delta=1 | acc - delta=1 (points) | log delta of the weights | cost | "
             "targets missed |", "|---|---|---:|---:|---:|---:|---|---:|---|"]
    for dataset, network in STUDY_CELLS:
        runs = {arm: [_zoo.cached(study_spec(dataset, network, s, arm), cache_dir()) for s in SEEDS] for arm in STUDY_ARMS}
        cv = None
        if (dataset, network) == ("bars", "mlp"):
            chosen, picked, cpu = cross_validation(lambda seed, arm: study_spec(dataset, network, seed, arm), study.GRID)
            cv_text, row = _row("cross-validation (chose " + ", ".join(f"{d:g}" for d in chosen) + ")", picked,
                                runs["delta=1"], cpu)
            cv = {**row, "overfits": sum(d > 1.0 for d in chosen) * 2 > len(chosen)}
        for arm in STUDY_ARMS:
            text, _ = _row(arm, runs[arm], runs["delta=1"], cv=None if arm == "delta=1" else cv)
            lines.append(f"| {dataset} / {network} " + text)
        if cv is not None:
            lines.append(f"| {dataset} / {network} " + cv_text)
    return lines + [""]


def guard_table() -> List[str]:
    """The guard's scores and decision at each estimate, per member and seed."""
    lines = ["| member | seed | (epoch: approximate CV log likelihood per datum, learned / declared, applied) | "
             "guard CPU share of the run |", "|---|---:|---|---:|"]
    for member in CV_MEMBERS:
        for s, run in zip(SEEDS, _runs(member, GUARD_ARM)):
            decisions = [h["guard"] for h in run["history"] if "guard" in h]
            text = "; ".join(f"{d['epoch']}: {d['learned']:.3f} / {d['declared']:.3f}, {d['applied']}" for d in decisions)
            estimate = sum(e["estimate"] for e in run["epochs_cpu"])
            lines.append(f"| {member.cell} | {s} | {text} | {estimate / run['cpu_seconds']:.2f} (estimates and guard) |")
    return lines + [""]


def analyse() -> None:
    path = RESULTS / f"{NAME}.md"
    runs = [_zoo.cached(s, cache_dir()) for s in plan() + study_plan()]
    libraries = sorted({r["library"] for r in runs})
    lines = [f"# {__doc__.splitlines()[0]}", "",
             _zoo.study_provenance(NAME, runs, SEEDS, steps="then `--mechanism` and `--analyse`") + ".", "",
             "Setting: 100 class means from N(0, I_64), inputs a mean plus noise, 5,000 test points; MLP 64-256-256-100 "
             "(3 hidden: 64-256-256-256-100), Adam 1e-3 constant, batch 128, 60 epochs, a layerwise prior from delta = 1; "
             "the defaults estimate every 10th epoch with the kron GGN of one Monte-Carlo sample (`mc_samples='auto'` at "
             "100 classes) and hold the output layer at delta = 1. Targets (issue 52): NLL at most delta = 1's + 0.02, accuracy at most "
             "1 point below, where delta = 1 overfits at least cross-validation's NLL and accuracy, cost at most 2x.", "",
             "## The members and the remedies", ""]
    for member in MEMBERS:
        lines += member_table(member)
    lines += ["## Does the learned prior keep growing? (noise 1, N = 5,000, defaults over 120 epochs)", ""]
    lines += growth_table()
    lines += ["## The approximate-CV guard's decisions", ""] + guard_table()
    lines += ["## The guard in the never-worse study's 12 cells (its recipes, data and epochs)", ""] + study_table()
    mech = os.path.join(_zoo.output_dir(NAME), "mechanism.json")
    if os.path.exists(mech):
        with open(mech) as f:
            lines += ["## The mechanism, post hoc (seed 0)", ""] + mechanism_tables(json.load(f))
    text = "\n".join(lines) + "\n\n" + hand_written(path)
    write_with_data(path, text, {"libraries": libraries})


def write_mechanism() -> None:
    with open(os.path.join(_zoo.output_dir(NAME), "mechanism.json"), "w") as f:
        json.dump(mechanism(), f)


def main(argv: Optional[Sequence[str]] = None) -> None:
    _zoo.study_main(None if argv is None else list(argv), __doc__, NAME, lambda: plan() + study_plan(), cache_dir(),
                    analyse, {"--mechanism": ("the post-hoc mechanism at cached weights", write_mechanism)})


if __name__ == "__main__":
    main()
