"""Where the ranking study's evidence puts its Occam factor: per tensor, per kind of tensor, per candidate.

The ranking study (``examples/ranking_study.py``) ranks the BatchNorm ResNets last although they test as
well as the best CNNs. This script reads the study's saved weights (``--posthoc``'s files, one per run),
re-estimates the default image evidence (kron-EF, layerwise prior re-optimised by Newton, as
``select_models(rank_by="auto")`` resolves for these networks) and splits the log evidence into the data fit
``log p(D|theta)`` and one Occam term per prior tensor ``t``,

    occam_t = 1/2 P_t log delta_t - 1/2 delta_t ||theta_t||^2 - 1/2 log|H_t|,

whose sum with the data fit is the evidence (the ``2 pi`` terms cancel). Every structure here is
block-diagonal over tensors with one precision per tensor, so ``log|H_t|`` is ``log|H|`` minus ``log|H|``
with ``delta_t`` raised to ``e^40`` plus ``40 P_t`` (exact up to ``s lambda e^-40``). With it the effective
number of parameters ``gamma_t = P_t - d log|H| / d log delta_t`` (MacKay's, by autograd).

Then, on the candidates small enough for the exact ``full`` GGN (``FULL_MAX_PARAMS``: its ``P x P``
matrix), the whole Occam term and gamma of ``full``, kron-GGN and kron-EF side by side (each with its own
Newton-optimised layerwise prior): whether the block-diagonal structures count more effective parameters
than the curvature has, and more so for networks with more tensors.

Usage::

    python examples/ranking_study.py                     # first: trains the study and saves its weights
    python benchmarks/investigations/occam_breakdown.py                 # seed 0 of every candidate -> results/occam_breakdown.md
    python benchmarks/investigations/occam_breakdown.py --cache DIR --candidates res16x1 cnn32x2 --print-only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ranking_study as rs  # noqa: E402
from _common import RESULTS, hand_written, now, write_with_data  # noqa: E402
from common import library_state  # noqa: E402
from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence  # noqa: E402
from lightning_marglik.curvature.scale_invariance import find_scale_invariant  # noqa: E402

NAME = "occam_breakdown"
LARGE = 40.0  # log delta that takes a tensor's block out of log|H| (its own term becomes P_t * LARGE)
KINDS = ("weights feeding a BatchNorm", "BatchNorm scale and shift", "other weights", "other biases")
FULL_MAX_PARAMS = 5200  # the full GGN's P x P matrices in float64 (about 0.2 GB at the largest), ~1 min each
STRUCTURES = (("full", "ggn"), ("kron", "ggn"), ("kron", "ef"))


def log_det_slope(evidence: LaplaceEvidence):
    """The hyperparameters (float64), ``log|H|`` there and its gradient in the log precisions."""
    values = {k: v.detach().to(torch.float64) for k, v in evidence.hyperparameters().items()}
    log_delta = values["log_precision"].clone().requires_grad_(True)
    log_det = evidence._pieces({**values, "log_precision": log_delta})["log_det"]
    return values, log_det.detach(), torch.autograd.grad(log_det, log_delta)[0]


def total_gamma(evidence: LaplaceEvidence) -> float:
    """MacKay's effective number of parameters of any structure: ``P - sum_t d log|H| / d log delta_t``."""
    return evidence.prior.n_params - float(log_det_slope(evidence)[2].sum())


def occam_per_tensor(evidence: LaplaceEvidence) -> List[Dict[str, float]]:
    """Per prior tensor of a layerwise prior: its Occam term, effective parameters and log precision (nats, totals)."""
    prior = evidence.prior
    values, log_det, slope = log_det_slope(evidence)
    rows = []
    for t, (name, param) in enumerate(zip(prior.param_names, prior.params)):
        raised = values["log_precision"].clone()
        raised[t] = LARGE
        without = evidence._pieces({**values, "log_precision": raised})["log_det"]
        own = float(log_det - without) + param.numel() * LARGE
        ld, sq = float(values["log_precision"][t]), float(param.detach().double().pow(2).sum())
        rows.append({"name": name, "params": param.numel(), "log_delta": ld,
                     "occam": 0.5 * param.numel() * ld - 0.5 * torch.tensor(ld).exp().item() * sq - 0.5 * own,
                     "gamma": param.numel() - float(slope[t])})
    return rows


