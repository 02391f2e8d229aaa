"""The empirical Fisher's evidence as networks interpolate their training data, against the GGN's.

Run from the repository root (needs ``pip install mlxtend``)::

    python benchmarks/investigations/ef_interpolation.py            # writes benchmarks/results/ef_interpolation.md
    python benchmarks/investigations/ef_interpolation.py --quick    # smoke test: 500 images, 3 epochs, outputs/ only

Candidates of ``examples/ranking_study.py`` (two MLPs that fit their training set and a small CNN
that does not) are trained on the MNIST-5k training split (4000 images, 14x14) by Adam (lr 1e-3,
batch 128) on ``map_loss`` with the layerwise prior fixed at delta = 1 (no callback: the weights
at every checkpoint depend on the training alone). At each checkpoint epoch, post hoc at the same
weights: the diag-EF, kron-EF, diag-GGN and kron-GGN evidence per datum, each with the
hyperparameters re-optimised by Newton on its own curvature (``LaplaceEvidence.fit`` then
``optimize(solver="newton", max_evaluations=50)``, as ``select_models`` does for ``rank_by``),
its terms (log-likelihood, log prior, ``-1/2 log|H|``), the training NLL and train/test accuracy,
the output-space ratio ``tr EF / tr GGN`` of :mod:`lightning_marglik.diagnostics` and the same
ratio of the exact parameter-space diagonals (from the diag-EF and diag-GGN passes).
One CPU thread.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import ranking_study as study  # noqa: E402
from benchmarks._common import hand_written, load_avg, now, write_with_data  # noqa: E402
from common import OUTPUTS, library_state, markdown_table  # noqa: E402
from lightning_marglik import CategoricalLikelihood, CurvatureOptions, GaussianPrior, LaplaceEvidence  # noqa: E402
from lightning_marglik import collect_statistics, map_loss  # noqa: E402
from lightning_marglik.diagnostics import (  # noqa: E402
    EF_RATIO_THRESHOLD, curvature_traces, ratio_from_traces, rescale_empirical_fisher,
)
from lightning_marglik.selection import full_ggn_refusal, resolve_auto  # noqa: E402
from lightning_marglik.selection.driver import AUTO_FALLBACK, AUTO_SAFE  # noqa: E402

CANDIDATES = ("mlp512x1", "mlp128x2", "cnn8x1")
DEFAULT = "default (auto)"
AUTO_LABELS = {AUTO_FALLBACK: "kron-EF", AUTO_SAFE: "kron-GGN"}  # the evidences rank_by="auto" may resolve to here
APPROXIMATIONS = (("diag", "ef"), ("kron", "ef"), ("diag", "ggn"), ("kron", "ggn"))
CHECKPOINTS = (1, 2, 5, 10, 20, 40, 80, 150)
QUICK_CHECKPOINTS = (1, 3)
PRIOR_PRECISION = 1.0


def label(structure: str, approx: str) -> str:
    return f"{structure}-{approx.upper()}"


@torch.no_grad()
def fit_metrics(net: nn.Module, x: Tensor, y: Tensor) -> Tuple[float, float]:
    """(accuracy, mean NLL) of the MAP softmax, in eval mode."""
    was = net.training
    logits = net.eval()(x)
    net.train(was)
    return (logits.argmax(1) == y).double().mean().item(), nn.functional.cross_entropy(logits.double(), y).item()


def solved(evidence: LaplaceEvidence, extra: Dict[str, Any]) -> Dict[str, Any]:
    """Newton on the evidence's hyperparameters (written into its prior), the evidence and its terms per datum."""
    start = time.process_time()
    solution = evidence.optimize(solver="newton", max_evaluations=50)
    evidence.set_hyperparameters(solution.values)
    n = evidence.n_data
    log_delta = solution.values["log_precision"]
    out = {
        "marglik": solution.value.item() / n,
        "log_likelihood": evidence.log_likelihood().item() / n,
        "log_prior": evidence.log_prior().item() / n,
        "half_log_det": -0.5 * evidence.log_det().item() / n,
        "log_delta_min": log_delta.min().item(), "log_delta_max": log_delta.max().item(),
        "converged": bool(solution.converged), "newton_cpu_seconds": time.process_time() - start, **extra,
    }
    out["occam"] = out["marglik"] - out["log_likelihood"]
    return out


