"""``select_models(rank_by="auto")``, the default (issue 24, item 4): one evidence for all candidates,
the exact full GGN where every candidate affords it, else kron-EF; recorded, printed and resumed.

References: the same runs with ``rank_by="full-ggn"`` and ``rank_by="kron-ef"`` given explicitly
(same seed, same training); the limits are the module constants of :mod:`lightning_marglik.selection.driver`.
"""
from __future__ import annotations

import csv
import inspect
import json
import warnings

import pytest
import torch
import yaml

from lightning_marglik import GaussianPrior, select_models
from lightning_marglik.diagnostics import EF_RATIO_THRESHOLD
from lightning_marglik.selection import build_parser, check_config, driver, rank_by_choices, run_command_line
from lightning_marglik.selection.driver import (
    AUTO_FULL_MAX_DIRECTIONS, DEFAULT_RANK_BY, check_rank_by, full_ggn_refusal, resolve_auto,
)
from tests.lightning_models import BlobData, Classifier, Regressor, loader, regression_data
from tests.test_ef_check_wiring import Fitted, _data

torch.set_num_threads(1)

CALLBACK = {"structure": "diag", "approx": "ggn", "steps": 20}
TRAINER = {"max_epochs": 10, "enable_progress_bar": False}
N = 32  # regression data: one output, so N C = 32


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def regressors(n: int = N, widths=(2, 16)):
    """1-hidden-layer regression MLPs: P = 3 h + 1 (7 and 49 parameters, 4 tensors)."""
    return {f"h{h}": (lambda h=h: Regressor(n_data=n, hidden=h)) for h in widths}


def run(rank_by=None, candidates=None, n: int = N, **kwargs):
    """``select_models`` over the regression data; ``rank_by=None``: the default."""
    chosen = {} if rank_by is None else {"rank_by": rank_by}
    return select_models(candidates or regressors(n), train_dataloader=loader(regression_data(n), batch_size=n),
                         callback=CALLBACK, trainer=TRAINER, **chosen, **kwargs)


def test_auto_is_the_default_and_ranks_a_small_regression_as_full_ggn_does(tmp_path, capsys):
    assert DEFAULT_RANK_BY == "auto" == inspect.signature(select_models).parameters["rank_by"].default
    auto = run(output_dir=str(tmp_path))
    printed = capsys.readouterr().out
    full = run("full-ggn", verbose=False)
    assert [r.name for r in auto] == [r.name for r in full]  # the same ranking
    for a, f in zip(auto, full):
        assert a.marglik == pytest.approx(f.marglik, rel=1e-9, abs=1e-12)  # the same evidence
        assert a.rank_by == "full-ggn" and f.rank_by == "full-ggn"
        assert set(a.evidences) == {"kron-ef", "kron-ggn", "full-ggn"} and a.full_ggn_refused is None
        assert a.evidences["full-ggn"] == a.marglik != a.evidences["kron-ef"]  # not kron-EF's value
        assert a.settings["rank_by"] == "auto" and f.settings["rank_by"] == "full-ggn"
        assert a.settings["auto_limits"]["max_directions"] == AUTO_FULL_MAX_DIRECTIONS
        assert f.evidences == {} and "auto_limits" not in f.settings
    assert "rank_by='auto' ranks all 2 candidates by 'full-ggn': the exact full GGN is within auto's limits" in printed
    assert "[1/2] h2: marglik=" in printed and "(full-ggn so far; kron-ef=" in printed and "; kron-ggn=" in printed
    # the files record the resolved choice and both evidences
    saved = {row["name"]: row for row in json.loads((tmp_path / "results.json").read_text())}
    assert {row["rank_by"] for row in saved.values()} == {"full-ggn"}
    assert saved["h16"]["evidences"]["full-ggn"] == pytest.approx(saved["h16"]["marglik"])
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert float(rows[0]["marglik_full-ggn"]) == pytest.approx(float(rows[0]["marglik"])) and rows[0]["rank_by"]
    # the same decision from the sizes alone: N C = 32, P = 3 h + 1, 4 tensors
    assert resolve_auto({r.name: full_ggn_refusal(N, r.n_params, 4) for r in auto})[0] == "full-ggn"