def kind_of(name: str, normalized: Sequence[str], norms: Sequence[str]) -> str:
    module = name.rsplit(".", 1)[0]
    if module in normalized:
        return KINDS[0]
    if module in norms:
        return KINDS[1]
    return KINDS[3] if name.endswith("bias") else KINDS[2]


def fitted(name: str, seed: int, cache: str, loader: DataLoader, structure: str, approx: str):
    """The run's final network and its evidence with ``structure``/``approx``, precisions optimised by Newton."""
    family, kwargs = rs.CANDIDATES[name]
    state = torch.load(rs.weights_path(cache, name, seed))["100%"]
    net = rs.build_network(family, rs.RECIPE["image_size"], **kwargs)
    net.load_state_dict(state["net"])
    net.eval()
    prior = GaussianPrior(net, structure="layerwise")
    prior.log_precision.copy_(state["log_precision"])
    evidence = LaplaceEvidence.fit(net, loader, CategoricalLikelihood(), prior, structure=structure, approx=approx)
    solution = evidence.optimize(solver="newton", max_evaluations=50)
    evidence.set_hyperparameters(solution.values)
    return net, prior, evidence, solution


def structures_side_by_side(name: str, seed: int, cache: str, loader: DataLoader) -> Dict[str, Any]:
    """Evidence, data fit, Occam term and gamma per structure of ``STRUCTURES`` (per datum, gamma in parameters)."""
    out: Dict[str, Any] = {"name": name, "family": rs.CANDIDATES[name][0], "seed": seed}
    for structure, approx in STRUCTURES:
        _, prior, evidence, solution = fitted(name, seed, cache, loader, structure, approx)
        n, fit = evidence.n_data, float(evidence.log_likelihood()) / evidence.n_data
        out["params"] = prior.n_params
        out[f"{structure}-{approx}"] = {"evidence": float(solution.value) / n, "fit": fit,
                                        "occam": float(solution.value) / n - fit, "gamma": total_gamma(evidence),
                                        "converged": bool(solution.converged)}
    return out


def breakdown(name: str, seed: int, cache: str, loader: DataLoader) -> Dict[str, Any]:
    family = rs.CANDIDATES[name][0]
    net, prior, evidence, solution = fitted(name, seed, cache, loader, "kron", "ef")
    n = evidence.n_data
    rows = occam_per_tensor(evidence)
    found = find_scale_invariant(net, next(iter(loader))[0][:64])
    normalized, norms = [f.layer for f in found], [f.norm for f in found]
    norms += [m for m, module in net.named_modules() if isinstance(module, torch.nn.modules.batchnorm._NormBase)]
    by_kind = {k: {"params": 0, "occam": 0.0, "gamma": 0.0} for k in KINDS}
    for row in rows:
        entry = by_kind[kind_of(row["name"], normalized, norms)]
        entry["params"] += row["params"]
        entry["occam"] += row["occam"] / n
        entry["gamma"] += row["gamma"]
    fit = float(evidence.log_likelihood()) / n
    return {"name": name, "family": family, "seed": seed, "params": prior.n_params, "n_data": n,
            "evidence": float(solution.value) / n,
            "fit": fit, "occam": sum(r["occam"] for r in rows) / n, "gamma": sum(r["gamma"] for r in rows),
            "by_kind": by_kind, "tensors": rows, "converged": bool(solution.converged)}


