"""Learned hyperparameters that never make a network worse (issue 23, items 3 and 4), measured.

Cells: five image networks of ``benchmarks/_zoo.py`` (MLP, plain CNN, BatchNorm ResNet, Fixup
ResNet, GroupNorm CNN) on three image sets (MNIST-5k at 14x14, scikit-learn digits 8x8, ``bars``:
14x14 strokes on noise drawn by ``_zoo.draw_bars``), and the pre-LayerNorm transformer on its own
generated sequence task (``tokens``: does the bigram "1 2" occur; ``examples/transformer_tokens.py``),
which takes no images. Each cell is trained with seeds 0, 1, 2 (weights, batch order and the
validation split), ``N_TRAIN`` training and ``N_TEST`` test examples, Adam (lr 3e-3; Fixup 1e-2,
transformer 2e-3), batch 32, ``EPOCHS`` epochs, layerwise prior. Arms:

* ``defaults``: ``MargLikCallback()`` as the library ships it, from delta = 1, with
  ``MargLikCheckpoint(save_top_k=1)`` (its best checkpoint is evaluated from disk) and
  ``MargLikEarlyStopping()`` (its first stop is recorded, then undone, so the run goes on to the
  end and one run gives both);
* ``oracle``: delta fixed at each of 0.1, 1, 10 (no callback); the best mean test accuracy over
  seeds is the oracle (chosen on test);
* ``validation``: delta fixed at each of 0.01, 0.1, 1, 10, 100, trained on 80 % of the training
  data, chosen by the mean validation NLL over seeds at the last epoch, then retrained on all of it
  (the paper's cross-validation baseline); the same runs give the stock ``ModelCheckpoint`` on
  validation accuracy (the epoch of the best one) and ``EarlyStopping`` on validation loss
  (Lightning's default patience 3, min_delta 0: the epoch it stops at), derived from their per-epoch
  trace at the chosen delta.

Targets per cell (means over seeds): (0) the defaults' test accuracy at most 0.5 points below
delta = 1's (the untuned prior a user starts from: adding the callback must cost no accuracy);
(1) at most 0.5 points below the oracle's; (2) their test NLL no worse than the validation-tuned delta's; (3) no precision more than
e^8 above its start unless a warning names that tensor; (4) in the last third of training,
consecutive online estimates within 0.05 nats per datum.

Usage::

    python benchmarks/never_worse.py --plan            # the runs and their estimated CPU time, nothing trained
    python benchmarks/never_worse.py --phase baselines # fixed-delta and validation runs (independent of the default)
    python benchmarks/never_worse.py                   # everything not cached, then benchmarks/results/never_worse.md
    python benchmarks/never_worse.py --analyse         # the tables of the cached runs only
    python benchmarks/never_worse.py --analyse --defaults defaults_5c3d984 defaults_e1f4454  # one commit, then another
    python benchmarks/never_worse.py --quick           # smoke test: 2 cells, 1 seed, tiny data (seconds), prints only

Runs are cached in ``outputs/never_worse/runs/`` (one JSON each); the ``defaults`` runs in a folder
named by the library commit they were trained on, so the arm reruns on a new default.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _zoo  # noqa: E402
from _common import RESULTS, hand_written, now, write_with_data  # noqa: E402
from common import library_state  # noqa: E402  (examples/common.py, on the path through _zoo)

NAME = "never_worse"
IMAGE_NETWORKS = ("mlp", "cnn", "bn_resnet", "fixup_resnet", "gn_cnn")
IMAGE_DATA = ("mnist", "digits", "bars")
CELLS: Tuple[Tuple[str, str], ...] = tuple((n, d) for d in IMAGE_DATA for n in IMAGE_NETWORKS) + (("transformer", "tokens"),)
SEEDS = (0, 1, 2)
ORACLE = (0.1, 1.0, 10.0)
GRID = (0.01, 0.1, 1.0, 10.0, 100.0)
VALIDATION = 0.2
N_TRAIN, N_TEST, EPOCHS, BATCH = 500, 500, 12, 32
LR = {"fixup_resnet": 1e-2, "transformer": 2e-3}
PATIENCE = 3  # Lightning's EarlyStopping default, and MargLikEarlyStopping's
ACC_MARGIN, RUNAWAY, JUMP = 0.005, 8.0, 0.05
QUICK_CELLS = (("bn_resnet", "bars"), ("transformer", "tokens"))
# CPU seconds per run measured on this machine (N_TRAIN, EPOCHS) for --plan: fixed delta / defaults
ESTIMATE = {"mlp": (0.5, 3), "cnn": (1.5, 8), "bn_resnet": (3, 15), "fixup_resnet": (3, 16), "gn_cnn": (1.8, 8),
            "transformer": (4, 15)}


def base(network: str, dataset: str, seed: int, quick: bool) -> Dict[str, Any]:
    size = dict(n_train=200, n_test=200, epochs=3) if quick else dict(n_train=N_TRAIN, n_test=N_TEST, epochs=EPOCHS)
    return dict(network=network, dataset=dataset, seed=seed, batch_size=BATCH, lr=LR.get(network, 3e-3), **size)


def baseline_specs(network: str, dataset: str, seed: int, quick: bool) -> Dict[str, _zoo.RunSpec]:
    b = base(network, dataset, seed, quick)
    out = {f"oracle {d:g}": _zoo.RunSpec(precision=d, **b) for d in ORACLE}
    out.update({f"validation {d:g}": _zoo.RunSpec(precision=d, validation=VALIDATION, **b) for d in GRID})
    return out


def retrain_spec(network: str, dataset: str, seed: int, quick: bool, delta: float) -> _zoo.RunSpec:
    return _zoo.RunSpec(precision=delta, **base(network, dataset, seed, quick))


# the callback's defaults before commits 5c3d984 / dcf714b made biases decoupled and max_step 1 the defaults
PREVIOUS: Dict[str, Any] = {"biases": "learn", "max_step": None}


def defaults_spec(network: str, dataset: str, seed: int, quick: bool, previous: bool = False) -> _zoo.RunSpec:
    return _zoo.RunSpec(callback=dict(PREVIOUS) if previous else {}, checkpoint=True, stopping=PATIENCE,
                        **base(network, dataset, seed, quick))


def defaults_cache(cache: str, previous: bool = False) -> str:
    """The defaults runs' folder, named by the library commit this process imported."""
    state = library_state()
    tag = state.split()[1] if state.startswith("HEAD ") else "unknown"
    kind = "previous_defaults" if previous else "defaults"
    return os.path.join(cache, f"{kind}_{tag}{'_dirty' if 'uncommitted' in state else ''}")


