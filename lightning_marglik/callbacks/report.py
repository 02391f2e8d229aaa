"""What the estimating callbacks tell the user: the decisions of set-up in one line, and a summary when
training ends.

The callbacks decide for the user which GGN estimator runs (``mc_samples="auto"``) and which tensors'
precisions are held or decoupled (the output layer, biases and normalization parameters, scale-invariant
tensors). :func:`announce_setup` names these decisions, and why, in one line when training starts;
:func:`announce_end` summarises the fit when it ends (estimates, final and best evidence, the learned
precisions' range, what was held) and says whether the evidence was still rising at the last estimate,
which the summary's facts (:func:`summarize`, the callback's ``summary``) also hold.

Both go, on global rank zero only, through Lightning's own ``rank_zero_info``: to the logger and handler
where the Trainer's "GPU available: ..." lines print (``pytorch_lightning`` or ``lightning.pytorch``, the
package imported last), at info level. ``logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)``
(or ``"lightning.pytorch"``) quiets them with Lightning's own.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_utilities.core.rank_zero import rank_zero_info  # the Trainer's own lines go there

from ..hyperparameters import BIAS_NORMALIZATION, SCALE_INVARIANT
from .logged import logged_values
from .output_layer import OUTPUT_LAYER
from .package import MONITOR
from .prior_guard import GUARD, guard_phrase, guard_summary, guard_words
from .schedule import BatchSchedule, EpochSchedule, Schedule, SettledSchedule

__all__ = ["FLAT", "announce_end", "announce_setup", "setup_line", "summarize", "summary_line", "trend"]

#: Change of the log evidence per datum between the last two estimates within which it reads as flat.
FLAT = 1e-3

# the named reasons of GaussianPrior.treat: what the tensors are, and why they are treated apart (a reason of
# the user's own is named as given)
_REASONS = {
    SCALE_INVARIANT: ("scale-invariant tensors", ", as the training loss does not change with their scale"),
    BIAS_NORMALIZATION: (
        "biases and normalization parameters", ", as deep-learning recipes put no weight decay on them"
    ),
}
_TREATED = {
    "fixed": "held at the declared precision",
    "decoupled": "decoupled (precision learned, weight decay kept at the declared precision)",
}


def _names(names: Sequence[str], shown: int = 3) -> str:
    """At most ``shown`` names, then how many more."""
    listed = ", ".join(names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _schedule(schedule: Schedule) -> str:
    """When the estimates come, in words, with the arguments that say so."""
    if isinstance(schedule, BatchSchedule):
        every = "every training batch" if schedule.every == 1 else f"every {schedule.every} training batches"
        words = f"a bound step after {every}"
    else:
        assert isinstance(schedule, EpochSchedule)
        every = "every epoch" if schedule.frequency == 1 else f"every {schedule.frequency} epochs"
        words = f"an estimate after {every}"
        if isinstance(schedule, SettledSchedule):
            words += " once the training loss has settled"
    if schedule.burnin:
        words += f" from epoch {schedule.burnin + 1}"
    if not isinstance(schedule, BatchSchedule):
        words += ", and after the last"
    return f"{words} ({schedule.describe()})"


def _decisions(callback: Any) -> List[str]:
    """What set-up held or decoupled, and why, one phrase each."""
    prior, likelihood = callback._hyperparameters()
    phrases = []
    if prior.fixed:
        phrases.append(f"GaussianPrior(fixed=...) ({_names(prior.fixed)}): held at the declared precision")
    output = getattr(callback, "output_decision", None)  # MargLikCallback's (MargLikBoundCallback has none)
    if output is not None:  # its reason names the layer and what was decided, or why nothing was held
        reason = output["reason"]
        reason = reason if reason.startswith(OUTPUT_LAYER) else f"{OUTPUT_LAYER}: {reason}"
        # why the default holds it: benchmarks/results/never_worse_default.md
        fixed = bool(output["names"]) and output["treatment"] == "fixed"
        phrases.append(reason + (", as a learned one cost held-out NLL (output_layer='learn' learns it)" * fixed))
    for reason, (names, treatment) in prior.treatments.items():
        strongest = [name for name in names if name in prior.treated(treatment)]  # not those held for another reason
        if reason not in (OUTPUT_LAYER, GUARD) and strongest and treatment in _TREATED:
            label, why = _REASONS.get(reason, (reason, ""))
            phrases.append(f"{label} ({_names(strongest)}): {_TREATED[treatment]}{why}")
    learned = prior.learned_names()
    extra = "".join(f" and {name[len('log_'):]}" for name in likelihood.learnable())
    phrases.append(f"learns the precisions of {len(learned)} of {len(prior.param_names)} tensors{extra}")
    if hasattr(callback, "guard_off"):  # MargLikCallback's (MargLikBoundCallback has none)
        phrases.append(guard_phrase(callback))
    return phrases


def setup_line(callback: Any) -> str:
    """The set-up line: the estimator and why, the curvature, what was held or decoupled and why, the schedule.

    Args:
        callback: A set-up estimating callback (``MargLikCallback`` or ``MargLikBoundCallback``).

    Returns:
        One line.
    """
    bound = getattr(callback, "bound", None)  # MargLikBoundCallback's; "ntk" takes no structure (exact kernels)
    kind = "" if bound is None else f"bound={bound!r}, "
    structure = "" if bound == "ntk" else f"structure={callback.options.structure!r}, "
    curvature = f"{kind}{structure}approx={callback.options.approx!r}"
    return (
        f"{type(callback).__name__}: estimator {callback.estimator}; {curvature}; "
        f"{'; '.join(_decisions(callback))}; {_schedule(callback.schedule)}."
    )


def announce_setup(callback: Any) -> None:
    """Log :func:`setup_line` on global rank zero, where Lightning's own lines print."""
    rank_zero_info(setup_line(callback))