def test_auto_falls_back_to_kron_ef_for_all_when_one_candidate_is_over_the_limit(monkeypatch, capsys):
    monkeypatch.setattr(driver, "AUTO_FULL_MAX_DIRECTIONS", 10)  # h2: min(32, 7) = 7 fits; h16: min(32, 49) = 32 not
    auto = {r.name: r for r in run()}
    printed = capsys.readouterr().out
    kron = {r.name: r for r in run("kron-ef", verbose=False)}
    assert {r.rank_by for r in auto.values()} == {"kron-ef"}
    for name in auto:
        assert auto[name].marglik == pytest.approx(kron[name].marglik, rel=1e-9, abs=1e-12)
    assert "full-ggn" in auto["h2"].evidences and auto["h2"].marglik != auto["h2"].evidences["full-ggn"]
    assert auto["h2"].full_ggn_refused is None
    assert "full-ggn" not in auto["h16"].evidences  # over the limit: not computed
    assert auto["h16"].full_ggn_refused == "min(N C, P) = min(32, 49) = 32 is above AUTO_FULL_MAX_DIRECTIONS = 10"
    assert ("rank_by='auto' ranks all 2 candidates by 'kron-ef': the exact full GGN is too large for candidate "
            "'h16': min(N C, P)") in printed
    lines = [line for line in printed.splitlines() if line.startswith("[")]
    assert "h2: marglik=" in lines[0] and "(full-ggn so far; kron-ef=" in lines[0]  # before h16 was trained
    assert "h16: marglik=" in lines[1] and "(kron-ef so far; kron-ggn=" in lines[1]
    assert "; full-ggn too large)" in lines[1]
    assert auto["h2"].settings["auto_limits"]["max_directions"] == 10


def test_the_limits_on_directions_and_memory_and_full_own_limit():
    limit = AUTO_FULL_MAX_DIRECTIONS
    assert full_ggn_refusal(limit, 5000, 8) is None and full_ggn_refusal(10**6, limit, 8) is None
    assert "AUTO_FULL_MAX_DIRECTIONS" in full_ggn_refusal(limit + 1, 5000, 8)
    assert "AUTO_FULL_MAX_DIRECTIONS" in full_ggn_refusal(10**6, limit + 1, 8)  # N C >= P: the P x P Gram
    # 8 (R P + T R^2) bytes against 256 MiB: 8 (1000 * 13554 + 20 * 1000^2) = 268.4 MB fits, one more parameter not
    assert full_ggn_refusal(1000, 13554, 20) is None
    assert "above AUTO_FULL_MAX_MEMORY = 256 MiB" in full_ggn_refusal(1000, 13555, 20)
    # few rows but P x P matrices above the full structure's own max_memory (4 GiB): P > 16384
    assert full_ggn_refusal(100, 16384, 2) is None
    assert full_ggn_refusal(100, 16385, 2).startswith("structure='full' needs about 4.0 GiB for P=16,385")
    choice, why = resolve_auto({"a": None, "b": "why b", "c": "why c"})
    assert (choice, why) == ("kron-ef", "the exact full GGN is too large for candidate 'b' (and 1 more): why b")


def test_the_memory_limit_is_read_when_resolving(monkeypatch):
    assert full_ggn_refusal(N, 49, 4) is None
    monkeypatch.setattr(driver, "AUTO_FULL_MAX_MEMORY", 8 * (N * 49 + 4 * N * N) - 1)
    assert "full would hold about" in full_ggn_refusal(N, 49, 4)
    assert full_ggn_refusal(N, 7, 4) is None  # N C >= P: 8 P^2 bytes


def test_a_resumed_auto_run_reuses_its_results_and_resolves_again(tmp_path, capsys):
    """N C = 1100 data: a 500-unit network (P = 1501) is over the limit by its size, not by a patch."""
    n, out = 1100, str(tmp_path)
    small = regressors(n, widths=(2,))
    first = run(candidates=small, n=n, output_dir=out, verbose=False)[0]
    assert first.rank_by == "full-ggn"
    both = run(candidates={**small, **regressors(n, widths=(500,))}, n=n, output_dir=out, resume=True)
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] h2: marglik=") and "reused" in lines[0]  # same settings: not trained again
    assert lines[1].startswith("[2/2] h500: marglik=") and "reused" not in lines[1]
    by_name = {r.name: r for r in both}
    assert by_name["h500"].full_ggn_refused.startswith("min(N C, P) = min(1,100, 1,501) = 1,100 is above")
    assert {r.rank_by for r in both} == {"kron-ef"}
    assert by_name["h2"].marglik == first.evidences["kron-ef"]  # its stored kron-EF evidence, now ranking it
    again = run(candidates=small, n=n, output_dir=out, resume=True)  # h500 stays in the files, not in this run
    printed = capsys.readouterr().out
    assert "reused" in printed and again[0].rank_by == "full-ggn" and again[0].marglik == first.marglik
    saved = {row["name"]: row["rank_by"] for row in json.loads((tmp_path / "results.json").read_text())}
    assert saved == {"h2": "full-ggn", "h500": "kron-ef"}


