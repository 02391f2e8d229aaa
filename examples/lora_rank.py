"""Low-rank adapters (LoRA) on a frozen pretrained MLP: does the evidence choose the adapter rank?

1. Pretrain a base MLP (64-64-64-5, tanh) on digits 0-4 (scikit-learn ``load_digits``, offline).
2. Freeze it (``requires_grad=False``: the prior and the evidence leave it out) and adapt it to a
   shifted task by adding ``B A x`` to every frozen linear layer ``W x + b``: ``A`` (rank x in) and
   ``B`` (out x rank) are bias-free ``nn.Linear``, ``B`` starts at zero. Two shifts: *new classes*
   (digits 5-9 as labels 0-4) and *mirrored* (digits 0-4 flipped left-right).
3. For every rank r, train the adapters with ``MargLikCallback(structure="kron")`` (Kronecker blocks
   for every A and B, a layerwise prior learned online) and compare the ranks by the final evidence.
   Rank 0 is the frozen base alone: with no free parameters its evidence is exactly its log-likelihood.

Usage::

    python examples/lora_rank.py              # 2 shifts x ranks 0, 1, 2, 4, 8, 16 x 2 seeds, ~2-3 min
    python examples/lora_rank.py --results    # the same, table and plot to examples/results/
    python examples/lora_rank.py --quick      # smoke test: a few seconds
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Dict, List, Optional, Sequence

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, MargLikCallback
from lightning_marglik.selection import quiet_lightning
from common import MapModule, study_options, write_report

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "lora_rank"
RANKS = (0, 1, 2, 4, 8, 16)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``r`` update: ``W x + b + B (A x)``."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.rank = rank
        if rank:
            self.A = nn.Linear(base.in_features, rank, bias=False)
            self.B = nn.Linear(rank, base.out_features, bias=False)
            nn.init.zeros_(self.B.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        return out + self.B(self.A(x)) if self.rank else out


def base_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def adapted(base: nn.Sequential, rank: int) -> nn.Sequential:
    """A copy of ``base`` with every Linear wrapped in a ``LoRALinear`` of ``rank``."""
    import copy

    layers = copy.deepcopy(base)
    return nn.Sequential(*(LoRALinear(m, rank) if isinstance(m, nn.Linear) else m for m in layers))


class Adapter(MapModule):
    def __init__(self, net: nn.Module, n_data: int, lr: float = 3e-3) -> None:
        # the prior covers only the adapters (the frozen base does not require grad)
        super().__init__(net, GaussianPrior(net), CategoricalLikelihood(), n_data, lr)


SHIFTS = {"new classes": "digits 5-9 as labels 0-4", "mirrored": "digits 0-4 mirrored left-right"}


def digits(seed: int, quick: bool):
    """Stratified 70/30 split of ``load_digits`` (pixels / 16): task A (digits 0-4, training part) and,
    per shift, the shifted task's (train, test) data."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.3, random_state=seed, stratify=y)
    dtype = torch.get_default_dtype()
    limit = 100 if quick else None

    def task(xs, ys, classes, mirror=False):
        keep = [i for i, c in enumerate(ys) if c in classes][:limit]
        images = torch.tensor(xs[keep], dtype=dtype)
        if mirror:
            images = images.reshape(-1, 8, 8).flip(2).reshape(-1, 64)
        return images, torch.tensor(ys[keep] - min(classes))

    shifted = {"new classes": (task(x_tr, y_tr, range(5, 10)), task(x_te, y_te, range(5, 10))),
               "mirrored": (task(x_tr, y_tr, range(5), True), task(x_te, y_te, range(5), True))}
    return task(x_tr, y_tr, range(5)), shifted


def pretrain(data, seed: int, epochs: int) -> nn.Sequential:
    """Plain MAP training of the base network on task A (Adam, fixed small L2)."""
    torch.manual_seed(seed)
    net = base_mlp()
    x, y = data
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=generator).split(64):
            optimizer.zero_grad()
            F.cross_entropy(net(x[idx]), y[idx]).backward()
            optimizer.step()
    return net.requires_grad_(False)


