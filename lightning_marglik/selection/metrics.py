"""The test metrics of model selection: reported next to the evidence, never used to select.

Test batches are read as the evidence reads them (``marglik_batch``) and scored at the positions
the likelihood counts (classes last in ``(B, ..., C)``, ``ignore_index`` left out); the first
test batch goes through the metrics when training starts, so that a mismatch costs no training.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor

from ..callbacks import find_hyperparameters
from ..curvature.batches import call_model, move, split_batch
from ..evidence import LaplaceEvidence
from ..hyperparameters import CategoricalLikelihood
from ..predictive import predict_classification

__all__ = ["MetricsCheck", "NegativeLogLikelihood", "check_predictive", "default_metrics", "evaluate_metrics"]


class NegativeLogLikelihood(torchmetrics.Metric):
    """Mean negative log-likelihood of integer labels under predicted class probabilities.

    Probabilities ``(B, ..., C)``, classes last, with labels ``(B, ...)`` in ``[0, C)``: the selection's test
    batches reach it with the positions labelled ``ignore_index`` already left out.

    Example:
        >>> metric = NegativeLogLikelihood()
        >>> metric.update(torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.tensor([0, 1]))
        >>> round(metric.compute().item(), 4)  # -(log 0.5 + log 0.75) / 2
        0.4904
    """

    higher_is_better = False
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add a batch of probabilities ``(B, ..., C)`` and their integer labels ``(B, ...)``.

        Raises:
            ValueError: On labels that are not integers of the probabilities' shape without the classes, or outside
                ``[0, C)``; on probabilities with a negative entry or rows that do not sum to 1 (logits).
        """
        classes = probs.shape[-1]
        if target.shape != probs.shape[:-1] or target.is_floating_point() or target.dtype == torch.bool:
            raise ValueError(f"NegativeLogLikelihood takes integer labels of shape {tuple(probs.shape[:-1])} (the "
                             f"probabilities' {tuple(probs.shape)} without the classes), got {tuple(target.shape)} of "
                             f"{target.dtype}: pass integer labels of that shape.")
        if target.numel() and (target.min() < 0 or target.max() >= classes):
            raise ValueError(f"NegativeLogLikelihood takes labels in [0, {classes}), got values in "
                             f"[{int(target.min())}, {int(target.max())}]: leave out the ignored positions (e.g. "
                             "ignore_index=-100) and check the number of classes.")
        sums, negative = probs.sum(-1), (probs < 0).any()
        off = (sums - 1).abs()
        if negative or (off > 1e-3).any():
            got = (f"an entry {float(probs.min()):.4g}" if negative
                   else f"a row summing to {float(sums.flatten()[off.argmax()]):.4g}")
            raise ValueError(f"NegativeLogLikelihood takes class probabilities, got {got} (logits?): pass "
                             "probabilities, logits.softmax(-1).")
        picked = probs.reshape(-1, classes).gather(1, target.reshape(-1, 1).long()).clamp_min(1e-12)
        self.total += -picked.log().sum().double()
        self.count += target.numel()

    def compute(self) -> Tensor:
        return self.total / self.count


def default_metrics(n_classes: int) -> Dict[str, torchmetrics.Metric]:
    """Accuracy, NLL and expected calibration error (15 bins) for ``n_classes`` classes.

    Example:
        >>> sorted(default_metrics(3))
        ['accuracy', 'ece', 'nll']
    """
    return {
        "accuracy": torchmetrics.classification.MulticlassAccuracy(n_classes, average="micro"),
        "nll": NegativeLogLikelihood(),
        "ece": torchmetrics.classification.MulticlassCalibrationError(n_classes, n_bins=15, norm="l1"),
    }


