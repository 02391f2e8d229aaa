"""Empirical-Fisher statistics from the forward and backward that training already runs.

The MAP loss ``mean_n nll_n / T + penalty / N`` (:func:`lightning_marglik.map_loss`) of a batch
with ``n`` kept terms, divided by the gradient-accumulation factor ``q``, has the gradient
``g_train = 1 / (n q T) * d nll_n / d out`` w.r.t. a layer's output ``out`` (the prior term does
not flow through layer outputs). The evidence pass's EF factor column is the unit-scale score,
whose square is ``T / s`` times the square of ``d (nll_n / T) / d out`` (``s`` the likelihood's
``curvature_scale("ef")``, e.g. ``1 / (sigma^4 T)``): so ``g_train * n q sqrt(T / s)`` is the
evidence pass's ``g`` up to its sign, and the structures' layer rules take it unchanged. A
forward hook records each hooked layer's input and puts a tensor hook on its output; the
tensor hook accumulates the layer's sums when the training backward reaches it. A forward hook on
the model adds the likelihood's statistics of the batch (the data term of the evidence).

What this relies on (the set-up check compares one batch's sums with the evidence pass's at the
same weights, :func:`mismatch`): the loss is ``map_loss`` of the model's one ``forward`` call per
step, the training forward equals the eval-mode one (no dropout, no batch statistics), and every
output row's gradient comes from one term (``(B, C)`` outputs; a ``(B, T, C)`` output takes a
sequence's positions as separate data, which the summed training gradient cannot tell apart once
layers mix positions).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..hyperparameters import Likelihood
from .batches import BatchFn, split_batch
from .hooks import layer_input
from .statistics import BatchCurvature, CurvatureStatistics, LayerPlan

__all__ = ["TrainingPassStatistics", "exact_path_refusal", "mismatch"]


def exact_path_refusal(plan: CurvatureStatistics) -> Optional[str]:
    """Why the training pass cannot take a plan: modules on the exact path (``None`` if it can).

    Their parameters have no per-example gradient in a plain backward (no layer output whose
    gradient is per example), and recomputing it would be the data pass the option avoids.
    """
    if not plan.slow:
        return None
    listed = "; ".join(f"'{name or '<top-level module>'}': {why}" for name, why in plan.slow.items())
    return (
        f"statistics='training' takes per-example gradients at the outputs of hooked layers, but the parameters of "
        f"{len(plan.slow)} module(s) take the exact per-example path, which a training backward does not give: "
        f"{listed}. Use statistics='pass' (the evidence pass), or register a layer rule for them "
        "(lightning_marglik.register_layer_rule)."
    )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Layer products in float64 for a float64 model, else float32 (bf16 gradients included); sums are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class TrainingPassStatistics:
    """Accumulates the EF statistics of the training batches between :meth:`begin` and :meth:`end`.

    Args:
        model: The module whose ``forward`` the training step calls once per batch.
        likelihood: The likelihood of ``map_loss``.
        plan: Statistics of the evidence pass on one batch (:func:`collect_statistics`): their
            structures are the template (layers and layout) of the accumulated ones.
        batch_fn: Maps a training batch to ``(inputs, targets)``; default: batches are such pairs.

    Raises:
        ValueError: If the plan has parameters on the exact path (:func:`exact_path_refusal`).
    """

    def __init__(
        self, model: nn.Module, likelihood: Likelihood, plan: CurvatureStatistics, batch_fn: Optional[BatchFn] = None
    ) -> None:
        reason = exact_path_refusal(plan)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.likelihood = likelihood
        self.plan = plan
        self.batch_fn = batch_fn
        layers: Dict[str, LayerPlan] = {}
        for structure in plan.structures:
            for layer in getattr(structure, "layers", []):
                layers.setdefault(layer.name, layer)
        self.layers = list(layers.values())
        self.batches = 0  # training batches accumulated since reset()
        self.layer_data = 0  # data terms of the batches whose layer products are in the sums
        self.problems: List[str] = []  # what the hooks saw that breaks the sums (reported by the set-up check)
        self._handles: list = []
        self._active = False
        self._layers = True
        self._target: Optional[Tensor] = None
        self._divisor = 1
        self._scale: Optional[float] = None
        self._called: Dict[str, int] = {}
        self._calls: List[bool] = []  # per model call in progress: whether it contains another model call
        self.reset()

    def reset(self) -> None:
        """Start new sums (a new epoch)."""
        self.stats = CurvatureStatistics(
            self.plan.options, list(self.plan.names), [s.zeroed() for s in self.plan.structures]
        )
        self.batches = 0
        self.layer_data = 0

    def attach(self) -> None:
        """Install the forward hooks (idle outside :meth:`begin` ... :meth:`end`)."""
        if self._handles:
            return
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(self._layer_hook(layer), with_kwargs=True))
        self._handles.append(self.model.register_forward_pre_hook(self._enter_model))
        self._handles.append(self.model.register_forward_hook(self._output_hook))

    def detach(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False

    def begin(self, batch: Any, loss_divisor: int = 1, layers: bool = True) -> None:
        """Record the training batch about to run (its forward and backward).

        Args:
            batch: The training batch, as the training step gets it.
            loss_divisor: What the training loop divides the loss by (gradient accumulation).
            layers: Whether to sum the batch's layer products too (else only its likelihood
                statistics: :meth:`take` scales the layers' sums to all the data).
        """
        _, self._target = split_batch(batch, self.batch_fn)
        self._divisor = loss_divisor
        self._layers = layers
        self._scale = None
        self._called = {}
        self._calls = []
        self._active = True

    def end(self) -> None:
        """The batch's backward is done (its sums are in :attr:`stats`)."""
        if self._active and self._scale is not None:
            self.batches += 1
        self._active = False
        self._target = None

    def take(self) -> CurvatureStatistics:
        """The sums since :meth:`reset`, the layers' scaled by ``n_data / layer_data`` where only some
        batches summed their layer products (an unbiased estimate of the whole data's sums when
        those batches are a uniform sample of it)."""
        n_data = self.stats.n_data
        if 0 < self.layer_data < n_data:
            for structure in self.stats.structures:
                structure.rescale(n_data / self.layer_data)
        return self.stats

    def _enter_model(self, module: nn.Module, args: Any) -> None:
        if self._calls:
            self._calls[-1] = True
        self._calls.append(False)

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        # A call that contains another call of the model is Lightning's redirection of training_step
        # through the model's __call__ (DDP and other wrapping strategies): its output is the loss.
        wraps = self._calls.pop() if self._calls else False
        if wraps or not self._active or not torch.is_grad_enabled():
            return
        if self._scale is not None:
            self._problem("the model's forward was called more than once in one training step")
            return
        if not isinstance(output, Tensor):
            self._problem(f"the model's forward returned a {type(output).__name__}, not the output tensor")
            return
        assert self._target is not None
        stats = self.likelihood.statistics(output.detach(), self._target.to(output.device))
        self.stats.add_likelihood(stats)
        values = {name: value.detach().double() for name, value in self.likelihood.hyperparameters().items()}
        unit = values["log_temperature"].exp() / self.likelihood.curvature_scale("ef", values)
        self._scale = int(stats["n_data"]) * self._divisor * math.sqrt(float(unit))
        if self._layers:
            self.layer_data += int(stats["n_data"])

    def _layer_hook(self, layer: LayerPlan):
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self._active or not self._layers or not torch.is_grad_enabled() or not isinstance(output, Tensor):
                return
            if not output.requires_grad:
                return
            self._called[layer.name] = self._called.get(layer.name, 0) + 1
            if self._called[layer.name] > 1:
                self._problem(f"module '{layer.name}' was called more than once in one training step")
                return
            given = layer_input(module, args, kwargs)  # a keyword call (self.lin(input=x)) too
            if given is None:
                self._problem(f"module '{layer.name}' was called without a tensor as its input in the training forward")
                return
            a = given.detach()
            if a.shape[:1] != output.shape[:1]:
                self._problem(
                    f"module '{layer.name}' has input {tuple(a.shape)} and output {tuple(output.shape)} with different "
                    "leading (batch) sizes in the training forward"
                )
                return
            output.register_hook(lambda g: self._accumulate(layer, a, g))

        return hook

    def _accumulate(self, layer: LayerPlan, a: Tensor, g: Tensor) -> None:
        if self._scale is None:  # the model's forward hook did not run: no likelihood scale
            self._problem(f"module '{layer.name}' ran in backward without a recorded model output")
            return
        compute = _compute_dtype(g.dtype)
        a = a.to(compute) if a.is_floating_point() else a
        batch = BatchCurvature([(layer, a, (g.detach().to(compute) * self._scale).unsqueeze(0))], None)
        for structure in self.stats.structures:
            structure.accumulate(batch)

    def _problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)


def mismatch(training: CurvatureStatistics, reference: CurvatureStatistics, rtol: float) -> Optional[str]:
    """The first statistic of one batch's training-pass sums that differs from the evidence pass's.

    Args:
        training: The training pass's sums of the batch.
        reference: The evidence pass's sums of the same batch at the same weights.
        rtol: Tolerance relative to the norm of each reference statistic.

    Returns:
        A description (name, norms, their ratio), or ``None`` if everything agrees.
    """
    pairs = [(f"likelihood {k}", training.likelihood.get(k), v) for k, v in reference.likelihood.items()]
    for index, (ours, theirs) in enumerate(zip(training.structures, reference.structures)):
        pairs += [(f"{type(theirs).__name__}[{index}] {k}", ours.states()[k], v) for k, v in theirs.states().items()]
    for name, ours, theirs in pairs:
        if ours is None:
            return f"{name}: missing from the training pass"
        ours, theirs = ours.double().cpu(), theirs.double().cpu()
        norm = float(theirs.norm())
        if float((ours - theirs).norm()) > rtol * max(norm, 1e-300):
            ratio = float(ours.norm()) / norm if norm else math.inf
            return f"{name}: |training| / |evidence pass| = {ratio:.4g}"
    return None
