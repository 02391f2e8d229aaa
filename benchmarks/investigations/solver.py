"""Inner hyperparameter solvers on the Laplace evidence: Newton against K Adam steps.

Run from the repository root::

    python benchmarks/investigations/solver.py            # full run (a few minutes), writes benchmarks/results/solver.md
    python benchmarks/investigations/solver.py --quick    # smoke test (seconds), prints the tables only

What is measured, single-threaded (``torch.set_num_threads(1)``), in float64:

* (a) every curvature structure (diag, kron, full; GGN) x prior structure (scalar, layerwise, and
  diagonal where the structure allows it) x likelihood (Gaussian regression with learned sigma,
  categorical classification) on an MLP 5-16-16-C (tanh) trained to a MAP on N=300 synthetic
  points. The learnable log hyperparameters start at 0 (delta = sigma = 1, the paper's default).
  Each solve runs on the evidence's cached curvature: ``solvers.adam`` with 1,000 and with
  K=100 steps (lr 0.1) and ``solvers.newton`` (tol 1e-6 nats, at most 20 evaluations). The
  reference optimum is the best of these and a tight Newton solve (tol 1e-12, 200 evaluations);
  the gap is (reference - value) / N. Times are process CPU per solve, the median of ``--reps``
  rounds in which the three solvers run side by side.
* (b) the online prior-precision setting of ``configs/prior_selection.yaml`` (paper Fig. 4),
  replicated in a plain loop with the public API: the breast-cancer MLP 30-50-2 (float32, scalar
  prior from delta_0 = 1e-3, 1, 1e2), full-batch Adam (lr 0.01, cosine to 0.001) for 300 epochs,
  and every 5 epochs a kron-GGN evidence and one inner solve, ``evidence.optimize(steps=100,
  lr=0.1, solver=...)`` with Adam (the example's setting, moments carried across estimates) or
  Newton. At each run's trained weights, the inner solves then restart from that run's delta_0.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_marglik import (CategoricalLikelihood, GaussianLikelihood, GaussianPrior,  # noqa: E402
                               LaplaceEvidence, map_loss)
from lightning_marglik.solvers import Solution  # noqa: E402

THREADS = 1
N_DATA = 300
WIDTH = 16
STRUCTURES = ("diag", "kron", "full")
PRIORS = ("scalar", "layerwise", "diagonal")
KINDS = ("regression", "classification")
INITS = (1e-3, 1.0, 1e2)
FREQUENCY = 5  # examples/prior_selection.py: an estimate every 5 epochs
BOSTON_N, BOSTON_D = 455, 13  # UCI boston's training split: 90% of 506 rows, 13 features
REGRESSION_F, REGRESSION_K = 50, 10  # the paper's UCI regression protocol: an estimate every F epochs, K Adam steps
RESULTS = ROOT / "benchmarks" / "results" / "solver.md"


def trained_mlp(kind: str, epochs: int) -> Tuple[nn.Module, DataLoader]:
    """MLP 5-16-16-C fitted by full-batch Adam on the MAP loss (delta = 1, sigma = 0.3)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_DATA, 5, generator=gen)
    mix = torch.randn(5, 3, generator=gen)
    if kind == "regression":
        y = torch.stack([torch.sin(2 * x @ mix[:, 0]), torch.tanh(x @ mix[:, 1]) * (x @ mix[:, 2])], 1)
        y = y + 0.3 * torch.randn(N_DATA, 2, generator=gen)
        lik: nn.Module = GaussianLikelihood(sigma=0.3)
    else:
        y = (torch.sin(2 * x @ mix) + 0.3 * torch.randn(N_DATA, 3, generator=gen)).argmax(1)
        lik = CategoricalLikelihood()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                        nn.Linear(WIDTH, y.shape[1] if kind == "regression" else 3))
    prior = GaussianPrior(net, precision=1.0, structure="scalar", learn=False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(epochs):
        opt.zero_grad()
        map_loss(net(x), y, lik, prior, N_DATA).backward()
        opt.step()
    for p in net.parameters():
        p.grad = None
    return net, DataLoader(TensorDataset(x, y), batch_size=100)


def timed(solve: Callable[[], Solution]) -> Tuple[Solution, float, int]:
    """A solve, its process CPU time, and the number of warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.process_time()
        solution = solve()
        seconds = time.process_time() - start
    return solution, seconds, len(caught)


def solve_all(
    evidence: LaplaceEvidence, reps: int, long_steps: int
) -> Tuple[Dict[str, object], Dict[str, Solution]]:
    """Adam (long), Adam (K=100), Adam (K=10) and Newton side by side through
    ``evidence.optimize``, ``reps`` rounds; gaps to the reference.

    Returns the table row and the solutions, with the tight reference Newton solve as ``"tight"``.
    """
    runs: Dict[str, Tuple[Callable[[], Solution], List[float]]] = {
        "adam_long": (lambda: evidence.optimize(steps=long_steps, lr=0.1, solver="adam"), []),
        "adam_100": (lambda: evidence.optimize(steps=100, lr=0.1, solver="adam"), []),
        "adam_10": (lambda: evidence.optimize(steps=10, lr=0.1, solver="adam"), []),
        "newton": (lambda: evidence.optimize(solver="newton"), []),
    }
    solutions: Dict[str, Solution] = {}
    warned: Dict[str, int] = {}
    for _ in range(reps):
        for name, (solve, seconds) in runs.items():
            solutions[name], elapsed, warned[name] = timed(solve)
            seconds.append(elapsed)
    tight = evidence.optimize(solver="newton", tol=1e-12, max_evaluations=200)
    reference = max([tight.value.item()] + [s.value.item() for s in solutions.values()])
    n = sum(t.numel() for t in solutions["newton"].values.values())
    row: Dict[str, object] = {"dim": n, "start": solutions["newton"].start.item() / N_DATA,
                              "optimum": reference / N_DATA}
    for name, (_, seconds) in runs.items():
        row[f"{name}_gap"] = (reference - solutions[name].value.item()) / N_DATA
        row[f"{name}_ms"] = 1e3 * statistics.median(seconds)
        row[f"{name}_warned"] = warned[name]
    row["newton_evals"] = solutions["newton"].evaluations
    row["newton_converged"] = solutions["newton"].converged
    row["newton_per_adam_10"] = row["newton_ms"] / row["adam_10_ms"]
    return row, {**solutions, "tight": tight}


def structure_table(reps: int, long_steps: int, epochs: int) -> List[Dict[str, object]]:
    rows = []
    for kind in KINDS:
        net, loader = trained_mlp(kind, epochs)
        for structure in STRUCTURES:
            for prior_structure in PRIORS:
                if structure == "kron" and prior_structure == "diagonal":
                    continue  # not combinable (one precision per scalar vs Kronecker factors)
                prior = GaussianPrior(net, precision=1.0, structure=prior_structure)
                lik = GaussianLikelihood(sigma=1.0) if kind == "regression" else CategoricalLikelihood()
                evidence = LaplaceEvidence.fit(net, loader, lik, prior, structure=structure)
                row, _ = solve_all(evidence, reps=reps, long_steps=long_steps)
                rows.append({"kind": kind, "structure": structure, "prior": prior_structure, "P": prior.n_params,
                             **row})
                print(format_row(rows[-1]), flush=True)
    return rows


def breast_cancer() -> Tuple[Tensor, Tensor]:
    """The example's training split: 70% of scikit-learn's breast-cancer data, stratified, standardized."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, _, y_train, _ = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    x_train = (x_train - x_train.mean(0)) / x_train.std(0)
    return torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)


