"""The callback and the evidence engine on a CUDA device: correctness checks and speed.

    python benchmarks/gpu.py                       # on a machine with CUDA: writes benchmarks/results/gpu.md (< 5 min)
    python benchmarks/gpu.py --device cpu --quick  # smoke test of the script on CPU (tiny sizes, prints only)
    python benchmarks/gpu.py --real-sizes full     # on CUDA: part 4 alone at issue 54's sizes (written per model)
    python benchmarks/gpu.py --real-sizes small --device cpu   # part 4 on the CPU at a small size (~5 min)

The device run of part 4: one prepared command (``run`` with ``timeout_s=590``; a lent machine gives at most 10
minutes a call and 15 in all, start-up included). The results file is written after each model, so a run cut
short by ``timeout`` keeps the models it measured; a second call with ``--models`` and the models left measures
the rest, once the returned ``gpu.md`` is back in ``benchmarks/results/``::

    LIGHTNING_MARGLIK_COMMIT="HEAD <commit> (working tree sent to the device)" timeout 540 \
        python3 benchmarks/gpu.py --real-sizes full; cp benchmarks/results/gpu.md "$OUT"/

Without CUDA (and without ``--device cpu``) it prints ``skipped: no CUDA`` and exits 0.

Checks (each reported as passed / FAILED with the reason; the exit status is 1 if any failed):

1. ``MargLikCallback`` in a 2-epoch ``Trainer`` fit on the device (a classifier with
   ``CategoricalLikelihood`` and a regressor with a learned-noise ``GaussianLikelihood``, kron-ggn
   and diag-ef): the hyperparameter buffers and the cached statistics of ``callback.evidence``
   (every structure's declared states, the likelihood statistics) are on the device, and the
   evidence is finite.
2. ``LaplaceEvidence.fit(...).log_marglik()`` of a float64 model on the device equals the same on
   CPU (float64) to 1e-6 relative, for diag / kron / full x ggn / ef on an MLP, and diag / kron on
   a CNN and the ResNet of ``benchmarks/engine.py`` (exact GGN and EF: no random draws). The same
   models in float32 on the device are compared with the CPU float64 value for information
   (float32 forward and backward passes, and TF32 if enabled, limit the agreement).
3. Speed: one evidence pass / one plain training epoch (wall time with ``torch.cuda.synchronize``)
   for the engine benchmark's MLP (N=10,000), CNN (N=5,000) and ResNet (N=3,000): diag-ef,
   kron-ggn MC (1 sample), kron-ggn exact; median of 3.
4. Real sizes (issue 54; ``--real-sizes small|full``, alone): ResNet-18 on 32x32 generated images (N = 50,000 at
   full size), a ViT-tiny and GPT-2 small with LoRA and the 50,257-token vocabulary, each trained one epoch
   without and one with ``MargLikCallback()`` at its defaults: the plain epoch, one estimate in epochs, the
   whole-run ratio at F = 10, peak memory with and without the callback, and ``"auto"``'s exact-against-sampled
   crossover. What and how: ``benchmarks/_real_sizes.py``.
"""
from __future__ import annotations

import argparse
import copy
import logging
import math
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from _common import RESULTS, cpu_name, hand_written, now, read_data, write_with_data  # noqa: E402
from common import library_state  # noqa: E402

OUTPUT = RESULTS / "gpu.md"
TOLERANCE = 1e-6
SPEED_METHODS = [("diag-ef", "diag", "ef", 0), ("kron-ggn MC (1 sample)", "kron", "ggn", 1), ("kron-ggn exact", "kron", "ggn", 0)]


class Result:
    def __init__(self) -> None:
        self.checks: List[Tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"[{'passed' if ok else 'FAILED'}] {name}: {detail}", flush=True)

    def guarded(self, name: str, fn: Callable[[], Tuple[bool, str]]) -> None:
        try:
            ok, detail = fn()
        except Exception as err:  # noqa: BLE001  (a failed check is reported, the others still run)
            last = traceback.extract_tb(err.__traceback__)[-1]
            ok, detail = False, f"raised {type(err).__name__}: {' '.join(str(err).split())[:300]} " \
                                f"(at {Path(last.filename).name}:{last.lineno})"
        self.add(name, ok, detail)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. the callback on the device ------------------------------------------------------------


