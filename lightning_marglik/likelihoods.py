"""The likelihoods: a tempered ``p(y|f)^(1/T)`` with its own log-parameterised hyperparameters.

Conventions (one everywhere: MAP loss, evidence, docs): the log-likelihood *and* the curvature
(GGN or EF) are divided by the temperature ``T``; the Gaussian likelihood's GGN scales with
``1/sigma^2``, its empirical Fisher (outer product of the score ``J^T (y - f) / sigma^2``) with
``1/sigma^4``. Every hyperparameter is a buffer (see :mod:`lightning_marglik.hyperparameters`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .validators import flag, number


__all__ = [
    "CategoricalLikelihood", "GaussianLikelihood", "Likelihood", "categorical_rows", "categorical_traces", "log_buffer",
    "HyperparameterModule", "LOG_LIMIT",
]


def _log_limit(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return min(math.log(info.max), -math.log(info.tiny)) / 2 - 1


#: The largest ``|log h|`` a hyperparameter ``h`` held in a floating dtype may take: ``h^2`` and ``1 / h^2`` (a
#: variance ``sigma^2`` and a precision, which the likelihoods and solvers form) stay finite and normal in it, with a
#: factor ``e^2`` to spare: 42.67 in float32, 353.2 in float64.
LOG_LIMIT: Dict[torch.dtype, float] = {
    dtype: _log_limit(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def log_buffer(value: float, name: str) -> Tensor:
    """``log value`` as a 0-dim tensor, for a hyperparameter given as a positive finite number (or a one-element
    tensor of one) within :data:`LOG_LIMIT`'s range; a list, a string or a tensor of several values is refused
    with the option's name."""
    value = number(value, name)  # a one-element tensor as its number
    log_value = torch.tensor(math.log(value))
    limit = LOG_LIMIT[log_value.dtype]
    if not abs(float(log_value)) <= limit:
        raise ValueError(f"`{name}` must lie within e^-{limit:.1f} to e^{limit:.1f} ({math.exp(-limit):.3g} to "
                         f"{math.exp(limit):.3g}: its square and inverse square stay within {log_value.dtype}, the "
                         f"dtype it is held in), got {value!r}.")
    return log_value


