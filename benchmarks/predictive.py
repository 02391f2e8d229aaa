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

``--cells`` (with ``--analyse``): the same variants on issue 52's 12 cells (digits, bars and MNIST with the MLP, CNN,
Fixup and BatchNorm ResNets; ``investigations/prior_guard.py``'s runs of the defaults arm, read from its cache:
train them with its own command first), each scored on its first test images and its OOD inputs.

``--one-call``: the one call at its default (``"auto"``), tempered and with the probit against the network alone on
every cell of issue 52 (its 12 image cells, the 100-class MLP family, full MNIST with the paper's MLP; the prior guard
study's runs).

``--peer`` (after ``--analyse``, whose rows it sets beside): laplace-torch's recommended recipe (last-layer kron
Laplace, a scalar prior precision by its post-hoc marginal likelihood, GLM probit) and its full-network kron GLM, on
the same runs and inputs, scored alike (needs ``laplace-torch``).

``--regression``: the one call's regression predictive (mean, model + noise variance) against the network's mean
with its learned sigma, test log-likelihood on the regression sets shipped here: two UCI sets (Boston housing, auto MPG)
and scikit-learn's diabetes set (MLPs of depth 1 and 2, the UCI protocol's 20 random 90/10 splits).
"""
from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import _zoo  # noqa: E402
from _common import (RESULTS, cpu_name, freeze_startup, now, package_version, read_data,  # noqa: E402
                     write_sections)
from lightning_marglik import GaussianPrior, LaplaceEvidence, predict  # noqa: E402
from lightning_marglik.curvature import eval_mode  # noqa: E402
from lightning_marglik.predictive import (  # noqa: E402
    class_probabilities, output_jacobians, over_confident, training_confidence,
)

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


def scored_inputs(spec_: _zoo.RunSpec, data: _zoo.Data) -> Tuple[Tensor, Tensor, Tensor]:
    """The inputs every predictive of a run is scored on: its first ``LINEARIZED`` test inputs, their labels, and as
    many OOD inputs."""
    ood = _zoo.ood_inputs(spec_.ood, data.image_size)[:_zoo.LINEARIZED]
    return data.x_test[:_zoo.LINEARIZED], data.y_test[:_zoo.LINEARIZED], ood


def scores_of(probs: Dict[str, List[List[Tensor]]], y: Tensor) -> Dict[str, Dict[str, float]]:
    """Each predictive's scores from its probabilities, gathered in chunks as ``[test parts, OOD parts]``."""
    return {name: _zoo._softmax_scores(torch.cat(p[0]), y, torch.cat(p[1])) for name, p in probs.items()}