def plan(cells: Sequence[Tuple[str, str]], seeds: Sequence[int]) -> str:
    fixed = sum(ESTIMATE[n][0] * (len(ORACLE) + (1 - VALIDATION) * len(GRID) + 0.4) for n, _ in cells) * len(seeds)
    callback = sum(ESTIMATE[n][1] for n, _ in cells) * len(seeds)
    runs = len(cells) * len(seeds) * (len(ORACLE) + len(GRID) + 1)
    return (f"{len(cells)} cells x {len(seeds)} seeds: about {runs} runs (+ a retrain where the validation choice is "
            f"outside {ORACLE}); estimated CPU: baselines {fixed / 60:.1f} min, defaults {callback / 60:.1f} min "
            f"(digits 8x8 cost less than estimated)")


# --- what each rule chooses -----------------------------------------------------------------------


def model_checkpoint_epoch(trace: List[Dict[str, Any]]) -> int:
    """Lightning's ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=1): the first epoch of the best."""
    best, epoch = -math.inf, trace[0]["epoch"]
    for row in trace:
        if row["val_acc"] > best:
            best, epoch = row["val_acc"], row["epoch"]
    return epoch


def early_stopping_epoch(trace: List[Dict[str, Any]], patience: int = PATIENCE) -> Optional[int]:
    """Lightning's EarlyStopping(monitor="val_loss", patience) at min_delta 0: the epoch it stops after (None: never)."""
    best, wait = math.inf, 0
    for row in trace:
        if row["val_nll"] < best:
            best, wait = row["val_nll"], 0
        else:
            wait += 1
            if wait >= patience:
                return row["epoch"]
    return None


def at_epoch(run: Dict[str, Any], epoch: Optional[int]) -> Dict[str, float]:
    row = run["trace"][-1] if epoch is None else next(r for r in run["trace"] if r["epoch"] == epoch)
    return {"acc": row["test_acc"], "nll": row["test_nll"], "epoch": row["epoch"]}


