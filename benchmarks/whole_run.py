"""The callback's cost over whole runs (issue 34): every epoch timed, late epochs against early ones, the
whole run against the same run without the callback, and against laplace-torch's ``marglik_training``.

MNIST-5k (4,000 train / 1,000 test, 14x14), Adam 3e-3 at a constant rate, batch 32, ``EPOCHS`` epochs, one
thread, process CPU time (robust to other load on the machine). Networks: the MLP 196-256-256-10 of the
issue, and the CNN, Fixup ResNet and BatchNorm ResNet of ``benchmarks/_zoo.py``. Every arm of one network
runs in one process, one after the other (``--networks`` splits the networks over processes):

* ``no callback``: the prior fixed at delta = 1 (the run every ratio divides by);
* ``defaults``: ``MargLikCallback()`` (an estimate every 10th epoch), which flushes denormal floats to zero for the
  fit, and the same with ``flush_denormals=False``;
* ``settle, F=1``: the defaults before issue 32 (``settle=0.05, frequency=1, max_step=1``, the run issue 34
  measured), flushed and unflushed, and ``settle, F=5`` (``frequency=5``);
* ``Algorithm 1``: ``MargLikCallback(settle=None, biases="learn", max_step=None, solver="adam", steps=10,
  lr=0.1, frequency=1)``, an estimate after every epoch;
* ``laplace-torch``: ``marglik_training`` with the same settings (kron GGN, its default ASDL backend, F=1, K=10
  Adam steps at 0.1, layerwise prior from 1) on the same network, data and optimizer, against
  ``laplace-torch, no estimate`` (the same call with its first estimate after the last epoch: its training loop
  and its one closing Laplace fit).

Per run: each epoch's training and estimate CPU seconds (``_zoo.EpochClock``), the whole run, and the
tensors (weights, Adam moments) that ended holding denormal floats. Targets (issue 34): the last 5 training
epochs at most 1.3x the first 5; a default run at most ``1 + (pass / epoch) x (fraction of epochs that
estimate) + 0.15`` of the run without the callback; at most 0.6x the peer's whole run.

Usage::

    python benchmarks/whole_run.py                          # every network, writes benchmarks/results/whole_run.md
    python benchmarks/whole_run.py --networks mlp256 cnn    # some networks (the file keeps the others)
    python benchmarks/whole_run.py --quick                  # smoke test: 300 images, 4 epochs, nothing written
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _zoo  # noqa: E402
from _common import RESULTS, cpu_name, hand_written, load_avg, now, package_version, read_data, write_with_data  # noqa: E402
from common import library_state  # noqa: E402  (examples/common.py, on the path through _zoo)

NAME = "whole_run"
PENALTY = "penalty"  # the results' key of adam_penalty()
NETWORKS = ("mlp256", "cnn", "fixup_resnet", "bn_resnet")
EPOCHS, EDGE = 40, 5  # epochs per run; the early and late epochs compared
ALGORITHM_1 = {"settle": None, "biases": "learn", "max_step": None, "solver": "adam", "steps": 10, "lr": 0.1, "frequency": 1}
PEER = {"hessian_structure": "kron", "n_hypersteps": 10, "lr_hyp": 0.1}
SETTLE = {"settle": 0.05, "max_step": 1.0}  # the defaults before issue 32, issue 34's "as shipped"
ARMS: Dict[str, Dict[str, Any]] = {
    "no callback": {},
    "defaults": {"callback": {}},
    "defaults, unflushed": {"callback": {"flush_denormals": False}},
    "settle, F=1": {"callback": {**SETTLE, "frequency": 1}},
    "settle, F=1, unflushed": {"callback": {**SETTLE, "frequency": 1, "flush_denormals": False}},
    "settle, F=5": {"callback": {**SETTLE, "frequency": 5}},
    "Algorithm 1": {"callback": ALGORITHM_1},
    "laplace-torch": {"peer": {**PEER, "marglik_frequency": 1}},
    "laplace-torch, no estimate": {"peer": {**PEER, "marglik_frequency": 10 ** 6}},
}


def spec(network: str, arm: str, quick: bool) -> _zoo.RunSpec:
    return _zoo.RunSpec(network=network, dataset="mnist", seed=0, epochs=4 if quick else EPOCHS,
                        n_train=300 if quick else 4000, n_test=100 if quick else 1000, batch_size=32, lr=3e-3,
                        trace=False, **ARMS[arm])


def summary(run: Dict[str, Any], plain_cpu: float) -> Dict[str, Any]:
    """One run's figures: whole-run CPU and its ratio to the run without the callback, early and late epochs,
    the estimates' mean cost over a training epoch's, and issue 34's bound on the ratio."""
    out: Dict[str, Any] = {"cpu": run["cpu_seconds"], "ratio": run["cpu_seconds"] / plain_cpu,
                           "error": run.get("error"), "acc": run.get("final", {}).get("acc", math.nan)}
    epochs = run.get("epochs_cpu") or []
    if not epochs:  # the peer: whole runs only
        return out
    train = [e["train"] for e in epochs]
    early, late = float(np.mean(train[:EDGE])), float(np.mean(train[-EDGE:]))
    out.update(early=early, late=late, late_over_early=late / early, epoch=float(np.mean(train)),
               estimates=len(run["history"]), denormals=run.get("denormals", {}))
    if run["history"]:
        est = [epochs[h["epoch"] - 1]["estimate"] for h in run["history"] if h["epoch"] <= len(epochs)]
        out["pass"] = float(np.mean(est)) if est else math.nan
        fraction = len(run["history"]) / len(epochs)
        out["bound"] = 1.0 + out["pass"] / out["epoch"] * fraction + 0.15
        out["late_estimate"] = float(np.mean(est[-EDGE:])) if est else math.nan
    return out


