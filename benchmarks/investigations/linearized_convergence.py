"""How fast the linearized evidence's L-BFGS reaches the linear model's optimum, with and without preconditioning.

``lightning_marglik.linearized.linearized_evidence`` takes the linearized network to its MAP by full-batch
L-BFGS. On the ranking study's BatchNorm ResNets the plain iterations did not reach a gradient of 1e-3 of its
start in 100 iterations (``examples/results/ranking_study.md``). This script runs the study's setting -- kron-GGN,
``tol=1e-3``, ``history=100``, ``steps=100`` (``LINEARIZED_*``), categorical likelihood, the layerwise prior at
the online precisions of the run, as ``posthoc_evidence`` sets it up -- on the seed-0 final weights of res8x1 and
cnn32x1, with ``precondition=False`` (plain ``torch.optim.LBFGS``) and ``precondition=True`` (the posterior
precision at the trained weights as the initial inverse Hessian). On a candidate small enough for the ``P x P``
matrix (``FULL_MAX_PARAMS``: res8x1) also ``structure="full"`` preconditioned: the exact GGN, with the couplings
between layers that kron leaves out, as the preconditioner (a reference; its evidence is the full one). Recorded:
iterations, passes over the data (forward calls of the network per batch: the curvature pass, the L-BFGS
evaluations and the final likelihood pass), whether it converged, the final gradient (max-norm, and relative to
its start), the objective, the evidence per datum at the online hyperparameters and the process CPU seconds,
one thread.

Then the same with every BatchNorm folded into the layer before it (``fold_batchnorm`` with the run's prior
carried over, as ``select_models`` scores a network): the folded network has none of the eval-mode null
directions of a conv -> BatchNorm pair, so its linear model is better conditioned. On res8x1, res16x1 (the best
candidate by test accuracy), cnn8x1 and cnn32x1 (no BatchNorm: folding changes nothing), kron-GGN with and
without preconditioning, ``FOLDED_STEPS`` iterations at most; recorded as above plus the evidence with its
hyperparameters re-optimised by Newton at the optimum (as the study's ``linearized`` arm), beside the kron-EF
evidence of the folded network at the trained weights (``select_models``' default for these) and the test
accuracy: whether the converged linearized evidence orders these four networks as their accuracy does.

Weights: the study's saved runs (``--cache``, default ``outputs/ranking_study/runs``); a candidate without one
is trained here with the study's recipe (``run_candidate`` without its post-hoc evidences, about a minute;
kept in ``outputs/linearized_convergence/``).

Usage::

    python benchmarks/investigations/linearized_convergence.py                        # -> results/linearized_convergence.md
    python benchmarks/investigations/linearized_convergence.py --candidates res8x1 --print-only
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ranking_study as rs  # noqa: E402
from _common import RESULTS, cpu_name, freeze_startup, hand_written, load_avg, now, timed, write_with_data  # noqa: E402
from common import library_state  # noqa: E402
from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence  # noqa: E402
from lightning_marglik.folding import fold_batchnorm  # noqa: E402
from lightning_marglik.linearized import linearized_evidence  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

NAME = "linearized_convergence"
CANDIDATES = ("res8x1", "cnn32x1")
SEED = 0
# (structure, precondition) of every candidate; "full" only up to FULL_MAX_PARAMS (its P x P matrices, ~2 min)
CONFIGS = (("kron", False), ("kron", True), ("full", True))
FULL_MAX_PARAMS = 5200
FOLDED_CANDIDATES = ("cnn8x1", "cnn32x1", "res8x1", "res16x1")
FOLDED_STEPS = 200  # the budget of the folded runs: each records whether it converged within it
OWN_CACHE = ROOT / "outputs" / NAME


def final_state(name: str, cache: str, data: Tuple[torch.Tensor, ...]) -> Tuple[Dict[str, Any], str]:
    """The seed-0 run's final ``net`` weights and online ``log_precision``, and where they come from."""
    saved = rs.weights_path(cache, name, SEED)
    if os.path.exists(saved):
        return torch.load(saved)["100%"], "the ranking study's saved run"
    own = OWN_CACHE / f"{name}_seed{SEED}.pt"
    if not own.exists():
        print(f"{name}: no saved run in {cache}; training it with the study's recipe", flush=True)
        # the study's own training, without the post-hoc evidences it runs at every checkpoint
        with quiet_lightning(), mock.patch.object(rs, "posthoc_all", lambda *args: {}):
            state = rs.run_candidate(name, SEED, data, rs.RECIPE)["_states"]["100%"]
        OWN_CACHE.mkdir(parents=True, exist_ok=True)
        torch.save(state, own)
    return torch.load(own), "trained here with the study's recipe (the study's saved runs were absent)"