def callback_check(device: torch.device, kind: str, structure: str, approx: str) -> Tuple[bool, str]:
    import pytorch_lightning as pl

    from lightning_marglik import (CategoricalLikelihood, GaussianLikelihood, GaussianPrior, MargLikCallback,
                                   map_loss)

    torch.manual_seed(0)
    n = 256
    x = torch.randn(n, 8)
    if kind == "classification":
        y = (x[:, :3] @ torch.randn(3, 3)).argmax(1)
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
        likelihood: nn.Module = CategoricalLikelihood()
    else:
        y = torch.sin(x[:, :2]) + 0.1 * torch.randn(n, 2)
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        likelihood = GaussianLikelihood(sigma=1.0)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.prior, self.likelihood = net, GaussianPrior(net), likelihood

        def forward(self, inputs):
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior, n)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=1e-2)

    class Devices(pl.Callback):
        """Where the hyperparameter buffers are when training ends: Lightning's teardown then moves the module
        back to the CPU, so after ``fit`` they are on the CPU wherever they trained."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: Module) -> None:
            self.devices = {"prior.log_precision": pl_module.prior.log_precision.device,
                            **{f"likelihood.{k}": v.device for k, v in pl_module.likelihood.hyperparameters().items()}}

    module, devices = Module(), Devices()
    callback = MargLikCallback(structure=structure, approx=approx, frequency=1, steps=5, lr=0.1)
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    trainer = pl.Trainer(max_epochs=2, callbacks=[callback, devices], accelerator=accelerator, devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
    problems = []
    buffers = devices.devices
    for name, where in buffers.items():
        if where.type != device.type:
            problems.append(f"{name} on {where} during training")
    evidence = callback.evidence
    if evidence is None:
        return False, "the callback made no estimate"
    states = {f"structure {i} ({type(s).__name__}).{k}": v
              for i, s in enumerate(evidence.structures) for k, v in s.states().items()}
    states.update({f"likelihood statistic {k}": v for k, v in evidence._lik_stats.items()})
    off = sorted({f"{k} on {v.device}" for k, v in states.items() if v.device.type != device.type})
    if off:
        problems.append(f"{len(off)} of {len(states)} statistics not on {device.type}, e.g. " + "; ".join(off[:3]))
    if not math.isfinite(callback.last_marglik):
        problems.append(f"marglik {callback.last_marglik}")
    if problems:
        return False, "; ".join(problems)
    return True, (f"marglik {callback.last_marglik:.4f}; {len(buffers)} hyperparameter buffer(s) and {len(states)} "
                  f"statistics on {device}")


# --- 2. the evidence on the device equals CPU float64 -------------------------------------------


def problem(name: str, quick: bool, n: int) -> Tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, inputs, targets): the engine benchmark's models, or ``small`` (an MLP 20-32-10, tanh,
    whose P x P curvature fits the ``full`` structure)."""
    if name == "small":
        torch.manual_seed(0)
        x = torch.randn(n, 20)
        return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10)), x, torch.randint(0, 10, (n,))
    from engine import make_problem

    model, data, _ = make_problem(name, n, 256, seed=0, quick=quick)
    return model, torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])


def evidence_value(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, dtype: torch.dtype,
                   structure: str, approx: str, mc: int = 0) -> float:
    from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

    net = copy.deepcopy(model).to(device=device, dtype=dtype)
    prior, lik = GaussianPrior(net).to(device), CategoricalLikelihood().to(device)
    if x.is_floating_point():
        x = x.to(dtype)
    loader = DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=128)
    gen = torch.Generator().manual_seed(0) if mc else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LaplaceEvidence.fit(net, loader, lik, prior, structure, approx, mc, generator=gen).log_marglik().item()