def online_run(init: float, solver: str, epochs: int) -> Tuple[nn.Module, float, float]:
    """Algorithm 1 with the example's settings in a plain loop; returns the net, the final log delta
    and the CPU seconds of the inner solves."""
    x, y = breast_cancer()
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(30, 50), nn.Tanh(), nn.Linear(50, 2))
    prior, lik = GaussianPrior(net, precision=init, structure="scalar"), CategoricalLikelihood()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=0.001)
    state: Dict = {}
    solve_seconds = 0.0
    for epoch in range(1, epochs + 1):
        opt.zero_grad()
        map_loss(net(x), y, lik, prior, len(x)).backward()
        opt.step()
        schedule.step()
        if epoch % FREQUENCY == 0:
            evidence = LaplaceEvidence.fit(net, loader, lik, prior, structure="kron")
            start = time.process_time()
            solution = evidence.optimize(steps=100, lr=0.1, state=state, solver=solver)
            solve_seconds += time.process_time() - start
            state = solution.state
            evidence.set_hyperparameters(solution.values)
    return net, prior.log_precision.item(), solve_seconds


def online_table(epochs: int, long_steps: int) -> List[Dict[str, object]]:
    x, y = breast_cancer()
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    rows = []
    for init in INITS:
        for solver in ("adam", "newton"):
            net, log_delta, solve_seconds = online_run(init, solver, epochs)
            prior = GaussianPrior(net, precision=init, structure="scalar")
            evidence = LaplaceEvidence.fit(net, loader, CategoricalLikelihood(), prior, structure="kron")
            row, solutions = solve_all(evidence, reps=1, long_steps=long_steps)
            rows.append({"delta_0": init, "online_solver": solver, "online_log_delta": log_delta,
                         "online_solve_s": solve_seconds,
                         "newton_log_delta": solutions["newton"].values["log_precision"].item(),
                         "optimum_log_delta": solutions["tight"].values["log_precision"].item(), **row})
            print(format_row(rows[-1]), flush=True)
    return rows