def posthoc(net: nn.Module, log_precision: Tensor, loader: DataLoader, structure: str, approx: str,
            traces: Tensor) -> Dict[str, Dict[str, Any]]:
    """The evidence of ``net`` with one approximation, its hyperparameters re-optimised by Newton (from
    ``log_precision``), and its terms; for the EF also with its curvature divided by the ratio of
    ``traces`` (``rescale_empirical_fisher``), from the same pass."""
    likelihood = CategoricalLikelihood()

    def prior() -> GaussianPrior:
        fresh = GaussianPrior(net, structure="layerwise")
        fresh.log_precision.copy_(log_precision)
        return fresh

    start = time.process_time()
    stats = collect_statistics(net, loader, likelihood, prior(), options=CurvatureOptions(structure, approx, 0))
    extra: Dict[str, Any] = {"pass_cpu_seconds": time.process_time() - start}
    if structure == "diag":  # the exact parameter-space diagonal of the unit-scale curvature
        extra["diagonal_trace"] = sum(s.state("diag").sum().item() for s in stats.structures)
    corrected = copy.deepcopy(stats) if approx == "ef" else None
    out = {label(structure, approx): solved(LaplaceEvidence.from_statistics(stats, likelihood, prior()), extra)}
    if corrected is not None:
        rescale_empirical_fisher(corrected, traces, likelihood)
        out[label(structure, approx) + "/r"] = solved(LaplaceEvidence.from_statistics(corrected, likelihood, prior()), {})
    return out


def run(name: str, data: Tuple[Tensor, ...], checkpoints: Sequence[int], seed: int) -> List[Dict[str, Any]]:
    """Train one candidate, with the post-hoc measurements after every checkpoint epoch."""
    family, kwargs = study.CANDIDATES[name]
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    net = study.build_network(family, x_tr.shape[-1], **kwargs)
    prior, likelihood = GaussianPrior(net, precision=PRIOR_PRECISION, structure="layerwise"), CategoricalLikelihood()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    train = DataLoader(TensorDataset(x_tr, y_tr), batch_size=128, shuffle=True)
    evidence_data = DataLoader(TensorDataset(x_tr, y_tr), batch_size=500)
    rows, train_seconds = [], 0.0
    for epoch in range(1, max(checkpoints) + 1):
        start = time.process_time()
        net.train()
        for x, y in train:
            optimizer.zero_grad()
            map_loss(net(x), y, likelihood, prior, len(x_tr)).backward()
            optimizer.step()
        train_seconds += time.process_time() - start
        if epoch not in checkpoints:
            continue
        train_acc, train_nll = fit_metrics(net, x_tr, y_tr)
        test_acc, test_nll = fit_metrics(net, x_te, y_te)
        start = time.process_time()
        traces = curvature_traces(net, evidence_data, likelihood)
        ratio = ratio_from_traces(traces, likelihood)  # = ef_curvature_ratio(net, evidence_data, likelihood)
        ratio_seconds = time.process_time() - start
        frozen = copy.deepcopy(net)
        evidence = {k: v for s, a in APPROXIMATIONS
                    for k, v in posthoc(frozen, prior.log_precision, evidence_data, s, a, traces).items()}
        row = {
            "candidate": name, "params": prior.n_params, "n_rows": len(x_tr) * 10, "epoch": epoch, "train_nll": train_nll,
            "train_acc": train_acc,
            "test_acc": test_acc, "test_nll": test_nll, "ratio": ratio, "ratio_cpu_seconds": ratio_seconds,
            "diagonal_ratio": evidence["diag-EF"]["diagonal_trace"] / evidence["diag-GGN"]["diagonal_trace"],
            "train_cpu_seconds": train_seconds, "evidence": evidence,
        }
        rows.append(row)
        print(f"{name} epoch {epoch}: train nll {train_nll:.2e} acc {train_acc:.4f} test {test_acc:.4f} ratio "
              f"{ratio:.3g} diag ratio {row['diagonal_ratio']:.3g} | "
              + " ".join(f"{k} {v['marglik']:.4f}" for k, v in evidence.items()), flush=True)
    return rows


def columns() -> List[str]:
    """The evidence labels in table order: each structure's EF, EF / r, GGN."""
    return [lb for structure in ("diag", "kron") for lb in
            (label(structure, "ef"), label(structure, "ef") + "/r", label(structure, "ggn"))]