def network(name: str, state: Dict[str, Any]) -> Tuple[nn.Module, GaussianPrior]:
    """The network at the run's final weights, the layerwise prior at its online precisions (``posthoc_evidence``)."""
    family, kwargs = rs.CANDIDATES[name]
    net = rs.build_network(family, rs.RECIPE["image_size"], **kwargs)
    net.load_state_dict(state["net"])
    net.eval()
    prior = GaussianPrior(net, structure=rs.RECIPE["prior"])
    prior.log_precision.copy_(state["log_precision"])  # the layerwise prior's order: the net's parameters
    return net, prior


def measure(net: nn.Module, prior: GaussianPrior, loader: DataLoader, structure: str,
            precondition: bool, steps: int = rs.LINEARIZED_STEPS) -> Dict[str, Any]:
    """One ``linearized_evidence`` in the study's setting (at most ``steps`` iterations): its figures, passes over
    the data, CPU seconds, and the evidence with the hyperparameters re-optimised by Newton at the optimum."""
    calls = [0]
    hook = net.register_forward_pre_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    try:
        cpu, wall, result = timed(lambda: linearized_evidence(
            net, loader, CategoricalLikelihood(), prior, structure=structure, approx="ggn", steps=steps,
            tol=rs.LINEARIZED_TOL, history=rs.LINEARIZED_HISTORY, precondition=precondition))
    finally:
        hook.remove()
    evidence = result.evidence
    return {"structure": structure, "precondition": precondition, "iterations": result.iterations,
            "converged": result.converged, "passes": calls[0] / len(loader), "gradient_norm": result.gradient_norm,
            "objective": list(result.objective), "evidence": float(evidence.log_marglik()) / evidence.n_data,
            "evidence_newton": newton(evidence), "cpu_seconds": cpu, "wall_seconds": wall}


def newton(evidence: LaplaceEvidence) -> float:
    """The evidence per datum with its hyperparameters re-optimised by Newton (the study's ``posthoc_evidence``)."""
    return evidence.optimize(solver="newton", max_evaluations=50).value.item() / evidence.n_data


def folded_rows(name: str, state: Dict[str, Any], loader: DataLoader, test: Tuple[torch.Tensor, torch.Tensor],
                inputs: torch.Tensor) -> List[Dict[str, Any]]:
    """The folded network's linearized evidence with and without preconditioning, its kron-EF evidence at the
    trained weights and the test accuracy of the run."""
    net, prior = network(name, state)
    accuracy = float(rs.test_log_probs(net, *test)[1].mean())
    folded = fold_batchnorm(net, inputs, prior=prior)
    default = newton(LaplaceEvidence.fit(folded.model, loader, CategoricalLikelihood(), folded.prior, structure="kron",
                                         approx="ef"))
    start = start_gradient(folded.model, folded.prior, loader)
    return [{"name": name, "params": folded.prior.n_params, "start_gradient": start, "folded": len(folded.folded),
             "test_accuracy": accuracy, "kron_ef_folded": default,
             **measure(folded.model, folded.prior, loader, "kron", precondition, FOLDED_STEPS)}
            for precondition in (True, False)]


def start_gradient(net: nn.Module, prior: GaussianPrior, loader: DataLoader) -> float:
    """The objective's gradient max-norm at the trained weights (``steps=0``): what ``tol`` is relative to."""
    return linearized_evidence(net, loader, CategoricalLikelihood(), prior, structure="kron", steps=0).gradient_norm


def summary(row: Dict[str, Any]) -> str:
    """One line of a measured row, for the console."""
    relative = row["gradient_norm"] / row["start_gradient"]
    return (f"{row['name']} {row['structure']} precondition={row['precondition']}: {row['iterations']} iterations, "
            f"{row['passes']:.0f} passes, converged {row['converged']}, gradient {row['gradient_norm']:.3g} "
            f"({relative:.2e} of its start), objective {row['objective'][0]:.2f} -> {row['objective'][1]:.2f}, "
            f"evidence {row['evidence']:.4f} per datum, {row['cpu_seconds']:.1f} CPU s")


