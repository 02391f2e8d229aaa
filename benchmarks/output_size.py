"""Any number of outputs at a bounded cost (issues 39 and 54): what one estimate costs, in training epochs
and peak memory, as the number of outputs grows, how close the sampled GGN's learned precisions are
to the exact GGN's where that is still affordable, and the output-side Kronecker factor held exact
or as its diagonal (``max_output_factor``).

Parts (each in a fresh process, so that its peak memory is its own; ``--parts`` selects):

* ``crossover``: the exact and the one-sample Monte-Carlo GGN's estimate, in training epochs, for
  an MLP 256-512-512-C at C in {3, 6, 11, 21, 51}, N = 2,048: where the exact GGN's cost overtakes.
* ``mlp-C`` for C in {10, 100, 1000, 10000}: MLP 256-512-512-C, N = 8,000, batch 128: one training
  epoch (Adam on ``map_loss``) and one estimate at the defaults (``mc_samples="auto"``, kron, Newton),
  process CPU, and the process's peak RSS after training and after the estimate; at C <= 1000 the
  exact GGN's estimate too (in its own process).
* ``cnn-100``: a CNN (conv 16, conv 32, linear) on 3x16x16 images, 100 classes, N = 8,000.
* ``gpt2`` and ``gpt2-lora``: a GPT-2 LM built from a config (vocabulary 8,192, 2 layers, 32 wide), 256
  sequences of 32 tokens (a quarter padded with -100 from position 24), and the same with a peft LoRA
  adapter (rank 4 on ``c_attn``).
* ``quality-C`` for C in {10, 100}: whole runs (30 epochs, ``MargLikCallback`` defaults: an estimate
  every 10th epoch) with the default estimator (Monte-Carlo seeds 0, 1, 2, and seed 0 once more) and with
  ``mc_samples=0``, on a teacher network's labels: learned log precisions, final ``marglik`` and test NLL.
* ``factor-C`` for C in {10, 100, 1000, 2000, 5000, 10000, 20000, 50000} (issue 54): the issue's MLP
  128-512-C, N = 8,192, batch 128, trained 2 epochs (the cost of one: the faster); then at those weights one
  estimate at the defaults (one Monte-Carlo sample, Newton) with the output-side factor held as its diagonal
  (``max_output_factor = min(C - 1, 4096)``: above 512 classes the output layer only, at 10 and 100 the
  512-wide hidden layer too) and, where it still fits (C <= 10,000), exact: estimate CPU in training
  epochs, peak RSS against training's (the diagonal first, so that its peak is its own), evidence per
  datum and learned log δ at the optimum; after the diagonal's estimate, the prior guard's scoring.
* ``gpt2-50257`` and ``gpt2-50257-untied``: the GPT-2 LM of ``gpt2`` with the real 50,257-token vocabulary,
  64 sequences of 32 tokens, its head tied to the token embedding or a separate trained Linear; 3 epochs,
  3 estimates at the defaults and after each the prior guard's scoring, the least CPU of each kept (one
  timing of these moved by up to a training epoch between two runs of the part).
* ``rows-50257``: a batch's categorical statistics and NLL on 1,024 rows of 50,257 logits with a fraction of the
  rows ignored, computed on every row and the ignored dropped after, or on a copy of the kept rows (the least CPU
  of three): where the likelihood's choice between the two (at least 4 in 5 kept: every row) comes from.

``mlp-C``, ``cnn-100``, the factor parts' diagonal and the GPT-2 50,257 parts time the prior guard after the
estimate as ``MargLikCallback()`` runs it within training (issue 52's default): issue 54's targets are judged on
the estimate and its guard together.

Whole-run ratios at the defaults are computed from the measured parts: 40 epochs with 4 estimates,
``(40 t_epoch + 4 t_estimate) / (40 t_epoch)``.

Run: ``python benchmarks/output_size.py`` (about 25 min on one thread for issue 39's parts, about an hour more
for issue 54's), or ``--parts mlp-1000 gpt2`` (``--default-only``: without the exact GGN's parts).
Results: ``benchmarks/results/output_size.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from _common import RESULTS, cpu_name, hand_written, load_avg, now, read_data, timed, write_with_data  # noqa: E402

FACTOR_CLASSES = (10, 100, 1000, 2000, 5000, 10000, 20000, 50000)
PARTS = ["crossover", "mlp-10", "mlp-100", "mlp-1000", "mlp-10000", "cnn-100", "gpt2", "gpt2-lora", "quality-10",
         "quality-100", *(f"factor-{c}" for c in FACTOR_CLASSES), "gpt2-50257", "gpt2-50257-untied", "rows-50257"]
KEPT_FRACTIONS = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0)
EXACT_FACTOR_MAX = 10_000  # the exact output-side factor beyond: 3.2 GB and ~8x the 10,000-class eigendecomposition
TARGET_EPOCHS, TARGET_MEMORY = 5.0, 1.3  # issue 54's bound on one default estimate
RESULT = RESULTS / "output_size.md"
EPOCHS, ESTIMATES = 40, 4  # the whole-run ratio's run: an estimate every 10th epoch


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- models and data --------------------------------------------------------------------------


def teacher_data(n: int, classes: int, seed: int = 0, dim: int = 256):
    """Inputs ``(n, dim)`` and a random teacher network's sampled labels, drawn 1,024 rows at a time so that
    the logits of 50,000 classes do not set the process's peak memory (the same labels as drawn at once)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    torch.manual_seed(seed + 100)  # before the teacher is built: its biases keep their initial draws
    teacher = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, classes))
    teacher.apply(lambda m: isinstance(m, nn.Linear) and nn.init.normal_(m.weight, std=1.5 / m.in_features ** 0.5))
    with torch.no_grad():
        y = torch.cat([torch.distributions.Categorical(logits=3 * teacher(rows)).sample() for rows in x.split(1024)])
    return x, y