def measure(network: str, quick: bool) -> Dict[str, Any]:
    """Every arm of ``network`` in this process, in order, freshly trained (timings are not cached)."""
    runs: Dict[str, Dict[str, Any]] = {}
    for arm in ARMS:
        runs[arm] = _zoo.train_peer(spec(network, arm, quick)) if "peer" in ARMS[arm] else _zoo.train(spec(network, arm, quick))
        print(f"{network} / {arm}: {runs[arm]['cpu_seconds']:.1f} CPU s"
              + (f" ({runs[arm]['error']})" if runs[arm].get("error") else ""), flush=True)
    plain = runs["no callback"]["cpu_seconds"]
    table = {arm: summary(run, plain) for arm, run in runs.items()}
    peer, peer_plain = table["laplace-torch"], table["laplace-torch, no estimate"]
    if peer["error"] is None and peer_plain["error"] is None:
        peer["ratio"] = peer["cpu"] / peer_plain["cpu"]
        for arm in ("defaults", "settle, F=1", "Algorithm 1"):
            table[arm]["vs_peer"] = table[arm]["cpu"] / peer["cpu"]
    return {"table": table, "per_epoch": {arm: run.get("epochs_cpu", []) for arm, run in runs.items()},
            "library": library_state(), "date": now(), "load": load_avg(), "epochs": EPOCHS,
            "versions": {"torch": torch.__version__, "laplace": package_version("laplace-torch")}}


PENALTY_FRACTIONS = (0.0, 0.1, 0.5)