def equality_checks(result: Result, device: torch.device, quick: bool) -> List[Dict[str, Any]]:
    cases = [("small", s, a) for s in ("diag", "kron", "full") for a in ("ggn", "ef")]
    cases += [(m, s, a) for m in ("mlp", "cnn", "resnet", "transformer") for s in ("diag", "kron") for a in ("ggn", "ef")]
    rows = []
    for name, structure, approx in cases:
        model, x, y = problem(name, quick, 64 if quick else 256)
        label = f"{name} {structure}-{approx}"
        row: Dict[str, Any] = {"case": label}

        def check() -> Tuple[bool, str]:
            reference = evidence_value(model, x, y, torch.device("cpu"), torch.float64, structure, approx)
            on_device = evidence_value(model, x, y, device, torch.float64, structure, approx)
            rel = abs(on_device - reference) / abs(reference)
            row.update(reference=reference, float64=on_device, rel64=rel)
            try:
                f32 = evidence_value(model, x, y, device, torch.float32, structure, approx)
                row.update(float32=f32, rel32=abs(f32 - reference) / abs(reference))
            except Exception as err:  # noqa: BLE001
                row.update(float32=math.nan, rel32=math.nan, error32=f"{type(err).__name__}: {err}"[:200])
            return rel <= TOLERANCE, f"log evidence CPU float64 {reference:.6f}, {device} float64 {on_device:.6f} " \
                                     f"(rel. {rel:.1e}); {device} float32 rel. {row['rel32']:.1e}"

        result.guarded(f"evidence {label} on {device} (float64) = CPU float64", check)
        rows.append(row)
    return rows


# --- 3. speed -----------------------------------------------------------------------------------


def speed(device: torch.device, quick: bool, reps: int) -> List[Dict[str, Any]]:
    from engine import QUICK_SIZES, SIZES, make_problem

    from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

    rows = []
    for name in ("mlp", "cnn", "resnet"):
        n = QUICK_SIZES[name] if quick else SIZES[name]
        model, data, _ = make_problem(name, n, 64 if quick else 256, seed=0, quick=quick)
        x = torch.cat([b[0] for b in data]).to(device)
        y = torch.cat([b[1] for b in data]).to(device)
        model = model.to(device)
        batch = 64 if quick else 256
        batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
        train = copy.deepcopy(model)
        opt = torch.optim.SGD(train.parameters(), lr=1e-3)

        def epoch() -> None:
            train.train()
            for xb, yb in batches:
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(train(xb), yb).backward()
                opt.step()

        def wall(fn: Callable[[], Any]) -> float:
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            return time.perf_counter() - start

        prior, lik = GaussianPrior(model).to(device), CategoricalLikelihood().to(device)
        methods = {}
        for label, structure, approx, mc in SPEED_METHODS:
            methods[label] = (lambda s=structure, a=approx, m=mc: LaplaceEvidence.fit(
                model, batches, lik, prior, s, a, m, generator=torch.Generator().manual_seed(0)))
        wall(epoch)  # warm-up (kernels, allocator)
        for fn in methods.values():
            try:
                wall(fn)
            except Exception:  # noqa: BLE001  (reported in the timed loop)
                pass
        epochs = [wall(epoch) for _ in range(reps)]
        row: Dict[str, Any] = {"model": name, "n": n, "epoch": statistics.median(epochs)}
        for label, fn in methods.items():
            try:
                times = [wall(fn) for _ in range(reps)]
                row[label] = statistics.median(times)
            except Exception as err:  # noqa: BLE001
                row[label] = f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
        rows.append(row)
        print(f"speed {name}: epoch {row['epoch']:.3f}s; " + "; ".join(
            f"{k} {v:.3f}s ({v / row['epoch']:.2f}x)" if isinstance(v, float) else f"{k} {v}"
            for k, v in row.items() if k in methods), flush=True)
    return rows


# --- report and main ------------------------------------------------------------------------------