def categorical_traces(logits: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
    """Per datum ``||y - p||^2`` and ``1 - ||p||^2`` (the traces of the EF's and the GGN's output-space
    factors) in float64, accurate however confident the fit (:func:`categorical_rows`' first two)."""
    return categorical_rows(logits, labels)[:2]


def categorical_rows(logits: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per datum the two traces of :func:`categorical_traces`, the top class's probability and whether the label is
    the top class (the network's confidence and accuracy on its data, which :func:`lightning_marglik.predict` reads).

    ``1 - p_c`` is computed as the sum of the other probabilities for each datum's most probable
    class: subtracting ``p_c ~ 1`` from 1 would cancel to 0 (and the ratio to 0/0) long before the
    curvature itself vanishes in float64. Every other class has ``p_c <= 1/2``, so its terms need no
    such care: with ``o`` and ``q`` the sum and the sum of squares of the probabilities but the top
    class's ``p_t``, ``1 - ||p||^2 = o - q + p_t o`` and ``||y - p||^2 = q + p_t^2 - p_y^2 + (1 - p_y)^2``
    (``q + o^2`` where ``y`` is the top class). Two passes over the classes after the softmax (a
    50,257-token vocabulary makes every pass count), none of them a copy.
    """
    probs = logits.double().softmax(1)
    rows = torch.arange(probs.shape[0], device=probs.device)
    top = probs.argmax(1)
    p_top, p_label = probs[rows, top], probs[rows, labels]
    probs[rows, top] = 0.0  # the softmax's own output: no copy
    others = probs.sum(1)
    squares = torch.einsum("nc,nc->n", probs, probs)
    hit = labels == top
    miss = torch.where(hit, others, 1 - p_label)  # 1 - p_y
    ef = squares + torch.where(hit, 0.0, p_top * p_top - p_label * p_label) + miss * miss
    return ef, others - squares + p_top * others, p_top, hit


def sample_classes(probs: Tensor, samples: int, generator: Optional[torch.Generator]) -> Tensor:
    """``samples`` classes per row of ``probs`` ``(rows, C)``, drawn with replacement by inverting each row's
    cumulative distribution: one uniform per draw (from ``generator``, a CPU generator, whatever the device),
    where ``torch.multinomial`` draws one exponential per class: 50,257 per token of a GPT-2 vocabulary, most
    of an estimate's time there. A class of probability 0 is never drawn.

    Returns:
        ``(rows, samples)`` class indices (int64, on ``probs``' device).
    """
    cdf = probs.cumsum(1)
    uniform = torch.rand(probs.shape[0], samples, generator=generator, dtype=probs.dtype).to(probs.device)
    draws = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)  # the first class whose cdf exceeds it
    return draws.clamp_(max=probs.shape[1] - 1)  # a uniform rounded up to the total


def _row_by_row(mask: Tensor) -> bool:
    """Whether a batch's terms are computed on every row and the ignored rows dropped after, with no copy of the
    outputs (a vocabulary's logits): where at least 4 in 5 rows are kept. With more ignored rows (masked prompts)
    the kept rows' copy is cheaper: on 1,024 rows of 50,257 logits the two took as long between 70 and 80 % kept
    for the statistics, near 50 % for the NLL (``benchmarks/results/output_size.md``). Either way the kept rows'
    values are the same."""
    return int(mask.sum()) * 5 >= 4 * mask.numel()


def _at_least_float32(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 where it is half precision (fp16 cannot hold ``sigma^2`` outside about [0.004, 255],
    nor a batch's sum of squares), else itself."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class HyperparameterModule(nn.Module):
    """A module whose floating buffers are log hyperparameters: ``.half()``, ``.bfloat16()`` and Lightning's
    ``"16-true"``/``"bf16-true"`` convert the network, but these stay float32. A half-precision ``log h`` moves in
    steps of about 0.016 near 3, which round an estimate's update away (the prior stopped learning under
    ``bf16-true``), and fp16 cannot hold ``sigma^2`` or ``1 / sigma^2`` outside about [0.004, 255]."""

    def _apply(self, fn: Any, recurse: bool = True) -> "HyperparameterModule":
        before = {name: b for name, b in self._buffers.items() if b is not None and b.is_floating_point()}
        module = super()._apply(fn, recurse)
        for name, held in before.items():
            after = self._buffers[name]
            if after is not None and after.dtype in (torch.float16, torch.bfloat16):
                self._buffers[name] = held.to(device=after.device, dtype=torch.float32)
        return module


class Likelihood(HyperparameterModule):
    """Base class of the likelihoods: a tempered ``p(y|f)^(1/T)`` with a learnable temperature.

    Outputs are ``(B, ..., C)``: every position ``(b, ...)`` is one *term* (datum) of the
    log-likelihood and one row of the curvature. Subclasses define the per-term negative
    log-likelihood, the sufficient statistics of the data term, a square root of the loss Hessian
    per term, and their own hyperparameters (log-parameterised buffers) with how they enter the
    log-likelihood and the curvature scale.
    """

    log_temperature: Tensor

    def __init__(self, temperature: float = 1.0, learn_temperature: bool = False) -> None:
        super().__init__()
        self.register_buffer("log_temperature", log_buffer(temperature, "temperature"))
        self.learn_temperature = flag(learn_temperature, "learn_temperature")
        if self.learn_temperature:
            warnings.warn(
                "learn_temperature=True: p(y|f)^(1/T) is not normalized in y, so the evidence can grow towards "
                "T -> infinity with the prior precision -> 0 (measured: no finite optimum on classification "
                "problems). Fix T (e.g. from the augmentation factor) unless you check the learned value.",
                stacklevel=3,
            )

    @property
    def temperature(self) -> Tensor:
        return self.log_temperature.exp()

    def hyperparameters(self) -> Dict[str, Tensor]:
        """The log hyperparameter buffers by name."""
        return {"log_temperature": self.log_temperature}

    def learnable(self) -> List[str]:
        """Names of the log hyperparameters the evidence optimizes."""
        return ["log_temperature"] if self.learn_temperature else []

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        """Validate a batch and return the target in the shape the likelihood works with."""
        raise NotImplementedError

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        """Outputs ``(n, C)``, targets and a boolean mask ``(n,)`` of the kept terms, one row per position."""
        raise NotImplementedError

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Untempered negative log-likelihood of each row of :meth:`terms`, shape ``(n,)``."""
        raise NotImplementedError

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        """Factor ``L`` ``(n, C, k)`` of each term's curvature in ``f`` (unit noise and temperature), a tensor of
        its own: the rows of ignored terms are zeroed in it."""
        raise NotImplementedError

    def term_columns(self, n_outputs: int, approx: str, mc_samples: int) -> int:
        """Columns ``k`` of :meth:`term_hessian_sqrt` for terms of ``n_outputs`` values (each costs the
        evidence pass one backward pass): the exact GGN ``C`` or ``C - 1``, Monte-Carlo ``mc_samples``, EF 1."""
        raise NotImplementedError

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        """Sum-reduced sufficient statistics of the terms ``mask`` keeps (integer counts as int64 tensors), computed
        row by row on ``output``'s rows and then selected."""
        raise NotImplementedError

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        """Tempered log-likelihood ``log p(D|theta) / T`` from summed statistics at log hyperparameters ``values``."""
        raise NotImplementedError

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        """The factor ``s`` of ``H = s C + diag(delta)`` for the unit-scale curvature ``C``."""
        raise NotImplementedError

    # --- shared by every likelihood: positions as terms -------------------------------------

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Untempered negative log-likelihood of every kept term at the current hyperparameters, ``(n_kept,)``."""
        flat, flat_target, mask = self.terms(output, target)
        # with gradients, the kept rows only: an ignored row's non-finite outputs (padding) would reach them as 0 * nan
        if (output.requires_grad and torch.is_grad_enabled()) or not _row_by_row(mask):
            return self.term_nll(flat[mask], flat_target[mask])
        return self.term_nll(flat, flat_target)[mask]

    def count(self, output: Tensor, target: Tensor) -> int:
        """Number of kept terms (data) in the batch: what ``n_data`` counts."""
        return int(self.terms(output, target)[2].sum())

    def count_targets(self, target: Tensor, like: Tensor) -> int:
        """What :meth:`count` gives for a batch's targets alone, without a forward pass.

        The same checks and mask as :meth:`count`, on a zero-stride stand-in for the batch's
        outputs (no memory): the leading sizes from ``target``, the number of outputs from ``like``
        (the outputs of another batch of the same data).
        """
        leading = target.shape if target.dim() < like.dim() else target.shape[:-1]
        stand_in = torch.zeros((), dtype=like.dtype, device=target.device).expand(*leading, like.shape[-1])
        return self.count(stand_in, target)

    def statistics(self, output: Tensor, target: Tensor) -> Dict[str, Tensor]:
        """Sum-reduced statistics of the batch, computed in float64 whatever the output dtype."""
        flat, flat_target, mask = self.terms(output.double(), target)
        if not _row_by_row(mask):
            flat, flat_target, mask = flat[mask], flat_target[mask], mask[mask]
        stats = self.term_statistics(flat, flat_target, mask)
        stats["n_data"] = mask.sum()
        return stats

    def factor_columns(self, output_shape: Sequence[int], approx: str, mc_samples: int) -> int:
        """Columns ``K`` of :meth:`hessian_sqrt` for outputs of ``output_shape``: the backward passes the
        evidence pass takes per batch (``k`` per term, times the positions of ``(B, T, C)`` outputs unless sampled)."""
        k = self.term_columns(output_shape[-1], approx, mc_samples)
        if len(output_shape) == 2 or (approx == "ggn" and mc_samples):
            return k
        return k * math.prod(output_shape[1:-1])

    def hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        """Factor ``L_n`` ``(B, M, K)`` of each example's curvature in its flattened output (``M`` values).

        For ``(B, C)`` outputs, ``K`` is the per-term ``k``. For ``(B, T, C)`` outputs the terms of
        one example must stay separate (the curvature is block-diagonal over positions): ``K = T k``
        columns, each supported on one position, except for the Monte-Carlo GGN, whose ``k``
        samples may sum over positions (independent draws: the same GGN in expectation). Ignored
        positions have zero columns. Computed in float64, returned in the output's dtype.
        """
        flat, flat_target, mask = self.terms(output.detach().double(), target)
        factor = self.term_hessian_sqrt(flat, flat_target, approx, mc_samples, generator)
        if not bool(mask.all()):
            factor[~mask] = 0  # ignored positions: zero columns, written in place (a vocabulary's factor is large)
        b, c, k = output.shape[0], output.shape[-1], factor.shape[2]
        if output.dim() == 2:
            return factor.to(output.dtype)
        positions = flat.shape[0] // b
        factor = factor.reshape(b, positions, c, k)
        if approx == "ggn" and mc_samples:
            return factor.reshape(b, positions * c, k).to(output.dtype)
        eye = torch.eye(positions, dtype=factor.dtype, device=factor.device)
        return torch.einsum("btck,ts->btcsk", factor, eye).reshape(b, positions * c, positions * k).to(output.dtype)


class GaussianLikelihood(Likelihood):
    """Gaussian likelihood ``N(y | f, sigma^2 I)`` for regression, with learnable noise.

    Outputs ``(B, ..., D)``: each position is one datum with ``D`` outputs.

    Args:
        sigma: Initial observation noise standard deviation.
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_sigma: Whether the marginal likelihood optimizes ``sigma``.
        learn_temperature: Whether the marginal likelihood optimizes ``T`` (warns: the tempered
            evidence may have no finite optimum in ``T``; see the README).

    Raises:
        ValueError: On a non-positive or non-finite ``sigma`` or ``temperature``, or a ``learn_sigma`` or
            ``learn_temperature`` that is not a bool.

    Example:
        >>> lik = GaussianLikelihood(sigma=0.5)
        >>> round(float(lik.sigma), 3)
        0.5
    """

    log_sigma: Tensor

    def __init__(
        self, sigma: float = 1.0, temperature: float = 1.0, learn_sigma: bool = True, learn_temperature: bool = False
    ) -> None:
        super().__init__(temperature, learn_temperature)
        self.register_buffer("log_sigma", log_buffer(sigma, "sigma"))
        self.learn_sigma = flag(learn_sigma, "learn_sigma")

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    def hyperparameters(self) -> Dict[str, Tensor]:
        return {**super().hyperparameters(), "log_sigma": self.log_sigma}

    def learnable(self) -> List[str]:
        return super().learnable() + (["log_sigma"] if self.learn_sigma else [])

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        if output.dim() < 2:
            raise ValueError(
                f"GaussianLikelihood expects outputs of shape (batch, ..., outputs), got {tuple(output.shape)}; "
                "return (batch, 1) for a single output."
            )
        # integer targets are most often class labels given to the regression likelihood by mistake
        labels = "" if target.is_floating_point() else (
            " Integer targets are class labels: for classification use CategoricalLikelihood (for regression "
            "pass the targets as floats, y.float())."
        )
        if target.shape == output.shape[:-1] and output.shape[-1] == 1:
            target = target.unsqueeze(-1)
        if target.shape != output.shape:
            raise ValueError(
                f"GaussianLikelihood: target shape {tuple(target.shape)} does not match output shape "
                f"{tuple(output.shape)}.{labels}"
            )
        if labels:
            raise ValueError(f"GaussianLikelihood expects floating-point targets, got {target.dtype}.{labels}")
        return target.to(output.dtype)

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        target = self.check_target(output, target)
        d = output.shape[-1]
        flat = output.reshape(-1, d)
        return flat, target.reshape(-1, d), torch.ones(flat.shape[0], dtype=torch.bool, device=output.device)

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        residual = _at_least_float32(target - output)
        sigma2 = self.sigma.detach().to(residual.dtype) ** 2
        return 0.5 * (residual ** 2).sum(1) / sigma2 + 0.5 * output.shape[1] * torch.log(2 * math.pi * sigma2)

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        squares = _at_least_float32(target - output) ** 2
        return {"sse": squares[mask].sum(), "n_outputs": torch.tensor(int(mask.sum()) * target.shape[1])}

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        log_sigma = values["log_sigma"]
        n_outputs = stats["n_outputs"].to(log_sigma.dtype)
        loglik = -0.5 * n_outputs * (math.log(2 * math.pi) + 2 * log_sigma) - 0.5 * stats["sse"] * torch.exp(-2 * log_sigma)
        return loglik * torch.exp(-values["log_temperature"])

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        n, c = output.shape
        if approx == "ef":
            return (target - output).unsqueeze(2)
        if mc_samples:
            noise = torch.randn(n, c, mc_samples, dtype=output.dtype, generator=generator).to(output.device)
            return noise / math.sqrt(mc_samples)
        return torch.eye(c, dtype=output.dtype, device=output.device).repeat(n, 1, 1)

    def term_columns(self, n_outputs: int, approx: str, mc_samples: int) -> int:
        return 1 if approx == "ef" else mc_samples or n_outputs

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        power = 4 if approx == "ef" else 2  # the score carries 1/sigma^2, its outer product 1/sigma^4
        return torch.exp(-power * values["log_sigma"] - values["log_temperature"])

    def extra_repr(self) -> str:
        return f"learn_sigma={self.learn_sigma}, learn_temperature={self.learn_temperature}"


def _binary(output: Tensor) -> str:
    """The fix for a single logit (a binary classifier written for a sigmoid), or ``""``."""
    if output.shape[-1] > 1:
        return ""
    return " For binary classification return 2 logits (e.g. nn.Linear(width, 2)) and integer labels 0 and 1."


def _label_mistake(output: Tensor, target: Tensor) -> str:
    """The likely mistake behind targets that are not integer labels of the logits' shape without the classes, and
    its fix, or ``""``.

    Example:
        >>> logits = torch.zeros(2, 3)
        >>> "y.argmax(-1)" in _label_mistake(logits, torch.eye(3)[[0, 2]])  # one-hot rows
        True
        >>> "GaussianLikelihood" in _label_mistake(logits, torch.randn(2, 3) + 5)  # rows of no distribution
        True
        >>> "y.squeeze(-1)" in _label_mistake(logits, torch.tensor([[0], [2]]))  # a column of labels
        True
    """
    classes = output.shape[-1]
    # rows that are distributions over the classes: one-hot or soft labels, as cross_entropy also takes them
    if target.shape == output.shape and classes > 1 and (not target.is_floating_point() or bool(
            (target >= 0).all() and ((target.sum(-1) - 1).abs() <= 1e-3).all())):
        return (" Targets of the logits' shape are one-hot or soft labels, which are not supported: pass the class "
                "indices, y.argmax(-1).")
    # logits (B, C, ...) as F.cross_entropy takes them, whose labels (B, ...) are the rest of their shape
    if output.dim() > 2 and target.shape == output.shape[:1] + output.shape[2:]:
        return (f" The logits look laid out (batch, classes, ...) with {output.shape[1]} classes, as F.cross_entropy "
                "takes them: the classes must be on the last dimension, pass logits.movedim(1, -1).")
    # labels with a trailing dimension of 1, as a data frame's column gives them
    if target.shape == output.shape[:-1] + (1,) and classes > 1:
        fix = "y.squeeze(-1).long()" if target.is_floating_point() else "y.squeeze(-1)"
        return f" Labels of shape {tuple(target.shape)} carry a trailing dimension of 1: pass {fix}."
    # other floating-point targets are most often regression targets given to the classifier's likelihood
    if target.is_floating_point():
        return (" Floating-point targets are regression targets: for regression use GaussianLikelihood (for "
                "classification pass the labels as integers, y.long()).")
    return ""


class CategoricalLikelihood(Likelihood):
    """Categorical likelihood ``softmax(f)`` over class logits for classification.

    Logits ``(B, C)`` with labels ``(B,)``, or ``(B, ..., C)`` with labels ``(B, ...)`` (token or
    pixel classification): every position whose label is not ``ignore_index`` is one datum.
    Labels of every integer dtype (``int8`` ... ``int64``, ``uint8``) are taken as ``int64``.

    Args:
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_temperature: Whether the marginal likelihood optimizes ``T`` (warns: the tempered
            evidence may have no finite optimum in ``T``; see the README).
        ignore_index: Label of positions that are not data (padding), as in ``F.cross_entropy``.

    Raises:
        ValueError: On a non-positive or non-finite ``temperature``, or a ``learn_temperature`` that is not a bool.

    Example:
        >>> lik = CategoricalLikelihood()
        >>> torch.allclose(lik.nll(torch.zeros(2, 4), torch.tensor([0, 3])), torch.tensor(math.log(4)))
        True
        >>> tokens = CategoricalLikelihood(ignore_index=-100)  # (batch, positions, classes) logits
        >>> tokens.count(torch.zeros(2, 3, 4), torch.tensor([[0, 1, -100], [2, -100, -100]]))
        3
    """

    def __init__(self, temperature: float = 1.0, learn_temperature: bool = False, ignore_index: int = -100) -> None:
        super().__init__(temperature, learn_temperature)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"`ignore_index` must be an int label (e.g. -100), got {ignore_index!r}.")
        self.ignore_index = ignore_index

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        if output.dim() < 2:
            raise ValueError(f"CategoricalLikelihood expects logits of shape (batch, ..., classes), got {tuple(output.shape)}.")
        if target.shape != output.shape[:-1] or target.dtype.is_floating_point or target.dtype == torch.bool:
            raise ValueError(
                f"CategoricalLikelihood expects integer class labels of shape {tuple(output.shape[:-1])}, got "
                f"{tuple(target.shape)} of {target.dtype}.{_label_mistake(output, target)}{_binary(output)}"
            )
        if output.shape[-1] < 2:  # a softmax over one logit is 1 whatever the weights: nothing would be learned
            raise ValueError(
                f"CategoricalLikelihood needs at least 2 classes, got logits of shape {tuple(output.shape)}.{_binary(output)}"
            )
        target = target.long()  # every integer dtype: cross_entropy and one_hot take int64 labels
        kept = target[target != self.ignore_index]
        if kept.numel() and (kept.min() < 0 or kept.max() >= output.shape[-1]):
            raise ValueError(
                f"CategoricalLikelihood: labels must lie in [0, {output.shape[-1]}) or equal ignore_index="
                f"{self.ignore_index}, got values in [{int(kept.min())}, {int(kept.max())}]."
            )
        return target

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        target = self.check_target(output, target).reshape(-1)
        mask = target != self.ignore_index
        return output.reshape(-1, output.shape[-1]), torch.where(mask, target, 0), mask

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, target, reduction="none")

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        # the output-space traces of the EF and the GGN factors, for the EF's curvature check (diagnostics); the
        # confidence and the correct count, for the predictive's choice of whether to apply the posterior at all
        ef_trace, ggn_trace, confidence, correct = categorical_rows(output, target)
        log_lik = -self.term_nll(output, target)[mask].sum()
        return {"log_lik": log_lik, "ef_trace": ef_trace[mask].sum(), "ggn_trace": ggn_trace[mask].sum(),
                "confidence": confidence[mask].sum(), "correct": correct[mask].sum()}

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        return stats["log_lik"] * torch.exp(-values["log_temperature"])

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        probs = output.softmax(1)
        if approx == "ef":
            onehot = nn.functional.one_hot(target, output.shape[1]).to(output.dtype)
            return (onehot - probs).unsqueeze(2)
        if mc_samples:
            draws = sample_classes(probs, mc_samples, generator)
            # onehot(draw) - p, built on -p in place: no one-hot over C classes per sample (50,257 for a GPT-2)
            factor = probs.neg_().unsqueeze(1).expand(-1, mc_samples, -1).contiguous()
            factor.scatter_add_(2, draws.unsqueeze(2), factor.new_ones(draws.shape + (1,)))
            return factor.transpose(1, 2).div_(math.sqrt(mc_samples))
        # diag(p) - p p^T = D^1/2 (I - s s^T) D^1/2 with s = sqrt(p), |s| = 1, has rank C - 1 (s spans
        # its null space): C - 1 columns suffice, one backward pass fewer. The Householder reflection
        # H = I - 2 v v^T / v^T v with v = s + e_C maps s to -e_C, so its first C - 1 columns are an
        # orthonormal basis of s's complement; v^T v = 2 + 2 s_C >= 2 keeps it stable.
        sqrt_p = probs.sqrt()
        v = sqrt_p.clone()
        v[:, -1] += 1
        reflection = torch.eye(output.shape[1], dtype=output.dtype, device=output.device) - 2 * v.unsqueeze(
            2
        ) * v.unsqueeze(1) / (v * v).sum(1).reshape(-1, 1, 1)
        return sqrt_p.unsqueeze(2) * reflection[:, :, :-1]

    def term_columns(self, n_outputs: int, approx: str, mc_samples: int) -> int:
        return 1 if approx == "ef" else mc_samples or n_outputs - 1

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        return torch.exp(-values["log_temperature"])

    def extra_repr(self) -> str:
        return f"learn_temperature={self.learn_temperature}, ignore_index={self.ignore_index}"