def trend(history: Sequence[Dict[str, float]]) -> Tuple[str, float]:
    """Whether the evidence was rising at the last estimate: the last two finite estimates of ``history``.

    Args:
        history: The callback's ``history`` (each entry's ``marglik``, log evidence per datum).

    Returns:
        ``("rising" | "flat" | "falling", last - previous)``, flat within :data:`FLAT`; ``("unknown", nan)``
        with fewer than two finite estimates.

    Example:
        >>> trend([{"epoch": 1, "marglik": -1.0}, {"epoch": 2, "marglik": -0.9}])[0]
        'rising'
        >>> trend([{"epoch": 1, "marglik": -1.0}, {"epoch": 2, "marglik": -1.0005}])[0]
        'flat'
    """
    values = [entry[MONITOR] for entry in history if math.isfinite(entry[MONITOR])]
    if len(values) < 2:
        return "unknown", math.nan
    change = values[-1] - values[-2]
    return ("rising" if change > FLAT else "falling" if change < -FLAT else "flat"), change


def summarize(callback: Any) -> Dict[str, Any]:
    """The facts of a fit's end, as the callback's ``summary`` holds them.

    Args:
        callback: An estimating callback whose training has ended.

    Returns:
        ``estimates``, ``final_marglik``, ``best_marglik``, ``best_epoch`` (index from 0, as the callback's),
        ``precisions`` (each learned tensor's precision, the geometric mean of a diagonal prior's), ``lowest`` and
        ``highest`` (``(name, precision)``, ``None`` if none is learned), ``held`` and ``decoupled`` (the
        tensors whose precision is held at, or whose weight decay stays at, the declared precision), ``trend``
        and ``change`` (:func:`trend`), and ``guard`` (the prior guard's decisions,
        :func:`~.prior_guard.guard_summary`; ``None`` where it did not run).
    """
    prior, likelihood = callback._hyperparameters()
    values = logged_values(prior, likelihood, callback.final_marglik)
    if prior.structure == "scalar":
        precisions = {"all tensors": values["prior_precision"]} if prior.learn else {}
    else:
        precisions = {name: values[f"prior_precision/{name}"] for name in prior.learned_names()}
    ranked = sorted(precisions.items(), key=lambda item: item[1])
    direction, change = trend(callback.history)
    return {
        "estimates": callback.estimations,
        "final_marglik": callback.final_marglik,
        "best_marglik": callback.best_marglik,
        "best_epoch": callback.best_epoch,
        "precisions": precisions,
        "lowest": ranked[0] if ranked else None,
        "highest": ranked[-1] if ranked else None,
        "held": prior.fixed_names() if prior.learn else list(prior.param_names),  # learn=False: every tensor
        "decoupled": prior.treated("decoupled"),
        "trend": direction,
        "change": change,
        "guard": guard_summary(getattr(callback, "guard_decisions", [])),
    }


def _trend_words(summary: Dict[str, Any], knob: str) -> str:
    change = f"{summary['change']:+.4f} per datum"
    return {
        "rising": f"the evidence was still rising at the last estimate ({change}): more epochs, or estimates more "
                  f"often (a smaller `{knob}`), may change the learned prior",
        "flat": f"the evidence was flat at the last estimate ({change}, within {FLAT})",
        "falling": f"the evidence fell at the last estimate ({change}); the best was at epoch={summary['best_epoch']}",
        "unknown": "fewer than two finite estimates: no trend of the evidence",
    }[summary["trend"]]


def summary_line(who: str, summary: Dict[str, Any], knob: str = "frequency") -> str:
    """The end-of-training line of :func:`summarize`'s facts.

    Args:
        who: The callback's class name.
        summary: :func:`summarize`'s dict.
        knob: The argument that sets how often estimates come (named where the evidence was still rising).

    Returns:
        One line.
    """
    estimates = summary["estimates"]
    parts = [f"{estimates} estimate{'' if estimates == 1 else 's'}", f"final marglik {summary['final_marglik']:.4f}"]
    if summary["best_epoch"] >= 0:
        parts.append(f"best {summary['best_marglik']:.4f} (epoch={summary['best_epoch']})")
    lowest: Optional[Tuple[str, float]] = summary["lowest"]
    highest: Optional[Tuple[str, float]] = summary["highest"]
    if lowest is not None and highest is not None and lowest[0] == highest[0]:  # one learned precision
        parts.append(f"learned precision {lowest[1]:.3g} ({lowest[0]})")
    elif lowest is not None and highest is not None:
        parts.append(f"learned precisions {lowest[1]:.3g} ({lowest[0]}) to {highest[1]:.3g} ({highest[0]})")
    if summary["held"]:
        parts.append(f"held at the declared precision: {_names(summary['held'])}")
    if summary["decoupled"]:
        parts.append(f"decoupled: {_names(summary['decoupled'])}")
    if summary.get("guard"):
        parts.append(guard_words(summary["guard"]))
    parts.append(_trend_words(summary, knob))
    return f"{who} at the end of training: {'; '.join(parts)}."


def announce_end(callback: Any) -> Dict[str, Any]:
    """Log :func:`summary_line` on global rank zero, where Lightning's own lines print; returns the summary."""
    summary = summarize(callback)
    knob = "every_k_batches" if isinstance(callback.schedule, BatchSchedule) else "frequency"
    rank_zero_info(summary_line(type(callback).__name__, summary, knob))
    return summary
