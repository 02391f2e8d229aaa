"""Paper Fig. 3: the evidence, from the training data alone, picks the network that generalizes better.

Two networks of the same architecture are trained on a small, noisy 2-D "moons" problem
(scikit-learn ``make_moons``, generated offline):

* **marglik**: layerwise prior precisions learned online by ``MargLikCallback`` (Algorithm 1);
* **weak**: a fixed, small prior precision (``learn_prior=false``): almost no regularization.

Both get the same evidence estimate on the training data at the end of training
(``callback.final_marglik``; for the fixed prior the callback only evaluates it). The
generalization gap (train minus test accuracy, and test minus train NLL, on a fresh test set of
2000 points) is measured but never used for the choice.

Usage::

    python examples/classification_2d.py               # full run, about a minute on one CPU thread
    python examples/classification_2d.py --quick       # smoke test: 3 epochs
    python examples/classification_2d.py --data.noise=0.2 --model.width=100   # any config override
    python examples/classification_2d.py --results     # rewrite examples/results/classification_2d.png

Writes ``outputs/classification_2d.png`` (``--output-dir``/``--results`` for elsewhere).
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("classification_2d: importing PyTorch, Lightning and scikit-learn ...", flush=True)

import os  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from common import CONFIGS, MLPClassifier, TensorData, accuracy_and_nll, configured, markdown_table, parse, parser  # noqa: E402
from lightning_marglik import MargLikCallback  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

CONFIG = os.path.join(CONFIGS, "classification_2d.yaml")
WEAK_PRECISION = 1e-4
QUICK = ["--trainer.max_epochs=3", "--trainer.callbacks.init_args.frequency=1", "--trainer.callbacks.init_args.steps=5"]


class MoonsData(TensorData):
    """``sklearn.datasets.make_moons`` (generated, offline), standardized with the training statistics.

    Args:
        n_train, n_test: Sizes of the training and the (independent) test set.
        noise: ``make_moons`` noise.
        seed: Seed; the test set uses ``seed + 1``.
        batch_size: Batch size (<= 0: full batch).
    """

    def __init__(self, n_train: int = 60, n_test: int = 2000, noise: float = 0.3, seed: int = 0, batch_size: int = 0):
        super().__init__(batch_size)
        from sklearn.datasets import make_moons

        x_tr, y_tr = make_moons(n_train, noise=noise, random_state=seed)
        x_te, y_te = make_moons(n_test, noise=noise, random_state=seed + 1)
        mean, std = x_tr.mean(0), x_tr.std(0)
        as_tensors = lambda x, y: (torch.tensor((x - mean) / std, dtype=torch.float32), torch.tensor(y))  # noqa: E731
        self.x_train, self.y_train = as_tensors(x_tr, y_tr)
        self.x_test, self.y_test = as_tensors(x_te, y_te)

def variants(weak_precision: float = WEAK_PRECISION) -> Dict[str, List[str]]:
    """Config overrides of the two compared models (same architecture, same data, same training)."""
    return {
        "marglik": ["--model.learn_prior=true"],
        "weak": [f"--model.prior_precision={weak_precision}", "--model.learn_prior=false"],
    }


def run(
    config: str = CONFIG,
    overrides: Sequence[str] = (),
    weak_precision: float = WEAK_PRECISION,
    plot: Optional[str] = None,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Train both variants; return their evidence and generalization gaps.

    Returns:
        ``rows`` (one per variant), ``marglik`` ``{name: log evidence / N}``, ``gap`` ``{name: train acc -
        test acc}``, ``chosen`` (highest evidence), ``smallest_gap`` (smallest accuracy gap) and
        ``agree`` (whether the evidence chose the model with the smaller gap).
    """
    rows: List[Dict[str, Any]] = []
    fits = {}
    for name, extra in variants(weak_precision).items():
        cli = configured(MLPClassifier, MoonsData, config, [*overrides, *extra])
        model, data = cli.model, cli.datamodule
        callback = next(c for c in cli.trainer.callbacks if isinstance(c, MargLikCallback))
        start = time.perf_counter()
        cli.trainer.fit(model, datamodule=data)
        seconds = time.perf_counter() - start
        train = accuracy_and_nll(model, data.x_train, data.y_train)
        test = accuracy_and_nll(model, data.x_test, data.y_test)
        rows.append({
            "model": name,
            "marglik": callback.final_marglik,
            "train_acc": train["acc"],
            "test_acc": test["acc"],
            "acc_gap": train["acc"] - test["acc"],
            "train_nll": train["nll"],
            "test_nll": test["nll"],
            "nll_gap": test["nll"] - train["nll"],
            "prior_precision": [round(v, 4) for v in model.prior.precision.tolist()],
            "seconds": seconds,
        })
        fits[name] = (model, data)
        if verbose:
            print(f"{name}: marglik {callback.final_marglik:.4f}  train acc {train['acc']:.3f}  test acc "
                  f"{test['acc']:.3f}  ({seconds:.1f} s)", flush=True)
    marglik = {r["model"]: r["marglik"] for r in rows}
    gap = {r["model"]: r["acc_gap"] for r in rows}
    nll_gap = {r["model"]: r["nll_gap"] for r in rows}
    chosen = max(marglik, key=lambda k: marglik[k])
    smallest = min(gap, key=lambda k: gap[k])
    smallest_nll = min(nll_gap, key=lambda k: nll_gap[k])
    out = {
        "rows": rows,
        "marglik": marglik,
        "gap": gap,
        "nll_gap": nll_gap,
        "chosen": chosen,
        "smallest_gap": smallest,
        "agree": chosen == smallest == smallest_nll,
    }
    if verbose:
        print(markdown_table(rows, ["model", "marglik", "train_acc", "test_acc", "acc_gap", "train_nll", "test_nll",
                                    "nll_gap", "seconds"]))
        for r in rows:
            print(f"  {r['model']}: prior precisions {r['prior_precision']}")
        print(f"evidence chooses '{chosen}'; smallest generalization gap: '{smallest}' (accuracy), "
              f"'{smallest_nll}' (NLL) -> {'agree' if out['agree'] else 'DISAGREE'}")
    if plot:
        make_plot(fits, rows, plot)
        if verbose:
            print(f"saved {plot}")
    return out