@torch.no_grad()
def metrics(net: nn.Module, data) -> Dict[str, float]:
    net.eval()
    logits = net(data[0])
    return {"accuracy": (logits.argmax(1) == data[1]).double().mean().item(),
            "nll": F.cross_entropy(logits, data[1]).item()}


def effective_ranks(net: nn.Module, tol: float = 0.05) -> List[int]:
    """Per adapted layer: singular values of ``B A`` above ``tol`` times the largest."""
    ranks = []
    for m in net.modules():
        if isinstance(m, LoRALinear) and m.rank:
            sv = torch.linalg.svdvals(m.B.weight.detach() @ m.A.weight.detach())
            ranks.append(int((sv > tol * sv[0]).sum()) if sv[0] > 0 else 0)
    return ranks


def fit_rank(base: nn.Sequential, rank: int, train, test, epochs: int, frequency: int, seed: int) -> Dict:
    start = time.perf_counter()
    pl.seed_everything(seed, verbose=False)
    net = adapted(base, rank).train()
    if rank == 0:  # no free parameters: the evidence is the likelihood itself
        marglik = -metrics(net, train)["nll"]
        return {"rank": rank, "seed": seed, "params": 0, "marglik": marglik, **metrics(net, test),
                "train_accuracy": metrics(net, train)["accuracy"], "seconds": time.perf_counter() - start,
                "precisions": {}, "effective_ranks": []}
    model = Adapter(net, len(train[1]))
    dataset = TensorDataset(*train)
    callback = MargLikCallback(structure="kron", approx="ggn", frequency=frequency, steps=100, lr=0.1,
                               dataloader=DataLoader(dataset, batch_size=256))
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.fit(model, DataLoader(dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    precisions = {k[len("prior_precision/"):]: float(v) for k, v in trainer.callback_metrics.items()
                  if k.startswith("prior_precision/")}
    return {"rank": rank, "seed": seed, "params": model.prior.n_params, "marglik": callback.last_marglik,
            **metrics(net, test), "train_accuracy": metrics(net, train)["accuracy"],
            "seconds": time.perf_counter() - start, "precisions": precisions, "effective_ranks": effective_ranks(net)}


def run(quick: bool = False, seeds: Sequence[int] = (0, 1), ranks: Sequence[int] = RANKS) -> Dict:
    epochs, frequency, pre_epochs = (10, 5, 10) if quick else (60, 5, 40)
    rows: List[Dict] = []
    base_accuracy, sizes = {}, {}
    for seed in seeds:
        task_a, shifted = digits(seed, quick)
        base = pretrain(task_a, seed, pre_epochs)  # one base per seed, shared by both shifts
        base_accuracy[seed] = metrics(base, task_a)["accuracy"]
        for shift, (train, test) in shifted.items():
            sizes[shift] = (len(train[1]), len(test[1]))
            rows += [{"shift": shift, **fit_rank(base, r, train, test, epochs, frequency, seed)} for r in ranks]
    groups = {(r["shift"], r["seed"]) for r in rows}
    pick = lambda key: {g: key([r for r in rows if (r["shift"], r["seed"]) == g])["rank"] for g in groups}  # noqa: E731
    return {"rows": rows, "seeds": list(seeds), "ranks": list(ranks), "epochs": epochs, "frequency": frequency,
            "pre_epochs": pre_epochs, "sizes": sizes, "n_pretrain": len(task_a[1]),
            "base_train_accuracy": base_accuracy,
            "chosen": pick(lambda rs: max(rs, key=lambda r: r["marglik"])),
            "best_accuracy": pick(lambda rs: max(rs, key=lambda r: (r["accuracy"], -r["nll"]))),
            "best_nll": pick(lambda rs: min(rs, key=lambda r: r["nll"]))}


def plot(out: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shifts = list(out["sizes"])
    fig, axes = plt.subplots(len(shifts), 3, figsize=(14, 3.6 * len(shifts)), squeeze=False)
    positions = {r: i for i, r in enumerate(out["ranks"])}
    for row, shift in zip(axes, shifts):
        for seed, marker in zip(out["seeds"], "osd^v"):
            rows = [r for r in out["rows"] if r["seed"] == seed and r["shift"] == shift]
            x = [positions[r["rank"]] for r in rows]
            for ax, key in zip(row, ("marglik", "accuracy", "nll")):
                ax.plot(x, [r[key] for r in rows], marker=marker, label=f"seed {seed}")
            chosen = next(r for r in rows if r["rank"] == out["chosen"][(shift, seed)])
            row[0].scatter([positions[chosen["rank"]]], [chosen["marglik"]], s=160, facecolors="none", edgecolors="red")
        for ax, title in zip(row, ("log evidence / N (rank 0: exact log-lik)", "test accuracy", "test NLL")):
            ax.set_xticks(range(len(out["ranks"])))
            ax.set_xticklabels(out["ranks"])
            ax.set_xlabel("adapter rank r")
            ax.set_title(f"{shift}: {title}", fontsize=10)
            ax.legend(fontsize=8)
        ranked = sorted(r["marglik"] for r in out["rows"] if r["shift"] == shift)
        row[0].set_ylim(ranked[len(ranked) // 4] - 0.3, ranked[-1] + 0.1)  # rank 0 can be far below
        below = [f"{r['marglik']:.2f}" for r in out["rows"] if r["shift"] == shift and r["rank"] == 0
                 and r["marglik"] < row[0].get_ylim()[0]]
        if below:
            row[0].annotate("rank 0 (off axis): " + ", ".join(below), (0.02, 0.03), xycoords="axes fraction",
                            fontsize=8)
        row[1].set_ylim(max(0.5, row[1].get_ylim()[0]), 1.0)
        row[2].set_yscale("log")
    fig.suptitle("LoRA on a frozen MLP pretrained on digits 0-4: evidence vs adapter rank (red circle: chosen)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(out: Dict, command: str, seconds: float) -> str:
    lines = [
        "# LoRA adapters on a frozen MLP: does the evidence choose the rank?", "",
        f"Date: {datetime.date.today()}. Command: `{command}`. Total wall time {seconds:.0f} s (2 shared CPU cores, "
        f"1 thread). Seeds {out['seeds']} (each: data split, pretraining, adapter initialisation, batches).", "",
        f"Base: MLP 64-64-64-5 (tanh), pretrained on digits 0-4 ({out['n_pretrain']} training images; Adam lr 1e-2, "
        f"weight decay 1e-4, {out['pre_epochs']} epochs; training accuracy "
        + ", ".join(f"{a:.3f}" for a in out["base_train_accuracy"].values()) + " per seed), then frozen. Shifted "
        "tasks (stratified 70/30 split of `load_digits`): " + "; ".join(
            f"**{k}**: {SHIFTS[k]}, {n} train / {m} test" for k, (n, m) in out["sizes"].items())
        + ". Adapters: `W x + b + B A x` on all three Linear layers, A and B bias-free `nn.Linear`, B = 0 at the "
        f"start. Recipe (every rank): Adam lr 3e-3, batch 64, {out['epochs']} epochs, `MargLikCallback("
        f"structure='kron', approx='ggn', frequency={out['frequency']}, steps=100, lr=0.1)` (exact 5-class GGN, a "
        "layerwise prior over the adapters, learned online); marglik/N is the last estimate (after the last epoch). "
        "Rank 0 is the frozen base: with no free parameters its evidence is exactly its log-likelihood per datum. "
        "\"effective rank\": per adapted layer, singular values of the learned B A above 5% of the largest.", "",
        "| shift | seed | rank | adapter params | marglik/N | test acc | test NLL | train acc | effective rank "
        "| wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in out["rows"]:
        mark = " **(chosen)**" if out["chosen"][(r["shift"], r["seed"])] == r["rank"] else ""
        eff = "/".join(map(str, r["effective_ranks"])) or "-"
        lines.append(f"| {r['shift']} | {r['seed']} | {r['rank']}{mark} | {r['params']} | {r['marglik']:.4f} | "
                     f"{r['accuracy']:.4f} | {r['nll']:.4f} | {r['train_accuracy']:.4f} | {eff} | {r['seconds']:.1f} |")
    lines += ["", "## Findings", ""]
    agree = 0
    for shift in out["sizes"]:
        for s in out["seeds"]:
            rows = {r["rank"]: r for r in out["rows"] if r["seed"] == s and r["shift"] == shift}
            c, a, n = (out[k][(shift, s)] for k in ("chosen", "best_accuracy", "best_nll"))
            agree += c == a
            verdict = "also the best test accuracy" if c == a else (
                f"**not** the best test rank: accuracy {rows[c]['accuracy']:.4f} / NLL {rows[c]['nll']:.4f} at rank "
                f"{c}, best accuracy {rows[a]['accuracy']:.4f} at rank {a}")
            spread = max(r["marglik"] for r in rows.values() if r["rank"] >= 2) - min(
                r["marglik"] for r in rows.values() if r["rank"] >= 2)
            lines.append(f"* {shift}, seed {s}: the evidence picks rank **{c}**, {verdict}; best test NLL at rank {n}. "
                         f"Evidence spread over ranks >= 2: {spread:.3f} per datum.")
    top = max(out["ranks"])
    used = [max(r["effective_ranks"]) for r in out["rows"] if r["rank"] == top and r["effective_ranks"]]
    lines += ["", f"The evidence's rank matched the best-test-accuracy rank in {agree} of "
              f"{len(out['sizes']) * len(out['seeds'])} (shift, seed) cases.", "",
              "Reading: adapting at all (rank 0 -> 1 -> 2) is what the evidence and the test metrics agree on by a "
              "wide margin. Above that the evidence is nearly flat and its pick is decided by differences of the "
              "order of the seed-to-seed variation. The nominal rank matters little there: a Gaussian prior on both "
              "factors makes MAP training a nuclear-norm penalty on B A (min over factorisations of "
              "(|A|^2 + |B|^2) / 2 is the sum of the singular values of B A), so directions that the data do not need "
              f"are pruned; at rank {top} the learned updates use at most {max(used) if used else 0} directions per "
              "layer (effective rank column), and pruned directions (a row of A and a column of B both near zero) have "
              "near-zero curvature and cost almost no evidence. The "
              "evidence therefore plateaus instead of falling after the needed rank, and choosing the rank by "
              "the maximum of a plateau does not reliably pick the best test rank.", "",
              f"![evidence and test metrics vs rank]({NAME}.png)", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = study_options(__doc__, NAME, "100 images per task, 10 epochs, ranks 0, 1, 4", plot=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with quiet_lightning():  # no per-Trainer banners
        out = run(args.quick, args.seeds, (0, 1, 4) if args.quick else RANKS)
    seconds = time.perf_counter() - start
    for r in out["rows"]:
        print(f"{r['shift']:>11} seed {r['seed']} rank {r['rank']:>2}  marglik {r['marglik']:.4f}  "
              f"test acc {r['accuracy']:.4f}  "
              f"NLL {r['nll']:.4f}  {r['seconds']:.1f}s")
    print("evidence picks rank", out["chosen"], "best test accuracy at rank", out["best_accuracy"])
    target = os.path.join(HERE, "results") if args.results else args.output_dir
    write_report(NAME, argv, target, lambda command: markdown(out, command, seconds), lambda path: plot(out, path))
    print(f"total {seconds:.0f}s, wrote {target}/{NAME}.md")
    return out


if __name__ == "__main__":
    main()
