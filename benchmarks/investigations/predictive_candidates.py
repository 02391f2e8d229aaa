"""Predictives measured for issue 53's never-worse default on every cell of the predictive study
(``benchmarks/predictive.py``: shapes8's runs, and issue 52's 12 cells from the prior guard study's cache) and dropped
(``benchmarks/results/predictive_candidates.md``). Two can also sharpen:

``--temperature``: the network's logits over one temperature fitted to the training labels, of the training logits
(in-sample) or of approximate leave-one-out logits under three kron-GGN posteriors.

``--mode``: the GLM predictive with its mean at the linear model's own MAP (``linearized_evidence``, Antoran et al.
2022): how far the trained weights are from it, and whether the predictive there is never worse.

Two complete the issue's list of posteriors and predictives:

``--sampled``: the NN predictive, weights drawn from the kron-GGN posterior and run through the network.

``--subnetwork``: a subnetwork posterior (Daxberger et al., ICML 2021), full covariance over the weights of largest
marginal variance.

The runs are read from the caches (train shapes8's with ``python benchmarks/predictive.py --train``, the 12 cells'
with ``python benchmarks/investigations/prior_guard.py --shard 0/1``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _zoo  # noqa: E402
import predictive as study  # noqa: E402
from _common import RESULTS, freeze_startup, now, timed, write_sections  # noqa: E402
from common import library_state  # noqa: E402
from lightning_marglik import LaplaceEvidence  # noqa: E402
from lightning_marglik.curvature import eval_mode  # noqa: E402
from lightning_marglik.linearized import linearized_evidence  # noqa: E402
from lightning_marglik.predictive import class_probabilities, output_jacobians  # noqa: E402

PATH = RESULTS / "predictive_candidates.md"
Run = Callable[[_zoo.RunSpec, str], Dict[str, Any]]


def every_cell(run: Run, cache: str) -> Dict[str, List[Dict[str, Any]]]:
    """``run`` on shapes8's runs (from ``cache``) and on issue 52's 12 cells (``predictive.guard_specs``), by cell name."""
    runs = {f"shapes8 / {n}": [run(study.spec(n, seed), cache) for seed in study.SEEDS]
            for n in study.NETWORKS}
    runs.update(study.on_cells(run, study.guard_specs))
    return runs


# --- a temperature from the training data alone (a candidate that can sharpen) --------------------------------

LOG_TEMPERATURES = torch.linspace(-3.0, 3.0, 601, dtype=torch.float64)  # T from 0.05 to 20, steps of 1 % in log


def fit_temperature(logits: Tensor, y: Tensor) -> float:
    """The ``T`` of :data:`LOG_TEMPERATURES` whose ``softmax(logits / T)`` has the least NLL on ``y`` (a grid: the
    NLL of one scale is cheap, and the grid's ends say when a fit runs off)."""
    logits = logits.double()
    nll = torch.stack([torch.nn.functional.cross_entropy(logits / t.exp(), y) for t in LOG_TEMPERATURES])
    return float(LOG_TEMPERATURES[nll.argmin()].exp())


def leave_one_out_logits(logits: Tensor, covariance: Tensor, y: Tensor) -> Tensor:
    """``f_i - V_i (y_i - p_i)``: each training example's logits after one Newton step of the MAP objective from
    the MAP without the example's gradient (its curvature kept in ``H``; ``V_i = J_i H^-1 J_i^T`` is
    ``covariance`` ``(B, C, C)``, ``p_i = softmax(f_i)``, ``y_i`` one-hot)."""
    residual = torch.nn.functional.one_hot(y, logits.shape[1]).to(logits) - logits.softmax(1)
    return logits - (covariance.to(logits) @ residual[:, :, None])[..., 0]


def temperature_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """The network's test and OOD scores with its logits divided by a temperature fitted on the training data: on
    the training logits themselves (in-sample), or on approximate leave-one-out logits of each training example,
    ``f_i - V_i (y_i - p_i)`` with ``V_i = J_i H^-1 J_i^T`` (one Newton step from the MAP without the example's
    gradient, its curvature kept) under three posteriors: as trained, post-hoc precisions (every tensor), and the
    last layer at post-hoc precisions."""
    module, data, result = study.trained(spec_, cache)
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    fitted, _ = study.posthoc(module, loader)
    sizes, n_tensors = module.prior.param_sizes, len(module.prior.param_names)
    last = [i >= n_tensors - 2 for i in range(n_tensors)]  # the last Linear's weight and bias
    posteriors = {
        "as trained": (LaplaceEvidence.fit(module, loader, module.likelihood, module.prior, "kron", "ggn"),
                       [True] * n_tensors),
        "post hoc precisions": (fitted, [True] * n_tensors),
        "post hoc, last layer": (fitted, last),
    }
    logits, loo = [], {name: [] for name in posteriors}
    for i in range(0, len(data.y_train), study.CHUNK):
        mean, jac = output_jacobians(module.prior, module, data.x_train[i:i + study.CHUNK])
        logits.append(mean)
        for name, (evidence, keep) in posteriors.items():
            cov = study.covariances(evidence, jac, sizes, keep)
            loo[name].append(leave_one_out_logits(mean, cov, data.y_train[i:i + study.CHUNK]))
    y_train = data.y_train
    temperatures = {"in-sample": fit_temperature(torch.cat(logits), y_train)}
    loo_acc = {}
    for name, parts in loo.items():
        loo_logits = torch.cat(parts)
        temperatures[f"leave-one-out, {name}"] = fit_temperature(loo_logits, y_train)
        loo_acc[name] = (loo_logits.argmax(1) == y_train).double().mean().item()
    x, y, ood = study.scored_inputs(spec_, data)
    with torch.no_grad(), eval_mode(module):
        test, out = _zoo.logits_of(module, x), _zoo.logits_of(module, ood)
    scores = {"network alone": _zoo._softmax_scores(test.softmax(1), y, out.softmax(1))}
    for name, t in temperatures.items():
        scores[name] = _zoo._softmax_scores((test / t).softmax(1), y, (out / t).softmax(1))
    return {"library": result["library"], "scores": scores, "temperature": temperatures, "loo_acc": loo_acc,
            "train_acc": (torch.cat(logits).argmax(1) == y_train).double().mean().item()}



EVERY_CELL = ("Cells: shapes8 / mlp and cnn (benchmarks/predictive.py's runs) and issue 52's 12 (the prior guard "
              "study's `defaults` arm), seeds 0-2, each scored on its first 500 test and 500 OOD inputs (those of "
              "benchmarks/predictive.py's analysis).")



def temperature_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float, library: str) -> str:
    """The results page's part for :func:`temperature_run` on every cell."""
    trained_on = sorted({r["library"] for rs in runs.values() for r in rs})

    def temperature(rs: List[Dict[str, Any]], name: str) -> str:
        return f"{np.mean([r['temperature'].get(name, 1.0) for r in rs]):.2f}"

    def loo_acc(rs: List[Dict[str, Any]], name: str) -> str:
        if name == "network alone":
            return f"{np.mean([r['train_acc'] for r in rs]):.3f} (training)"
        kind = name.split(", ", 1)[1] if name.startswith("leave-one-out") else None
        return f"{np.mean([r['loo_acc'][kind] for r in rs]):.3f}" if kind else ""

    return "\n".join([
        "## A temperature from the training data alone (item 2: a candidate that can sharpen)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {library}; runs trained on "
        f"{', '.join(trained_on)}. {EVERY_CELL} The network's logits divided by one temperature T, fitted on a grid "
        "(log T from -3 to 3, steps of 0.01) to the training labels: of the training logits (in-sample), or of "
        "approximate leave-one-out logits `f_i - V_i (y_i - p_i)`, `V_i = J_i H^-1 J_i^T` of a kron-GGN posterior (as "
        "trained; post-hoc precisions; the last layer at post-hoc precisions). Means over seeds; `meets`: seeds whose "
        "NLL and ECE are at most the network's alone; `accuracy`: on the training data, of the network's logits and "
        "of the leave-one-out ones.", "",
        *study.variant_rows(runs, {"T": temperature, "accuracy": loo_acc})])