def trained(spec_: _zoo.RunSpec, cache: str) -> Tuple[Any, _zoo.Data, Dict[str, Any]]:
    """The run's module at its final weights (hyperparameters included), its data and its cached result."""
    result = _zoo.cached(spec_, cache)
    data = _zoo.load(spec_.dataset, spec_.n_train, spec_.n_test)
    module = _zoo.make_module(spec_, data, result["n_data"])
    module.load_state_dict(torch.load(_zoo.weights_path(spec_, cache), weights_only=False)["final"])
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
    x, y, ood = scored_inputs(spec_, data)
    trained_evidence = LaplaceEvidence.fit(module, loader, module.likelihood, module.prior, "kron", "ggn")
    fitted, fitted_prior = posthoc(module, loader)
    scalar, scalar_prior = posthoc(module, loader, "scalar")
    names, sizes = module.prior.param_names, module.prior.param_sizes
    output = [i >= len(names) - 2 for i in range(len(names))]  # the last Linear's weight and bias
    body = [not o for o in output]
    everything = [True] * len(names)
    variants: Dict[str, Tuple[LaplaceEvidence, List[bool], str]] = {
        "as trained (issue's default), probit": (trained_evidence, everything, "probit"),
        "as trained, tempered (the one call's posterior)": (trained_evidence, everything, "tempered"),
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
    # a gate read from the training data alone: every variant lowers the network's confidence, which can only help
    # where the network is over-confident; measured on its own training inputs
    with torch.no_grad(), eval_mode(module):
        fitted_probs = _zoo.logits_of(module, data.x_train).softmax(1)
    train = {"confidence": fitted_probs.max(1).values.mean().item(),
             "acc": (fitted_probs.argmax(1) == data.y_train).double().mean().item()}
    over = train["confidence"] > train["acc"]
    for gated, variant in GATED.items():
        probs[gated] = probs[variant] if over else probs["network alone"]
    scores = scores_of(probs, y)
    return {
        "library": result["library"], "scores": scores, "train": train,
        "variance": {name: torch.cat(v).mean().item() for name, v in variance.items()},
        "log_delta": {"trained": module.prior.per_tensor(module.prior.log_precision).tolist(),
                      "post hoc": fitted_prior.per_tensor(fitted_prior.log_precision).tolist(),
                      "post hoc scalar": scalar_prior.log_precision.item()},
        "names": names,
    }


TARGETS = ("nll", "ece")
# gated variants: the variant where the network's mean confidence on its training inputs exceeds its training
# accuracy, the network alone elsewhere (the second: predict's default since 4e80216, which reads the two figures
# from the evidence's own sums instead; the one call's section below calls it)
GATED = {
    "gated by training over-confidence: last layer, tempered": "post hoc, last layer, tempered",
    "gated by training over-confidence (the one call's default since 4e80216)":
        "as trained, tempered (the one call's posterior)",
}


def meets(row: Dict[str, float], network: Dict[str, float]) -> bool:
    """NLL and ECE at most the network's alone."""
    return all(row[k] <= network[k] for k in TARGETS)


STUDY_CELLS = (f"Cells: {', '.join(f'shapes8 / {n}' for n in NETWORKS)}, seeds {', '.join(map(str, SEEDS))}, {EPOCHS} "
               f"epochs, {N_TRAIN} training images, the first {_zoo.LINEARIZED} test images and {_zoo.LINEARIZED} "
               "MNIST-14 test images (OOD).")


def report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float,
           title: str = "## Why the predictive is under-confident, and a candidate default (items 1 and 2)",
           cells: str = STUDY_CELLS) -> str:
    """The results page's analysis part: ``runs`` by cell name (``"shapes8 / mlp"``), seeds in order."""
    libraries = sorted({r["library"] for rs in runs.values() for r in rs})
    lines = [
        title, "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Runs trained on library {', '.join(libraries)}; "
        f"analysed by this script at the commit named in the reading below. {cells} Every predictive is the "
        f"linearized (GLM) one of a kron-GGN posterior at the final weights; MC: {MC_SAMPLES} draws. Means over seeds; "
        "`meets`: seeds whose NLL and ECE are at most the network's alone.",
        "",
    ]
    for cell, rs in runs.items():
        names = list(rs[0]["scores"])
        lines += [f"### {cell}", "", "| predictive | acc | NLL | ECE | OOD AUROC | meets NLL and ECE |",
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


def _guard_study() -> Any:
    """The prior guard study's script (its cells' specs and cache)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "investigations"))
    import prior_guard as study  # noqa: E402  (the investigations' folder, on the path from here)

    return study


def _in_cache(cells: Dict[str, List[_zoo.RunSpec]], cache: str) -> Dict[str, List[_zoo.RunSpec]]:
    """``cells``, each of whose runs is in ``cache`` (never trained here: a missing run is an error naming the
    command that trains it)."""
    missing = [s.key() for specs in cells.values() for s in specs if not os.path.exists(_zoo.run_path(s, cache))]
    if missing:
        raise SystemExit(f"{missing} are not in {cache}: train them with "
                         "`python benchmarks/investigations/prior_guard.py --shard 0/1` first")
    return cells


def guard_specs() -> Tuple[str, Dict[str, List[_zoo.RunSpec]]]:
    """The prior guard study's cache and its 12 image cells' runs of the ``defaults`` arm, by cell name."""
    study = _guard_study()
    cells = {f"{dataset} / {network}": [study.cell_spec(dataset, network, seed, "defaults") for seed in study.SEEDS]
             for dataset, network in study.family.STUDY_CELLS}
    return study.cache_dir(), _in_cache(cells, study.cache_dir())


def other_specs() -> Tuple[str, Dict[str, List[_zoo.RunSpec]]]:
    """The prior guard study's cache and its runs of the ``defaults`` arm on issue 52's other cells: the 100-class
    MLP family and full MNIST with the paper's MLP, by cell name."""
    study = _guard_study()
    cells = {f"{member.cell} (100 classes)": [study.family_spec(member, seed, "defaults") for seed in study.SEEDS]
             for member in study.family.MEMBERS}
    cells["mnist-60k / paper MLP"] = [study.mnist_spec(seed, "defaults") for seed in study.SEEDS]
    return study.cache_dir(), _in_cache(cells, study.cache_dir())


def on_cells(run: Callable[[_zoo.RunSpec, str], Dict[str, Any]],
             where: Callable[[], Tuple[str, Dict[str, List[_zoo.RunSpec]]]]) -> Dict[str, List[Dict[str, Any]]]:
    """``run`` on every run of the cells ``where`` names (:func:`guard_specs`, :func:`other_specs`), by cell name."""
    cache, cells = where()
    return {cell: [run(s, cache) for s in specs] for cell, specs in cells.items()}


def variant_rows(runs: Dict[str, List[Dict[str, Any]]],
                 columns: Dict[str, Callable[[List[Dict[str, Any]], str], str]]) -> List[str]:
    """A table of every cell's variants (means over seeds, the seeds that meet the targets) with ``columns`` (name
    -> the cell's runs and the variant -> text) after the variant's name, and the totals over cells."""
    names = list(next(iter(runs.values()))[0]["scores"])
    header = ["cell", "predictive", *columns, "acc", "NLL", "ECE", "OOD AUROC", "meets"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    totals = {name: [0, 0] for name in names[1:]}
    for cell, rs in runs.items():
        network = [r["scores"]["network alone"] for r in rs]
        for name in names:
            s = [r["scores"][name] for r in rs]
            mean = {k: float(np.mean([x[k] for x in s])) for k in ("acc", "nll", "ece", "auroc")}
            met = sum(meets(a, b) for a, b in zip(s, network))
            row = [cell if name == "network alone" else "", name, *(column(rs, name) for column in columns.values()),
                   *(f"{mean[k]:.4f}" for k in ("acc", "nll", "ece")),
                   "-" if math.isnan(mean["auroc"]) else f"{mean['auroc']:.4f}",  # no OOD inputs
                   "-" if name == "network alone" else f"{met} / {len(rs)}"]
            lines.append("| " + " | ".join(row) + " |")
            if name in totals:
                totals[name][0] += met == len(rs)
                totals[name][1] += met
    seeds = sum(len(rs) for rs in runs.values())
    lines += ["", "| predictive | cells where every seed meets | seeds |", "|---|---:|---:|"]
    lines += [f"| {name} | {c} / {len(runs)} | {m} / {seeds} |" for name, (c, m) in totals.items()]
    return lines


# --- the one call on every cell of issue 52 ------------------------------------------------------------------

ONE_CALL = {"the one call (its default, auto)": None, "the one call, tempered": "tempered",
            "the one call, probit": "probit"}


def one_call_run(spec_: _zoo.RunSpec, cache: str, whole: bool = True) -> Dict[str, Any]:
    """``predict`` at its default (``"auto"``), tempered and with the probit against the network alone on the
    run's whole test set and its OOD inputs, where the run has them (``whole=False``: the inputs the analysis
    scores, :func:`scored_inputs`); the evidence at the final weights as the callback takes it (kron-GGN,
    ``mc_samples="auto"``: one Monte-Carlo sample beyond 11 classes)."""
    module, data, result = trained(spec_, cache)
    evidence = LaplaceEvidence.fit(module, _zoo._loader(data.x_train, data.y_train, 500, None), module.likelihood,
                                   module.prior)
    if whole:
        parts, y = {"test": data.x_test}, data.y_test
        if spec_.ood:
            parts["ood"] = _zoo.ood_inputs(spec_.ood, data.image_size)
    else:
        x, y, ood = scored_inputs(spec_, data)
        parts = {"test": x, "ood": ood}
    probs: Dict[str, Dict[str, Tensor]] = {name: {} for name in ["network alone", *ONE_CALL]}
    with warnings.catch_warnings(record=True) as caught:  # the first posterior batch may warn
        warnings.simplefilter("always")
        for part, inputs in parts.items():
            with torch.no_grad(), eval_mode(module):
                probs["network alone"][part] = _zoo.logits_of(module, inputs).softmax(1)
            with torch.inference_mode():  # as in a predict_step
                for name, method in ONE_CALL.items():
                    probs[name][part] = torch.cat([predict(evidence, module, x, method=method)
                                                   for x in inputs.split(CHUNK)])
    scores = {name: _zoo._softmax_scores(p["test"], y, p.get("ood")) for name, p in probs.items()}
    confidence, accuracy = training_confidence(evidence)
    return {"library": result["library"], "scores": scores, "applied": over_confident(evidence),
            "train": {"confidence": confidence, "acc": accuracy},
            "warned": any("near uniform" in str(w.message) for w in caught)}


def one_call_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float, library: str) -> str:
    """The results page's part for :func:`one_call_run` on every cell of issue 52."""
    trained_on = sorted({r["library"] for rs in runs.values() for r in rs})
    default, tempered = list(ONE_CALL)[:2]

    def applied(rs: List[Dict[str, Any]], name: str) -> str:
        return f"{sum(r['applied'] for r in rs)} / {len(rs)}" if name == default else ""

    def train(rs: List[Dict[str, Any]], name: str) -> str:
        return (f"{np.mean([r['train']['confidence'] for r in rs]):.4f} / {np.mean([r['train']['acc'] for r in rs]):.4f}"
                if name == default else "")

    def warned(rs: List[Dict[str, Any]], name: str) -> str:
        return f"{sum(r['warned'] for r in rs)} / {len(rs)}" if name == tempered else ""

    return "\n".join([
        "## The one call on every cell of issue 52 (item 2)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {library}; runs trained on "
        f"{', '.join(trained_on)}: the prior guard study's `defaults` arm (benchmarks/investigations/prior_guard.py), "
        "seeds 0-2. Its 12 image cells are scored on the inputs of the variants' table above (the first "
        f"{_zoo.LINEARIZED} test and {_zoo.LINEARIZED} OOD images); the six members of the 100-class MLP family "
        "(64 inputs, no OOD inputs) and full MNIST with the paper's MLP 784-1024-512-256-128-10 (12 epochs; permuted "
        "MNIST as OOD) on every test input. `predict(evidence, module, x, method=...)`, the evidence at the final "
        "weights as the callback takes it (kron-GGN, `mc_samples=\"auto\"`). Means over seeds; `posterior "
        "applied`: seeds where the default found the network over-confident on its training data and applied the "
        "tempered posterior (the network's own softmax elsewhere); `train confidence / accuracy`: the two figures "
        "it compared (means over seeds); `warned`: seeds whose first posterior batch "
        f"({CHUNK} test inputs, tempered) made `predict` warn that its probabilities are near uniform where the "
        "network is confident; `meets`: seeds whose NLL and ECE are at most the network's alone.", "",
        *variant_rows(runs, {"posterior applied": applied, "train confidence / accuracy": train, "warned": warned})])


# --- the peer side by side (item 3) ----------------------------------------------------------------------------

PEER_RECIPES = {
    # laplace-torch's recommended recipe (its README) and its full-network GLM: kron GGN, the scalar prior precision
    # by its post-hoc marginal likelihood (its defaults: 100 Adam steps from 1), its default predictive (GLM, probit)
    "laplace-torch: last-layer kron, post-hoc marglik, GLM probit (its recommended recipe)": "last_layer",
    "laplace-torch: full-network kron, post-hoc marglik, GLM probit": "all",
}
PEER_CHUNK = 25  # inputs per predictive call: its full-network Jacobians of the CNN take about 20 MB an input
REFERENCE_ROWS = ("as trained, tempered (the one call's posterior)", "post hoc, last layer, tempered")


def peer_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """laplace-torch's recipes at the run's final weights, scored on the inputs ``analyse_run`` scores, with the
    network alone recomputed (a check that the inputs are the analysis's)."""
    try:
        from laplace import Laplace
    except ImportError as err:
        raise SystemExit(f"--peer needs laplace-torch ({err}): pip install laplace-torch") from err

    module, data, _ = trained(spec_, cache)
    module.eval()
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    x, y, ood = scored_inputs(spec_, data)
    with torch.no_grad():
        scores = {"network alone": _zoo._softmax_scores(module(x).softmax(1), y, module(ood).softmax(1))}
    precision: Dict[str, float] = {}
    for name, subset in PEER_RECIPES.items():
        la = Laplace(copy.deepcopy(module.net), "classification", subset_of_weights=subset, hessian_structure="kron")
        la.fit(loader)
        la.optimize_prior_precision(method="marglik")
        probs = [torch.cat([la(part[i:i + PEER_CHUNK], pred_type="glm", link_approx="probit").detach()
                            for i in range(0, len(part), PEER_CHUNK)]) for part in (x, ood)]
        scores[name] = _zoo._softmax_scores(probs[0], y, probs[1])
        precision[name] = float(la.prior_precision.detach().mean())
    return {"scores": scores, "prior_precision": precision}


def peer_report(peer: Dict[str, List[Dict[str, Any]]], analysis: Dict[str, List[Dict[str, Any]]], command: str,
                elapsed: float) -> str:
    """The peer's rows beside the network alone and this library's rows of the same runs (from the analysis)."""
    lines = [
        "## Side by side with laplace-torch (item 3)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). laplace-torch {package_version('laplace-torch')} "
        f"(curvlinops-for-pytorch {package_version('curvlinops-for-pytorch')}, its default backend `CurvlinopsGGN`), "
        f"library {_zoo.library_state()}. The six runs and the inputs of the analysis above (the first "
        f"{_zoo.LINEARIZED} test and MNIST-14 images); `Laplace(net, \"classification\", subset_of_weights=..., "
        "hessian_structure=\"kron\")`, `fit` on the 3,000 training images, `optimize_prior_precision(method=\"marglik\")` "
        "(a scalar precision), predictive `pred_type=\"glm\", link_approx=\"probit\"`. This library's rows are the "
        "analysis's (same runs and inputs); `network alone` is recomputed here and equals the analysis's. Means over "
        "seeds; `meets`: seeds whose NLL and ECE are at most the network's alone.", "",
    ]
    for network, rs in peer.items():
        lines += [f"### shapes8 / {network}", "",
                  "| predictive | acc | NLL | ECE | OOD AUROC | meets NLL and ECE | prior precision |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        rows = [(name, [r["scores"][name] for r in rs]) for name in rs[0]["scores"]]
        rows[1:1] = [(f"lightning_marglik: {name}", [a["scores"][name] for a in analysis[network]])
                     for name in REFERENCE_ROWS]
        alone = [r["scores"]["network alone"] for r in rs]
        for name, per_seed in rows:
            mean = {k: float(np.mean([s[k] for s in per_seed])) for k in ("acc", "nll", "ece", "auroc")}
            met = sum(meets(s, a) for s, a in zip(per_seed, alone))
            delta = ("" if name not in rs[0]["prior_precision"]
                     else f"{np.mean([r['prior_precision'][name] for r in rs]):.3g}")
            lines.append(f"| {name} | {mean['acc']:.4f} | {mean['nll']:.4f} | {mean['ece']:.4f} | {mean['auroc']:.4f} | "
                         + ("-" if name == "network alone" else f"{met} / {len(rs)}") + f" | {delta} |")
        lines.append("")
    return "\n".join(lines)


# --- regression (item 5) -------------------------------------------------------------------------------------

REGRESSION_DEPTHS = (1, 2)
REGRESSION_EPOCHS = 100
# the UCI protocol of Hernandez-Lobato & Adams (ICML 2015): 20 random 90/10 splits per set. Three splits were too few:
# on three 80/20 splits of diabetes the difference between the two rows ran from -0.010 to +0.015 nats per datum.
REGRESSION_SPLITS = 20
REGRESSION_TEST_FRACTION = 0.1


@functools.lru_cache(maxsize=None)  # read once, not once per run
def regression_sets() -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """The regression sets shipped in packages here (no download): two of the UCI benchmark sets, in mlxtend's copies,
    and scikit-learn's diabetes set (Efron et al., 2004: UCI-style, not from UCI)."""
    from mlxtend.data import autompg_data, boston_housing_data
    from sklearn.datasets import load_diabetes

    x_auto, y_auto = autompg_data()
    return {"boston housing (UCI)": boston_housing_data(),
            "auto MPG (UCI)": (x_auto[:, :7], y_auto),  # the 8th column, the car's name, is NaN
            "diabetes": load_diabetes(return_X_y=True)}


def regression_run(dataset: str, depth: int, seed: int, epochs: int = REGRESSION_EPOCHS) -> Dict[str, float]:
    """One of :func:`regression_sets` (split 90/10 by ``seed``, inputs and targets standardized by the training part),
    an MLP D-50(-50)-1 (tanh) trained with ``MargLikCallback()`` at its defaults (sigma learned); the test Gaussian
    log-likelihood per datum of the one call (mean, model + noise variance) and of the network's mean with the learned
    noise variance alone."""
    import pytorch_lightning as pl

    from common import MLPRegressor
    from lightning_marglik import MargLikCallback
    from lightning_marglik.selection import quiet_lightning

    x_all, y_all = (torch.as_tensor(np.asarray(a, dtype=np.float32)) for a in regression_sets()[dataset])
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(seed))
    n_train = len(x_all) - round(REGRESSION_TEST_FRACTION * len(x_all))
    train, test = order[:n_train], order[n_train:]
    x_mean, x_std = x_all[train].mean(0), x_all[train].std(0)
    y_mean, y_std = y_all[train].mean(), y_all[train].std()
    x, y = (x_all - x_mean) / x_std, ((y_all - y_mean) / y_std)[:, None]
    pl.seed_everything(seed, verbose=False)
    module = MLPRegressor(n_train, in_features=x.shape[1], width=50, depth=depth)
    callback = MargLikCallback()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]), batch_size=32,
                                         shuffle=True, generator=torch.Generator().manual_seed(seed))
    with quiet_lightning():
        pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(module, loader)
    out = predict(callback, module, x[test])
    target = y[test]

    def log_likelihood(mean: Tensor, variance: Tensor) -> float:
        # per datum, in the original units of the target (the standardization's Jacobian: - log y_std)
        return (-0.5 * (torch.log(2 * torch.pi * variance) + (target - mean) ** 2 / variance)).mean().item() \
            - math.log(y_std)

    result = {"predictive": log_likelihood(out.mean, out.variance),
              "network + sigma": log_likelihood(out.mean, out.noise_variance),
              "sigma": out.noise_variance[0, 0].sqrt().item(),
              "model variance": out.model_variance.mean().item(),
              "rmse": (out.mean - target).pow(2).mean().sqrt().item(),
              "log delta": module.prior.per_tensor(module.prior.log_precision).tolist()}
    # the candidate of the classification study: every precision (the held output layer's too) and sigma fitted by
    # the evidence at the final weights; it writes the module's sigma, so it comes after the rows above
    evidence, prior = posthoc(module, torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[train], y[train]), batch_size=len(train)))
    fitted = predict(evidence, module, x[test])
    result.update({"post hoc": log_likelihood(fitted.mean, fitted.variance),
                   "post hoc sigma": fitted.noise_variance[0, 0].sqrt().item(),
                   "post hoc model variance": fitted.model_variance.mean().item(),
                   "post hoc log delta": prior.per_tensor(prior.log_precision).tolist()})
    return result


