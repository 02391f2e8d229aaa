"""Smoke runs of the real-network examples (``--quick``, in process, seconds each), asserting values.

* ``examples/resnet_bn.py``: ResNet with BatchNorm, kron evidence vs fixed weight decay;
* ``examples/transformer_tokens.py``: transformer encoder on padded tokens, dict batches + ``marglik_batch``;
* ``examples/lora_rank.py``: LoRA adapters on a frozen MLP, the evidence choosing the rank.

The full experiments (minutes) are reproduced by the commands in ``examples/results/<name>.md``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("real_network_examples")


def test_resnet_bn_quick(outputs):
    import resnet_bn

    out = resnet_bn.main(["--quick", "--output-dir", str(outputs / "resnet_bn")])
    rows = {r["run"]: r for r in out["rows"]}
    assert list(rows) == ["marglik", "wd=0.0001", "wd=0.001", "wd=0.01", "marglik, no BN recal.", "marglik, BN-fed convs fixed"]
    fixed = rows["marglik, BN-fed convs fixed"]["precisions"]
    assert fixed["stem.0.weight"] == fixed["block2.shortcut.0.weight"] == pytest.approx(1.0)
    assert fixed["head.weight"] == pytest.approx(1.0)  # the output layer, held at its declared precision by default
    assert fixed["stem.1.weight"] != pytest.approx(1.0)  # a BatchNorm scale: decoupled, learned
    for r in rows.values():
        assert math.isfinite(r["marglik"]) and math.isfinite(r["marglik_exact"]), r["run"]
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["nll"])
        # BatchNorm's affine parameters are covered (exact diagonal blocks next to the conv Kronecker blocks)
        assert {"stem.1.weight", "stem.1.bias", "block2.shortcut.1.weight", "head.weight"} <= set(r["precisions"])
    learned = rows["marglik"]["precisions"]
    assert all(abs(math.log(p)) > 1e-3 for n, p in learned.items() if not n.startswith("head.")), \
        "learned precisions must move from the init 1.0 (the output layer's is held there by default)"
    assert len({round(math.log(p), 3) for p in learned.values()}) > 5, "one precision per tensor, not one for all"
    n = out["n_train"]
    for w in resnet_bn.WEIGHT_DECAYS:  # fixed priors stay where they were set: delta = w N
        assert all(p == pytest.approx(w * n, rel=1e-6) for p in rows[f"wd={w:g}"]["precisions"].values())
    # the logged keys are the per-tensor precisions
    assert any(k.startswith("prior_precision/") for k in rows["marglik"]["estimates"][-1])
    assert (outputs / "resnet_bn" / "resnet_bn.md").stat().st_size > 0
    assert (outputs / "resnet_bn" / "resnet_bn.png").stat().st_size > 0


@pytest.fixture(scope="module")
def transformer_out(outputs):
    import transformer_tokens

    return transformer_tokens.main(["--quick", "--output-dir", str(outputs / "transformer_tokens")])


def test_transformer_tokens_quick(transformer_out, outputs):
    own = transformer_out["rows"][0]
    assert own["block"] == "own" and own["error"] is None
    assert math.isfinite(own["marglik"]) and math.isfinite(own["last_marglik"])
    assert 0.0 <= own["accuracy"] <= 1.0
    assert own["slow_warnings"] == [], "own attention: every parameter takes the hook path"
    # every Linear/Embedding weight in Kronecker blocks: all parameters but the LayerNorms' (d=32: 3 x 2 x 32 + 2 x 32)
    assert own["n_kron"] == own["n_params"] - 5 * 2 * 32
    held = {n: p for n, p in own["precisions"].items() if n.startswith("head.")}  # the output layer, held by default
    assert held and all(p == 1.0 for p in held.values())
    assert all(abs(math.log(p)) > 1e-3 for n, p in own["precisions"].items() if n not in held)
    names = {"tokens.weight", "positions.weight", "blocks.0.attn.q.weight", "blocks.1.ln2.bias"}
    assert names <= set(own["precisions"])
    assert (outputs / "transformer_tokens" / "transformer_tokens.md").stat().st_size > 0


def test_transformer_tokens_torch_layer_quick(transformer_out):
    """nn.TransformerEncoderLayer: its MultiheadAttention takes the exact per-example path, with a warning."""
    row = transformer_out["rows"][1]
    assert row["block"] == "torch"
    assert row["slow_warnings"] and "MultiheadAttention" in row["slow_warnings"][0]
    assert row["error"] is None, row["error"]
    assert math.isfinite(row["marglik"])
    assert 0 < row["n_kron"] < row["n_params"]


def test_lora_rank_quick(outputs):
    import lora_rank

    out = lora_rank.main(["--quick", "--output-dir", str(outputs / "lora_rank")])
    assert out["ranks"] == [0, 1, 4]
    for r in out["rows"]:
        assert math.isfinite(r["marglik"]), (r["shift"], r["seed"], r["rank"])
        # only the adapters are parameters of the prior: r (in + out) per Linear, 64-64-64-5
        assert r["params"] == r["rank"] * ((64 + 64) + (64 + 64) + (64 + 5))
        assert len(r["effective_ranks"]) == (3 if r["rank"] else 0)
        assert all(e <= r["rank"] for e in r["effective_ranks"])
        if r["rank"] == 0:  # no free parameters: the evidence is the frozen base's log-likelihood
            assert r["precisions"] == {}
        else:
            # the last layer's up-projection makes the output: held at its declared precision (output_layer="fixed")
            held = {n for n, p in r["precisions"].items() if abs(math.log(p)) <= 1e-3}
            assert len(r["precisions"]) == 6 and held == {"4.B.weight"}, r["precisions"]
    for (shift, seed), rank in out["chosen"].items():
        rows = [r for r in out["rows"] if (r["shift"], r["seed"]) == (shift, seed)]
        assert rank == max(rows, key=lambda r: r["marglik"])["rank"]
        if shift == "new classes":  # the frozen base is at chance on digits 5-9: adapting must win
            assert rank > 0, rows
    assert (outputs / "lora_rank" / "lora_rank.md").stat().st_size > 0
    assert (outputs / "lora_rank" / "lora_rank.png").stat().st_size > 0