# --- the GLM predictive at the linear model's own mode ----------------------------------------------------------

MODE_STEPS = 100  # L-BFGS iterations of the linear model (tol 1e-3, memory 100: linearized_convergence.md's setting)
MODE = "at the linear model's mode"


def pass_seconds(module: Any, loader: Any) -> float:
    """Process CPU seconds of one forward and backward of the training loss over ``loader`` (an epoch's work,
    without the optimizer's steps)."""
    def one_pass() -> None:
        for x, y in loader:
            module.zero_grad(set_to_none=True)
            module.likelihood.nll(module(x), y).sum().backward()
        module.zero_grad(set_to_none=True)

    return timed(one_pass)[0]


def mode_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """The GLM predictive with its mean at the linear model's MAP (``linearized_evidence``, Antoran et al. 2022),
    ``f(theta*) + J (theta_lin - theta*)``, under the posterior as trained (the covariance is the same at both
    means: the linear model's Jacobian and curvature are the network's at ``theta*``), against the network alone
    and the one call's posterior at ``theta*``."""
    module, data, result = study.trained(spec_, cache)
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    seconds, _, lin = timed(lambda: linearized_evidence(module, loader, module.likelihood, module.prior, "kron", "ggn",
                                                       steps=MODE_STEPS, tol=1e-3, history=100))
    step = torch.cat([(a - b.detach()).reshape(-1) for a, b in zip(lin.params, module.prior.params)])
    x, y, ood = study.scored_inputs(spec_, data)
    methods = {"tempered": "tempered", "probit": "probit", "MC": "mc"}
    names = ["network alone", "as trained, tempered (the one call's posterior)", f"{MODE}, its mean alone",
             *(f"{MODE}, {m}" for m in methods)]
    probs: Dict[str, List[List[Tensor]]] = {name: [[], []] for name in names}
    generator = torch.Generator().manual_seed(spec_.seed)
    for part, inputs in enumerate((x, ood)):
        for i in range(0, len(inputs), study.CHUNK):
            mean, jac = output_jacobians(module.prior, module, inputs[i:i + study.CHUNK])
            cov = lin.evidence.jacobian_covariance(jac)
            moved = mean + jac @ step.to(jac)
            probs["network alone"][part].append(mean.softmax(1))
            probs[names[1]][part].append(class_probabilities(mean, cov, "tempered"))
            probs[names[2]][part].append(moved.softmax(1))
            for label, method in methods.items():
                probs[f"{MODE}, {label}"][part].append(
                    class_probabilities(moved, cov, method, study.MC_SAMPLES, generator))
    scores = study.scores_of(probs, y)
    return {"library": result["library"], "scores": scores, "iterations": lin.iterations, "converged": lin.converged,
            "objective": list(lin.objective), "seconds": seconds, "epoch_seconds": pass_seconds(module, loader),
            "step_norm": step.norm().item()}