def regression_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float) -> str:
    lines = [
        "## Regression: the predictive against the network plus its learned sigma (item 5)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {_zoo.library_state()}. "
        "The regression sets shipped in packages here: two of the UCI benchmark sets (mlxtend's copies: Boston "
        "housing, 506 x 13; auto MPG, 392 x 7 without the car's name) and scikit-learn's `load_diabetes` (442 x 10). "
        f"The UCI protocol's {REGRESSION_SPLITS} random splits, {1 - REGRESSION_TEST_FRACTION:.0%} / "
        f"{REGRESSION_TEST_FRACTION:.0%} (seeds 0-{REGRESSION_SPLITS - 1}; inputs and target standardized by the "
        "training part); an MLP D-50-1 or D-50-50-1 (tanh, `examples/common.MLPRegressor`), "
        f"{REGRESSION_EPOCHS} epochs of Adam (lr 1e-2, cosine to 1e-3, batches of 32), `MargLikCallback()` at its "
        "defaults (sigma learned). Test Gaussian log-likelihood per datum in the target's units (higher is better) of "
        "`predict(callback, module, x)` (mean, model + noise variance) and of the same mean with the learned noise "
        "variance alone; `post hoc`: the one call with an evidence whose precisions (the held output layer's too) "
        "and sigma are fitted at the final weights (`posthoc`, as in the analysis). Means over the splits, the "
        "differences with their standard errors; `at least`: splits where the row is at least the network's. The "
        "RMSE, sigma and the variances in standardized units.", "",
        "| set | network | test LL, network + sigma | predictive | difference | at least | post hoc: predictive "
        "| difference | at least | sigma | mean model variance | RMSE |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cell, rs in runs.items():
        base = np.array([r["network + sigma"] for r in rs])
        row = [f"| {cell.replace(' / ', ' | ', 1)} | {base.mean():.4f}"]
        for key in ("predictive", "post hoc"):
            diff = np.array([r[key] for r in rs]) - base
            error = diff.std(ddof=1) / math.sqrt(len(rs)) if len(rs) > 1 else math.nan
            row.append(f"{np.mean([r[key] for r in rs]):.4f} | {diff.mean():+.4f} ± {error:.4f} | "
                       f"{int((diff >= 0).sum())} / {len(rs)}")
        row.append(" | ".join(f"{np.mean([r[k] for r in rs]):.4f}" for k in ("sigma", "model variance", "rmse")) + " |")
        lines.append(" | ".join(row))
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

        def one_call(method: Optional[str]) -> Callable[[], None]:
            def run() -> None:
                with torch.inference_mode():  # as in a predict_step
                    for b in batches:
                        predict(evidence, module, b, method=method)
            return run

        calls = {"forward": forward, "default": one_call(None), "probit": one_call("probit"), "mc": one_call("mc")}
        timings: Dict[str, List[float]] = {name: [] for name in calls}
        for _ in range(repeats):  # interleaved: the load drifts alike for all of them
            for name, fn in calls.items():
                start = time.process_time()
                fn()
                timings[name].append(time.process_time() - start)
        medians = {k: float(np.median(v)) for k, v in timings.items()}
        out[network] = {"seconds": medians, "parameters": sum(module.prior.param_sizes), "classes": 8,
                        "applied": over_confident(evidence)}
    return out


def cost_report(measured: Dict[str, Any], command: str, library: str) -> str:
    lines = ["## What the one call costs (item 4)", "",
             f"Date: {now()}. Command: `{command}`. Library {library}. CPU: {cpu_name()}, one thread, torch "
             f"{package_version('torch')}. "
             "Process CPU seconds per 1,000 inputs in batches of 100 (medians of 3 rounds, each measuring all four in "
             "turn), at "
             "the seed-0 runs' final weights with their kron-GGN evidence; `predict` under `torch.inference_mode` as in "
             "a `predict_step`; MC: 100 draws; the default (`\"auto\"`) gives the network's own softmax where the network "
             "is not over-confident on its training data (`posterior applied`: no), the tempered posterior elsewhere.",
             "",
             "| network | parameters | forward (s) | posterior applied | predict, default (s) | ratio | predict, probit "
             "(s) | ratio | predict, MC (s) | ratio |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for network, m in measured.items():
        s = m["seconds"]
        lines.append(f"| {network} | {m['parameters']:,} | {s['forward']:.4f} | {'yes' if m['applied'] else 'no'} | "
                     f"{s['default']:.4f} | {s['default'] / s['forward']:.1f}x | {s['probit']:.3f} | "
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
    parser.add_argument("--regression", action="store_true",
                        help="the one call's regression predictive against the network plus its learned sigma")
    parser.add_argument("--cells", action="store_true",
                        help="with --analyse: the variants on issue 52's 12 cells (the prior guard study's cached runs)")
    parser.add_argument("--one-call", action="store_true",
                        help="the one call against the network alone on every cell of issue 52")
    parser.add_argument("--peer", action="store_true",
                        help="laplace-torch's last-layer and full-network recipes on the analysed runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.train:
        _zoo.run_shard(plan(args.quick), args.shard[0], args.shard[1], args.cache)
    if not (args.analyse or args.cost or args.peer or args.regression or args.one_call):
        return
    freeze_startup()
    path = RESULTS / "predictive.md"
    command = "python benchmarks/predictive.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sections = ("cost", "analysis", "cells", "one_call", "peer", "regression")  # in the page's order
    data = {key: None for key in sections}
    data.update(read_data(path))
    computed = set()  # this command's sections (write_sections keeps the others as they are on disk then)
    if args.cost:
        from common import library_state

        computed.add("cost")
        data["cost"] = {"measured": cost(args.cache), "library": library_state(), "text": None}
        data["cost"]["text"] = cost_report(data["cost"]["measured"], command, data["cost"]["library"])
    if args.analyse:
        start = time.perf_counter()
        runs = {network: [analyse_run(spec(network, seed, args.quick), args.cache) for seed in SEEDS]
                for network in NETWORKS}
        computed.add("analysis")
        data["analysis"] = {"runs": runs, "text": report({f"shapes8 / {n}": r for n, r in runs.items()}, command,
                                                         time.perf_counter() - start)}
    if args.cells:
        if not args.analyse:
            raise SystemExit("--cells is a part of --analyse: run them together")
        start = time.perf_counter()
        runs = on_cells(analyse_run, guard_specs)
        computed.add("cells")
        data["cells"] = {"runs": runs, "text": report(
            runs, command, time.perf_counter() - start,
            title="## The variants on issue 52's 12 cells (item 2: every cell of the never-worse study)",
            cells=f"Cells: issue 52's 12 (benchmarks/investigations/prior_guard.py, its `defaults` arm, seeds "
                  f"{', '.join(map(str, SEEDS))}), the first {_zoo.LINEARIZED} test images and {_zoo.LINEARIZED} OOD "
                  "images of each (the study's own).")}
    if args.one_call:
        from common import library_state

        start = time.perf_counter()
        runs = {**on_cells(functools.partial(one_call_run, whole=False), guard_specs),
                **on_cells(one_call_run, other_specs)}
        computed.add("one_call")
        data["one_call"] = {"runs": runs, "text": one_call_report(runs, command, time.perf_counter() - start,
                                                                 library_state())}
    if args.peer:
        if not data["analysis"]:
            raise SystemExit("--peer sets its rows beside the analysis's: run --analyse first (or with it)")
        start = time.perf_counter()
        peer = {network: [peer_run(spec(network, seed, args.quick), args.cache) for seed in SEEDS]
                for network in NETWORKS}
        computed.add("peer")
        data["peer"] = {"runs": peer, "text": peer_report(peer, data["analysis"]["runs"], command,
                                                         time.perf_counter() - start)}
    if args.regression:
        start = time.perf_counter()
        regression = {f"{name} / mlp, depth {depth}": [
            regression_run(name, depth, seed, 3 if args.quick else REGRESSION_EPOCHS)
            for seed in range(2 if args.quick else REGRESSION_SPLITS)] for name in regression_sets()
            for depth in REGRESSION_DEPTHS}
        computed.add("regression")
        data["regression"] = {"runs": regression,
                              "text": regression_report(regression, command, time.perf_counter() - start)}
    print(write_sections(path, "# The posterior predictive (issue 53)", sections, {k: data[k] for k in computed}))


if __name__ == "__main__":
    main()
