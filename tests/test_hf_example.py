"""Smoke run of ``examples/hf_sequence_classification.py`` (``--quick``, in process, seconds), asserting values.

The full run is reproduced by the command in ``examples/results/hf_sequence_classification.md``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="examples/hf_sequence_classification.py needs transformers")
pytest.importorskip("peft", reason="examples/hf_sequence_classification.py needs peft")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))


def test_hf_sequence_classification_quick(tmp_path):
    import hf_sequence_classification as example

    committed = sorted((ROOT / "examples" / "results").iterdir())
    out = example.main(["--quick", f"--output-dir={tmp_path}"])
    rows = {r["rank"]: r for r in out["rows"]}
    assert list(rows) == [0, 2]
    hidden, classes, layers = 32, 2, 2
    head = hidden * classes + classes
    assert rows[0]["params"] == head  # rank 0: the classifier head alone
    # rank 2: LoRA A (2 x 32) and B (32 x 2) on query and value of both layers, and the head
    assert rows[2]["params"] == head + layers * 2 * (2 * hidden + hidden * 2)
    for r in rows.values():
        assert math.isfinite(r["marglik"]) and r["marglik"] < 0
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["nll"])
    assert out["chosen"] == max(rows.values(), key=lambda r: r["marglik"])["rank"]
    text = (tmp_path / "hf_sequence_classification.md").read_text()
    assert "| rank |" in text and "**(chosen)**" in text
    assert sorted((ROOT / "examples" / "results").iterdir()) == committed  # --output-dir: nothing else written
