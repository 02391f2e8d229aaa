"""The posterior predictive (issue 53): what the one call costs, why the predictive is under-confident, and
which predictive is never worse than the network alone.

``--cost``: :func:`lightning_marglik.predict` against a plain forward pass, per 1,000 inputs, side by side in
one process on one thread (the MLP and CNN of the study, probit and MC).

``--train``: the study's runs, cached in ``outputs/predictive/runs`` (``_zoo.cached``): 8-class generated images
(``shapes8``: ``_zoo.draw_bars`` with a cross and a corner besides bars, diagonals, square and plus; 14x14, noise
0.2: at bars' 0.45 the MLP ends at accuracy 0.33), the MLP and CNN of ``_zoo.build``, 40 epochs of Adam (lr 1e-3, cosine), ``MargLikCallback()`` at its
defaults, seeds 0-2, MNIST-14 test images as out-of-distribution inputs.

``--analyse``: from each run's final weights, the predictive's variance split by tensor and its variants
(the posterior as trained, post-hoc precisions, the output layer's block alone, probit and MC), scored on the
same test and OOD inputs as the network alone; writes ``results/predictive.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import _zoo  # noqa: E402
from _common import RESULTS, cpu_name, freeze_startup, hand_written, now, package_version, write_with_data  # noqa: E402
from lightning_marglik import GaussianPrior, LaplaceEvidence, predict  # noqa: E402
from lightning_marglik.predictive import class_probabilities, output_jacobians  # noqa: E402

NETWORKS = ("mlp", "cnn")
SEEDS = (0, 1, 2)
N_TRAIN, N_TEST = 3000, 500
NOISE = 0.2
EPOCHS = 40


def shapes8(n_train: int, n_test: int, split_seed: int) -> _zoo.Data:
    """8 classes of strokes on noise (``_zoo.draw_bars(classes=8)``), training and test drawn apart."""
    x_tr, y_tr = _zoo.draw_bars(n_train, 11 + split_seed, noise=NOISE, classes=8)
    x_te, y_te = _zoo.draw_bars(n_test, 1011 + split_seed, noise=NOISE, classes=8)
    return _zoo.Data(x_tr, y_tr, x_te, y_te, 14, 8)


_zoo.DATA_LOADERS["shapes8"] = shapes8


def spec(network: str, seed: int, quick: bool = False) -> _zoo.RunSpec:
    """One run of the study: the callback at its defaults."""
    base = _zoo.RunSpec(network=network, dataset="shapes8", seed=seed, epochs=EPOCHS, n_train=N_TRAIN,
                        n_test=N_TEST, batch_size=128, lr=1e-3, schedule="cosine", trace=False, ood="mnist",
                        callback={})
    return replace(base, epochs=3, n_train=300, n_test=200) if quick else base


def plan(quick: bool) -> List[_zoo.RunSpec]:
    return [spec(network, seed, quick) for network in NETWORKS for seed in SEEDS]


# --- analysis: the predictive's variance by tensor, and its variants -------------------------------------------

MC_SAMPLES = 100
CHUNK = 250  # inputs per Jacobian


def trained(spec_: _zoo.RunSpec, cache: str) -> Tuple[Any, _zoo.Data, Dict[str, Any]]:
    """The run's module at its final weights (hyperparameters included), its data and its cached result."""
    result = _zoo.cached(spec_, cache)
    data = _zoo.load(spec_.dataset, spec_.n_train, spec_.n_test)
    module = _zoo.make_module(spec_, data, result["n_data"])
    module.load_state_dict(torch.load(os.path.join(cache, spec_.key() + ".pt"), weights_only=False)["final"])
    module.prior.record_n_data(result["n_data"])
    return module, data, result


def posthoc(module: Any, loader: Any, structure: str = "layerwise") -> Tuple[LaplaceEvidence, GaussianPrior]:
    """The kron-GGN evidence at the final weights under a prior of its own (every tensor learned, the output layer
    too), its precisions fitted by Newton on that evidence: nothing of the module's prior is touched."""
    prior = GaussianPrior(module.net, precision=1.0, structure=structure)
    if structure == "layerwise":
        with torch.no_grad():
            prior.log_precision.copy_(module.prior.log_precision)
    evidence = LaplaceEvidence.fit(module, loader, module.likelihood, prior, "kron", "ggn")
    evidence.set_hyperparameters(evidence.optimize(solver="newton", max_evaluations=50).values)
    return evidence, prior


def covariances(evidence: LaplaceEvidence, jacobians: Tensor, sizes: List[int], keep: List[bool]) -> Tensor:
    """``J H^-1 J^T`` with the Jacobian columns of the tensors not kept set to zero: under ``kron`` (``H``
    block-diagonal by layer) the exact contribution of the kept layers' blocks."""
    mask = torch.cat([torch.full((n,), float(k), dtype=jacobians.dtype) for n, k in zip(sizes, keep)])
    return evidence.jacobian_covariance(jacobians * mask)


