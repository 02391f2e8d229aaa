"""``benchmarks/gpu.py --real-sizes`` (issue 54, item 3) on the CPU, at a size below its small one: the ViT-tiny
(the exact GGN) and GPT-2 small with LoRA (the Monte-Carlo GGN) measured end to end with and without
``MargLikCallback()``; what the records say is checked against what the parts measured and what the library
decides. ResNet-18 is only built here: its 4,608-wide input factors take a minute of one CPU thread to decompose
(``--real-sizes small --device cpu`` measures it)."""
from __future__ import annotations

import math
import os
import re
import sys

import pytest
import torch

# the models are the integrations' (timm, transformers, peft) and torchvision's (the backpack extra): without them the
# README's install skips this file
for _package in ("timm", "transformers", "peft", "torchvision"):
    pytest.importorskip(_package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")]

import _real_sizes as rs  # noqa: E402
import gpu  # noqa: E402
from _common import read_data  # noqa: E402

from lightning_marglik import CategoricalLikelihood  # noqa: E402
from lightning_marglik.callbacks.output_layer import find_output_layer  # noqa: E402
from lightning_marglik.curvature.estimator import resolve_mc_samples  # noqa: E402

TINY = rs.Size(images=8, image_batch=4, sequences=2, tokens=8, token_batch=1, crossover_batches=1, sweep_classes=())
MEASURED = ("vit_tiny", "gpt2_lora")


@pytest.fixture(scope="module")
def records():
    torch.set_num_threads(1)
    return {model: rs.measure(model, TINY, torch.device("cpu")) for model in MEASURED}


@pytest.mark.parametrize("model", MEASURED)
def test_the_whole_run_ratio_is_built_from_the_measured_phases(records, model):
    r = records[model]
    assert r["epoch"] == r["plain"]["epoch"]["seconds"]
    assert r["epoch_with_callback"] == r["default"]["epoch"]["seconds"]
    assert r["estimate"] == r["default"]["estimate"]["seconds"]
    f = rs.FREQUENCY
    assert f == 10 and r["frequency"] == f
    assert r["run_ratio"] == pytest.approx((f * r["epoch_with_callback"] + r["estimate"]) / (f * r["epoch"]), rel=1e-12)
    assert r["estimate_epochs"] == pytest.approx(r["estimate"] / r["epoch"], rel=1e-12)
    # the estimate phase holds the callback's one estimate: without the callback nothing runs there
    assert r["estimations"] == 1
    assert r["plain"]["estimate"]["seconds"] < 0.01 * r["estimate"]
    assert r["memory_ratio"] == pytest.approx(r["default_peak_mib"] / r["plain_peak_mib"])
    assert r["default_peak_mib"] == max(phase["peak_mib"] for phase in r["default"].values())


@pytest.mark.parametrize("model, outputs", [("vit_tiny", (TINY.image_batch, rs.CLASSES)),
                                            ("gpt2_lora", (TINY.token_batch, TINY.tokens, rs.VOCABULARY))])
def test_the_estimate_ran_with_the_estimator_the_defaults_choose(records, model, outputs):
    expected = resolve_mc_samples("auto", "ggn", CategoricalLikelihood(), outputs)[1]
    assert records[model]["estimator"].split("; kron:")[0] == expected
    assert expected.startswith("auto: the exact GGN" if model == "vit_tiny" else "auto: the Monte-Carlo GGN (1 sample)")


def test_lora_learns_only_the_adapters_and_the_untied_head(records):
    r = records["gpt2_lora"]
    adapters = [n for n in r["learnable"] if re.fullmatch(r"model\.base_model\.model\.transformer\.h\.\d+\.attn\.c_attn"
                                                           r"\.lora_[AB]\.default\.weight", n)]
    assert len(adapters) == 2 * 12
    assert sorted(r["learnable"]) == sorted(adapters + ["model.base_model.model.lm_head.weight"])
    rank, width = rs.LORA_RANK, 768
    assert r["learnable_count"] == 12 * rank * (width + 3 * width) + rs.VOCABULARY * width
    assert r["output_layer"]["names"] == ["model.base_model.model.lm_head.weight"]


def test_the_vit_holds_its_head(records):
    decision = records["vit_tiny"]["output_layer"]
    assert decision["names"] == ["head.weight", "head.bias"]
    assert decision["treatment"] == "fixed"


@pytest.mark.parametrize("model", MEASURED)
def test_records_are_finite_and_complete(records, model):
    r = records[model]
    for key in ("epoch", "epoch_with_callback", "estimate", "run_ratio", "plain_peak_mib", "default_peak_mib",
                "memory_ratio", "marglik"):
        assert math.isfinite(r[key]), key
    assert all(set(r[fit]) == {"setup", "epoch", "estimate"} for fit in ("plain", "default"))
    assert all(v > 0 for fit in ("plain", "default") for phase in r[fit].values() for v in phase.values())
    assert r["n_data"] == (TINY.sequences * TINY.tokens if model == "gpt2_lora" else TINY.images)
    (row,) = r["crossover"]
    assert row["sampled_seconds"] > 0 and row["steps_seconds"] > 0
    if model == "gpt2_lora":  # tokens x (V - 1) columns a batch: not run
        assert row["columns"] == TINY.tokens * (rs.VOCABULARY - 1) and math.isnan(row["exact_seconds"])
    else:
        assert row["columns"] == rs.CLASSES - 1 and row["exact_steps"] == row["exact_seconds"] / row["steps_seconds"] > 0


def test_resnet18_has_the_cifar_stem_and_its_fc_as_output_layer():
    module = rs.module_of("resnet18", 4)
    net = module.net
    assert (net.conv1.kernel_size, net.conv1.stride) == ((3, 3), (1, 1)) and isinstance(net.maxpool, torch.nn.Identity)
    assert sum(p.numel() for p in net.parameters()) == 11_173_962
    x = torch.randn(2, 3, 32, 32)
    assert net(x).shape == (2, rs.CLASSES)
    assert find_output_layer(module, x).layers == ("net.fc",)


def test_the_results_file_keeps_the_checks_report_and_each_run(tmp_path, records):
    path = tmp_path / "gpu.md"
    path.write_text("# The callback and the evidence engine on a GPU\n\nold checks\n")  # a file from before its data
    data = gpu.results_data(path)
    run = {"device": "CPU (test)", "cuda": False, "size": "tiny", "date": "now", "library": "HEAD x", "command": "c",
           "torch": torch.__version__, "meter": rs.Meter(torch.device("cpu")).describe(), "models": records}
    data.setdefault("real_sizes", {})["CPU (test), tiny size"] = run
    gpu.write_results(path, data)
    text = path.read_text()
    assert text.startswith("# The callback and the evidence engine on a GPU\n\nold checks\n")
    assert "### CPU (test), tiny size" in text
    rows = [line for line in text.splitlines() if line.startswith("| vit_tiny |") or line.startswith("| gpt2_lora |")]
    assert len(rows) == 4  # a cost row and a crossover row each
    assert f"**{records['vit_tiny']['run_ratio']:.2f}**" in text
    # the checks rewritten later keep the runs, and the data round-trips
    again = gpu.results_data(path)
    again["checks"] = "# new checks\n"
    gpu.write_results(path, again)
    assert read_data(path)["real_sizes"]["CPU (test), tiny size"]["models"]["gpt2_lora"]["estimations"] == 1
    assert path.read_text().startswith("# new checks\n")


def test_a_model_that_fails_is_recorded_and_the_others_still_run(tmp_path):
    saved = []
    records = rs.measure_all(["no_such_model"], TINY, torch.device("cpu"), save=lambda m, r: saved.append(m))
    assert saved == ["no_such_model"] and records["no_such_model"]["error"].startswith("KeyError")
    path = tmp_path / "gpu.md"
    gpu.write_results(path, {"real_sizes": {"k": {"date": "d", "command": "c", "library": "l", "torch": "t", "meter": "m",
                                                  "cuda": True, "models": records}}})
    assert "| no_such_model | not run: KeyError: 'no_such_model' |" in path.read_text()
