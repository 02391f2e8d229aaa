"""Which GGN estimator an evidence pass runs, chosen from the output size (``mc_samples="auto"``).

The exact GGN takes one backward pass per column of the loss-Hessian factor: ``C - 1`` for ``C``
classes, ``C`` for ``C`` regression outputs, and ``T`` times that for ``(B, T, C)`` outputs (token
models), while a training step takes one. Its cost therefore grows with the number of outputs; the
Monte-Carlo GGN (``mc_samples=k``: ``k`` sampled columns, the GGN in expectation) does not.
``"auto"`` keeps the exact GGN while it needs at most :data:`EXACT_COLUMNS` columns (10 classes:
9) and samples :data:`AUTO_MC_SAMPLES` column beyond. ``benchmarks/output_size.py`` measures the
crossover (an exact estimate's cost in training epochs as the columns grow) and how close one sample's
learned precisions and test NLL come to the exact GGN's where that is still affordable
(``benchmarks/results/output_size.md``).

Example:
    >>> from lightning_marglik import CategoricalLikelihood
    >>> resolve_mc_samples("auto", "ggn", CategoricalLikelihood(), (32, 10))
    (0, 'auto: the exact GGN (9 backward passes per batch, at most 10)')
    >>> resolve_mc_samples("auto", "ggn", CategoricalLikelihood(), (32, 1000))[0]
    1
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple, Union

from ..likelihoods import Likelihood
from .options import CurvatureOptions

__all__ = ["AUTO", "AUTO_MC_SAMPLES", "EXACT_COLUMNS", "resolve_mc_samples", "resolved_options"]

AUTO = "auto"
#: Most backward passes per batch (factor columns) ``"auto"`` gives the exact GGN.
EXACT_COLUMNS = 10
#: Monte-Carlo samples ``"auto"`` takes beyond :data:`EXACT_COLUMNS`.
AUTO_MC_SAMPLES = 1


def resolve_mc_samples(
    mc_samples: Union[int, str], approx: str, likelihood: Likelihood, output_shape: Sequence[int]
) -> Tuple[int, str]:
    """The Monte-Carlo sample count an evidence pass runs (0: exact), and why.

    Args:
        mc_samples: The requested count, or ``"auto"``.
        approx: ``"ggn"`` or ``"ef"`` (the EF has one column whatever the output size).
        likelihood: Counts the factor's columns (:meth:`~lightning_marglik.likelihoods.Likelihood.factor_columns`).
        output_shape: Shape of one batch's network outputs ``(B, ..., C)``.

    Returns:
        ``(mc_samples, reason)``: the count (0 for the exact GGN) and a sentence for the record.
    """
    if mc_samples != AUTO:
        what = "the exact GGN" if not mc_samples else f"the Monte-Carlo GGN ({_count(int(mc_samples), 'sample')})"
        return int(mc_samples), f"as set: {what}" if approx == "ggn" else "as set: the empirical Fisher"
    if approx != "ggn":
        return 0, "auto: the empirical Fisher (one backward pass per batch)"
    columns = likelihood.factor_columns(output_shape, approx, 0)
    if columns <= EXACT_COLUMNS:
        return 0, f"auto: the exact GGN ({_count(columns, 'backward pass')} per batch, at most {EXACT_COLUMNS})"
    return AUTO_MC_SAMPLES, (
        f"auto: the Monte-Carlo GGN ({_count(AUTO_MC_SAMPLES, 'sample')}) as the exact GGN would take {columns} backward "
        f"passes per batch (more than {EXACT_COLUMNS}; outputs {tuple(output_shape[1:])})"
    )


def resolved_options(
    options: CurvatureOptions, likelihood: Likelihood, output_shape: Sequence[int]
) -> Tuple[CurvatureOptions, str]:
    """The options an evidence pass runs, its ``mc_samples`` resolved (:func:`resolve_mc_samples`) from its first
    batch's outputs, and why; an evidence pass resolves them once, whichever backend runs it, and a caller that
    passes the resolved options to later passes has them taken as set.

    Args:
        options: The pass's options, ``mc_samples`` as requested.
        likelihood: Counts the factor's columns.
        output_shape: Shape of the first batch's network outputs ``(B, ..., C)``.

    Returns:
        ``(options, reason)``: ``options`` with the count the pass runs, and a sentence for the record.
    """
    mc_samples, reason = resolve_mc_samples(options.mc_samples, options.approx, likelihood, output_shape)
    return dataclasses.replace(options, mc_samples=mc_samples), reason


def _count(number: int, noun: str) -> str:
    """``"1 sample"``, ``"2 samples"``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}{'es' if noun.endswith('s') else 's'}"