def mlp(classes: int):
    from torch import nn

    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, classes))


def wide_mlp(classes: int):
    """Issue 54's MLP 128-512-C."""
    from torch import nn

    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, classes))


def cnn(classes: int):
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, classes))


def gpt2(lora: bool, vocabulary: int = 8192, sequences: int = 256, tied: bool = True):
    """A GPT-2 LM built from a config, as a module returning logits ``(B, T, V)``, with next-token data."""
    import torch
    import transformers
    from torch import nn

    config = transformers.GPT2Config(vocab_size=vocabulary, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=tokens).logits

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocabulary, (sequences, 33), generator=g)
    labels = tokens[:, 1:].clone()
    labels[::4, 24:] = -100
    return LM(), tokens[:, :-1].contiguous(), labels


# --- one part ---------------------------------------------------------------------------------


def _epoch(net, loader, likelihood, prior, optimizer) -> Callable[[], None]:
    from lightning_marglik import map_loss

    def run() -> None:
        for xb, yb in loader:
            optimizer.zero_grad()
            map_loss(net(xb), yb, likelihood, prior).backward()
            optimizer.step()

    return run


def cost(net, x, y, batch_size: int, mc_samples: Any, repeats: int = 1, guarded: bool = False) -> Dict[str, Any]:
    """One training epoch and one estimate, process CPU and peak RSS (``guarded``: then the prior guard's scoring of
    the learned against the declared weight decay, as ``MargLikCallback(guard=True)`` runs it after an estimate).
    Each of the three is timed ``repeats`` times and the least kept (an estimate after the first starts from the
    hyperparameters the one before it learned, as in training)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    likelihood = CategoricalLikelihood()
    prior = GaussianPrior(net)
    prior.record_n_data(int((y != -100).sum()))
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    run = _epoch(net, loader, likelihood, prior, optimizer)
    before = peak_mb()
    epoch_cpu = min(timed(run)[0] for _ in range(repeats))
    trained = peak_mb()

    def estimate():
        evidence = LaplaceEvidence.fit(net, loader, likelihood, prior, mc_samples=mc_samples,
                                       generator=torch.Generator().manual_seed(0))
        evidence.set_hyperparameters(evidence.optimize(solver="newton").values)
        return evidence

    estimates: List[float] = []
    guards: List[float] = []
    for _ in range(repeats):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exact-path notes of tied and positional embeddings
            seconds, _, evidence = timed(estimate)
        estimates.append(seconds)
        if len(estimates) == 1:
            peak_estimate = peak_mb()  # before any guard ran: the peak RSS only grows
        if guarded:
            guards.append(_guard_cpu(evidence, net, loader, prior.log_precision))
        estimator = evidence.estimator
        del evidence  # not held while the next one is fitted: the peaks are one estimate's
    estimate_cpu = min(estimates)
    guard = _guard_figures(min(guards), estimate_cpu, epoch_cpu, trained) if guarded else {}
    return {
        "epoch_cpu": epoch_cpu, "estimate_cpu": estimate_cpu, "epochs_per_estimate": estimate_cpu / epoch_cpu,
        "run_ratio": (EPOCHS * epoch_cpu + ESTIMATES * estimate_cpu) / (EPOCHS * epoch_cpu),
        "peak_before_mb": before, "peak_training_mb": trained, "peak_estimate_mb": peak_estimate,
        "memory_ratio": peak_estimate / trained, "estimator": estimator, "n_params": sum(p.numel() for p in params),
        **guard,
    }


def _guard_cpu(evidence, net, loader, learned) -> float:
    """The process CPU of what ``MargLikCallback``'s default adds after an estimate: the prior guard's scoring of
    the ``learned`` log precision against the declared one."""
    import torch

    from lightning_marglik.guard import approximate_cv

    learned = learned.detach().clone()
    declared = torch.full_like(learned, math.log(evidence.prior.initial_precision))
    return timed(lambda: approximate_cv(evidence, net, list(loader), {"learned": learned, "declared": declared}))[0]


def _guard_figures(guard_cpu: float, estimate_cpu: float, epoch_cpu: float, trained_mb: float) -> Dict[str, Any]:
    """The guard's CPU, the guarded estimate in epochs, and the process's peak RSS after the guard."""
    return {"guard_cpu": guard_cpu, "epochs_per_guarded_estimate": (estimate_cpu + guard_cpu) / epoch_cpu,
            "peak_guard_mb": peak_mb(), "memory_ratio_guarded": peak_mb() / trained_mb}


def quality(classes: int) -> Dict[str, Any]:
    """Whole runs with the default estimator and the exact GGN: log precisions, marglik, test NLL."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, map_loss
    from lightning_marglik.selection import quiet_lightning

    x, y = teacher_data(10_000, classes)
    train, test = (x[:8000], y[:8000]), (x[8000:], y[8000:])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = mlp(classes)
            self.prior = GaussianPrior(self.net)
            self.likelihood = CategoricalLikelihood()

        def forward(self, inputs):
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=1e-3)

    out = {}
    # the default estimator with three Monte-Carlo seeds (the callback's seed): one run's NLL moves with the draws
    # and once more with seed 0: what two runs of one setting differ by
    for arm, mc, seed in (("default", "auto", 0), ("default-seed1", "auto", 1), ("default-seed2", "auto", 2),
                          ("default-repeat", "auto", 0), ("exact", 0, 0)):
        module = Module()
        callback = MargLikCallback(mc_samples=mc, seed=seed)
        quiet_lightning()
        trainer = pl.Trainer(max_epochs=30, callbacks=[callback], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        g = torch.Generator().manual_seed(2)
        cpu = timed(lambda: trainer.fit(module, DataLoader(TensorDataset(*train), batch_size=128, shuffle=True,
                                                            generator=g)))[0]
        with torch.no_grad():
            nll = nn.functional.cross_entropy(module(test[0]), test[1]).item()
        out[arm] = {"log_precision": dict(zip(module.prior.param_names, module.prior.log_precision.tolist())),
                    "marglik": callback.final_marglik, "test_nll": nll, "estimator": callback.estimator, "cpu": cpu}
    diffs = [abs(out["default"]["log_precision"][k] - out["exact"]["log_precision"][k]) for k in out["exact"]["log_precision"]]
    out["max_log_precision_diff"] = max(diffs)
    out["nll_diff"] = out["default"]["test_nll"] - out["exact"]["test_nll"]
    seeds = [out[arm] for arm in ("default", "default-seed1", "default-seed2")]
    out["seeds_nll_mean_diff"] = sum(s["test_nll"] for s in seeds) / len(seeds) - out["exact"]["test_nll"]
    out["repeat_nll_diff"] = out["default-repeat"]["test_nll"] - out["default"]["test_nll"]
    out["seeds_nll_range"] = [min(s["test_nll"] for s in seeds), max(s["test_nll"] for s in seeds)]
    return out


def factor(classes: int) -> Dict[str, Any]:
    """Issue 54: the output-side factor as its diagonal and exact, at the same trained weights."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence
    from lightning_marglik.curvature import CurvatureOptions
    from lightning_marglik.curvature.structures import KronStructure

    x, y = teacher_data(8192, classes, dim=128)
    torch.manual_seed(0)
    net = wide_mlp(classes)
    loader = DataLoader(TensorDataset(x, y), batch_size=128)
    likelihood, prior = CategoricalLikelihood(), GaussianPrior(net)
    prior.record_n_data(len(y))
    run = _epoch(net, loader, likelihood, prior, torch.optim.Adam(net.parameters(), lr=1e-3))
    epoch_cpu = min(timed(run)[0] for _ in range(2))
    out: Dict[str, Any] = {"epoch_cpu": epoch_cpu, "peak_training_mb": peak_mb(), "n_data": len(y),
                           "n_params": sum(p.numel() for p in net.parameters())}
    arms = [("diagonal", min(classes - 1, CurvatureOptions.max_output_factor))]
    arms += [("exact", None)] if classes <= EXACT_FACTOR_MAX else []
    for arm, limit in arms:
        def estimate():
            evidence = LaplaceEvidence.fit(net, loader, likelihood, prior, generator=torch.Generator().manual_seed(0),
                                           max_output_factor=limit)
            return evidence, evidence.optimize(solver="newton")

        estimate_cpu, _, (evidence, solution) = timed(estimate)
        structure = next(s for s in evidence.structures if isinstance(s, KronStructure))
        out[arm] = {
            "max_output_factor": limit, "estimate_cpu": estimate_cpu, "epochs_per_estimate": estimate_cpu / epoch_cpu,
            "peak_estimate_mb": peak_mb(), "memory_ratio": peak_mb() / out["peak_training_mb"],
            "evidence_per_datum": solution.value.item() / len(y),
            "log_precision": dict(zip(prior.param_names, solution.values["log_precision"].tolist())),
            "diagonal_layers": [layer.name for layer, d in zip(structure.layers, structure.diagonal) if d],
            "estimator": evidence.estimator,
        }
        if arm == "diagonal":  # the default's structure: the guard follows its estimate, as in MargLikCallback()
            evidence.set_hyperparameters(solution.values)
            guard_cpu = _guard_cpu(evidence, net, loader, solution.values["log_precision"])
            out[arm].update(_guard_figures(guard_cpu, estimate_cpu, epoch_cpu, out["peak_training_mb"]))
        del evidence, solution
    return out


def ignored_rows(vocabulary: int, n: int = 1024) -> Dict[str, Any]:
    """The likelihood's two ways to drop ignored rows, timed at each of ``KEPT_FRACTIONS``."""
    import torch

    from lightning_marglik import CategoricalLikelihood

    likelihood = CategoricalLikelihood()
    logits = torch.randn(n, vocabulary, generator=torch.Generator().manual_seed(0))
    out = {}
    for kept in KEPT_FRACTIONS:
        labels = torch.randint(0, vocabulary, (n,), generator=torch.Generator().manual_seed(1))
        labels[torch.rand(n, generator=torch.Generator().manual_seed(2)) >= kept] = -100
        flat, target, mask = likelihood.terms(logits.double(), labels)
        ways = {
            "statistics, every row": lambda: likelihood.term_statistics(flat, target, mask),
            "statistics, kept rows' copy": lambda: likelihood.term_statistics(flat[mask], target[mask], mask[mask]),
            "nll, every row": lambda: likelihood.term_nll(logits, target)[mask],
            "nll, kept rows' copy": lambda: likelihood.term_nll(logits[mask], target[mask]),
        }
        out[str(kept)] = {way: min(timed(run)[0] for _ in range(3)) for way, run in ways.items()}
    return out


def run_part(part: str) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    kind, _, size = part.partition("-")
    if kind == "crossover":
        rows = {}
        for classes in (3, 6, 11, 21, 51):
            x, y = teacher_data(2048, classes)
            for mc in (0, 1):
                torch.manual_seed(0)
                rows[f"{classes}/{mc}"] = cost(mlp(classes), x, y, 128, mc)
        return rows
    if kind in ("mlp", "cnn"):
        classes = int(size)
        if kind == "mlp":
            x, y = teacher_data(8000, classes)
        else:
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(8000, 3, 16, 16, generator=g), torch.randint(0, classes, (8000,), generator=g)
        torch.manual_seed(0)
        return cost((mlp if kind == "mlp" else cnn)(classes), x, y, 128, "auto", guarded=True)
    if kind == "exact":  # exact-mlp-C, run as its own process by main()
        classes = int(size.rsplit("-", 1)[1])
        x, y = teacher_data(8000, classes)
        torch.manual_seed(0)
        return cost(mlp(classes), x, y, 128, 0)
    if kind == "gpt2" and size.startswith("50257"):  # issue 54: the real vocabulary, its head tied or not
        net, tokens, labels = gpt2(lora=False, vocabulary=50257, sequences=64, tied=size == "50257")
        return cost(net, tokens, labels, 32, "auto", repeats=3, guarded=True)
    if kind == "gpt2":
        net, tokens, labels = gpt2(lora=size == "lora")
        return cost(net, tokens, labels, 32, "auto")
    if kind == "factor":
        return factor(int(size))
    if kind == "rows":
        return ignored_rows(int(size))
    if kind == "quality":
        return quality(int(size))
    raise ValueError(part)


def in_process(part: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--one", part], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the results file --------------------------------------------------------------------------


def _cost_row(name: str, r: Dict[str, Any], exact: Dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | error: {r['error']} | | | | | |"
    ex = f"{exact['epochs_per_estimate']:.1f}" if exact and "error" not in exact else ("error" if exact else "–")
    return (f"| {name} | {r['n_params']:,} | {r['epoch_cpu']:.2f} | {r['epochs_per_estimate']:.2f} | {ex} | "
            f"{r['run_ratio']:.2f} | {r['peak_training_mb']:.0f} / {r['peak_estimate_mb']:.0f} ({r['memory_ratio']:.2f}) | "
            f"{r['estimator']} |")


def render(data: Dict[str, Any]) -> str:
    lines = ["# One estimate's cost against the number of outputs (issues 39 and 54)", "",
             "Generated by `python benchmarks/output_size.py`; process CPU, one thread. "
             f"Last run: library {data.get('library', '?')}; {data.get('machine', '?')}, {data.get('date', '?')} "
             f"at load {data.get('load', float('nan')):.1f}. Parts measured since issue 54 carry their own library, "
             "machine and date in the data (issue 54's tables show them); the reading names the run of the others.", "",
             "## Cost and memory at the defaults", "",
             "| network | parameters | epoch CPU s | estimate / epoch (default) | estimate / epoch (exact GGN) | "
             "whole run / no callback (40 epochs, 4 estimates) | peak MB training / estimate (ratio) | estimator |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    parts = data.get("parts", {})
    for part in ("mlp-10", "mlp-100", "mlp-1000", "mlp-10000", "cnn-100", "gpt2", "gpt2-lora"):
        if part in parts:
            lines.append(_cost_row(part, parts[part], parts.get(f"exact-{part}")))
    if "crossover" in parts:
        lines += ["", "## Crossover: the exact against the one-sample GGN (MLP 256-512-512-C, N = 2,048)", "",
                  "| classes C | exact: columns | exact estimate / epoch | MC(1) estimate / epoch |", "|---:|---:|---:|---:|"]
        rows = parts["crossover"]
        for classes in (3, 6, 11, 21, 51):
            exact, sampled = rows.get(f"{classes}/0", {}), rows.get(f"{classes}/1", {})
            if exact and sampled:
                lines.append(f"| {classes} | {classes - 1} | {exact['epochs_per_estimate']:.2f} | "
                             f"{sampled['epochs_per_estimate']:.2f} |")
    quality_rows = [p for p in ("quality-10", "quality-100") if p in parts]
    if quality_rows:
        lines += ["", "## Quality: whole runs, the default estimator against the exact GGN (30 epochs, N = 8,000)", "",
                  "| classes | default estimator | max abs diff of learned log δ | marglik default / exact | "
                  "test NLL default / exact (diff) | 3 MC seeds: NLL range, mean - exact | seed 0 run again: NLL diff |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for part in quality_rows:
            q = parts[part]
            if "error" in q:
                lines.append(f"| {part} | error: {q['error']} | | | |")
                continue
            lines.append(f"| {part.split('-')[1]} | {q['default']['estimator']} | {q['max_log_precision_diff']:.3f} | "
                         f"{q['default']['marglik']:.4f} / {q['exact']['marglik']:.4f} | "
                         f"{q['default']['test_nll']:.4f} / {q['exact']['test_nll']:.4f} ({q['nll_diff']:+.4f}) | "
                         + (f"{q['seeds_nll_range'][0]:.4f}-{q['seeds_nll_range'][1]:.4f}, {q['seeds_nll_mean_diff']:+.4f} |"
                            f" {q['repeat_nll_diff']:+.4f} |" if "seeds_nll_range" in q else "| |"))
    guarded = [p for p in ("mlp-10", "mlp-100", "mlp-1000", "mlp-10000", "cnn-100") if "guard_cpu" in parts.get(p, {})]
    if guarded:
        lines += ["", "## With the prior guard (issue 52's default): one estimate and its guard", "",
                  "| network | parameters | estimate / epoch | estimate and guard / epoch | peak MB training / estimate / "
                  "guard | guarded ratio (target 1.3) | measured |", "|---|---:|---:|---:|---:|---:|---|"]
        for part in guarded:
            r = parts[part]
            lines.append(f"| {part} | {r['n_params']:,} | {r['epochs_per_estimate']:.2f} | "
                         f"{r['epochs_per_guarded_estimate']:.2f} | {r['peak_training_mb']:.0f} / "
                         f"{r['peak_estimate_mb']:.0f} / {r['peak_guard_mb']:.0f} | {r['memory_ratio_guarded']:.2f} | "
                         f"{r.get('library', '?')}, {r.get('date', '?')} |")
    lines += _factor_lines(parts)
    if "rows-50257" in parts:
        ways = ("statistics, every row", "statistics, kept rows' copy", "nll, every row", "nll, kept rows' copy")
        measured = parts["rows-50257"]
        lines += ["", "## Ignored rows: every row's terms or the kept rows' copy (1,024 rows of 50,257 logits, CPU s)", "",
                  f"{measured['library']}, {measured['machine']}, {measured['date']}; the likelihood takes every row "
                  "where at least 80 % are kept.", "",
                  "| kept | " + " | ".join(ways) + " |", "|---:|" + "---:|" * len(ways)]
        for kept, row in measured.items():
            if kept in ("library", "machine", "date", "error"):
                continue
            lines.append(f"| {float(kept):.0%} | " + " | ".join(f"{row[way]:.3f}" for way in ways) + " |")
    return "\n".join(lines) + "\n\n" + hand_written(RESULT)


def _factor_lines(parts: Dict[str, Any]) -> List[str]:
    """Issue 54's tables: the targets at the defaults, then the sweep of the output-side factor."""
    lines: List[str] = []
    targets = [(name, part) for name, part in (("MLP 128-512-10,000, N = 8,192", "factor-10000"),
                                               ("GPT-2, 50,257 tokens, untied head", "gpt2-50257-untied"),
                                               ("GPT-2, 50,257 tokens, tied head", "gpt2-50257")) if part in parts]
    if targets:
        lines += ["", f"## Issue 54's targets: one default estimate (at most {TARGET_EPOCHS:g} training epochs and "
                  f"{TARGET_MEMORY:g}x training's peak memory)", "",
                  "Since issue 52 the default estimate within training is followed by the prior guard: where a part "
                  "measured it, the target is judged on the estimate and its guard together.", "",
                  "| case | epoch CPU s | estimate / epoch: alone / with the guard | peak MB training / estimate / "
                  "guard | ratio: estimate / with the guard | met | library, machine, date |",
                  "|---|---:|---:|---:|---:|---|---|"]
        for name, part in targets:
            r = parts[part]
            r = dict(r, **r["diagonal"]) if "diagonal" in r else r  # the sweep's row: the defaults' structure
            if "error" in r:
                lines.append(f"| {name} | error: {r['error']} | | | | | |")
                continue
            epochs, ratio = (r.get("epochs_per_guarded_estimate", r["epochs_per_estimate"]),
                             r.get("memory_ratio_guarded", r["memory_ratio"]))
            met = epochs <= TARGET_EPOCHS and ratio <= TARGET_MEMORY
            guarded = "guard_cpu" in r
            lines.append(f"| {name} | {r['epoch_cpu']:.2f} | {r['epochs_per_estimate']:.2f} / "
                         f"{epochs:.2f} | {r['peak_training_mb']:.0f} / {r['peak_estimate_mb']:.0f} / "
                         f"{r['peak_guard_mb']:.0f} | {r['memory_ratio']:.2f} / {ratio:.2f} | "
                         if guarded else
                         f"| {name} | {r['epoch_cpu']:.2f} | {r['epochs_per_estimate']:.2f} / – | "
                         f"{r['peak_training_mb']:.0f} / {r['peak_estimate_mb']:.0f} / – | {r['memory_ratio']:.2f} / – | ")
            lines[-1] += f"{'yes' if met else 'no'} | {r.get('library', '?')}, {r.get('machine', '?')}, {r.get('date', '?')} |"
    sweep = [c for c in FACTOR_CLASSES if f"factor-{c}" in parts]
    if sweep:
        lines += ["", "## The output-side factor: its diagonal against exact (MLP 128-512-C, N = 8,192, the same "
                  "trained weights, one Monte-Carlo sample)", "",
                  "| classes C | layers with diag(G) | epoch CPU s | estimate / epoch: diagonal / exact | "
                  "peak MB training / diagonal / exact | evidence per datum: diagonal / exact | "
                  "learned log δ, largest difference (tensor) |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for classes in sweep:
            r = parts[f"factor-{classes}"]
            if "error" in r:
                lines.append(f"| {classes:,} | error: {r['error']} | | | | | |")
                continue
            d, e = r["diagonal"], r.get("exact")
            layers = ", ".join(f"'{name}'" for name in d["diagonal_layers"])
            if e is None:
                lines.append(f"| {classes:,} | {layers} | {r['epoch_cpu']:.2f} | {d['epochs_per_estimate']:.2f} / – | "
                             f"{r['peak_training_mb']:.0f} / {d['peak_estimate_mb']:.0f} / – | "
                             f"{d['evidence_per_datum']:.4f} / – | – |")
                continue
            diffs = {k: d["log_precision"][k] - e["log_precision"][k] for k in e["log_precision"]}
            worst = max(diffs, key=lambda k: abs(diffs[k]))
            lines.append(f"| {classes:,} | {layers} | {r['epoch_cpu']:.2f} | {d['epochs_per_estimate']:.2f} / "
                         f"{e['epochs_per_estimate']:.2f} | {r['peak_training_mb']:.0f} / {d['peak_estimate_mb']:.0f} / "
                         f"{e['peak_estimate_mb']:.0f} | {d['evidence_per_datum']:.4f} / {e['evidence_per_datum']:.4f} | "
                         f"{diffs[worst]:+.3f} ({worst}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--default-only", action="store_true",
                        help="skip the exact GGN's part of an MLP (at 1,000 classes it takes about 1,000 epochs)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_part(args.one)))
        return
    from common import library_state

    data = read_data(RESULT)
    data.setdefault("parts", {})
    data.update(library=library_state(), machine=cpu_name(), date=now(), load=load_avg())
    for part in args.parts:
        exact = part in ("mlp-10", "mlp-100", "mlp-1000") and not args.default_only
        names = [part] + ([f"exact-{part}"] if exact else [])
        for name in names:
            print(f"{name} ...", flush=True)
            provenance = {key: data[key] for key in ("library", "machine", "date")}
            data["parts"][name] = {**in_process(name), **provenance}
            print(f"  {data['parts'][name]}", flush=True)
            write_with_data(RESULT, render(data), data)


if __name__ == "__main__":
    main()