def adam_penalty(repeats: int = 200) -> Dict[str, Any]:
    """Where denormals cost on this CPU, op by op (one thread, process CPU): ``sqrt`` of 65,536 float32 values that
    are normal, zero or denormal, and one Adam step on a 256 x 256 weight whose moments are denormal in a fraction
    of its entries (their gradients tiny, as a weight the evidence has shrunk), each unflushed and flushed."""

    def seconds(fn: Any) -> float:
        fn()
        start = time.process_time()
        for _ in range(repeats):
            fn()
        return (time.process_time() - start) / repeats

    out: Dict[str, Any] = {"sqrt": {}, "adam": {}}
    values = {"normal": torch.rand(65536) + 0.1, "zero": torch.zeros(65536)}
    values["denormal"] = values["normal"] * 1e-39
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        out["sqrt"][str(flush)] = {name: seconds(lambda v=v: v.sqrt()) for name, v in values.items()}
        for fraction in PENALTY_FRACTIONS:
            torch.set_flush_denormal(False)  # the state is made denormal unflushed, as a run leaves it
            generator = torch.Generator().manual_seed(0)
            weight = torch.nn.Parameter(torch.randn(256, 256, generator=generator))
            optimizer = torch.optim.Adam([weight], lr=3e-3)
            weight.grad = torch.randn(256, 256, generator=generator)
            optimizer.step()
            tiny = torch.rand(256, 256, generator=generator) < fraction
            for moment in ("exp_avg", "exp_avg_sq"):
                optimizer.state[weight][moment][tiny] = 1e-39
            weight.grad = torch.where(tiny, 1e-21, 1e-3) * torch.randn(256, 256, generator=generator)
            torch.set_flush_denormal(flush)
            out["adam"].setdefault(str(flush), {})[str(fraction)] = seconds(optimizer.step)
    torch.set_flush_denormal(False)
    return {"table": out, "date": now(), "load": load_avg(), "library": library_state()}


def penalty_markdown(penalty: Dict[str, Any]) -> List[str]:
    t = penalty["table"]
    lines = ["", "## Where denormals cost on this CPU", "",
             f"Measured {penalty['date']} (load {penalty['load']:.1f}), `adam_penalty()`: microseconds per call, one "
             "thread. `sqrt` of 65,536 float32 values; one Adam step (lr 3e-3) on a 256 x 256 weight with the given "
             "fraction of its moments denormal and their gradients tiny.", "",
             "| mode | sqrt normal | sqrt zero | sqrt denormal | " + " | ".join(
                 f"Adam step, {float(f):.0%} denormal" for f in t["adam"]["False"]) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(t["adam"]["False"])]
    for flush, label in (("False", "unflushed"), ("True", "flushed")):
        sq, ad = t["sqrt"][flush], t["adam"][flush]
        lines.append(f"| {label} | {sq['normal'] * 1e6:.0f} | {sq['zero'] * 1e6:.0f} | {sq['denormal'] * 1e6:.0f} | "
                     + " | ".join(f"{v * 1e6:.0f}" for v in ad.values()) + " |")
    return lines