def mode_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float, library: str) -> str:
    """The results page's part for :func:`mode_run` on every cell."""
    trained_on = sorted({r["library"] for rs in runs.values() for r in rs})

    def fit(rs: List[Dict[str, Any]], name: str) -> str:
        if name != "network alone":
            return ""
        cost = np.mean([r["seconds"] / r["epoch_seconds"] for r in rs])
        drop = np.mean([r["objective"][1] / r["objective"][0] for r in rs])
        return (f"{np.mean([r['iterations'] for r in rs]):.0f} it., {cost:.0f} epochs, objective x{drop:.2f}")

    return "\n".join([
        "## The GLM predictive at the linear model's own mode (items 1 and 2)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {library}; runs trained on "
        f"{', '.join(trained_on)}. {EVERY_CELL} The linear model `f(theta*) + J (theta - theta*)` taken to its MAP under "
        f"the callback's learned prior and likelihood by `linearized_evidence` (kron-GGN, up to {MODE_STEPS} "
        "preconditioned L-BFGS iterations, tol 1e-3, memory 100); its predictive's covariance is the one at theta* "
        "(the linear model's Jacobian and curvature are the network's there). `fit`: iterations, the fit's process "
        "CPU in forward-and-backward passes over the training data, the linear model's objective at its end over "
        "its start. MC: 100 draws. Means over seeds; `meets`: seeds whose NLL and ECE are at most the network's "
        "alone.", "",
        *study.variant_rows(runs, {"fit": fit})])


# --- the NN predictive: weights drawn from the posterior, through the network -------------------------------------

DRAWS = 30  # weight draws per input batch (the GLM's MC takes 100 of the logits, which cost no forward each)
SAMPLED = "NN predictive"