def runaway(run: Dict[str, Any]) -> Tuple[List[str], List[str], Tuple[float, str]]:
    """Tensors more than e^8 above their start (not named by a warning, named by one) and the largest rise."""
    start = math.log(run["spec"]["precision"])
    rises: Dict[str, float] = {}
    for row in run["trace"]:
        for name, value in zip(run["param_names"], row["log_delta"]):
            rises[name] = max(rises.get(name, -math.inf), value - start)
    above = [n for n, r in rises.items() if r > RUNAWAY]
    warned = [n for n in above if any(n in w for w in run["warnings"])]
    worst = max(((r, n) for n, r in rises.items()), default=(0.0, "-"))
    return [n for n in above if n not in warned], warned, worst


def weight_decay_rise(run: Dict[str, Any]) -> Tuple[float, str]:
    """The largest rise of a log precision the MAP loss used (below the evidence's for decoupled tensors)."""
    start = math.log(run["spec"]["precision"])
    return max(((v - start, n) for row in run["trace"] for n, v in zip(run["param_names"], row["wd_log_delta"])),
               default=(0.0, "-"))


def last_third_jump(run: Dict[str, Any]) -> float:
    values = [r["marglik"] for r in run["trace"] if "marglik" in r and r["epoch"] > 2 * run["spec"]["epochs"] / 3]
    return max((abs(b - a) for a, b in zip(values, values[1:])), default=math.nan)


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def analyse_cell(oracle: Dict[float, List[Dict]], grid: Dict[float, List[Dict]], retrain: List[Dict],
                 chosen: float, defaults: List[Dict]) -> Dict[str, Any]:
    """Everything a cell's row shows; ``defaults`` may be empty (not trained yet)."""
    oracle_acc = {d: mean([r["final"]["acc"] for r in runs]) for d, runs in oracle.items()}
    best = max(oracle_acc, key=oracle_acc.get)
    cell: Dict[str, Any] = {
        "oracle_delta": best, "oracle_acc": oracle_acc[best],
        "oracle_nll": mean([r["final"]["nll"] for r in oracle[best]]),
        "oracle_accs": oracle_acc, "val_delta": chosen,
        "val_nll_by_delta": {d: mean([r["trace"][-1]["val_nll"] for r in runs]) for d, runs in grid.items()},
        "val_acc": mean([r["final"]["acc"] for r in retrain]), "val_nll": mean([r["final"]["nll"] for r in retrain]),
    }
    at_chosen = grid[chosen]
    mc = [at_epoch(r, model_checkpoint_epoch(r["trace"])) for r in at_chosen]
    es = [at_epoch(r, early_stopping_epoch(r["trace"])) for r in at_chosen]
    cell["model_checkpoint"] = {k: mean([m[k] for m in mc]) for k in ("acc", "nll")}
    cell["model_checkpoint"]["epochs"] = [m["epoch"] for m in mc]
    cell["early_stopping"] = {k: mean([m[k] for m in es]) for k in ("acc", "nll")}
    cell["early_stopping"]["epochs"] = [early_stopping_epoch(r["trace"]) for r in at_chosen]
    cell["grid_final_80"] = {k: mean([r["final"][k] for r in at_chosen]) for k in ("acc", "nll")}
    if not defaults:
        return cell
    unwarned, warned, worst = zip(*(runaway(r) for r in defaults))
    jumps = [last_third_jump(r) for r in defaults]
    d = {
        "seeds": [r["spec"]["seed"] for r in defaults], "acc": mean([r["final"]["acc"] for r in defaults]),
        "nll": mean([r["final"]["nll"] for r in defaults]), "unwarned": sorted({n for u in unwarned for n in u}),
        "warned": sorted({n for w in warned for n in w}), "worst": max(worst),
        "worst_wd": max(weight_decay_rise(r) for r in defaults),
        "jump_mean": mean(jumps), "jump_max": max((j for j in jumps if math.isfinite(j)), default=math.nan),
        "libraries": sorted({r["library"] for r in defaults}),
        "cpu": mean([r["cpu_seconds"] for r in defaults]),
        "cpu_fixed": mean([r["cpu_seconds"] for r in oracle[1.0]]),
        "checkpoint": {k: mean([r["checkpoint"][k] for r in defaults if "checkpoint" in r]) for k in ("acc", "nll")},
        "checkpoint_epochs": [r.get("checkpoint", {}).get("epoch") for r in defaults],
        "stop_epochs": [r.get("stop", {}).get("epoch") for r in defaults],
    }
    d["stopped"] = {k: mean([at_epoch(r, r.get("stop", {}).get("epoch"))[k] for r in defaults]) for k in ("acc", "nll")}
    d["targets"] = {
        "accuracy": d["acc"] >= cell["oracle_acc"] - ACC_MARGIN,
        # the product's promise: adding the callback costs no accuracy against the untuned delta = 1
        "untuned": d["acc"] >= cell["oracle_accs"][1.0] - ACC_MARGIN,
        "nll": d["nll"] <= cell["val_nll"],
        "precision": not d["unwarned"],
        # None: fewer than two estimates in the last third (nothing to compare)
        "stability": None if not math.isfinite(d["jump_mean"]) else d["jump_mean"] <= JUMP,
    }
    cell["defaults"] = d
    return cell