def write(results: List[Dict[str, Any]], side: List[Dict[str, Any]], command: str, seconds: float) -> Path:
    path = RESULTS / f"{NAME}.md"
    lines = [
        "# Where the evidence puts its Occam factor (the ranking study's candidates)",
        "",
        f"{now()}. Command: `{command}`; {seconds / 60:.1f} min on one thread; library: {library_state()}; "
        f"weights: the ranking study's saved runs, seed {', '.join(sorted({str(r['seed']) for r in results}))}.",
        "",
        "kron-EF at the final weights, layerwise prior re-optimised by Newton (the default image evidence). Per datum: "
        "log evidence = data fit + Occam (the sum of the per-tensor terms). gamma: effective number of parameters "
        "(MacKay). Occam per effective parameter: the Occam term per datum times N over gamma.",
        "",
        "| candidate | family | params | log evidence / N | data fit / N | Occam / N | gamma | Occam nats per "
        "effective parameter | share of the Occam: " + " / ".join(KINDS) + " |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = " / ".join(f"{100 * r['by_kind'][k]['occam'] / r['occam']:.0f} %" if r["by_kind"][k]["params"] else "-"
                           for k in KINDS)
        lines.append(f"| {r['name']} | {r['family']} | {r['params']} | {r['evidence']:.3f} | {r['fit']:.3f} | "
                     f"{r['occam']:.3f} | {r['gamma']:.0f} | {-r['occam'] * r['n_data'] / r['gamma']:.2f} | {share} |")
    labels = [f"{s}-{a}" for s, a in STRUCTURES]
    lines += [
        "",
        f"## full against kron on the candidates with at most {FULL_MAX_PARAMS} parameters",
        "",
        "Each structure with its own Newton-optimised layerwise prior at the same weights; per datum, gamma in "
        "parameters. rank: by evidence among these candidates (1 = best).",
        "",
        "| candidate | family | params | test acc | "
        + " | ".join(f"{lb}: evidence / Occam / gamma / rank" for lb in labels) + " |",
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    ranks = {lb: rs.rankdata(-torch.tensor([r[lb]["evidence"] for r in side]).numpy()) for lb in labels} if side else {}
    for i, r in enumerate(side):
        cells = " | ".join(f"{r[lb]['evidence']:.3f} / {r[lb]['occam']:.3f} / {r[lb]['gamma']:.0f} / {ranks[lb][i]:.0f}"
                           for lb in labels)
        lines.append(f"| {r['name']} | {r['family']} | {r['params']} | {r['test_accuracy']:.3f} | {cells} |")
    lines += ["", hand_written(path)]
    write_with_data(path, "\n".join(lines), {"results": results, "structures": side})
    return path


def main(argv: Sequence[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--cache", default=os.path.join(ROOT, "outputs", "ranking_study", "runs"))
    options.add_argument("--seeds", type=int, nargs="+", default=[0])
    options.add_argument("--candidates", nargs="+", default=list(rs.CANDIDATES), choices=list(rs.CANDIDATES))
    options.add_argument("--print-only", action="store_true", help="print, do not write the results file")
    args = options.parse_args(argv)
    torch.set_num_threads(1)
    x_train, y_train, _, _ = rs.load_mnist(rs.RECIPE["n_train"], rs.RECIPE["image_size"], rs.RECIPE["split_seed"])
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=500)
    start, results = time.perf_counter(), []
    for seed in args.seeds:
        for name in args.candidates:
            if not os.path.exists(rs.weights_path(args.cache, name, seed)):
                print(f"{name} seed {seed}: no saved weights in {args.cache}, skipped", flush=True)
                continue
            r = breakdown(name, seed, args.cache, loader)
            results.append(r)
            print(f"{name} seed {seed}: evidence {r['evidence']:.3f} = fit {r['fit']:.3f} + Occam {r['occam']:.3f}, "
                  f"gamma {r['gamma']:.0f}", flush=True)
    side = []
    for seed in args.seeds:
        for name in args.candidates:
            small = sum(p.numel() for p in rs.build_network(rs.CANDIDATES[name][0], rs.RECIPE["image_size"],
                                                            **rs.CANDIDATES[name][1]).parameters())
            if small > FULL_MAX_PARAMS or not os.path.exists(rs.weights_path(args.cache, name, seed)):
                continue
            r = structures_side_by_side(name, seed, args.cache, loader)
            with open(rs.cache_path(args.cache, name, seed)) as f:
                r["test_accuracy"] = json.load(f)["checkpoints"]["100%"]["test_accuracy"]
            side.append(r)
            print(f"{name} seed {seed}: " + ", ".join(f"{lb} {r[lb]['evidence']:.3f} (gamma {r[lb]['gamma']:.0f})"
                                                       for lb in (f"{s}-{a}" for s, a in STRUCTURES)), flush=True)
    if results and not args.print_only:
        command = " ".join(["python benchmarks/investigations/occam_breakdown.py", *(sys.argv[1:] if argv is None else argv)])
        print(write(results, side, command, time.perf_counter() - start))


if __name__ == "__main__":
    main()