def write(rows: List[Dict[str, Any]], folded: List[Dict[str, Any]], command: str, sources: Dict[str, str]) -> Path:
    path = RESULTS / f"{NAME}.md"
    lines = [
        "# The linearized evidence's L-BFGS with and without preconditioning",
        "",
        f"{now()}. Command: `{command}`; one thread on {cpu_name()} (load average {load_avg():.1f} at the end); "
        f"library: {library_state()}.",
        "",
        "Weights: " + "; ".join(f"{name} seed {SEED}: {source}" for name, source in sources.items()) + ".",
        "",
        f"Setting: the ranking study's linearized GGN evidence (`steps={rs.LINEARIZED_STEPS}`, "
        f"`tol={rs.LINEARIZED_TOL:g}`, `history={rs.LINEARIZED_HISTORY}`), categorical likelihood, layerwise prior "
        "at the run's online precisions, the 4000 training digits in batches of 500. passes: forward calls of the "
        "network per batch (the curvature pass at the trained weights, every L-BFGS evaluation and the final "
        "likelihood pass). gradient: max-norm of the linear objective's gradient at the end, and relative to its "
        "start (converged: at most tol). objective: the negative log joint of the linear model, start -> end (the "
        "same function in every row). evidence: log evidence per datum at the online hyperparameters, of the row's "
        "structure (no re-optimisation). structure full: the exact GGN as the preconditioner, a reference.",
        "",
        "| candidate | params | structure | precondition | iterations | passes | converged | gradient "
        "| gradient / start | objective | evidence / N | Newton | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row_line(r, [r["name"], r["params"], r["structure"]], [f"{r['evidence_newton']:.4f}"]) for r in rows]
    lines += [
        "",
        f"The BatchNorms folded (`fold_batchnorm`, the prior carried over), kron-GGN, at most {FOLDED_STEPS} "
        "iterations. Newton: the evidence per datum with the hyperparameters re-optimised at the optimum (the "
        "study's `linearized` arm). kron-EF folded: the evidence of the folded network at the trained weights, "
        "Newton, what `select_models`' default ranks these by.",
        "",
        "| candidate | test acc | norms folded | params | precondition | iterations | passes | converged | gradient "
        "| gradient / start | objective | evidence / N | Newton | kron-EF folded | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row_line(r, [r["name"], f"{r['test_accuracy']:.4f}", r["folded"], r["params"]],
                       [f"{r['evidence_newton']:.4f}", f"{r['kron_ef_folded']:.4f}"]) for r in folded]
    lines += ["", hand_written(path)]
    write_with_data(path, "\n".join(lines), {"rows": rows, "folded": folded, "sources": sources})
    return path


def row_line(r: Dict[str, Any], first: List[Any], extra: Sequence[str] = ()) -> str:
    """One table row: the ``first`` cells, the run's figures, the ``extra`` cells, the CPU seconds."""
    cells = [*first, r["precondition"], r["iterations"], f"{r['passes']:.0f}", r["converged"],
             f"{r['gradient_norm']:.3g}", f"{r['gradient_norm'] / r['start_gradient']:.2e}",
             f"{r['objective'][0]:.1f} -> {r['objective'][1]:.1f}", f"{r['evidence']:.4f}", *extra,
             f"{r['cpu_seconds']:.1f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: Sequence[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--cache", default=os.path.join(ROOT, "outputs", "ranking_study", "runs"))
    options.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(rs.CANDIDATES))
    options.add_argument("--folded", nargs="*", default=list(FOLDED_CANDIDATES), choices=list(rs.CANDIDATES))
    options.add_argument("--print-only", action="store_true", help="print, do not write the results file")
    args = options.parse_args(argv)
    torch.set_num_threads(1)
    data = rs.load_mnist(rs.RECIPE["n_train"], rs.RECIPE["image_size"], rs.RECIPE["split_seed"])
    test = (data[2], data[3])
    loader = DataLoader(TensorDataset(data[0], data[1]), batch_size=500)
    freeze_startup()
    rows, sources = [], {}
    for name in args.candidates:
        state, sources[name] = final_state(name, args.cache, data)
        net, prior = network(name, state)
        start = start_gradient(net, prior, loader)
        for structure, precondition in CONFIGS:
            if structure == "full" and prior.n_params > FULL_MAX_PARAMS:
                continue
            rows.append({"name": name, "params": prior.n_params, "start_gradient": start,
                         **measure(net, prior, loader, structure, precondition)})
            print(summary(rows[-1]), flush=True)
    folded: List[Dict[str, Any]] = []
    for name in args.folded:
        state, sources[name] = final_state(name, args.cache, data)
        folded += folded_rows(name, state, loader, test, data[0][:500])
        print("\n".join(f"folded {summary(r)}; test acc {r['test_accuracy']:.4f}, Newton {r['evidence_newton']:.4f}, "
                        f"kron-EF folded {r['kron_ef_folded']:.4f}" for r in folded[-2:]), flush=True)
    if not args.print_only:
        command = " ".join(["python benchmarks/investigations/linearized_convergence.py", *(sys.argv[1:] if argv is None else argv)])
        print(write(rows, folded, command, sources))


if __name__ == "__main__":
    main()
