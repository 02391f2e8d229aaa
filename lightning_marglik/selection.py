"""Step 2 of the method: train candidate models with ``MargLikCallback`` and rank them by evidence.

From Python::

    results = select_models({"mlp": make_mlp, "cnn": make_cnn}, datamodule=data,
                            callback={"structure": "diag", "approx": "ef"},
                            trainer={"max_epochs": 30}, output_dir="selection")

From the command line, over a YAML file (``class_path``/``init_args`` as in LightningCLI)::

    marglik-select candidates.yaml            # or: python -m lightning_marglik.selection ...

    seed: 0
    output_dir: selection
    trainer: {max_epochs: 30}
    callback: {structure: diag, approx: ef}
    data: {class_path: mypackage.Data, init_args: {batch_size: 64}}
    candidates:
      mlp: {class_path: mypackage.MLP, init_args: {width: 100}}
      cnn: {class_path: mypackage.CNN, init_args: {channels: 16}}

A candidate class whose ``__init__`` takes ``n_data`` gets the training set size when the YAML
does not set it.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import pytorch_lightning as pl
import torch
import torchmetrics
import yaml
from torch import Tensor
from torch.utils.data import DataLoader

from .callbacks import MargLikCallback, find_hyperparameters
from .hyperparameters import CategoricalLikelihood
from .predictive import predict_classification

__all__ = ["CandidateResult", "NegativeLogLikelihood", "default_metrics", "select_models", "main"]

PREDICTIVES = ("map", "probit")


@dataclass
class CandidateResult:
    """One trained candidate: its evidence, size, cost and test metrics."""

    name: str
    marglik: float  # log evidence per datum (higher is better)
    n_params: int
    train_seconds: float
    epochs: int
    hyperparameters: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


class NegativeLogLikelihood(torchmetrics.Metric):
    """Mean negative log-likelihood of integer labels under predicted class probabilities."""

    higher_is_better = False
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: Tensor, target: Tensor) -> None:
        picked = probs.gather(1, target.unsqueeze(1)).squeeze(1).clamp_min(1e-12)
        self.total += -picked.log().sum().double()
        self.count += target.numel()

    def compute(self) -> Tensor:
        return self.total / self.count


def default_metrics(n_classes: int) -> Dict[str, torchmetrics.Metric]:
    """Accuracy, NLL and expected calibration error (15 bins) for ``n_classes`` classes."""
    return {
        "accuracy": torchmetrics.classification.MulticlassAccuracy(n_classes, average="micro"),
        "nll": NegativeLogLikelihood(),
        "ece": torchmetrics.classification.MulticlassCalibrationError(n_classes, n_bins=15, norm="l1"),
    }


def _test_metrics(
    module: pl.LightningModule,
    callback: MargLikCallback,
    loader: DataLoader,
    metrics: Mapping[str, torchmetrics.Metric],
    predictive: str,
) -> Dict[str, float]:
    was_training = module.training
    module.eval()
    try:
        for x, y in loader:
            if predictive == "probit":
                assert callback.evidence is not None
                probs = predict_classification(callback.evidence, module, x, "probit")
            else:
                with torch.no_grad():
                    output = module(x)
                probs = output.softmax(1) if isinstance(callback.likelihood, CategoricalLikelihood) else output
            for metric in metrics.values():
                metric.update(probs.detach().float() if probs.is_floating_point() else probs, y)
        return {name: float(metric.compute()) for name, metric in metrics.items()}
    finally:
        module.train(was_training)
        for metric in metrics.values():
            metric.reset()


def select_models(
    candidates: Mapping[str, Callable[[], pl.LightningModule]],
    train_dataloader: Optional[DataLoader] = None,
    datamodule: Optional[pl.LightningDataModule] = None,
    callback: Optional[Dict[str, Any]] = None,
    trainer: Optional[Dict[str, Any]] = None,
    test_dataloader: Optional[DataLoader] = None,
    metrics: Optional[Callable[[], Mapping[str, torchmetrics.Metric]]] = None,
    predictive: str = "map",
    output_dir: Optional[str] = None,
    seed: int = 0,
    verbose: bool = True,
) -> List[CandidateResult]:
    """Train every candidate with ``MargLikCallback`` and rank them by their final evidence.

    Args:
        candidates: Name to a factory returning a fresh LightningModule (with prior and likelihood).
        train_dataloader: Training data (or give ``datamodule``).
        datamodule: A DataModule with ``train_dataloader`` (and ``test_dataloader`` for metrics).
        callback: Keyword arguments of ``MargLikCallback``.
        trainer: Keyword arguments of ``pl.Trainer`` (default: CPU, no logger, no checkpoints).
        test_dataloader: Held-out data for the metrics (only reported, never used to select).
        metrics: Factory of named torchmetrics called with (class probabilities, labels);
            default for a categorical likelihood: :func:`default_metrics`.
        predictive: ``"map"`` (softmax of the trained network) or ``"probit"`` (linearized
            Laplace predictive of the evidence's posterior) for the test metrics.
        output_dir: Where to write ``results.csv``, ``results.json`` and ``evidence.png``.
        seed: Seed set before each candidate (``pl.seed_everything``).
        verbose: Print one line per candidate.

    Returns:
        The results, best evidence first.

    Raises:
        ValueError: On no candidates, no training data, or an unknown ``predictive``.
    """
    if not candidates:
        raise ValueError("`candidates` is empty: give at least one name -> factory.")
    if (train_dataloader is None) == (datamodule is None):
        raise ValueError("Give exactly one of `train_dataloader` and `datamodule`.")
    if predictive not in PREDICTIVES:
        raise ValueError(f"`predictive` must be one of {PREDICTIVES}, got {predictive!r}.")
    if test_dataloader is None and datamodule is not None and _has_test_data(datamodule):
        datamodule.setup("test")
        test_dataloader = datamodule.test_dataloader()
    results = []
    for index, (name, factory) in enumerate(candidates.items(), 1):
        pl.seed_everything(seed, verbose=False)
        module = factory()
        cb = MargLikCallback(**(callback or {}))
        kwargs = dict(logger=False, enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
        kwargs.update(trainer or {})
        fit_trainer = pl.Trainer(callbacks=[cb], **kwargs)
        start = time.perf_counter()
        fit_trainer.fit(module, train_dataloaders=train_dataloader, datamodule=datamodule)
        seconds = time.perf_counter() - start
        prior, likelihood = find_hyperparameters(module)
        scores: Dict[str, float] = {}
        if test_dataloader is not None:
            n_classes = _n_classes(module, test_dataloader)
            chosen = metrics() if metrics else (default_metrics(n_classes) if n_classes else {})
            scores = _test_metrics(module, cb, test_dataloader, chosen, predictive) if chosen else {}
        result = CandidateResult(
            name=name,
            marglik=cb.final_marglik,
            n_params=prior.n_params,
            train_seconds=seconds,
            epochs=fit_trainer.current_epoch,
            hyperparameters={k: v for k, v in cb.logged_values(cb.final_marglik).items() if k != "marglik"},
            metrics=scores,
        )
        results.append(result)
        if verbose:
            shown = " ".join(f"{k}={v:.4f}" for k, v in scores.items())
            print(f"[{index}/{len(candidates)}] {name}: marglik={result.marglik:.4f} params={result.n_params} "
                  f"time={seconds:.1f}s {shown}", flush=True)
    ranked = sorted(results, key=lambda r: -r.marglik if math.isfinite(r.marglik) else math.inf)
    if output_dir:
        save_results(ranked, output_dir)
    return ranked


def _has_test_data(datamodule: pl.LightningDataModule) -> bool:
    return type(datamodule).test_dataloader is not pl.LightningDataModule.test_dataloader


def _n_classes(module: pl.LightningModule, loader: DataLoader) -> int:
    """Number of classes if the likelihood is categorical, else 0."""
    _, likelihood = find_hyperparameters(module)
    if not isinstance(likelihood, CategoricalLikelihood):
        return 0
    x, _ = next(iter(loader))
    with torch.no_grad():
        return int(module.eval()(x[:1]).shape[1])


def save_results(results: Sequence[CandidateResult], output_dir: str) -> None:
    """Write ``results.csv``, ``results.json`` and, with matplotlib, ``evidence.png``."""
    os.makedirs(output_dir, exist_ok=True)
    rows = [{**{k: v for k, v in asdict(r).items() if k not in ("metrics", "hyperparameters")}, **r.metrics} for r in results]
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump([asdict(r) for r in results], f, indent=2)
    with open(os.path.join(output_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    metric_names = list(results[0].metrics)
    if not metric_names:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is an extra: pip install lightning_marglik[examples]
        return
    metric = metric_names[0]
    fig, ax = plt.subplots(figsize=(5, 4))
    sizes = [20 + 200 * r.n_params / max(q.n_params for q in results) for r in results]
    ax.scatter([r.marglik for r in results], [r.metrics[metric] for r in results], s=sizes, alpha=0.7)
    for r in results:
        ax.annotate(r.name, (r.marglik, r.metrics[metric]), fontsize=7)
    ax.set_xlabel("log marginal likelihood / N")
    ax.set_ylabel(f"test {metric}")
    ax.set_title("Model selection by the evidence (size: #params)")
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, "evidence.png"), dpi=120)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------


def instantiate(spec: Mapping[str, Any], **defaults: Any) -> Any:
    """Build ``class_path(**init_args)``; ``defaults`` fill constructor arguments the spec leaves out.

    Raises:
        ValueError: If ``spec`` has no ``class_path``.
    """
    if "class_path" not in spec:
        raise ValueError(f"Expected a mapping with `class_path` (and `init_args`), got {dict(spec)!r}.")
    module_name, _, attr = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), attr)
    kwargs = dict(spec.get("init_args") or {})
    accepted = inspect.signature(cls).parameters
    kwargs.update({k: v for k, v in defaults.items() if k in accepted and k not in kwargs})
    return cls(**kwargs)


def select_from_config(config: Mapping[str, Any]) -> List[CandidateResult]:
    """Run :func:`select_models` from a parsed YAML configuration (see the module docstring)."""
    datamodule = instantiate(config["data"])
    datamodule.setup("fit")
    n_data = len(datamodule.train_dataloader().dataset)
    candidates = {name: (lambda spec=spec: instantiate(spec, n_data=n_data)) for name, spec in config["candidates"].items()}
    return select_models(
        candidates,
        datamodule=datamodule,
        callback=config.get("callback"),
        trainer=config.get("trainer"),
        predictive=config.get("predictive", "map"),
        output_dir=config.get("output_dir"),
        seed=config.get("seed", 0),
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``marglik-select CONFIG.yaml [--output-dir DIR]``: rank the configured candidates by evidence."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", help="YAML file with data, candidates, trainer and callback sections")
    parser.add_argument("--output-dir", help="overrides `output_dir` of the YAML")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())  # class paths of the user's own modules, as with `python -m`
    with open(args.config) as f:
        config = yaml.safe_load(f)
    if args.output_dir:
        config["output_dir"] = args.output_dir
    results = select_from_config(config)
    width = max(len(r.name) for r in results)
    print(f"{'rank':>4}  {'candidate':<{width}}  {'marglik':>9}  {'params':>8}  metrics")
    for rank, r in enumerate(results, 1):
        shown = " ".join(f"{k}={v:.4f}" for k, v in r.metrics.items())
        print(f"{rank:>4}  {r.name:<{width}}  {r.marglik:>9.4f}  {r.n_params:>8}  {shown}")


if __name__ == "__main__":
    main()