def _posterior_blocks(evidence: LaplaceEvidence) -> List[Tuple[int, Optional[Tensor], Optional[Tensor], Tensor, bool]]:
    """The evidence's posterior precision per prior tensor ``i``, ``(i, L, R, s E + delta, transposed)``: in the basis
    ``L (x) R`` of the tensor's matrices (``None``: the identity) it is diagonal, ``s E + delta`` (a diagonal block's
    entries as ``E``), laid out as the matrices ``X`` of the tensor's view, or their transposes where the tensor
    stores ``X^T`` (``transposed``). It reads the structures' private eigenbases: an investigation's, not the
    library's.

    Raises:
        NotImplementedError: On a structure other than a Kronecker or a diagonal one.
    """
    from lightning_marglik.curvature.structures.diag import DiagStructure
    from lightning_marglik.curvature.structures.kron import KronStructure, _rows, _view

    prior, likelihood = evidence.prior, evidence.likelihood
    hyper = {name: value.detach().double() for name, value in likelihood.hyperparameters().items()}
    scale = likelihood.curvature_scale(evidence.approx, hyper)
    delta = [d.exp() for d in prior.tensor_log_precisions(prior.log_precision.detach().double())]
    blocks = []
    for structure in evidence.structures:
        if isinstance(structure, DiagStructure):
            blocks += [(i, None, None, (scale * diagonal + delta[i]).reshape(1, -1, 1), False)
                       for i, diagonal in structure.diagonal().items()]
            continue
        if not isinstance(structure, KronStructure):
            raise NotImplementedError(f"no posterior blocks of {type(structure).__name__}")
        for j, (layer, shape) in enumerate(zip(structure.layers, structure.shapes)):
            bases = structure._bases(j)
            for role, i in layer.roles.items():
                left, right, values = bases[role]
                blocks.append((i, left, right, scale * _rows(values) + delta[i], _view(shape, role)[1]))
    return sorted(blocks, key=lambda block: block[0])


def _to_tensor(x: Tensor, left: Optional[Tensor], right: Optional[Tensor], transposed: bool) -> Tensor:
    """``L x R^T`` of a block's working layout, flat in the tensor's own order."""
    x = left @ x if left is not None else x
    x = x @ right.mT if right is not None else x
    return (x.transpose(1, 2) if transposed else x).reshape(-1)


def posterior_draw(evidence: LaplaceEvidence, generator: torch.Generator) -> List[Tensor]:
    """One draw of ``N(0, H^-1)``, one flat float64 tensor per prior tensor: ``L (z / sqrt(s E + delta)) R^T`` per
    block (:func:`_posterior_blocks`)."""
    return [_to_tensor(torch.randn(precision.shape, generator=generator, dtype=torch.float64) * precision.rsqrt(),
                       left, right, transposed) for _, left, right, precision, transposed in _posterior_blocks(evidence)]


def marginal_variances(evidence: LaplaceEvidence) -> Tensor:
    """``diag(H^-1)`` of every weight, flat in the prior's order: ``(L o L) (1 / (s E + delta)) (R o R)^T`` per block."""
    return torch.cat([_to_tensor(1 / precision, None if left is None else left * left,
                                 None if right is None else right * right, transposed)
                      for _, left, right, precision, transposed in _posterior_blocks(evidence)])


def sampled_probabilities(evidence: LaplaceEvidence, module: Any, inputs: Tensor, draws: int,
                          generator: torch.Generator) -> Tensor:
    """The mean over ``draws`` weight draws of the network's softmax on ``inputs`` (eval mode)."""
    from torch.func import functional_call

    from lightning_marglik.curvature import locate

    names, _ = locate(module, evidence.prior)
    theta = [p.detach() for p in evidence.prior.params]
    total = torch.zeros(())
    with torch.no_grad(), eval_mode(module), contextlib.ExitStack() as reusing:
        for structure in evidence.structures:  # every draw reads the same eigenbases: decomposed once
            reusing.enter_context(structure.reusing_decompositions())
        for _ in range(draws):
            drawn = [t + z.to(t.dtype).view_as(t) for t, z in zip(theta, posterior_draw(evidence, generator))]
            total = total + functional_call(module, dict(zip(names, drawn)), (inputs,)).softmax(1)
    return total / draws