def analyse_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """Every variant's scores on the run's test and OOD inputs, the network's alone, and the variance split."""
    module, data, result = trained(spec_, cache)
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    x, y = data.x_test[:_zoo.LINEARIZED], data.y_test[:_zoo.LINEARIZED]
    ood = _zoo.ood_inputs(spec_.ood, data.image_size)[:_zoo.LINEARIZED]
    trained_evidence = LaplaceEvidence.fit(module, loader, module.likelihood, module.prior, "kron", "ggn")
    fitted, fitted_prior = posthoc(module, loader)
    scalar, scalar_prior = posthoc(module, loader, "scalar")
    names, sizes = module.prior.param_names, module.prior.param_sizes
    output = [i >= len(names) - 2 for i in range(len(names))]  # the last Linear's weight and bias
    body = [not o for o in output]
    everything = [True] * len(names)
    variants: Dict[str, Tuple[LaplaceEvidence, List[bool], str]] = {
        "as trained (issue's default), probit": (trained_evidence, everything, "probit"),
        "as trained, tempered (the one call's default)": (trained_evidence, everything, "tempered"),
        "as trained, MC": (trained_evidence, everything, "mc"),
        "as trained, body only (output layer at MAP)": (trained_evidence, body, "probit"),
        "as trained, output layer only": (trained_evidence, output, "probit"),
        "post hoc precisions, probit": (fitted, everything, "probit"),
        "post hoc precisions, tempered": (fitted, everything, "tempered"),
        "post hoc precisions, MC": (fitted, everything, "mc"),
        "post hoc, last layer (= last-layer Laplace), probit": (fitted, output, "probit"),
        "post hoc, last layer, tempered": (fitted, output, "tempered"),
        "post hoc, last layer, MC": (fitted, output, "mc"),
        "post hoc scalar precision, probit": (scalar, everything, "probit"),
    }
    probs: Dict[str, List[Tensor]] = {name: [[], []] for name in ["network alone", *variants]}
    variance: Dict[str, List[float]] = {name: [] for name in variants if "MC" not in name and "tempered" not in name}
    generator = torch.Generator().manual_seed(spec_.seed)
    for part, inputs in enumerate((x, ood)):
        for i in range(0, len(inputs), CHUNK):
            mean, jac = output_jacobians(module.prior, module, inputs[i:i + CHUNK])
            probs["network alone"][part].append(mean.softmax(1))
            for name, (evidence, keep, method) in variants.items():
                cov = covariances(evidence, jac, sizes, keep)
                probs[name][part].append(class_probabilities(mean, cov, method, MC_SAMPLES, generator))
                if part == 0 and name in variance:
                    variance[name].append(torch.diagonal(cov, dim1=1, dim2=2).mean(1))
    scores = {name: _zoo._softmax_scores(torch.cat(p[0]), y, torch.cat(p[1])) for name, p in probs.items()}
    return {
        "library": result["library"], "scores": scores,
        "variance": {name: torch.cat(v).mean().item() for name, v in variance.items()},
        "log_delta": {"trained": module.prior.per_tensor(module.prior.log_precision).tolist(),
                      "post hoc": fitted_prior.per_tensor(fitted_prior.log_precision).tolist(),
                      "post hoc scalar": scalar_prior.log_precision.item()},
        "names": names,
    }


TARGETS = ("nll", "ece")


def meets(row: Dict[str, float], network: Dict[str, float]) -> bool:
    """NLL and ECE at most the network's alone."""
    return all(row[k] <= network[k] for k in TARGETS)