def _cell(value: Any, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(data: Dict[str, Any], command: str) -> str:
    networks = {n: d for n, d in data.items() if n != PENALTY}
    if not networks:
        return "\n".join(["# The callback's cost over whole runs (issue 34)", *penalty_markdown(data[PENALTY])]) + "\n"
    first = next(iter(networks.values()))
    lines = [
        "# The callback's cost over whole runs (issue 34)", "",
        f"Command: `{command}`. Library: {'; '.join(sorted({d['library'] for d in networks.values()}))}. "
        f"{cpu_name()}, one thread, process CPU seconds; torch {first['versions']['torch']}, laplace-torch "
        f"{first['versions']['laplace']}. Dates and load per network below.", "",
        f"MNIST-5k, 4,000 train images (14x14), Adam 3e-3 constant, batch 32, {first['epochs']} epochs; every arm of a "
        "network in one process. `ratio`: the whole run over the same run without the callback (laplace-torch: over "
        "its own run without an estimate); `early`/`late`: mean training epoch over the first and the last "
        f"{EDGE}; `pass`: mean estimate (evidence pass and hyperparameter steps); `bound`: issue 34's "
        "`1 + pass/epoch x (estimates/epochs) + 0.15`; `vs peer`: CPU over laplace-torch's whole run with an "
        "estimate every epoch. `denormal tensors`: what ended holding denormal floats (weights, Adam moments).", "",
        "| network | arm | CPU s | ratio | bound | early s | late s | late / early | estimates | pass s | vs peer "
        "| test acc | denormal tensors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for network, d in networks.items():
        for arm, s in d["table"].items():
            if s.get("error"):
                lines.append(f"| {network} | {arm} | - | - | - | - | - | - | - | - | - | - | not run: {s['error'][:120]} |")
                continue
            dn = s.get("denormals") or {}
            shown = ", ".join(f"{k} ({v})" for k, v in sorted(dn.items(), key=lambda kv: -kv[1])[:3])
            shown += f", +{len(dn) - 3} more" if len(dn) > 3 else ""
            lines.append(
                f"| {network} | {arm} | {s['cpu']:.1f} | {_cell(s['ratio'])} | {_cell(s.get('bound'))} | "
                f"{_cell(s.get('early'))} | {_cell(s.get('late'))} | {_cell(s.get('late_over_early'))} | "
                f"{s.get('estimates', '-')} | {_cell(s.get('pass'))} | {_cell(s.get('vs_peer'))} | "
                f"{_cell(s['acc'], 4)} | {shown or ('none' if 'denormals' in s else '-')} |")
    lines += ["", "Measured: " + "; ".join(f"{n} {d['date']} (load {d['load']:.1f})" for n, d in networks.items()) + "."]
    lines += ["", "## Targets (issue 34)", "", "| network | late / early <= 1.3 (flushed arms) | defaults' ratio <= bound | "
              "defaults <= 0.6 x laplace-torch | Algorithm 1 (its settings) <= 0.6 x laplace-torch |", "|---|---|---|---|---|"]
    for network, d in networks.items():
        t = d["table"]
        flushed = {a: v["late_over_early"] for a, v in t.items() if "late_over_early" in v and "unflushed" not in a}
        worst = max(flushed, key=flushed.get) if flushed else None
        late = f"{'met' if flushed[worst] <= 1.3 else 'MISSED'} (worst {flushed[worst]:.2f}, {worst})" if worst else "-"
        d_row = t["defaults"]
        bound = (f"{'met' if d_row['ratio'] <= d_row['bound'] else 'MISSED'} ({d_row['ratio']:.2f} <= {d_row['bound']:.2f})"
                 if "bound" in d_row else "-")
        peers = [f"{'met' if t[a]['vs_peer'] <= 0.6 else 'MISSED'} ({t[a]['vs_peer']:.2f})" if "vs_peer" in t[a]
                 else "- (the peer did not run)" for a in ("defaults", "Algorithm 1")]
        lines.append(f"| {network} | {late} | {bound} | {peers[0]} | {peers[1]} |")
    if PENALTY in data:
        lines += penalty_markdown(data[PENALTY])
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", nargs="*", choices=NETWORKS, default=list(NETWORKS),
                        help="the networks to measure (none: only --penalty)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 300 images, 4 epochs, nothing written")
    parser.add_argument("--penalty", action="store_true", help="also measure adam_penalty() (seconds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = RESULTS / f"{NAME}.md"
    command = ("python benchmarks/whole_run.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    data: Dict[str, Any] = {PENALTY: adam_penalty()} if args.penalty else {}

    def save() -> None:  # read again first: processes measuring other networks share the file
        merged = {**read_data(path), **data}
        ordered = {n: merged[n] for n in (*NETWORKS, PENALTY) if n in merged}
        write_with_data(path, markdown(ordered, command) + "\n" + hand_written(path) + "\n", ordered)

    if args.penalty and not args.quick:
        save()
    for network in args.networks:
        data[network] = measure(network, args.quick)
        if not args.quick:  # after every network: a killed run keeps what it measured
            save()
    print(markdown({n: data[n] for n in (*NETWORKS, PENALTY) if n in data}, command))
    return data


if __name__ == "__main__":
    main()