def sampled_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """The NN predictive (weights drawn from the kron-GGN posterior and run through the network, laplace-torch's
    ``pred_type="nn"``) under the posterior as trained and at post-hoc precisions, against the network alone and
    the GLM's at the same posteriors (tempered, the one call's posterior; MC)."""
    module, data, result = study.trained(spec_, cache)
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    posteriors = {"as trained": LaplaceEvidence.fit(module, loader, module.likelihood, module.prior, "kron", "ggn"),
                  "post hoc precisions": study.posthoc(module, loader)[0]}
    x, y, ood = study.scored_inputs(spec_, data)
    generator = torch.Generator().manual_seed(spec_.seed)
    probs: Dict[str, List[List[Tensor]]] = {"network alone": [[], []]}
    for part, inputs in enumerate((x, ood)):
        for i in range(0, len(inputs), study.CHUNK):
            chunk = inputs[i:i + study.CHUNK]
            mean, jac = output_jacobians(module.prior, module, chunk)
            probs["network alone"][part].append(mean.softmax(1))
            for name, evidence in posteriors.items():
                cov = evidence.jacobian_covariance(jac)
                for label, method in (("GLM, tempered", "tempered"), ("GLM, MC", "mc")):
                    probs.setdefault(f"{name}, {label}", [[], []])[part].append(
                        class_probabilities(mean, cov, method, study.MC_SAMPLES, generator))
                probs.setdefault(f"{name}, {SAMPLED}", [[], []])[part].append(
                    sampled_probabilities(evidence, module, chunk, DRAWS, generator))
    scores = study.scores_of(probs, y)
    return {"library": result["library"], "scores": scores}


def sampled_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float, library: str) -> str:
    """The results page's part for :func:`sampled_run` on every cell."""
    trained_on = sorted({r["library"] for rs in runs.values() for r in rs})
    return "\n".join([
        "## The NN predictive: weights drawn from the posterior (item 2's GLM and NN predictives)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {library}; runs trained on "
        f"{', '.join(trained_on)}. {EVERY_CELL} The NN predictive: the mean softmax of the network at {DRAWS} weight "
        "draws from the kron-GGN posterior (`posterior_draw`: each Kronecker block in its eigenbasis), as trained and "
        "at post-hoc precisions (every tensor, the output layer too, fitted by the evidence at the final weights), "
        f"beside the GLM predictive at the same posteriors (tempered: the one call's posterior; MC: "
        f"{study.MC_SAMPLES} draws of the logits). Means over seeds; `meets`: seeds whose NLL and ECE are at most the "
        "network's alone.", "",
        *study.variant_rows(runs, {})])


# --- a subnetwork posterior (Daxberger et al., ICML 2021) -------------------------------------------------------

SUBNETWORK = 1000  # weights of the subnetwork, chosen by their marginal variance under the kron posterior as trained
SUBNET = f"subnetwork of {SUBNETWORK} weights"