def report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float) -> str:
    """The results page's analysis part."""
    libraries = sorted({r["library"] for rs in runs.values() for r in rs})
    lines = [
        "## Why the predictive is under-confident, and a candidate default (items 1 and 2)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Runs trained on library {', '.join(libraries)}; "
        "analysed by this script at the commit named in the reading below. "
        f"Cells: {', '.join(f'shapes8 / {n}' for n in NETWORKS)}, seeds {', '.join(map(str, SEEDS))}, {EPOCHS} epochs, "
        f"{N_TRAIN} training images, the first {_zoo.LINEARIZED} test images and {_zoo.LINEARIZED} MNIST-14 test images "
        "(OOD). Every predictive is the linearized (GLM) one of a kron-GGN posterior at the final weights; "
        f"MC: {MC_SAMPLES} draws. Means over seeds; `meets`: seeds whose NLL and ECE are at most the network's alone.",
        "",
    ]
    for network, rs in runs.items():
        names = list(rs[0]["scores"])
        lines += [f"### shapes8 / {network}", "", "| predictive | acc | NLL | ECE | OOD AUROC | meets NLL and ECE |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name in names:
            mean = {k: float(np.mean([r["scores"][name][k] for r in rs])) for k in ("acc", "nll", "ece", "auroc")}
            met = sum(meets(r["scores"][name], r["scores"]["network alone"]) for r in rs)
            lines.append(f"| {name} | {mean['acc']:.4f} | {mean['nll']:.4f} | {mean['ece']:.4f} | {mean['auroc']:.4f} | "
                         + ("-" if name == "network alone" else f"{met} / {len(rs)}") + " |")
        lines += ["", "Mean predictive variance of a logit (test inputs), and where the precisions are:", "",
                  "| posterior | variance |", "|---|---:|"]
        for name in rs[0]["variance"]:
            lines.append(f"| {name} | {np.mean([r['variance'][name] for r in rs]):.4g} |")
        tensors = rs[0]["names"]
        lines += ["", "| tensor | log delta as trained | log delta post hoc |", "|---|---:|---:|"]
        for i, t in enumerate(tensors):
            lines.append(f"| {t} | {np.mean([r['log_delta']['trained'][i] for r in rs]):.2f} | "
                         f"{np.mean([r['log_delta']['post hoc'][i] for r in rs]):.2f} |")
        lines.append(f"| (scalar prior, post hoc) | | {np.mean([r['log_delta']['post hoc scalar'] for r in rs]):.2f} |")
        lines.append("")
    return "\n".join(lines)


# --- cost of the one call ----------------------------------------------------------------------------------


def cost(cache: str, repeats: int = 3, n: int = 1000, batch: int = 100) -> Dict[str, Any]:
    """Seconds per ``n`` inputs (batches of ``batch``) of a forward pass and of ``predict`` (probit, MC), side by
    side on the seed-0 runs' final weights (medians of ``repeats``), one thread."""
    out: Dict[str, Any] = {}
    for network in NETWORKS:
        module, data, _ = trained(spec(network, 0), cache)
        evidence = LaplaceEvidence.fit(module, _zoo._loader(data.x_train, data.y_train, 500, None), module.likelihood,
                                       module.prior, "kron", "ggn")
        module.eval()
        x = data.x_train[:n]
        batches = [x[i:i + batch] for i in range(0, n, batch)]

        def forward() -> None:
            with torch.inference_mode():
                for b in batches:
                    module(b).softmax(1)

        def one_call(method: str) -> Callable[[], None]:
            def run() -> None:
                with torch.inference_mode():  # as in a predict_step
                    for b in batches:
                        predict(evidence, module, b, method=method)
            return run

        timings = {name: [] for name in ("forward", "probit", "mc")}
        for _ in range(repeats):  # interleaved: the load drifts alike for all three
            for name, fn in (("forward", forward), ("probit", one_call("probit")), ("mc", one_call("mc"))):
                start = time.process_time()
                fn()
                timings[name].append(time.process_time() - start)
        medians = {k: float(np.median(v)) for k, v in timings.items()}
        out[network] = {"seconds": medians, "parameters": sum(module.prior.param_sizes), "classes": 8}
    return out


def cost_report(measured: Dict[str, Any], command: str) -> str:
    lines = ["## What the one call costs (item 4)", "",
             f"Date: {now()}. Command: `{command}`. CPU: {cpu_name()}, one thread, torch {package_version('torch')}. "
             "Process CPU seconds per 1,000 inputs in batches of 100 (medians of 3, the three measured in turn), at "
             "the seed-0 runs' final weights with their kron-GGN evidence; `predict` under `torch.inference_mode` as in "
             "a `predict_step`; MC: 100 draws.", "",
             "| network | parameters | forward (s) | predict, probit (s) | ratio | predict, MC (s) | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for network, m in measured.items():
        s = m["seconds"]
        lines.append(f"| {network} | {m['parameters']:,} | {s['forward']:.4f} | {s['probit']:.3f} | "
                     f"{s['probit'] / s['forward']:.0f}x | {s['mc']:.3f} | {s['mc'] / s['forward']:.0f}x |")
    return "\n".join(lines)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help="train (or read from the cache) the study's runs")
    parser.add_argument("--shard", type=int, nargs=2, metavar=("K", "N"), default=(0, 1),
                        help="with --train: shard K of N of the runs")
    parser.add_argument("--cache", default=os.path.join(_zoo.output_dir("predictive"), "runs"))
    parser.add_argument("--quick", action="store_true", help="3 epochs on 300 images (a smoke test)")
    parser.add_argument("--analyse", action="store_true", help="the variants of the predictive on the cached runs")
    parser.add_argument("--cost", action="store_true", help="the one call against a forward pass")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.train:
        _zoo.run_shard(plan(args.quick), args.shard[0], args.shard[1], args.cache)
    if not (args.analyse or args.cost):
        return
    freeze_startup()
    path = RESULTS / "predictive.md"
    command = "python benchmarks/predictive.py " + " ".join(sys.argv[1:] if argv is None else argv)
    data = {"cost": None, "analysis": None}
    if path.exists():
        from _common import read_data
        data.update(read_data(path))
    if args.cost:
        data["cost"] = {"measured": cost(args.cache), "text": None}
        data["cost"]["text"] = cost_report(data["cost"]["measured"], command)
    if args.analyse:
        start = time.perf_counter()
        runs = {network: [analyse_run(spec(network, seed, args.quick), args.cache) for seed in SEEDS]
                for network in NETWORKS}
        data["analysis"] = {"runs": runs, "text": report(runs, command, time.perf_counter() - start)}
    parts = [part["text"] for part in (data["cost"], data["analysis"]) if part]
    text = "\n\n".join(["# The posterior predictive (issue 53)", *parts, hand_written(path)])
    write_with_data(path, text, data)
    print(text)


if __name__ == "__main__":
    main()