def test_other_limits_are_other_settings(tmp_path, monkeypatch, capsys):
    run(candidates=regressors(widths=(2,)), output_dir=str(tmp_path), verbose=False)
    monkeypatch.setattr(driver, "AUTO_FULL_MAX_DIRECTIONS", 5)  # h2 (R = 7) now over it: trained again
    result = run(candidates=regressors(widths=(2,)), output_dir=str(tmp_path), resume=True)[0]
    assert "reused" not in capsys.readouterr().out
    assert result.rank_by == "kron-ef" and result.full_ggn_refused is not None


def test_auto_never_ranks_by_a_flagged_ef_evidence_and_so_gives_no_ef_warning(monkeypatch):
    """The interpolating classifier of tests/test_ef_check_wiring.py (N C = 64 x 4, P = 16): its EF
    evidence is unreliable, which "auto" heeds: the full GGN where affordable, else kron-GGN (issue 33)."""
    def fitted(**kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = select_models({"fitted": lambda: Fitted(10.0)}, train_dataloader=_data(),
                                   callback={"structure": "diag", "approx": "ggn", "steps": 5},
                                   trainer={"max_epochs": 2, "enable_progress_bar": False}, verbose=False)[0]
        return result, [str(w.message) for w in caught if "empirical Fisher" in str(w.message)]

    result, messages = fitted()
    assert result.rank_by == "full-ggn" and result.ef_curvature_ratio < EF_RATIO_THRESHOLD and messages == []
    monkeypatch.setattr(driver, "AUTO_FULL_MAX_DIRECTIONS", 8)
    result, messages = fitted()
    assert result.rank_by == "kron-ggn" and messages == [] and "flags candidate 'fitted'" in result.rank_by_reason


def test_auto_is_accepted_everywhere_rank_by_is_and_near_misses_are_refused(tmp_path, capsys):
    assert rank_by_choices()[:2] == ("auto", "online")
    assert check_rank_by(" AUTO ") == ("auto", None)
    with pytest.raises(ValueError, match=r"`rank_by` must be one of \('auto', 'online', .*got 'atuo' "
                                         r"\(did you mean 'auto'\?\)"):
        select_models({"a": lambda: Classifier(60)}, datamodule=BlobData(), rank_by="atuo")
    config = {"data": {"class_path": "tests.lightning_models.BlobData"},
              "candidates": {"a": {"class_path": "tests.lightning_models.Classifier"}}}
    check_config({**config, "rank_by": "Auto"})  # the YAML's spelling is forgiven
    with pytest.raises(ValueError, match=r"got 'autp' \(did you mean 'auto'\?\)"):
        check_config({**config, "rank_by": "autp"})
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(config))
    assert build_parser().get_defaults().rank_by == "auto"
    assert "auto" in " ".join(build_parser().format_help().split())
    with pytest.raises(SystemExit):
        run_command_line([str(path), "--rank_by=autoo"])
    assert "did you mean 'auto'?" in capsys.readouterr().err


def test_auto_refuses_before_training_a_candidate_its_fallback_cannot_score():
    def factory():  # a diagonal prior: full could score it, kron-ef (which auto may need) cannot
        module = Classifier(60, width=8)
        module.prior = GaussianPrior(module.net, structure="diagonal")
        return module

    with pytest.raises(ValueError, match=r"rank_by='auto' falls back to rank_by='kron-ef' when the exact full GGN "
                                         r"of a candidate is too large, and rank_by='kron-ef' cannot score candidate "
                                         r"'mlp': .*diagonal.*Give rank_by='full-ggn'"):
        select_models({"mlp": factory}, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, verbose=False)