# --- driver ---------------------------------------------------------------------------------------


def _get(spec: _zoo.RunSpec, folder: str, train: bool) -> Optional[Dict[str, Any]]:
    """The cached run of ``spec`` in ``folder``; trained there first if ``train`` (None if neither)."""
    if not train and not os.path.exists(_zoo.run_path(spec, folder)):
        return None
    return _zoo.cached(spec, folder, log=lambda m: print(f"{m} [{time.strftime('%H:%M:%S')}]", flush=True))


def train_all(cells: Sequence[Tuple[str, str]], seeds: Sequence[int], quick: bool, phases: Sequence[str],
              cache: str, previous: bool = False) -> None:
    """Train the asked phases seed by seed (so a cut run has every cell for the first seeds); the defaults
    into the folder of the library commit this process imported (``previous``: with ``PREVIOUS``, the
    callback's defaults before the remedies, into a ``previous_defaults_`` folder)."""
    for stage in ("baselines", "defaults"):
        if stage not in phases:
            continue
        for seed in seeds:
            for network, dataset in cells:
                if stage == "baselines":
                    for spec in baseline_specs(network, dataset, seed, quick).values():
                        _get(spec, cache, True)
                else:
                    _get(defaults_spec(network, dataset, seed, quick, previous), defaults_cache(cache, previous), True)


def analyse_all(cells: Sequence[Tuple[str, str]], seeds: Sequence[int], quick: bool, cache: str,
                defaults_folder: str, retrain: bool) -> Dict[str, Any]:
    """Every cell whose baselines are complete for some seeds, with the defaults runs found in
    ``defaults_folder``; ``retrain``: train the retrain on all data at the validation choice where missing."""
    out: Dict[str, Any] = {}
    for network, dataset in cells:
        got = {seed: {k: _get(s, cache, False) for k, s in baseline_specs(network, dataset, seed, quick).items()}
               for seed in seeds}
        complete = [s for s in seeds if all(v is not None for v in got[s].values())]
        if not complete:
            continue
        oracle = {d: [got[s][f"oracle {d:g}"] for s in complete] for d in ORACLE}
        grid = {d: [got[s][f"validation {d:g}"] for s in complete] for d in GRID}
        val_nll = {d: mean([r["trace"][-1]["val_nll"] for r in runs]) for d, runs in grid.items()}
        chosen = min(val_nll, key=val_nll.get)
        retrained = [r for r in (_get(retrain_spec(network, dataset, s, quick, chosen), cache, retrain) for s in complete)
                     if r is not None]
        if len(retrained) < len(complete):
            continue
        previous = os.path.basename(defaults_folder).startswith("previous_")
        defaults = [r for r in (_get(defaults_spec(network, dataset, s, quick, previous), defaults_folder, False)
                                for s in complete) if r is not None]
        cell = analyse_cell(oracle, grid, retrained, chosen, defaults)
        cell["seeds"] = complete
        out[f"{network} / {dataset}"] = cell
    return out


def _pass(flag: Optional[bool]) -> str:
    return "n/a" if flag is None else "PASS" if flag else "MISS"