def report(result: Result, equality: List[Dict[str, Any]], speeds: List[Dict[str, Any]], device: torch.device,
           quick: bool, seconds: float, reps: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tf32 = torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None
    lines = [
        "# The callback and the evidence engine on a GPU",
        "",
        f"- {now()}; command: `python benchmarks/gpu.py{' --device ' + str(device.type) if device.type != 'cuda' else ''}"
        f"{' --quick' if quick else ''}`; run time {seconds:.0f} s",
        f"- library: {library_state()}; device: {device} ({name}); torch {torch.__version__}"
        + (f", CUDA {torch.version.cuda}; TF32 matmul allowed: {tf32}" if device.type == "cuda" else ""),
        "",
        "## Checks",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for check, ok, detail in result.checks:
        lines.append(f"| {check} | {'passed' if ok else '**FAILED**'} | {detail.replace('|', '/')} |")
    lines += [
        "",
        f"Evidence values (log q(D|M), float64 model unless noted; tolerance {TOLERANCE:g} relative):",
        "",
        "| case | CPU float64 | device float64 | rel. diff. | device float32 | rel. diff. to CPU float64 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in equality:
        if "reference" not in row:
            lines.append(f"| {row['case']} | — | — | — | — | — |")
            continue
        lines.append(f"| {row['case']} | {row['reference']:.6f} | {row['float64']:.6f} | {row['rel64']:.1e} | "
                     f"{row['float32']:.6f} | {row['rel32']:.1e} |")
    lines += [
        "",
        f"## Evidence pass / one plain training epoch on the device (wall time, synchronized, median of {reps})",
        "",
        "| model | N | epoch s | " + " | ".join(label for label, *_ in SPEED_METHODS) + " |",
        "|---|---:|---:|" + "---:|" * len(SPEED_METHODS),
    ]
    for row in speeds:
        cells = []
        for label, *_ in SPEED_METHODS:
            v = row.get(label)
            cells.append(f"{v:.3f} s (**{v / row['epoch']:.2f}**)" if isinstance(v, float) else f"failed: {v}")
        lines.append(f"| {row['model']} | {row['n']:,} | {row['epoch']:.3f} | " + " | ".join(cells) + " |")
    failed = [c for c in result.checks if not c[1]]
    lines += ["", f"{len(result.checks) - len(failed)} of {len(result.checks)} checks passed.", ""]
    return "\n".join(lines)


# --- 4. real sizes, and the results file ------------------------------------------------------------


def write_results(path: Path, data: Dict[str, Any]) -> None:
    """The checks' report (parts 1-3), then part 4's runs, then the hand-written reading, then the data."""
    text = data.get("checks", "").rstrip() + "\n\n" + "\n".join(real_sizes_markdown(data.get("real_sizes", {})))
    write_with_data(path, text.rstrip() + "\n\n" + hand_written(path) + "\n", data)


def results_data(path: Path) -> Dict[str, Any]:
    """The results file's data; a file written before it carried data is all the checks' report."""
    data = read_data(path)
    if not data and path.exists():
        data["checks"] = path.read_text()
    return data


def _estimator(reason: str) -> str:
    """The estimator's record, short: which GGN, and whether a head's output-side factor is held as its diagonal."""
    short = reason.split(" as the exact GGN would")[0].split("; kron:")[0]
    return short + ("; diag(G) of the head" if "kron: the diagonal of the output-side" in reason else "")


def _f(value: float, digits: int = 2) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def real_sizes_markdown(runs: Dict[str, Dict[str, Any]]) -> List[str]:
    from lightning_marglik.curvature.estimator import EXACT_COLUMNS

    from _real_sizes import FREQUENCY, TARGET

    if not runs:
        return []
    lines = ["## The callback at real sizes (issue 54)", "",
             "One epoch without and one with `MargLikCallback()` at its defaults (`benchmarks/_real_sizes.py`). "
             f"`whole run`: `({FREQUENCY} x epoch with the callback + estimate) / ({FREQUENCY} x plain epoch)`, a run "
             f"at the default frequency F = {FREQUENCY}; issue 54's target is at most {TARGET}x on the GPU. Peak memory: "
             "the fit's largest phase peak (set-up, training epoch, estimate), with the callback over without."]
    for key, run in runs.items():
        lines += ["", f"### {key}", "",
                  f"{run['date']}; command `{run['command']}`; library {run['library']}; torch {run['torch']}; "
                  f"{run['meter']}.", "",
                  "| model | N | parameters (learnable) | plain epoch s | epoch with callback s | one estimate s "
                  "(in plain epochs) | whole run / plain | peak MiB plain / default (ratio) | estimator | "
                  "output layer held |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        failed = {model: r["error"] for model, r in run["models"].items() if "error" in r}
        measured = {model: r for model, r in run["models"].items() if "error" not in r}
        for model, error in failed.items():
            lines.append(f"| {model} | not run: {error.replace('|', '/')} | | | | | | | | |")
        for model, r in measured.items():
            target = "" if not run["cuda"] else (" (met)" if r["run_ratio"] <= TARGET else " (**missed**)")
            layer = ", ".join(r["output_layer"]["names"]) if r.get("output_layer") else "–"
            lines.append(
                f"| {model} | {r['n_data']:,} | {r['parameters']:,} ({r['learnable_count']:,}) | {_f(r['epoch'])} | "
                f"{_f(r['epoch_with_callback'])} | {_f(r['estimate'])} ({_f(r['estimate_epochs'], 1)}) | "
                f"**{_f(r['run_ratio'])}**{target} | {r['plain_peak_mib']:,.0f} / {r['default_peak_mib']:,.0f} "
                f"({_f(r['memory_ratio'])}) | {_estimator(r['estimator'])} | {layer} |")
        lines += ["", f"`\"auto\"`'s crossover: one evidence pass (kron) over the first batches, exact GGN and one "
                  "sample, each over as many training steps (ResNet-18's heads of other class counts: the sweep). "
                  f"`\"auto\"` is exact up to {EXACT_COLUMNS} columns a batch.", "",
                  "| model | classes | exact GGN: columns a batch | batches | training steps s | exact pass / steps | "
                  "one-sample pass / steps | `\"auto\"` takes |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for model, r in measured.items():
            for c in r["crossover"]:
                chosen = "exact" if c["columns"] <= EXACT_COLUMNS else "one sample"
                lines.append(f"| {model} | {c['classes']:,} | {c['columns']:,} | {c['batches']} | "
                             f"{_f(c['steps_seconds'])} | "
                             f"{_f(c['exact_steps'], 1) if not math.isnan(c['exact_steps']) else 'not run'} | "
                             f"{_f(c['sampled_steps'], 1)} | {chosen} |")
    return lines


def real_sizes(device: torch.device, size: str, models: List[str], output: Optional[Path],
               command: str) -> Dict[str, Any]:
    """Part 4: :func:`_real_sizes.measure_all`, each model's record written to ``output`` as it is measured."""
    from _real_sizes import SIZES, Meter, measure_all

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({cpu_name()})"
    key = f"{name}, {size} size"
    run = {"device": name, "cuda": cuda, "size": size, "date": now(), "library": library_state(), "command": command,
           "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if cuda else ""),
           "meter": Meter(device).describe(), "models": {}}

    def save(model: str, record: Dict[str, Any]) -> None:
        run["models"][model] = record
        print(f"{model}: " + (record.get("error") or "; ".join(
            f"{k} {record[k]:.3g}" for k in ("epoch", "estimate_epochs", "run_ratio", "memory_ratio"))), flush=True)
        if output is not None:  # read again: the file may have changed since this run started
            data = results_data(output)
            data.setdefault("real_sizes", {})[key] = run
            write_results(output, data)

    measure_all(models, SIZES[size], device, save)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one timing round")
    parser.add_argument("--output", type=Path, default=None,
                        help="results file (default benchmarks/results/gpu.md on CUDA without --quick, and with "
                             "--real-sizes; else none)")
    parser.add_argument("--real-sizes", choices=("small", "full"),
                        help="part 4 alone at this size: issue 54's models (full: on a GPU; small: minutes on a CPU)")
    parser.add_argument("--models", nargs="+", default=None, help="part 4's models (default: all)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False); run with --device cpu --quick for a smoke test")
        return 0
    torch.set_num_threads(1 if device.type == "cpu" else max(1, torch.get_num_threads()))
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.real_sizes:
        from _real_sizes import MODELS

        models = args.models or list(MODELS)
        unknown = sorted(set(models) - set(MODELS))
        if unknown:
            parser.error(f"--models: unknown {unknown}; expected some of {list(MODELS)}")
        command = "python benchmarks/gpu.py " + " ".join(sys.argv[1:])
        real_sizes(device, args.real_sizes, models, args.output or OUTPUT, command)
        return 0
    output = args.output or (OUTPUT if device.type == "cuda" and not args.quick else None)
    started = time.perf_counter()
    result = Result()
    for kind, structure, approx in (("classification", "kron", "ggn"), ("classification", "diag", "ef"),
                                    ("regression", "kron", "ggn"), ("regression", "diag", "ef")):
        result.guarded(f"callback on {device.type}, {kind}, {structure}-{approx}: buffers and statistics on the device",
                       lambda k=kind, s=structure, a=approx: callback_check(device, k, s, a))
    equality = equality_checks(result, device, args.quick)
    reps = 1 if args.quick else 3
    speeds = speed(device, args.quick, reps=reps)
    text = report(result, equality, speeds, device, args.quick, time.perf_counter() - started, reps)
    print()
    print(text)
    if output is not None:
        data = results_data(output)
        data["checks"] = text
        write_results(output, data)
        print(f"written to {output}")
    return 0 if all(ok for _, ok, _ in result.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