def check_predictive(likelihood: Any, predictive: str, inputs: Any = None) -> None:
    """Refuse a ``predictive`` the test metrics cannot take with this likelihood (and these inputs, where given).

    Example:
        >>> from lightning_marglik import GaussianLikelihood
        >>> check_predictive(GaussianLikelihood(), "probit")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: predictive='probit' needs a CategoricalLikelihood ...; use predictive='map' (got GaussianLikelihood).

    Raises:
        ValueError: On ``"probit"`` with a likelihood other than ``CategoricalLikelihood`` or inputs that are not a
            tensor.
    """
    tensors = inputs is None or isinstance(inputs, Tensor)
    if predictive == "probit" and not (isinstance(likelihood, CategoricalLikelihood) and tensors):
        got = "" if inputs is None else f" and {type(inputs).__name__} inputs"
        raise ValueError("predictive='probit' needs a CategoricalLikelihood and tensor inputs; use predictive='map' "
                         f"(got {type(likelihood).__name__}{got}).")


def _predictions(
    module: pl.LightningModule, evidence: Optional[LaplaceEvidence], batch: Any, predictive: str
) -> Tuple[Tensor, Tensor]:
    """What the test metrics see of one batch: ``(predictions, targets)`` on the CPU.

    The batch is read as the evidence reads it (``marglik_batch`` or ``(inputs, targets)``).
    Under a categorical likelihood the predictions are class probabilities ``(n, C)`` of the
    positions the likelihood counts: classes on the last dimension of ``(B, ..., C)`` outputs,
    positions labelled ``ignore_index`` left out. Other likelihoods get the raw outputs.
    """
    _, likelihood = find_hyperparameters(module)
    inputs, target = split_batch(batch, getattr(module, "marglik_batch", None))
    weight = next(module.parameters())
    inputs = move(inputs, weight.device, weight.dtype)
    check_predictive(likelihood, predictive, inputs)
    if predictive == "probit":
        if evidence is None:  # the check before training: the network's output shape is all it needs
            with torch.no_grad():
                output = call_model(module, inputs)
            if output.dim() != 2:
                raise ValueError(f"predictive='probit' needs (batch, classes) outputs, got {tuple(output.shape)}; "
                                 "use predictive='map' for sequence outputs.")
            output = output.softmax(-1)
        else:
            output = predict_classification(evidence, module, inputs, "probit")
    else:
        with torch.no_grad():
            output = call_model(module, inputs)
        if isinstance(likelihood, CategoricalLikelihood):
            output = output.softmax(-1)
    output, target = output.detach(), target.to(output.device)
    if isinstance(likelihood, CategoricalLikelihood):
        probs, labels, kept = likelihood.terms(output, target)
        output, target = probs[kept], labels[kept]
    return (output.float() if output.is_floating_point() else output).cpu(), target.cpu()


def evaluate_metrics(
    module: pl.LightningModule,
    evidence: Optional[LaplaceEvidence],
    loader: Any,
    metrics: Mapping[str, torchmetrics.Metric],
    predictive: str,
    batches: Optional[int] = None,
) -> Dict[str, float]:
    """The ``metrics`` over the first ``batches`` (default all) batches of ``loader``, in eval mode."""
    was_training = module.training
    module.eval()
    try:
        for batch in itertools.islice(loader, batches):
            predictions, target = _predictions(module, evidence, batch, predictive)
            for metric in metrics.values():
                metric.update(predictions, target)
        return {name: float(metric.compute()) for name, metric in metrics.items()}
    finally:
        module.train(was_training)
        for metric in metrics.values():
            metric.reset()


class MetricsCheck(pl.Callback):
    """Runs the first test batch through the metrics when training starts (after the module's set-up
    hooks), so that a batch, shape or metric mistake costs no training; keeps the metrics."""

    def __init__(
        self, loader: Any, metrics: Optional[Callable[[], Mapping[str, torchmetrics.Metric]]], predictive: str
    ) -> None:
        self.loader, self.factory, self.predictive = loader, metrics, predictive
        self.metrics: Dict[str, torchmetrics.Metric] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.factory is not None:
            self.metrics = dict(self.factory())
        elif isinstance(find_hyperparameters(pl_module)[1], CategoricalLikelihood):
            module_mode = pl_module.training
            pl_module.eval()
            try:
                predictions, _ = _predictions(pl_module, None, next(iter(self.loader)), "map")
            finally:
                pl_module.train(module_mode)
            self.metrics = default_metrics(predictions.shape[-1])
        evaluate_metrics(pl_module, None, self.loader, self.metrics, self.predictive, batches=1)
