"""Is the empirical Fisher's evidence trustworthy here? A forward-pass check of its curvature scale.

The empirical Fisher (EF) and the GGN differ only in the output-space factor of each datum: the
EF takes the outer product of the observed residual, the GGN its expectation under the model.
For the categorical likelihood, ``(y - p)(y - p)^T`` against ``diag(p) - p p^T = E_{y~p}[(y - p)(y - p)^T]``,
whose traces are ``||y - p||^2`` and ``1 - ||p||^2``; for the Gaussian, ``r r^T / sigma^4`` against
``I / sigma^2`` (traces ``||r||^2 / sigma^4`` and ``D / sigma^2``). The ratio of the summed traces,

    r = sum_n tr EF_n / sum_n tr GGN_n,

is about 1 where the model is calibrated on its training data (labels distributed as it
predicts them) and tends to 0 as it fits them with growing confidence (interpolation): the
per-example gradients vanish faster than the GGN's curvature, the EF under-states the curvature
by about that factor, its Occam factor collapses and its evidence rates such a fit too highly
(Kunstner, Balles and Hennig, NeurIPS 2019, "Limitations of the Empirical Fisher Approximation").
For the Gaussian, ``r`` is the mean squared residual per output over ``sigma^2``: about 1 at the
sigma the evidence learns, far below where the noise is fixed too large for a fit of the data.

The check needs no pass of its own: the categorical likelihood sums both traces with its statistics,
so any evidence carries them (:func:`ef_ratio_of`); :func:`ef_curvature_ratio` runs one forward pass
(no Jacobians) for data of your own. ``benchmarks/results/ef_interpolation.md`` measures it along
training against the exact parameter-space diagonals and the GGN evidence, and dividing the EF's
curvature by ``r`` (:func:`rescale_empirical_fisher`) against the GGN's evidence and its choice of model.

Example:
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from lightning_marglik import CategoricalLikelihood
    >>> net = torch.nn.Linear(4, 3)
    >>> data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), batch_size=16)
    >>> ratio = ef_curvature_ratio(net, data, CategoricalLikelihood())
    >>> 0.0 < ratio
    True
    >>> ef_unreliable_message({"mlp": 0.02, "cnn": 0.9}).startswith("The empirical Fisher evidence of 'mlp'")
    True
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import validators
from .curvature import CurvatureStatistics, eval_mode
from .curvature.batches import BatchFn, call_model, move, split_batch
from .curvature.statistics import Structure
from .evidence import LaplaceEvidence, require_data
from .hyperparameters import CategoricalLikelihood, GaussianLikelihood, Likelihood

__all__ = [
    "EF_RATIO_THRESHOLD",
    "batch_traces",
    "curvature_traces",
    "ef_curvature_ratio",
    "ef_ratio_of",
    "ef_unreliable_message",
    "ratio_from_traces",
    "rescale_empirical_fisher",
    "traces_from_statistics",
]

# Below this ratio the EF evidence is not to be trusted: in benchmarks/results/ef_interpolation.md it separated
# exactly the checkpoints where a network had fitted its training set (and whose EF evidence was inflated).
EF_RATIO_THRESHOLD = 0.3

# What to do instead, by where the EF evidence was computed.
_FIXES = {
    "select_models": "rank by a GGN approximation instead (e.g. rank_by=\"kron-ggn\"; the default rank_by=\"auto\" "
                     "does so by itself)",
    "callback": "estimate with approx=\"ggn\" instead (e.g. MargLikCallback(structure=\"kron\", approx=\"ggn\"))",
}

_SUPPORTED = (CategoricalLikelihood, GaussianLikelihood)


def _check_likelihood(likelihood: Any) -> None:
    if not isinstance(likelihood, _SUPPORTED):
        raise TypeError(
            f"`likelihood` must be a CategoricalLikelihood or GaussianLikelihood, got {type(likelihood).__name__}: "
            "the curvature ratio is defined for these two."
        )


def batch_traces(output: Tensor, target: Tensor, likelihood: Likelihood) -> Tensor:
    """``[sum_n tr EF_n, sum_n tr GGN_n, n]`` of one batch's outputs, at unit curvature scale.

    For a pass that already has the outputs: sum these over its batches (and processes), then
    :func:`ratio_from_traces`. Per datum, ``||y - p||^2`` and ``1 - ||p||^2`` (categorical,
    positions labelled ``ignore_index`` left out) or ``||y - f||^2`` and ``D`` (Gaussian); outputs
    ``(B, ..., C)`` are split into data as the likelihood's ``terms`` does. The evidence pass sums
    the same traces in its likelihood statistics (:func:`traces_from_statistics`).

    Args:
        output: The network's outputs ``(B, ..., C)``.
        target: The batch's targets.
        likelihood: A ``CategoricalLikelihood`` or ``GaussianLikelihood``.

    Returns:
        A float64 tensor of three sums on the output's device.

    Raises:
        TypeError: On a likelihood of another type.
        ValueError: On targets that do not fit the likelihood.
    """
    _check_likelihood(likelihood)
    return traces_from_statistics(likelihood.statistics(output.detach(), target), likelihood)


def traces_from_statistics(statistics: Mapping[str, Tensor], likelihood: Likelihood) -> Tensor:
    """The three sums of :func:`batch_traces` from a likelihood's summed statistics (those of an
    evidence pass: ``LaplaceEvidence.likelihood_statistics``), so that the check costs no pass of its own.

    Raises:
        TypeError: On a likelihood of another type.
        KeyError: On statistics without the traces (gathered by another likelihood).
    """
    _check_likelihood(likelihood)
    keys = ("ef_trace", "ggn_trace") if isinstance(likelihood, CategoricalLikelihood) else ("sse", "n_outputs")
    return torch.stack([statistics[key].double() for key in (*keys, "n_data")])


def curvature_traces(
    model: nn.Module, dataloader: Iterable, likelihood: Likelihood, batch_fn: Optional[BatchFn] = None,
) -> Tensor:
    """:func:`batch_traces` summed over ``dataloader``: one forward pass, no Jacobians.

    The pass runs in eval mode (every submodule's mode restored after) without gradients, inputs
    moved to the device and floating dtype of the model's parameters. Sum the result over
    processes (all-reduce) for the traces of the whole data, then :func:`ratio_from_traces`.

    Args:
        model: Network mapping inputs to outputs ``(B, ..., C)`` (logits or predictions).
        dataloader: Iterable of batches covering the evidence data once.
        likelihood: A ``CategoricalLikelihood`` or ``GaussianLikelihood``.
        batch_fn: Maps a batch to ``(inputs, targets)``; default: batches are such pairs.

    Returns:
        A float64 CPU tensor of three sums: the EF trace, the GGN trace (both at unit scale) and
        the number of data.

    Raises:
        TypeError: On a model that is not an ``nn.Module``, a likelihood of another type, a
            ``batch_fn`` that is not callable, batches that are not ``(inputs, targets)`` pairs or
            a forward that does not return a tensor.
        ValueError: On a loader that yields no batch, or targets that do not fit the likelihood.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    _check_likelihood(likelihood)
    if batch_fn is not None and not callable(batch_fn):
        raise TypeError(f"`batch_fn` must map a batch to (inputs, targets), got {type(batch_fn).__name__} {batch_fn!r}.")
    param = next(model.parameters(), None)
    total: Optional[Tensor] = None
    with eval_mode(model), torch.no_grad():
        for batch in dataloader:
            inputs, target = split_batch(batch, batch_fn)
            if param is not None:
                inputs, target = move(inputs, param.device, param.dtype), target.to(param.device)
            traces = batch_traces(call_model(model, inputs), target, likelihood).cpu()
            total = traces if total is None else total + traces
    if total is None:
        raise ValueError("The data loader yielded no batch: the curvature ratio needs the evidence data.")
    return total


def ratio_from_traces(traces: Tensor, likelihood: Likelihood) -> float:
    """``tr EF / tr GGN`` from summed :func:`batch_traces`, with the likelihood's curvature scales.

    The scales are those the evidence uses at the likelihood's current hyperparameters:
    ``1 / sigma^4`` and ``1 / sigma^2`` for the Gaussian, ``1 / T`` for both approximations of the
    categorical (so that the temperature cancels).

    Args:
        traces: The three sums ``[tr EF, tr GGN, n_data]`` at unit scale (over every process).
        likelihood: The likelihood at its current hyperparameters.

    Returns:
        The ratio; 0 where both traces vanish (a softmax one-hot in float64 on every datum: the
        most confident fit there is), NaN where the outputs were not finite.

    Raises:
        TypeError: On a likelihood of another type, or ``traces`` that are not a tensor.
        ValueError: On a tensor that is not three sums, or no datum (e.g. every label ``ignore_index``).
    """
    _check_likelihood(likelihood)
    wanted = "`traces` must be the tensor [tr EF, tr GGN, n_data] of curvature_traces"
    if not isinstance(traces, Tensor):
        raise TypeError(f"{wanted}, got {type(traces).__name__}.")
    if traces.shape != (3,):
        raise ValueError(f"{wanted}, got shape {tuple(traces.shape)}.")
    ef, ggn, n_data = (float(v) for v in traces)
    require_data(int(n_data), likelihood)
    if ggn == 0 and ef == 0:
        return 0.0
    values = {name: value.detach().double().cpu() for name, value in likelihood.hyperparameters().items()}
    scale_ef, scale_ggn = (float(likelihood.curvature_scale(approx, values)) for approx in ("ef", "ggn"))
    return ef * scale_ef / (ggn * scale_ggn)


def ef_ratio_of(evidence: LaplaceEvidence) -> Optional[float]:
    """:func:`ef_curvature_ratio` of the data an evidence was built from, read from its likelihood
    statistics at the likelihood's current hyperparameters (no pass of its own); ``None`` for a
    likelihood of another type, or one whose statistics do not carry the traces (a subclass's own)."""
    likelihood, statistics = evidence.likelihood, evidence.likelihood_statistics
    if not isinstance(likelihood, _SUPPORTED):
        return None
    try:
        traces = traces_from_statistics(statistics, likelihood)
    except KeyError:
        return None
    return ratio_from_traces(traces, likelihood)


def ef_curvature_ratio(
    model: nn.Module, dataloader: Iterable, likelihood: Likelihood, batch_fn: Optional[BatchFn] = None,
) -> float:
    """How much of the GGN's curvature the empirical Fisher keeps: ``sum_n tr EF_n / sum_n tr GGN_n``.

    About 1 where the model predicts its training labels as confidently as it should (labels
    drawn from its own predictive give 1 in expectation); towards 0 as it interpolates them.
    Below :data:`EF_RATIO_THRESHOLD` the EF evidence is not to be trusted
    (:func:`ef_unreliable_message`). For the Gaussian likelihood the ratio is the mean squared
    residual per output over ``sigma^2``.

    Args:
        model: Network mapping inputs to outputs ``(B, ..., C)``.
        dataloader: Iterable of batches covering the evidence data once.
        likelihood: A ``CategoricalLikelihood`` or ``GaussianLikelihood`` at its current hyperparameters.
        batch_fn: Maps a batch to ``(inputs, targets)``; default: batches are such pairs.

    Returns:
        The ratio (a float >= 0; NaN where the outputs are not finite).

    Raises:
        TypeError: As :func:`curvature_traces`.
        ValueError: As :func:`curvature_traces`, or on data without a datum (every label ``ignore_index``).
    """
    return ratio_from_traces(curvature_traces(model, dataloader, likelihood, batch_fn), likelihood)


def rescale_empirical_fisher(stats: CurvatureStatistics, traces: Tensor, likelihood: Likelihood) -> CurvatureStatistics:
    """Divide a categorical EF's curvature by its ratio ``r``, in place: the trace the GGN would have.

    The correction the ratio suggests (its measurement: ``benchmarks/results/ef_interpolation.md``,
    where the rescaled EF evidence came within a few hundredths of a nat per datum of the GGN's,
    interpolating networks included). Call it before the statistics build an evidence
    (``LaplaceEvidence.from_statistics``), which prepares their decompositions.

    Args:
        stats: Statistics of an ``approx="ef"`` pass with a diag, kron or ekfac structure.
        traces: :func:`batch_traces` summed over the same data (and processes).
        likelihood: The ``CategoricalLikelihood`` of the pass (the Gaussian's EF carries its own
            ``1 / sigma^4``: its ratio changes with the sigma the evidence learns, so a constant
            does not correct it).

    Returns:
        ``stats``, its EF curvature divided by ``r``.

    Raises:
        ValueError: On statistics of another approximation, a ratio that is not positive and
            finite, or a structure that cannot rescale its sums (``full``).
        TypeError: On a likelihood other than ``CategoricalLikelihood``.
    """
    if not isinstance(likelihood, CategoricalLikelihood):
        raise TypeError(
            f"rescale_empirical_fisher takes a CategoricalLikelihood, got {type(likelihood).__name__}: the Gaussian's "
            "ratio is the mean squared residual over sigma^2, which the evidence's own sigma sets; use approx=\"ggn\"."
        )
    if stats.options.approx != "ef":
        raise ValueError(f"rescale_empirical_fisher rescales an empirical Fisher, got approx={stats.options.approx!r}.")
    ratio = validators.number(ratio_from_traces(traces, likelihood), "the curvature ratio tr EF / tr GGN",
                              what="an EF without curvature cannot be rescaled to the GGN's")
    fixed = [type(s).__name__ for s in stats.structures if type(s).rescale is Structure.rescale]
    if fixed:  # before any structure is changed
        raise ValueError(
            f"structure={stats.options.structure!r} cannot rescale its sums ({', '.join(fixed)}); use diag, kron or ekfac."
        )
    for structure in stats.structures:
        structure.rescale(1 / ratio)
    return stats


def ef_unreliable_message(
    names_and_ratios: Union[Mapping[str, float], Sequence[Tuple[str, float]]],
    threshold: float = EF_RATIO_THRESHOLD,
    where: str = "select_models",
) -> str:
    """The warning for the models whose EF curvature ratio is below ``threshold``; ``""`` if none.

    Args:
        names_and_ratios: Model name to its :func:`ef_curvature_ratio` (a mapping or pairs).
        threshold: The ratio below which a model is named.
        where: ``"select_models"`` (the fix: rank by a GGN approximation) or ``"callback"``
            (the fix: estimate with ``approx="ggn"``).

    Returns:
        One message naming every such model with its ratio and the fix, or ``""``.

    Raises:
        ValueError: On a bad ``threshold`` or ``where``, or ratios that are not numbers.
    """
    threshold = validators.number(threshold, "threshold", 0.0, 1.0, low_open=True)
    where = validators.choice(where, tuple(_FIXES), "where")
    pairs = list(names_and_ratios.items()) if isinstance(names_and_ratios, Mapping) else list(names_and_ratios)
    for name, ratio in pairs:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise ValueError(f"The curvature ratio of {name!r} must be a number, got {ratio!r}.")
    low = [(name, float(ratio)) for name, ratio in pairs if ratio < threshold]
    if not low:
        return ""
    listed = ", ".join(f"{name!r} (ratio {ratio:.3g})" for name, ratio in low)
    one = len(low) == 1
    return (
        f"The empirical Fisher evidence of {listed} {'is' if one else 'are'} unreliable: tr EF / tr GGN is below "
        f"{threshold:g}, so {'this model fits' if one else 'these models fit'} the evidence data more confidently "
        "than the EF's curvature can tell (per-example gradients vanish at interpolation), and the EF evidence "
        f"over-rates {'it' if one else 'them'}; {_FIXES[where]}."
    )