def targets_table(cells: Dict[str, Any]) -> List[str]:
    """The targets of every cell, PASS / MISS / n/a, and how many passed."""
    lines = [
        "| cell | seeds | defaults acc | oracle acc (delta) | (1) acc >= oracle - 0.5 pt | delta=1 acc | (0) acc >= delta=1 "
        "- 0.5 pt | defaults NLL | val-tuned NLL (delta) | (2) NLL <= val-tuned | largest log delta rise (tensor) | "
        "largest weight-decay rise | (3) > e^8 unwarned | (3) | (4) mean / max last-third jump | (4) | CPU defaults / fixed |",
        "|---|---|---:|---|---|---:|---|---:|---|---|---|---|---|---|---|---|---|",
    ]
    counts = {k: [0, 0] for k in ("untuned", "accuracy", "nll", "precision", "stability")}
    for name, c in cells.items():
        d = c.get("defaults")
        if d is None:
            lines.append(f"| {name} | {c['seeds']} | (not trained) | {c['oracle_acc']:.4f} ({c['oracle_delta']:g}) | | "
                         f"{c['oracle_accs'][1.0]:.4f} | | | {c['val_nll']:.4f} ({c['val_delta']:g}) | | | | | | | | |")
            continue
        t = d["targets"]
        for k, v in t.items():
            if v is not None:
                counts[k][0] += v
                counts[k][1] += 1
        lines.append(
            f"| {name} | {', '.join(map(str, d['seeds']))} | {d['acc']:.4f} | {c['oracle_acc']:.4f} ({c['oracle_delta']:g}) | "
            f"{_pass(t['accuracy'])} ({100 * (d['acc'] - c['oracle_acc']):+.1f}) | {c['oracle_accs'][1.0]:.4f} | "
            f"{_pass(t.get('untuned'))} ({100 * (d['acc'] - c['oracle_accs'][1.0]):+.1f}) | {d['nll']:.4f} | "
            f"{c['val_nll']:.4f} ({c['val_delta']:g}) | {_pass(t['nll'])} | {d['worst'][0]:.1f} ({d['worst'][1]}) | "
            f"{d['worst_wd'][0]:.1f} ({d['worst_wd'][1]}) | "
            f"{', '.join(d['unwarned']) or '-'} | {_pass(t['precision'])} | {d['jump_mean']:.3f} / {d['jump_max']:.3f} | "
            f"{_pass(t['stability'])} | {d['cpu']:.0f} / {d['cpu_fixed']:.0f} |")
    lines += ["", "Passed: " + "; ".join(f"({i}) {k} {p}/{n}" for i, (k, (p, n)) in enumerate(counts.items())), ""]
    return lines