def make_plot(fits: Dict[str, Any], rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(fits), figsize=(5.2 * len(fits) + 1, 4.6), squeeze=False, constrained_layout=True)
    for ax, (name, (model, data)), row in zip(axes[0], fits.items(), rows):
        lo = torch.minimum(data.x_train.min(0).values, data.x_test.min(0).values) - 0.5
        hi = torch.maximum(data.x_train.max(0).values, data.x_test.max(0).values) + 0.5
        g0, g1 = torch.meshgrid(torch.linspace(lo[0], hi[0], 200), torch.linspace(lo[1], hi[1], 200), indexing="ij")
        with torch.no_grad():
            model.eval()
            prob = model(torch.stack([g0.reshape(-1), g1.reshape(-1)], 1)).softmax(1)[:, 1].reshape(g0.shape)
        cs = ax.contourf(g0.numpy(), g1.numpy(), prob.numpy(), levels=20, cmap="RdBu_r", vmin=0, vmax=1, alpha=0.8)
        ax.contour(g0.numpy(), g1.numpy(), prob.numpy(), levels=[0.5], colors="k", linewidths=1.5)
        ax.scatter(data.x_test[:400, 0], data.x_test[:400, 1], c=data.y_test[:400], cmap="RdBu_r", s=4, alpha=0.35,
                   vmin=0, vmax=1)
        ax.scatter(data.x_train[:, 0], data.x_train[:, 1], c=data.y_train, cmap="RdBu_r", s=30, edgecolors="k",
                   vmin=0, vmax=1)
        label = "marglik-learned prior" if name == "marglik" else f"fixed weak prior $\\delta$={row['prior_precision'][0]:g}"
        ax.set_title(f"{label}\nlog evidence/N {row['marglik']:.3f} | train acc {row['train_acc']:.2f}, "
                     f"test acc {row['test_acc']:.2f}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(cs, ax=axes[0].tolist(), label="p(class 1)", shrink=0.9)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args, overrides = parse(parser(__doc__, CONFIG), argv, QUICK)
    start = time.perf_counter()
    with quiet_lightning():
        out = run(args.config, overrides, plot=os.path.join(args.output_dir, "classification_2d.png"))
    print(f"total {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    main()