def subnetwork_run(spec_: _zoo.RunSpec, cache: str) -> Dict[str, Any]:
    """A subnetwork posterior: the :data:`SUBNETWORK` weights of largest marginal variance under the kron-GGN
    posterior as trained (Daxberger et al. choose by a diagonal posterior's), a full-covariance Laplace over them
    (their exact GGN on the training data, at their tensors' learned precisions) and every other weight at its
    trained value; its GLM predictive against the network alone and the one call's posterior."""
    module, data, result = study.trained(spec_, cache)
    prior, likelihood = module.prior, module.likelihood
    loader = _zoo._loader(data.x_train, data.y_train, 500, None)
    evidence = LaplaceEvidence.fit(module, loader, likelihood, prior, "kron", "ggn")
    chosen = marginal_variances(evidence).topk(min(SUBNETWORK, sum(prior.param_sizes))).indices
    hyper = {name: value.detach().double() for name, value in likelihood.hyperparameters().items()}
    delta = torch.cat([d.exp().expand(n) for d, n in zip(prior.tensor_log_precisions(
        prior.log_precision.detach().double()), prior.param_sizes)])
    precision = torch.diag(delta[chosen])
    scale = likelihood.curvature_scale("ggn", hyper)
    for i in range(0, len(data.y_train), study.CHUNK):
        mean, jac = output_jacobians(prior, module, data.x_train[i:i + study.CHUNK])
        rows, p = jac[:, :, chosen].double(), mean.double().softmax(1)
        hessian = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        precision += scale * torch.einsum("bcs,bcd,bdt->st", rows, hessian, rows)
    covariance = torch.cholesky_inverse(torch.linalg.cholesky(precision))
    x, y, ood = study.scored_inputs(spec_, data)
    generator = torch.Generator().manual_seed(spec_.seed)
    names = ["network alone", "as trained, tempered (the one call's posterior)", f"{SUBNET}, tempered", f"{SUBNET}, MC"]
    probs: Dict[str, List[List[Tensor]]] = {name: [[], []] for name in names}
    for part, inputs in enumerate((x, ood)):
        for i in range(0, len(inputs), study.CHUNK):
            mean, jac = output_jacobians(prior, module, inputs[i:i + study.CHUNK])
            rows = jac[:, :, chosen].double()
            sub = (rows @ covariance @ rows.mT).to(mean)
            probs["network alone"][part].append(mean.softmax(1))
            probs[names[1]][part].append(class_probabilities(mean, evidence.jacobian_covariance(jac), "tempered"))
            probs[names[2]][part].append(class_probabilities(mean, sub, "tempered"))
            probs[names[3]][part].append(class_probabilities(mean, sub, "mc", study.MC_SAMPLES, generator))
    scores = study.scores_of(probs, y)
    return {"library": result["library"], "scores": scores, "weights": len(chosen),
            "parameters": sum(prior.param_sizes)}


def subnetwork_report(runs: Dict[str, List[Dict[str, Any]]], command: str, elapsed: float, library: str) -> str:
    """The results page's part for :func:`subnetwork_run` on every cell."""
    trained_on = sorted({r["library"] for rs in runs.values() for r in rs})

    def size(rs: List[Dict[str, Any]], name: str) -> str:
        return f"{rs[0]['weights']:,} of {rs[0]['parameters']:,}" if name == "network alone" else ""

    return "\n".join([
        "## A subnetwork posterior (item 2's last-layer and subnetwork posteriors)", "",
        f"Date: {now()}. Command: `{command}` ({elapsed / 60:.1f} min). Library {library}; runs trained on "
        f"{', '.join(trained_on)}. {EVERY_CELL} Subnetwork Laplace (Daxberger et al., ICML 2021): the {SUBNETWORK} "
        "weights of largest marginal variance under the kron-GGN posterior as trained (`marginal_variances`; the paper "
        "chooses by a diagonal posterior's), a full-covariance posterior over them (their exact GGN on the training "
        "data plus their tensors' learned precisions), every other weight held at its trained value; the GLM "
        f"predictive, tempered and MC ({study.MC_SAMPLES} draws). Means over seeds; `meets`: seeds whose NLL and ECE "
        "are at most the network's alone.", "",
        *study.variant_rows(runs, {"subnetwork": size})])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.path.join(_zoo.output_dir("predictive"), "runs"),
                        help="shapes8's runs (benchmarks/predictive.py --train)")
    parser.add_argument("--temperature", action="store_true", help="a temperature fitted on the training data")
    parser.add_argument("--mode", action="store_true", help="the GLM predictive at the linear model's own MAP")
    parser.add_argument("--sampled", action="store_true", help="the NN predictive: weights drawn from the posterior")
    parser.add_argument("--subnetwork", action="store_true", help="a subnetwork posterior (Daxberger et al. 2021)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    freeze_startup()
    command = ("python benchmarks/investigations/predictive_candidates.py "
               + " ".join(sys.argv[1:] if argv is None else argv))
    sections = {"temperature": (temperature_run, temperature_report), "mode": (mode_run, mode_report),
                "sampled": (sampled_run, sampled_report), "subnetwork": (subnetwork_run, subnetwork_report)}
    computed = {}
    for key, (run, section) in sections.items():
        if getattr(args, key):
            start = time.perf_counter()
            runs = every_cell(run, args.cache)
            computed[key] = {"runs": runs, "text": section(runs, command, time.perf_counter() - start, library_state())}
    print(write_sections(PATH, "# Predictives measured and dropped (issue 53, item 2)", list(sections), computed))


if __name__ == "__main__":
    main()