def tables(rows: List[Dict[str, Any]]) -> List[str]:
    """Per candidate: the fit, the ratios and the evidence; then the evidence's terms."""
    labels = columns()
    lines: List[str] = []
    for name in dict.fromkeys(r["candidate"] for r in rows):
        mine = [r for r in rows if r["candidate"] == name]
        lines += [f"### {name} ({mine[0]['params']} parameters)", "",
                  "Fit, curvature ratios and evidence per datum (hyperparameters re-optimised on each curvature; "
                  "EF/r: the EF curvature divided by r):", ""]
        lines.append(markdown_table([
            {"epoch": r["epoch"], "train NLL": r["train_nll"], "train acc": r["train_acc"], "test acc": r["test_acc"],
             "test NLL": r["test_nll"], "r": r["ratio"], "diag trace ratio": r["diagonal_ratio"],
             **{lb: r["evidence"][lb]["marglik"] for lb in labels}} for r in mine],
            ["epoch", "train NLL", "train acc", "test acc", "test NLL", "r", "diag trace ratio", *labels]))
        lines += ["", "Occam factor per datum (evidence - log-likelihood); -1/2 log|H| / N and log delta range of kron:", ""]
        kron, half = ("kron-EF", "kron-GGN"), "-½log\\|H\\|"  # \| : a bar inside a markdown table cell
        lines.append(markdown_table([
            {"epoch": r["epoch"], **{lb: r["evidence"][lb]["occam"] for lb in labels},
             **{f"{lb} {half}": r["evidence"][lb]["half_log_det"] for lb in kron},
             **{f"{lb} log δ": f"{r['evidence'][lb]['log_delta_min']:.2f}..{r['evidence'][lb]['log_delta_max']:.2f}"
                for lb in kron}} for r in mine],
            ["epoch", *labels, *[f"{lb} {half}" for lb in kron], *[f"{lb} log δ" for lb in kron]]))
        lines.append("")
    return lines


def picks(rows: List[Dict[str, Any]]) -> List[str]:
    """At every checkpoint epoch that all candidates reached: the candidate each evidence picks."""
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    if len(names) < 2:
        return []
    table = []
    for epoch in sorted({r["epoch"] for r in rows}):
        at = [r for r in rows if r["epoch"] == epoch]
        if len(at) < len(names):
            continue
        best = max(at, key=lambda r: r["test_acc"])
        row = {"epoch": epoch, "best test acc": f"{best['candidate']} ({best['test_acc']:.3f})"}
        for lb in columns():
            pick = max(at, key=lambda r: r["evidence"][lb]["marglik"])
            row[lb] = f"{pick['candidate']} ({pick['test_acc']:.3f})"
        choice, _ = resolve_auto({r["candidate"]: full_ggn_refusal(r["n_rows"], r["params"], 0) for r in at},
                                 {r["candidate"]: r["ratio"] for r in at})
        pick = max(at, key=lambda r: r["evidence"][AUTO_LABELS[choice]]["marglik"])
        row[DEFAULT] = f"{pick['candidate']} ({pick['test_acc']:.3f}; {AUTO_LABELS[choice]})"
        table.append(row)
    return ["### The candidate each evidence picks (its test accuracy)", "",
            f"{DEFAULT}: `select_models`' default `rank_by=\"auto\"` over the candidates at that epoch "
            "(`resolve_auto`: kron-EF, or kron-GGN for all where r < "
            f"{EF_RATIO_THRESHOLD:g} for one of them; the exact full GGN is over its limits for all).", "",
            markdown_table(table, ["epoch", "best test acc", *columns(), DEFAULT]), ""]


