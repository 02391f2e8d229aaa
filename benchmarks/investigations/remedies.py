"""Remedies for run-away prior precisions, compared on the same runs (issue 23, item 2).

Setting (the recipe of ``benchmarks/investigations/runaway_mechanism.py`` on half its data, to fit the CPU budget):
MNIST-5k, 500 train / 1000 test, 14x14, Adam batch 32 (lr 3e-3; Fixup 1e-2), 12 epochs; networks of
``benchmarks/_zoo.py``: BatchNorm ResNet, Fixup ResNet, plain CNN, MLP; layerwise prior from
delta = 1. Arms (``arms``):

* ``defaults``: ``MargLikCallback()`` as the library ships it (kron, GGN, Newton, frequency 1;
  biases and norms decoupled, a trust region of 1 on log delta, the first estimate once the training
  loss has settled);
* ``delta=1``: the prior fixed at 1, no callback (the untuned default a user compares with);
* ``Algorithm 1``: the paper's schedule with no remedy (``ALGORITHM_1``: every precision learned and
  fed back from epoch 1, each estimate's Newton steps to convergence); every remedy below is added
  to it alone:
* ``adam``: ``solver="adam"``, the paper's K=100 Adam steps of lr 0.1 (each estimate's move bounded implicitly);
* ``burnin``: ``burnin=4`` (the first estimate after 30 % of the epochs, at epoch 5);
* ``fixed bias/norm``: ``GaussianPrior(fixed=no_decay_names(prior))`` (every bias, normalization
  parameter and Fixup scalar: the tensors of at most one dimension, as timm's ``param_groups_weight_decay``);
* ``hyperprior`` (log-normal, scale 2, on every learned log delta), ``trust region`` (``max_step=1``:
  every log delta moves at most 1 per estimate), ``decoupled bias/norm`` (``biases="decoupled"``:
  the evidence learns their precision, the MAP loss keeps delta = 1 for them), ``settle``
  (``settle=0.05``: the first estimate once the training loss moved less than 5 % over 2 epochs);
* combinations: decoupled with the hyperprior, the trust region, both, and the trust region with
  the burn-in (decoupled + trust region + settle is ``defaults``).

Columns: test accuracy and NLL (mean over seeds, final weights), the largest log delta above its
start over all estimates and tensors (and the tensor), the largest jump of the online marglik/N
between consecutive estimates in the last third of training, and CPU time against ``defaults``.

Usage::

    python benchmarks/investigations/remedies.py              # trains what is not cached, writes benchmarks/results/remedies.md
    python benchmarks/investigations/remedies.py --quick      # smoke test, prints only
    python benchmarks/investigations/remedies.py --arms adam burnin --seeds 0 1

Runs are cached in ``outputs/remedies/runs/`` (one JSON per run, with the library commit).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the shared harness

import _zoo  # noqa: E402
from _common import RESULTS, hand_written, now, write_with_data  # noqa: E402
from lightning_marglik import GaussianPrior  # noqa: E402
from lightning_marglik.hyperparameters import LogNormalHyperprior, no_decay_names  # noqa: E402

NAME = "remedies"
NETWORKS = ("bn_resnet", "fixup_resnet", "cnn", "mlp")
LR = {"fixup_resnet": 1e-2}
RUNAWAY = 8.0
EPOCHS = 12


def base(network: str, seed: int, quick: bool) -> Dict[str, Any]:
    size = dict(epochs=3, n_train=300, n_test=300) if quick else dict(epochs=EPOCHS, n_train=500, n_test=1000)
    return dict(network=network, dataset="mnist", seed=seed, batch_size=32, lr=LR.get(network, 3e-3), **size)


def arms(network: str, epochs: int) -> Dict[str, Dict[str, Any]]:
    """Arm name -> RunSpec fields on top of ``base``: each remedy alone on ``ALGORITHM_1``, combinations, and
    the defaults as shipped (decoupled biases and norms, the trust region and the settle rule together)."""
    names = no_decay_names(GaussianPrior(_zoo.build(network, 14, 10)))
    burnin = round(0.3 * epochs)  # 30 % of the epochs: the first estimate after epoch 4 of 12

    def on_top(prior_setup: Optional[str] = None, fixed: Optional[List[str]] = None, **callback: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {"callback": {**ALGORITHM_1, **callback}}
        if prior_setup:
            out["prior_setup"] = prior_setup
        if fixed:
            out["fixed"] = fixed
        return out

    return {
        "defaults": {"callback": {}},
        "delta=1": {},
        "Algorithm 1": on_top(),
        "adam": on_top(solver="adam"),
        "burnin": on_top(burnin=burnin),
        "fixed bias/norm": on_top(fixed=names),
        "hyperprior": on_top("hyperprior"),
        "trust region": on_top(max_step=MAX_STEP),
        "decoupled bias/norm": on_top(biases="decoupled"),
        "settle": on_top(settle=SETTLE),
        "decoupled bias/norm + hyperprior": on_top("hyperprior", biases="decoupled"),
        "decoupled bias/norm + trust region": on_top(biases="decoupled", max_step=MAX_STEP),
        "decoupled bias/norm + hyperprior + trust region": on_top("hyperprior", biases="decoupled", max_step=MAX_STEP),
        "decoupled bias/norm + trust region + burnin": on_top(biases="decoupled", max_step=MAX_STEP, burnin=burnin),
    }


# the paper's Algorithm 1 with the engine's converged Newton steps: no remedy (each arm adds its own)
ALGORITHM_1: Dict[str, Any] = {"settle": None, "max_step": None, "biases": "learn"}
HYPERPRIOR_SCALE = 2.0  # the weak log-normal of LogNormalHyperprior's docstring: e^2 away from delta_0 costs 0.5 nats
MAX_STEP = 1.0  # largest change of any log delta per estimate
SETTLE = 0.05  # the first estimate once the epochs' mean training loss moved <= 5 % over 2 epochs


def _hyperprior(prior: GaussianPrior) -> None:
    prior.hyperprior = LogNormalHyperprior(scale=HYPERPRIOR_SCALE)


_zoo.PRIOR_SETUPS["hyperprior"] = _hyperprior


def summarize(runs: List[Dict[str, Any]], reference_cpu: Optional[float]) -> Dict[str, Any]:
    """Means over seeds and the worst case of the stability measures."""
    rises, wd_rises, jumps = [], [], []
    for run in runs:
        start = math.log(run["spec"]["precision"])
        est = [r for r in run["trace"] if "marglik" in r] or run["trace"]
        rise, tensor = max(((v - start, n) for r in est for v, n in zip(r["log_delta"], run["param_names"])),
                           default=(0.0, "-"))
        rises.append((rise, tensor, run["spec"]["seed"]))
        wd_rises.append(max(((v - start, n) for r in est for v, n in zip(r["wd_log_delta"], run["param_names"])),
                            default=(0.0, "-")) + (run["spec"]["seed"],))
        values = [r["marglik"] for r in run["trace"] if "marglik" in r and r["epoch"] > 2 * run["spec"]["epochs"] / 3]
        jumps.append(max((abs(b - a) for a, b in zip(values, values[1:])), default=math.nan))
    cpu = float(np.mean([r["cpu_seconds"] for r in runs]))
    return {
        "seeds": [r["spec"]["seed"] for r in runs],
        "acc": float(np.mean([r["final"]["acc"] for r in runs])), "acc_sd": float(np.std([r["final"]["acc"] for r in runs])),
        "nll": float(np.mean([r["final"]["nll"] for r in runs])), "nll_sd": float(np.std([r["final"]["nll"] for r in runs])),
        # the last epochs' mean: a final epoch of an undertrained BatchNorm network moves by several points
        "acc_last3": float(np.mean([np.mean([row["test_acc"] for row in r["trace"][-3:]]) for r in runs])),
        "nll_last3": float(np.mean([np.mean([row["test_nll"] for row in r["trace"][-3:]]) for r in runs])),
        "max_rise": max(rises), "max_wd_rise": max(wd_rises), "above_8": sum(1 for run in runs for n in _above(run, RUNAWAY)),
        "jump": float(np.nanmax(jumps)) if not all(math.isnan(j) for j in jumps) else math.nan,
        "cpu": cpu, "cpu_ratio": cpu / reference_cpu if reference_cpu else math.nan,
        "libraries": sorted({r["library"] for r in runs}),
    }


def _above(run: Dict[str, Any], limit: float) -> List[str]:
    start = math.log(run["spec"]["precision"])
    return sorted({n for r in run["trace"] for v, n in zip(r["log_delta"], run["param_names"]) if v - start > limit})


def fmt_jump(jump: float) -> str:
    return "-" if math.isnan(jump) else f"{jump:.3f}"


def markdown(table: Dict[str, Dict[str, Dict[str, Any]]], command: str, seconds: float) -> str:
    libraries = sorted({lib for by in table.values() for s in by.values() for lib in s["libraries"]})
    lines = [
        "# Remedies for run-away prior precisions (issue 23, item 2)", "",
        f"Date: {now()}. Library: {'; '.join(libraries)}. Command: `{command}`; {seconds / 60:.1f} min wall for this "
        "invocation (cached runs are not retrained); one CPU thread on a shared 2-core machine.", "",
        f"Setting: MNIST-5k (500 train / 1000 test, 14x14), Adam batch 32 (lr 3e-3, Fixup 1e-2), {EPOCHS} epochs, layerwise "
        "prior from delta = 1, seeds as listed. `max rise`: the largest evidence log delta above its start over all "
        "estimates, tensors and seeds (tensor, seed); `weight-decay`: the same for the log precision the MAP loss "
        "uses (lower for decoupled tensors, whose learned precision is not fed back); `last 3 epochs`: the test metrics averaged over the last three epochs "
        "(then over seeds), less noisy than the final epoch's; `> e^8`: (tensor, seed) pairs above e^8; `jump`: the largest |change| of "
        "the online marglik/N between consecutive estimates in the last third of training (max over seeds); `CPU`: "
        "mean process CPU seconds per run and its ratio to `defaults` (wall time on this shared machine is noisier).", "",
    ]
    for network, by in table.items():
        ref = by.get("delta=1")
        lines += [f"## {network}", "",
                  "| arm | seeds | test acc (sd) | vs delta=1 (points) | test NLL (sd) | acc / NLL, mean of the last 3 epochs | "
                  "max log delta rise (tensor, seed) | > e^8 | max weight-decay log delta rise (tensor, seed) | jump (nats/datum) | "
                  "CPU s | CPU / defaults |",
                  "|---|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|"]
        for arm, s in by.items():
            gap = f"{100 * (s['acc'] - ref['acc']):+.1f}" if ref else ""
            rise, tensor, seed = s["max_rise"]
            wd = s["max_wd_rise"]
            lines.append(
                f"| {arm} | {', '.join(map(str, s['seeds']))} | {s['acc']:.4f} ({s['acc_sd']:.3f}) | {gap} | "
                f"{s['nll']:.4f} ({s['nll_sd']:.3f}) | {s['acc_last3']:.4f} / {s['nll_last3']:.4f} | "
                f"{rise:.2f} ({tensor}, {seed}) | {s['above_8']} | {wd[0]:.2f} ({wd[1]}, {wd[2]}) | "
                f"{fmt_jump(s['jump'])} | "
                f"{s['cpu']:.0f} | {s['cpu_ratio']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 300 images, 3 epochs, nothing written")
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", nargs="+", help="train only these arms (the tables show every cached one)")
    parser.add_argument("--analyse", action="store_true", help="train nothing: tables of the cached runs")
    parser.add_argument("--rerun", action="store_true", help="retrain cached runs of the arms asked")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = os.path.join(_zoo.output_dir(NAME), "quick" if args.quick else "runs")
    start = time.perf_counter()
    table: Dict[str, Dict[str, Dict[str, Any]]] = {}
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {} for n in args.networks}
    for seed in args.seeds:  # seed by seed: a cut run has every network and arm for the first seeds
        for network in args.networks:
            b = base(network, seed, args.quick)
            for arm, extra in arms(network, b["epochs"]).items():
                spec = _zoo.RunSpec(**{**b, **extra})
                train = not args.analyse and (args.arms is None or arm in args.arms)
                if not train and not os.path.exists(_zoo.run_path(spec, cache)):
                    continue
                runs[network].setdefault(arm, []).append(_zoo.cached(spec, cache, args.rerun and train))
    for network, by in runs.items():
        reference = by.get("defaults")
        ref_cpu = float(np.mean([r["cpu_seconds"] for r in reference])) if reference else None
        table[network] = {arm: summarize(got, ref_cpu) for arm, got in by.items()}
    command = "python benchmarks/investigations/remedies.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(table, command.strip(), time.perf_counter() - start)
    print(text)
    if not args.quick:
        path = RESULTS / f"{NAME}.md"
        write_with_data(path, text + "\n" + hand_written(path) + "\n", {"table": table})
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
