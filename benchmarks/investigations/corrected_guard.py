"""The prior guard with a mode-corrected learned candidate, in every cell of issue 52: measured on 84cce80, not kept.

On 84cce80 (2026-12-07) ``MargLikCallback``'s guard scored, as its learned candidate, per tensor the weaker of the
evidence's own precision and the mode-corrected evidence's: the evidence of the quadratic model at its own mode,
``log Z + r^T H^-1 r / 2`` with ``r`` the MAP objective's gradient (Lin, Antoran and Hernandez-Lobato, 2023; the
prototype of ``online_remedies.py``, with closed-form Newton derivatives in ``lightning_marglik/mode_correction.py``
at that commit). The weaker of the two, because the correction alone ran the toy regression's depth 3 to log delta
15-22 at its first estimate, which the guard let through (test RMSE 0.73 against 0.11). 49bde90 reverted it: the
results file says why.

These are ``prior_guard.py``'s runs (its plan, its arms, 3 seeds) trained on that library: the ``defaults`` arm is
the corrected guard; ``delta=1``, ``no guard`` and cross-validation do not run the guard, and reproduce
``prior_guard.md``'s (b95a88b) figures. This script only reads them (every run must name 84cce80), so that no run of
another library enters the study.

Usage::

    git worktree add /tmp/corrected 84cce80 && cd /tmp/corrected
    python benchmarks/investigations/prior_guard.py --shard 0/2 &
    python benchmarks/investigations/prior_guard.py --shard 1/2
    cp -r outputs/prior_guard/runs <this checkout>/outputs/corrected_guard/
    python benchmarks/investigations/corrected_guard.py       # writes benchmarks/results/corrected_guard.md
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import _zoo  # noqa: E402
import prior_guard  # noqa: E402
from _common import RESULTS  # noqa: E402

NAME = "corrected_guard"
LIBRARY = "HEAD 84cce80"


def cache_dir() -> str:
    return os.path.join(_zoo.output_dir(NAME), "runs")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check that every run of the plan is stored and names :data:`LIBRARY`, then write the results file.

    Raises:
        SystemExit: Naming the first run that is missing or of another library.
    """
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    cache = cache_dir()
    for spec in prior_guard.plan():
        try:
            library = _zoo.stored(spec, cache)["library"]
        except FileNotFoundError as missing:
            raise SystemExit(f"{missing}: train prior_guard.py's runs on 84cce80 (this docstring's usage)") from None
        if library != LIBRARY:
            raise SystemExit(f"{spec.key()} ran on {library}, not {LIBRARY}: the study would mix libraries")
    prior_guard.analyse(cache, RESULTS / f"{NAME}.md", title=__doc__.splitlines()[0],
                        steps=f"on {LIBRARY}, then `python benchmarks/investigations/{NAME}.py`")


if __name__ == "__main__":
    main()