def markdown(cells: Dict[str, Any], command: str, seconds: float, quick: bool,
             others: Optional[Dict[str, Dict[str, Any]]] = None) -> str:
    """The results file: targets and item 4 for ``cells``; the targets of ``others`` (defaults runs of other
    library commits, by folder name) after them."""
    libs = sorted({lib for c in cells.values() for lib in c.get("defaults", {}).get("libraries", [])})
    size = "200 / 200, 3 epochs (quick)" if quick else f"{N_TRAIN} train / {N_TEST} test, {EPOCHS} epochs"
    lines = [
        "# Never worse: the learned prior against a tuned one, and checkpointing without validation (issue 23, items 3-4)",
        "", f"Date: {now()}. Defaults arm trained on library {'; '.join(libs) or '(not yet trained)'}; this process "
        f"imported {library_state()}. Command: `{command}`; {seconds / 60:.1f} min wall for this invocation (cached "
        "runs are not retrained); one CPU thread on a shared 2-core machine.", "",
        f"Data: {size} per cell (digits: of its 1797 images; bars: drawn, 6 classes; tokens: the transformer's own "
        f"generated sequence task, 2 classes), Adam batch {BATCH} (lr 3e-3; Fixup 1e-2; transformer 2e-3), "
        "layerwise prior from delta = 1. Every number is a mean over the seeds listed. `oracle`: the best of "
        f"delta {ORACLE} by mean test accuracy; `val-tuned`: the delta of {GRID} with the best mean validation NLL "
        f"(last epoch, {VALIDATION:.0%} of the training data held out), retrained on all of it.", "",
        "## Targets", "",
    ]
    lines += targets_table(cells)
    lines += [
        "## Checkpointing and stopping without validation data (item 4)", "",
        "Test accuracy / NLL of the weights each rule keeps. `MargLikCheckpoint` and `MargLikEarlyStopping`: the "
        "defaults run on all training data (the checkpoint read back from disk; the weights at the stop epoch). "
        "`ModelCheckpoint(val_acc)` and `EarlyStopping(val_loss, patience 3)`: the validation run at the val-tuned "
        f"delta, trained on {1 - VALIDATION:.0%} of the data (derived from its per-epoch trace). Epochs per seed "
        "(`-`: never stopped).", "",
        "| cell | defaults final | MargLikCheckpoint (epochs) | MargLikEarlyStopping (stop epochs) | val-delta final (80 %) | "
        "ModelCheckpoint val acc (epochs) | EarlyStopping val loss (stop epochs) |",
        "|---|---|---|---|---|---|---|",
    ]

    def pair(m: Dict[str, float]) -> str:
        return f"{m['acc']:.4f} / {m['nll']:.4f}"

    def epochs(values: Sequence[Optional[int]]) -> str:
        return ", ".join("-" if e is None else str(e) for e in values)

    for name, c in cells.items():
        d = c.get("defaults")
        left = ("(not trained) | | |" if d is None else
                f"{d['acc']:.4f} / {d['nll']:.4f} | {pair(d['checkpoint'])} ({epochs(d['checkpoint_epochs'])}) | "
                f"{pair(d['stopped'])} ({epochs(d['stop_epochs'])}) |")
        lines.append(f"| {name} | {left} {pair(c['grid_final_80'])} | {pair(c['model_checkpoint'])} "
                     f"({epochs(c['model_checkpoint']['epochs'])}) | {pair(c['early_stopping'])} "
                     f"({epochs(c['early_stopping']['epochs'])}) |")
    lines += ["", "## Baselines per delta", "",
              "| cell | oracle: mean test acc at " + ", ".join(f"{d:g}" for d in ORACLE) +
              " | validation: mean val NLL at " + ", ".join(f"{d:g}" for d in GRID) + " |", "|---|---|---|"]
    for name, c in cells.items():
        accs = ", ".join(f"{c['oracle_accs'][d]:.4f}" for d in ORACLE)
        nlls = ", ".join(f"{c['val_nll_by_delta'][d]:.4f}" for d in GRID)
        lines.append(f"| {name} | {accs} | {nlls} |")
    for folder, other in (others or {}).items():
        libs = sorted({lib for c in other.values() for lib in c.get("defaults", {}).get("libraries", [])})
        what = f"MargLikCallback(**{PREVIOUS})" if folder.startswith("previous_") else "the defaults"
        lines += ["", f"## Targets of {what} on {'; '.join(libs) or folder} ({folder})", ""]
        lines += targets_table(other)
    warned = {name: c["defaults"]["warned"] for name, c in cells.items() if c.get("defaults", {}).get("warned")}
    if warned:
        lines += ["", "Tensors above e^8 that a warning named: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in warned.items())]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 cells, 1 seed, 200 examples, 3 epochs")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--phase", choices=("baselines", "defaults"), nargs="+", default=["baselines", "defaults"])
    parser.add_argument("--cells", nargs="+", help="only these cells, as network/dataset (e.g. mlp/digits)")
    parser.add_argument("--analyse", action="store_true", help="train nothing: the tables of the cached runs")
    parser.add_argument("--plan", action="store_true", help="print the runs and their estimated CPU time")
    parser.add_argument("--previous", action="store_true",
                        help=f"train the defaults arm with the callback's defaults before the remedies ({PREVIOUS})")
    parser.add_argument("--defaults", nargs="+", metavar="FOLDER",
                        help="the defaults runs to report, by folder under the cache (e.g. defaults_5c3d984): the "
                             "first in full, the others' targets after it (default: this process's commit)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cells = list(QUICK_CELLS if args.quick else CELLS)
    if args.cells:
        wanted = {tuple(c.split("/")) for c in args.cells}
        unknown = wanted - set(CELLS)
        if unknown:
            parser.error(f"unknown cells {sorted('/'.join(c) for c in unknown)}; choose from "
                         f"{', '.join('/'.join(c) for c in CELLS)}")
        cells = [c for c in cells if c in wanted]
    seeds = args.seeds[:1] if args.quick else args.seeds
    if args.plan:
        print(plan(cells, seeds))
        return {}
    cache = os.path.join(_zoo.output_dir(NAME), "quick" if args.quick else "runs")
    start = time.perf_counter()
    if not args.analyse:
        train_all(cells, seeds, args.quick, args.phase, cache, args.previous)
    folders = [os.path.join(cache, f) for f in args.defaults] if args.defaults else [defaults_cache(cache)]
    missing = [f for f in folders if not os.path.isdir(f)]
    if missing and args.defaults:
        parser.error(f"no defaults runs in {missing}; the folders are {sorted(os.listdir(cache))}")
    retrain = not args.analyse and "baselines" in args.phase
    out = analyse_all(cells, seeds, args.quick, cache, folders[0], retrain)
    others = {os.path.basename(f): analyse_all(cells, seeds, args.quick, cache, f, False) for f in folders[1:]}
    command = "python benchmarks/never_worse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(out, command.strip(), time.perf_counter() - start, args.quick, others)
    print(text)
    if not args.quick:
        path = RESULTS / f"{NAME}.md"
        write_with_data(path, text + "\n" + hand_written(path) + "\n", {"cells": out, "others": others})
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
