"""The documentation site builds strictly (no broken link or anchor, every API object found) and holds what it should."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_documentation_builds_strictly(tmp_path):
    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    front = (tmp_path / "index.html").read_text()
    assert "Options of <code>MargLikCallback</code>" in front and "Measured results" in front  # the README
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("MargLikCallback", "LaplaceEvidence", "GaussianPrior", "predict_regression", "select_models"):
        assert f'id="lightning_marglik.{name}"' in api, name
    assert "class_path" in (tmp_path / "selection" / "index.html").read_text()  # the YAML format