def summary(rows: List[Dict[str, Any]]) -> List[str]:
    """The numbers the threshold and the correction rest on, over every checkpoint."""
    def gap(r: Dict[str, Any], a: str, b: str) -> float:
        return r["evidence"][a]["marglik"] - r["evidence"][b]["marglik"]

    def span(values: List[float]) -> str:
        return f"{min(values):.3g}..{max(values):.3g}" if values else "none"

    lines = ["### Summary over all checkpoints", ""]
    below = [r for r in rows if r["ratio"] < EF_RATIO_THRESHOLD]
    above = [r for r in rows if r["ratio"] >= EF_RATIO_THRESHOLD]
    for name, group in ((f"r < {EF_RATIO_THRESHOLD:g}", below), (f"r >= {EF_RATIO_THRESHOLD:g}", above)):
        lines.append(
            f"- {name} ({len(group)} checkpoints: {', '.join(sorted({r['candidate'] for r in group}))}): r "
            f"{span([r['ratio'] for r in group])}, train accuracy {span([r['train_acc'] for r in group])}; EF - GGN "
            f"evidence per datum, kron {span([gap(r, 'kron-EF', 'kron-GGN') for r in group])}, "
            f"diag {span([gap(r, 'diag-EF', 'diag-GGN') for r in group])}.")
    for structure in ("diag", "kron"):
        ef, ggn = label(structure, "ef"), label(structure, "ggn")
        lines.append(f"- {structure}: |EF/r - GGN| at most {max(abs(gap(r, ef + '/r', ggn)) for r in rows):.3g} nats per "
                     f"datum, against |EF - GGN| up to {max(abs(gap(r, ef, ggn)) for r in rows):.3g}.")
    epochs = [e for e in sorted({r["epoch"] for r in rows}) if len({r["candidate"] for r in rows if r["epoch"] == e}) > 1]

    def pick(epoch: int, lb: str) -> str:
        return max((r for r in rows if r["epoch"] == epoch), key=lambda r: r["evidence"][lb]["marglik"])["candidate"]

    for structure in ("diag", "kron") if epochs else ():
        ef, ggn = label(structure, "ef"), label(structure, "ggn")
        differ = [e for e in epochs if pick(e, ef) != pick(e, ggn)]
        corrected = [e for e in epochs if pick(e, ef + "/r") != pick(e, ggn)]
        lines.append(f"- {structure}: the EF picks another candidate than the GGN at epochs {differ or 'none'}; "
                     f"EF/r at epochs {corrected or 'none'} (of {epochs}).")
    lines.append(f"- r against the parameter-space ratio sum diag(EF) / sum diag(GGN): at most "
                 f"{max(abs(r['ratio'] / r['diagonal_ratio'] - 1) for r in rows):.1%} apart.")
    lines.append(f"- cost of r (one forward pass), median over the checkpoints: "
                 f"{statistics.median(r['ratio_cpu_seconds'] for r in rows):.3g} CPU s, against "
                 f"{statistics.median(r['evidence']['kron-EF']['pass_cpu_seconds'] for r in rows):.3g} for the kron-EF "
                 f"pass and {statistics.median(r['evidence']['kron-GGN']['pass_cpu_seconds'] for r in rows):.3g} for "
                 "the kron-GGN pass.")
    return lines + [""]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(study.CANDIDATES))
    parser.add_argument("--quick", action="store_true", help="500 images, epochs 1 and 3, written to outputs/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = study.load_mnist(n_train=400, n_total=500) if args.quick else study.load_mnist()
    checkpoints = QUICK_CHECKPOINTS if args.quick else CHECKPOINTS
    output = Path(OUTPUTS if args.quick else os.path.join(ROOT, "benchmarks", "results")) / "ef_interpolation.md"
    load_before, start_cpu, start_wall = load_avg(), time.process_time(), time.perf_counter()
    rows = [row for name in args.candidates for row in run(name, data, checkpoints, args.seed)]
    cpu_minutes, wall_minutes = (time.process_time() - start_cpu) / 60, (time.perf_counter() - start_wall) / 60
    header = [
        "# The empirical Fisher at interpolation: EF against GGN evidence along training",
        "",
        f"{now()}. Command: `python benchmarks/investigations/ef_interpolation.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        f"library {library_state()}. One CPU thread, {cpu_minutes:.1f} CPU minutes ({wall_minutes:.1f} wall), load "
        f"average {load_before:.2f} at the start (2 cores shared with other jobs).",
        "",
        f"Data: MNIST-5k, {len(data[0])} training / {len(data[2])} test images at 14x14 (examples/ranking_study.py "
        "load_mnist). Training: Adam (lr 1e-3, batch 128) on map_loss, layerwise prior fixed at delta = "
        f"{PRIOR_PRECISION:g}, seed {args.seed}, no callback. At each checkpoint epoch, post hoc at the same weights: "
        "LaplaceEvidence.fit with each approximation over the training images (batches of 500), then "
        "optimize(solver=\"newton\", max_evaluations=50) from delta = 1. `r` is "
        "`lightning_marglik.diagnostics.ef_curvature_ratio` (one forward pass); the diagonal ratio is "
        "sum diag(EF) / sum diag(GGN) of the exact parameter-space diagonals of the two diag passes. "
        f"The library's threshold: r < {EF_RATIO_THRESHOLD:g} warns.",
        "",
    ]
    text = "\n".join(header + summary(rows) + tables(rows) + picks(rows) + [hand_written(output)])
    write_with_data(output, text,
                    {"rows": rows, "cpu_minutes": cpu_minutes, "library": library_state()})
    print(f"written {output}")


if __name__ == "__main__":
    main()
