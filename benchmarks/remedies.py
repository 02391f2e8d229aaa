"""Remedies for run-away prior precisions, compared on the same runs (issue 23, item 2).

Setting (the recipe of ``benchmarks/runaway_mechanism.py`` on half its data, to fit the CPU budget):
MNIST-5k, 500 train / 1000 test, 14x14, Adam batch 32 (lr 3e-3; Fixup 1e-2), 12 epochs; networks of
``benchmarks/_zoo.py``: BatchNorm ResNet, Fixup ResNet, plain CNN, MLP; layerwise prior from
delta = 1. Arms (``ARMS``):

* ``defaults``: ``MargLikCallback()`` (kron, GGN, Newton to convergence, frequency 1, burn-in 0);
* ``delta=1``: the prior fixed at 1, no callback (the untuned default a user compares with);
* ``adam``: ``solver="adam"``, the paper's K=100 Adam steps of lr 0.1 (each estimate's move bounded implicitly);
* ``burnin``: ``burnin=4`` (the first estimate after 30 % of the epochs, at epoch 5);
* ``fixed bias/norm``: ``GaussianPrior(fixed=no_decay_names(prior))`` (every bias, normalization
  parameter and Fixup scalar: the tensors of at most one dimension, as timm's ``param_groups_weight_decay``);
* the engine's remedies (``remedy_arms``, set from the benchmark side): ``hyperprior`` (log-normal,
  scale 2, on every learned log delta), ``trust region`` (every log delta moves at most 1 per
  estimate), ``decoupled bias/norm`` (the evidence learns their precision, the MAP loss keeps
  delta = 1 for them), two combinations, and ``settle`` (the first estimate once the training loss
  moved less than 5 % over 2 epochs).

Columns: test accuracy and NLL (mean over seeds, final weights), the largest log delta above its
start over all estimates and tensors (and the tensor), the largest jump of the online marglik/N
between consecutive estimates in the last third of training, and CPU time against ``defaults``.

Usage::

    python benchmarks/remedies.py              # trains what is not cached, writes benchmarks/results/remedies.md
    python benchmarks/remedies.py --quick      # smoke test, prints only
    python benchmarks/remedies.py --arms adam burnin --seeds 0 1

Runs are cached in ``outputs/remedies/runs/`` (one JSON per run, with the library commit).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _zoo  # noqa: E402
from _common import RESULTS, now, write_with_data  # noqa: E402
from lightning_marglik import GaussianPrior, MargLikCallback  # noqa: E402
from lightning_marglik.hyperparameters import BIAS_NORMALIZATION, LogNormalHyperprior, no_decay_names  # noqa: E402
from lightning_marglik.schedule_rules import loss_has_settled  # noqa: E402

NAME = "remedies"
NETWORKS = ("bn_resnet", "fixup_resnet", "cnn", "mlp")
LR = {"fixup_resnet": 1e-2}
RUNAWAY = 8.0
EPOCHS = 12
HAND_WRITTEN = "<!-- hand-written below: kept when the script rewrites the file -->"


def base(network: str, seed: int, quick: bool) -> Dict[str, Any]:
    size = dict(epochs=3, n_train=300, n_test=300) if quick else dict(epochs=EPOCHS, n_train=500, n_test=1000)
    return dict(network=network, dataset="mnist", seed=seed, batch_size=32, lr=LR.get(network, 3e-3), **size)


def arms(network: str, epochs: int) -> Dict[str, Dict[str, Any]]:
    """Arm name -> RunSpec fields on top of ``base`` (the arms the current library can run)."""
    names = no_decay_names(GaussianPrior(_zoo.build(network, 14, 10)))
    out: Dict[str, Dict[str, Any]] = {
        "defaults": {"callback": {}},
        "delta=1": {},
        "adam": {"callback": {"solver": "adam"}},
        "burnin": {"callback": {"burnin": max(1, round(0.3 * epochs))}},  # 30 % of the epochs
        "fixed bias/norm": {"callback": {}, "fixed": names},
    }
    out.update(remedy_arms())
    return out


def remedy_arms() -> Dict[str, Dict[str, Any]]:
    """The engine's remedies (commit dff4298), set from the benchmark side while the callback has no option for
    them: a weak log-normal hyperprior on log delta (``GaussianPrior.hyperprior``), a trust region of
    ``MAX_STEP`` on every log delta per estimate (``LaplaceEvidence.optimize(max_step=...)`` through
    ``TrustRegionCallback``), biases and normalization parameters decoupled (``GaussianPrior.treat(
    no_decay_names(prior), "decoupled", BIAS_NORMALIZATION)``: the evidence learns their precision, the MAP
    loss keeps delta_0 for them), combinations, and a settle rule for the first estimate."""
    return {
        "hyperprior": {"callback": {}, "prior_setup": "hyperprior"},
        "trust region": {"callback": {}, "callback_class": "trust region"},
        "decoupled bias/norm": {"callback": {}, "prior_setup": "decoupled bias/norm"},
        "decoupled bias/norm + hyperprior": {"callback": {}, "prior_setup": "decoupled bias/norm + hyperprior"},
        "hyperprior + trust region": {"callback": {}, "prior_setup": "hyperprior", "callback_class": "trust region"},
        "settle": {"callback": {}, "callback_class": "settle"},
    }


HYPERPRIOR_SCALE = 2.0  # the weak log-normal of LogNormalHyperprior's docstring: e^2 away from delta_0 costs 0.5 nats
MAX_STEP = 1.0  # largest change of any log delta per estimate
SETTLE = {"window": 2, "rel_tol": 0.05}  # the first estimate once the epoch's mean MAP loss moved <= 5 % over 2 epochs


def _hyperprior(prior: GaussianPrior) -> None:
    prior.hyperprior = LogNormalHyperprior(scale=HYPERPRIOR_SCALE)


def _decoupled(prior: GaussianPrior) -> None:
    prior.treat(no_decay_names(prior), "decoupled", BIAS_NORMALIZATION)


def _decoupled_hyperprior(prior: GaussianPrior) -> None:
    _decoupled(prior)
    _hyperprior(prior)


class TrustRegionCallback(MargLikCallback):
    """``MargLikCallback`` whose every solve keeps each log delta within ``MAX_STEP`` of its start."""

    def _evidence(self, *args: Any, **kwargs: Any) -> Any:
        evidence = super()._evidence(*args, **kwargs)
        evidence.optimize = functools.partial(evidence.optimize, max_step=MAX_STEP)
        return evidence


class SettleCallback(MargLikCallback):
    """``MargLikCallback`` whose first estimate waits until ``loss_has_settled`` (the epochs' mean training
    loss), then estimates every epoch; the last epoch always estimates."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._losses: List[float] = []
        self._batch: List[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._batch.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._losses.append(float(np.mean(self._batch)))
        self._batch = []
        last = trainer.current_epoch + 1 == trainer.max_epochs
        if self.estimations or last or loss_has_settled(self._losses, **SETTLE):
            super().on_train_epoch_end(trainer, pl_module)


_zoo.PRIOR_SETUPS.update({"hyperprior": _hyperprior, "decoupled bias/norm": _decoupled,
                          "decoupled bias/norm + hyperprior": _decoupled_hyperprior})
_zoo.CALLBACKS.update({"trust region": TrustRegionCallback, "settle": SettleCallback})


def summarize(runs: List[Dict[str, Any]], reference_cpu: Optional[float]) -> Dict[str, Any]:
    """Means over seeds and the worst case of the stability measures."""
    rises, jumps = [], []
    for run in runs:
        start = math.log(run["spec"]["precision"])
        est = [r for r in run["trace"] if "marglik" in r] or run["trace"]
        rise, tensor = max(((v - start, n) for r in est for v, n in zip(r["log_delta"], run["param_names"])),
                           default=(0.0, "-"))
        rises.append((rise, tensor, run["spec"]["seed"]))
        values = [r["marglik"] for r in run["trace"] if "marglik" in r and r["epoch"] > 2 * run["spec"]["epochs"] / 3]
        jumps.append(max((abs(b - a) for a, b in zip(values, values[1:])), default=math.nan))
    cpu = float(np.mean([r["cpu_seconds"] for r in runs]))
    return {
        "seeds": [r["spec"]["seed"] for r in runs],
        "acc": float(np.mean([r["final"]["acc"] for r in runs])), "acc_sd": float(np.std([r["final"]["acc"] for r in runs])),
        "nll": float(np.mean([r["final"]["nll"] for r in runs])), "nll_sd": float(np.std([r["final"]["nll"] for r in runs])),
        "max_rise": max(rises), "above_8": sum(1 for run in runs for n in _above(run, RUNAWAY)),
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
        "prior from delta = 1, seeds as listed. `max rise`: the largest log delta above its start over all estimates, "
        "tensors and seeds (tensor, seed); `> e^8`: (tensor, seed) pairs above e^8; `jump`: the largest |change| of "
        "the online marglik/N between consecutive estimates in the last third of training (max over seeds); `CPU`: "
        "mean process CPU seconds per run and its ratio to `defaults` (wall time on this shared machine is noisier).", "",
    ]
    for network, by in table.items():
        ref = by.get("delta=1")
        lines += [f"## {network}", "",
                  "| arm | seeds | test acc (sd) | vs delta=1 (points) | test NLL (sd) | max log delta rise (tensor, seed) | "
                  "> e^8 | jump (nats/datum) | CPU s | CPU / defaults |",
                  "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for arm, s in by.items():
            gap = f"{100 * (s['acc'] - ref['acc']):+.1f}" if ref else ""
            rise, tensor, seed = s["max_rise"]
            lines.append(
                f"| {arm} | {', '.join(map(str, s['seeds']))} | {s['acc']:.4f} ({s['acc_sd']:.3f}) | {gap} | "
                f"{s['nll']:.4f} ({s['nll_sd']:.3f}) | {rise:.2f} ({tensor}, {seed}) | {s['above_8']} | "
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
                path = os.path.join(cache, spec.key() + ".json")
                train = not args.analyse and (args.arms is None or arm in args.arms)
                if not train and not os.path.exists(path):
                    continue
                runs[network].setdefault(arm, []).append(_zoo.cached(spec, cache, args.rerun and train))
    for network, by in runs.items():
        reference = by.get("defaults")
        ref_cpu = float(np.mean([r["cpu_seconds"] for r in reference])) if reference else None
        table[network] = {arm: summarize(got, ref_cpu) for arm, got in by.items()}
    command = "python benchmarks/remedies.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(table, command.strip(), time.perf_counter() - start)
    print(text)
    if not args.quick:
        path = RESULTS / f"{NAME}.md"
        kept = ""
        if path.exists():
            old = path.read_text()
            kept = old[old.index(HAND_WRITTEN):].split("<!-- benchmark-data")[0] if HAND_WRITTEN in old else ""
        write_with_data(path, text + "\n" + (kept or HAND_WRITTEN + "\n"), {"table": table})
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