def boston_like() -> Tuple[Tensor, Tensor]:
    """Data of UCI boston's training shape (N=455 of 506, D=13): standardized Gaussian features, a
    smooth nonlinear target with noise, standardized."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BOSTON_N, BOSTON_D, generator=gen)
    mix = torch.randn(BOSTON_D, 3, generator=gen) / BOSTON_D**0.5
    y = torch.sin(2 * x @ mix[:, 0]) + (x @ mix[:, 1]) * torch.tanh(x @ mix[:, 2]) + 0.3 * torch.randn(BOSTON_N, generator=gen)
    return x, ((y - y.mean()) / y.std()).unsqueeze(1)


def regression_protocol(epochs: int, reps: int) -> List[Dict[str, object]]:
    """The paper's UCI regression protocol with the full GGN, one row per estimate.

    MLP 13-50-1 (tanh), layerwise prior and Gaussian likelihood with learned sigma (all starting
    at 1), full-batch Adam (lr 1e-2) on the MAP loss; every ``REGRESSION_F`` epochs the full-GGN
    evidence (N = 455 < P = 751: the determinant-lemma form) and ``REGRESSION_K`` Adam steps (lr
    0.1, moments carried): the online run. At each estimate the default Newton solve and the K
    Adam steps are also timed from the same start on the same evidence, ``reps`` rounds.
    """
    x, y = boston_like()
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(BOSTON_D, 50), nn.Tanh(), nn.Linear(50, 1))
    prior, lik = GaussianPrior(net, precision=1.0, structure="layerwise"), GaussianLikelihood(sigma=1.0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    state: Dict = {}
    rows = []
    for epoch in range(1, epochs + 1):
        opt.zero_grad()
        map_loss(net(x), y, lik, prior, len(x)).backward()
        opt.step()
        if epoch % REGRESSION_F:
            continue
        start = time.process_time()
        evidence = LaplaceEvidence.fit(net, loader, lik, prior, structure="full")
        pass_s = time.process_time() - start
        newton_s, adam_s = [], []
        for _ in range(reps):
            solution, seconds, _ = timed(lambda: evidence.optimize(solver="newton"))
            newton_s.append(seconds)
            adam_solution, seconds, _ = timed(
                lambda: evidence.optimize(steps=REGRESSION_K, lr=0.1, state=state, solver="adam"))
            adam_s.append(seconds)
        start_value = solution.start.item()
        rows.append({
            "epoch": epoch, "P": prior.n_params, "pass_ms": 1e3 * pass_s,
            "newton_ms": 1e3 * statistics.median(newton_s), "adam_10_ms": 1e3 * statistics.median(adam_s),
            "newton_evals": solution.evaluations, "newton_converged": solution.converged,
            "newton_gain": (solution.value.item() - start_value) / len(x),
            "adam_10_gain": (adam_solution.value.item() - start_value) / len(x),
        })
        rows[-1]["newton_per_adam_10"] = rows[-1]["newton_ms"] / rows[-1]["adam_10_ms"]
        print(format_row(rows[-1]), flush=True)
        state = adam_solution.state
        evidence.set_hyperparameters(adam_solution.values)  # the protocol's run: K Adam steps
    return rows


def format_row(row: Dict[str, object]) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def markdown(rows: List[Dict[str, object]], columns: List[Tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" if f == "s" else "---:" for _, _, f in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) for k, _, f in columns) + " |")
    return "\n".join(lines)


STRUCTURE_COLUMNS = [
    ("kind", "likelihood", "s"), ("structure", "curvature", "s"), ("prior", "prior", "s"), ("dim", "dim", "d"),
    ("start", "start /N", ".4f"), ("optimum", "optimum /N", ".4f"),
    ("adam_long_gap", "gap Adam-1000", ".1e"), ("adam_100_gap", "gap Adam-100", ".1e"),
    ("adam_10_gap", "gap Adam-10", ".1e"), ("newton_gap", "gap Newton", ".1e"), ("newton_evals", "Newton evals", "d"),
    ("adam_long_ms", "ms Adam-1000", ".0f"), ("adam_100_ms", "ms Adam-100", ".1f"), ("adam_10_ms", "ms Adam-10", ".2f"),
    ("newton_ms", "ms Newton", ".2f"), ("newton_per_adam_10", "Newton / Adam-10", ".2f"),
]
ONLINE_COLUMNS = [
    ("delta_0", "delta_0", "g"), ("online_solver", "online solver", "s"), ("online_solve_s", "online solve s", ".2f"),
    ("online_log_delta", "online log delta", ".3f"),
    ("optimum_log_delta", "optimum log delta", ".3f"), ("newton_log_delta", "Newton log delta", ".3f"),
    ("start", "start /N", ".4f"), ("optimum", "optimum /N", ".5f"),
    ("adam_long_gap", "gap Adam-1000", ".1e"), ("adam_100_gap", "gap Adam-100", ".1e"),
    ("newton_gap", "gap Newton", ".1e"), ("newton_evals", "Newton evals", "d"), ("newton_converged", "converged", "s"),
    ("adam_long_ms", "ms Adam-1000", ".0f"), ("adam_100_ms", "ms Adam-100", ".1f"), ("adam_10_ms", "ms Adam-10", ".2f"),
    ("newton_ms", "ms Newton", ".2f"), ("newton_per_adam_10", "Newton / Adam-10", ".2f"),
]
REGRESSION_COLUMNS = [
    ("epoch", "epoch", "d"), ("pass_ms", "ms evidence pass", ".1f"), ("newton_ms", "ms Newton", ".2f"),
    ("newton_evals", "Newton evals", "d"), ("newton_converged", "converged", "s"), ("adam_10_ms", "ms Adam-10", ".2f"),
    ("newton_per_adam_10", "Newton / Adam-10", ".2f"), ("newton_gain", "gain Newton /N", ".2e"),
    ("adam_10_gain", "gain Adam-10 /N", ".2e"),
]


def summary(rows: List[Dict[str, object]], online: List[Dict[str, object]], regression: List[Dict[str, object]]) -> str:
    """The table's extremes in words (computed, so a rerun keeps them true)."""
    def span(values: List[float], fmt: str) -> str:
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    per_structure = []
    for structure in STRUCTURES:
        ratios = [r["newton_per_adam_10"] for r in rows if r["structure"] == structure]
        per_structure.append(f"{structure} {span(ratios, '.2f')}")
    slower = [f"{r['kind']} {r['structure']} {r['prior']} ({r['newton_per_adam_10']:.2f}x)"
              for r in rows if r["newton_per_adam_10"] > 1]
    slower += [f"(b) delta_0 = {r['delta_0']:g} {r['online_solver']} ({r['newton_per_adam_10']:.2f}x)"
               for r in online if r["newton_per_adam_10"] > 1]
    slower += [f"(c) epoch {r['epoch']} ({r['newton_per_adam_10']:.2f}x)" for r in regression if r["newton_per_adam_10"] > 1]
    worst = max(rows, key=lambda r: r["adam_100_gap"])
    worst_online = max(online, key=lambda r: r["adam_100_gap"])
    by = {(r["delta_0"], r["online_solver"]): r for r in online}
    times = {solver: [r["online_solve_s"] for r in online if r["online_solver"] == solver]
             for solver in ("adam", "newton")}
    return "\n".join([
        f"- Newton: {span([r['newton_evals'] for r in rows + online], 'd')} evaluations, converged in "
        f"{sum(r['newton_converged'] == 'True' for r in rows + online)} of {len(rows + online)} solves; largest gap "
        f"{max(r['newton_gap'] for r in rows):.1e} nats per datum in (a), {max(r['newton_gap'] for r in online):.1e} "
        f"in (b).",
        f"- Adam-1000 (lr 0.1): largest gap {max(r['adam_long_gap'] for r in rows + online):.1e} nats per datum. "
        f"Adam-100 (the paper's K): largest gap {worst['adam_100_gap']:.1e} in (a) ({worst['kind']} "
        f"{worst['structure']} {worst['prior']}), {worst_online['adam_100_gap']:.1e} in (b) (delta_0 = "
        f"{worst_online['delta_0']:g}: Adam moves a log hyperparameter by at most about lr per step).",
        f"- Time of Newton / time of 10 Adam steps, by curvature in (a): {', '.join(per_structure)}; (b) "
        f"{span([r['newton_per_adam_10'] for r in online], '.2f')}; (c) "
        f"{span([r['newton_per_adam_10'] for r in regression], '.2f')}. Newton slower than 10 Adam steps in: "
        f"{', '.join(slower) or 'none'}. Newton's gradient and Hessian are closed-form (the structures' "
        f"`log_det_derivatives`): one pass over the cached eigenvalues or diagonals under kron, diag and a full "
        f"curvature with one precision; for a full curvature with several, `H^-1` blocks from its cached Schur decomposition (Gram form), or an m x m Woodbury inverse in the largest tensor's eigenbasis (low-rank form).",
        f"- (c) the paper's regression protocol (full GGN, N = {BOSTON_N} < P = {regression[0]['P']}): Newton "
        f"{span([r['newton_ms'] for r in regression], '.1f')} ms per estimate in "
        f"{span([r['newton_evals'] for r in regression], 'd')} evaluations (converged in "
        f"{sum(r['newton_converged'] == 'True' for r in regression)} of {len(regression)}), 10 Adam steps "
        f"{span([r['adam_10_ms'] for r in regression], '.1f')} ms, the evidence pass "
        f"{span([r['pass_ms'] for r in regression], '.1f')} ms.",
        "- Online (b), final log delta with Adam / Newton inner solves: " + ", ".join(
            f"delta_0 = {init:g}: {by[(init, 'adam')]['online_log_delta']:.3f} / "
            f"{by[(init, 'newton')]['online_log_delta']:.3f}" for init in INITS
        ) + f"; CPU in the inner solves over the run: Adam {span(times['adam'], '.2f')} s, Newton "
        f"{span(times['newton'], '.2f')} s.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: fewer steps and rounds, no file")
    parser.add_argument("--reps", type=int, default=3, help="timing rounds per case (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    torch.set_default_dtype(torch.float64)
    reps, long_steps, epochs, online_epochs = (1, 200, 200, 3) if args.quick else (args.reps, 1000, 2000, 300)
    regression_epochs = REGRESSION_F * (1 if args.quick else 10)
    began = time.time()
    load = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = structure_table(reps, long_steps, epochs)
    torch.set_default_dtype(torch.float32)  # the example's float32 network
    online = online_table(online_epochs, long_steps)
    regression = regression_protocol(regression_epochs, reps)
    for row in rows + online + regression:
        row["newton_converged"] = str(row["newton_converged"])
    tables = markdown(rows, STRUCTURE_COLUMNS), markdown(online, ONLINE_COLUMNS), markdown(regression, REGRESSION_COLUMNS)
    print(*tables, sep="\n\n")
    if args.quick:
        return
    text = f"""# Inner solvers: Newton vs Adam on the Laplace evidence

- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC
- Command: `python benchmarks/investigations/solver.py` (from the repository root, commit {commit}; total run time {time.time() - began:.0f} s)
- torch {version("torch")}, Python {platform.python_version()}; `torch.set_num_threads({THREADS})`; \
load average (1 min) at start / end: {load:.1f} / {os.getloadavg()[0]:.1f} (shared 2-core machine)
- Times: process CPU per solve, median of {reps} rounds run side by side; the evidence pass itself is not included.
- Every solve goes through `LaplaceEvidence.optimize`. Gap: (reference optimum - value) / N, the reference
  being the best of all solves and a tight Newton (tol 1e-12, up to 200 evaluations). Newton:
  `optimize(solver="newton")` defaults (closed-form derivatives, tol 1e-6 nats, at most 20 evaluations);
  Adam: `optimize(steps=K, lr=0.1, solver="adam")`. The requirement: Newton costs no more than 10 Adam
  steps (the paper's K for UCI) in every row ("Newton / Adam-10" <= 1).

## Summary

{summary(rows, online, regression)}

## (a) Structures x priors x likelihoods

MLP 5-16-16-C (tanh, P = {rows[0]["P"]} for C = 2, {rows[-1]["P"]} for C = 3), N = {N_DATA} synthetic points,
trained {epochs} full-batch Adam steps on the MAP loss; float64. Learned: log prior precision (+ log sigma for
regression), all starting at 0. "dim" is the number of learned scalars. Newton's Hessian is exact except for a
diagonal prior on the full curvature (403 or 419 coupled precisions, above `DENSE_LIMIT` = 200), where the
precisions enter by their exact Hessian diagonal (the line search guards the step).

{tables[0]}

## (b) Online prior-precision setting of examples/prior_selection.py (configs/prior_selection.yaml; paper Fig. 4)

Each row: the breast-cancer MLP 30-50-2 (float32) trained online from delta_0 with the example's settings
({online_epochs} epochs, an estimate every {FREQUENCY}: kron GGN, scalar prior) and the given inner solver (Adam: K=100
steps at lr 0.1 with its moments carried over; Newton: default tol and budget). "online log delta" is where the run
ended, "online solve s" the CPU spent in its inner solves. Then, at the run's trained weights, the three inner solves
restart from delta_0 on the kron-GGN evidence (one learned scalar; gaps per datum as in (a)).

{tables[1]}

## (c) The paper's UCI regression protocol, boston-shaped (full GGN, determinant-lemma form)

Generated data of UCI boston's training shape (N = {BOSTON_N}, D = {BOSTON_D}; `boston_like`), MLP {BOSTON_D}-50-1 (tanh,
P = {regression[0]["P"]}), layerwise prior and learned sigma starting at 1, full-batch Adam (lr 1e-2) on the MAP
loss for {regression_epochs} epochs; every F = {REGRESSION_F} epochs the full-GGN evidence (N < P: the determinant
lemma) and the protocol's K = {REGRESSION_K} Adam steps (lr 0.1, moments carried), which the run continues with. At each
estimate, the default Newton solve and the K Adam steps are timed from the same start on the same evidence.

{tables[2]}
"""
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
