"""The README is a front page that runs, and the documentation site builds strictly and holds the rest.

The site (mkdocs.yml) has the README as its front page, the pages it links and a page per benchmark result
file (docs/hooks.py); a strict build fails on a broken link or anchor and on an API object it cannot find.
"""
from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FRONT_PAGE_LINES = 150
# what the README says to run: the main job, and the tests as CI's .ci/run runs them
MAIN_JOB = 'pip install -e ".[examples]" && python examples/toy_regression.py'
TESTS = 'pip install -e ".[dev,examples]" && python -m pytest -q'


def readme_python_blocks() -> list:
    """The README's ```python blocks, in order: the Lightning example, then the engine example."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def shortened(code: str, long: str, short: str) -> str:
    """``code`` with its one ``long`` replaced by ``short`` (a shorter run of the same example)."""
    assert code.count(long) == 1, f"the README example no longer contains {long!r} once; update this test"
    return code.replace(long, short)


def nav_pages() -> list:
    """Every page file named in mkdocs.yml's nav."""
    def walk(entries):
        for entry in entries:
            for value in entry.values():
                yield from walk(value) if isinstance(value, list) else [value]
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return list(walk(config["nav"]))


def test_documentation_builds_strictly(tmp_path):
    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    front = (tmp_path / "index.html").read_text()
    assert "With Lightning" in front and 'href="callback/#options-of-marglikcallback"' in front  # the README
    assert 'href="docs/' not in front, "a README link kept its docs/ prefix on the site"
    assert "Options of <code>MargLikCallback</code>" in (tmp_path / "callback" / "index.html").read_text()
    assert "Never silently wrong." in (tmp_path / "guarantees" / "index.html").read_text()
    assert "Paper experiments at laptop scale" in (tmp_path / "results" / "index.html").read_text()
    for result in (ROOT / "benchmarks" / "results").glob("*.md"):  # a page each (docs/hooks.py)
        page = (tmp_path / "benchmarks" / result.stem / "index.html").read_text()
        assert f'href="benchmarks/{result.stem}/"' in front, result.name  # in the nav
        assert result.read_text().splitlines()[0].lstrip("# ") in page, result.name
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("MargLikCallback", "LaplaceEvidence", "GaussianPrior", "predict_regression", "select_models"):
        assert f'id="lightning_marglik.{name}"' in api, name
    assert "class_path" in (tmp_path / "selection" / "index.html").read_text()  # the YAML format


def test_readme_is_one_front_page_with_both_commands_and_links_to_every_page():
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= FRONT_PAGE_LINES, f"README.md has {lines} lines; move the detail to a docs page"
    assert MAIN_JOB in text and TESTS in text
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()  # the command CI runs is the README's
    linked = set(re.findall(r"\]\(docs/([^)#]+)", text))
    assert all((DOCS / page).is_file() for page in linked), sorted(p for p in linked if not (DOCS / p).is_file())
    top_pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert top_pages <= linked, f"pages the README does not link: {sorted(top_pages - linked)}"
    assert set(nav_pages()) == {p.name for p in DOCS.glob("*.md")}, "the nav and docs/*.md differ"


def test_the_tests_the_guarantees_and_works_with_pages_name_exist():
    source = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    defined = set(re.findall(r"^def (test_\w+)\(", source, flags=re.MULTILINE))
    for page in ("guarantees.md", "works-with.md"):
        text = (DOCS / page).read_text()
        names = re.findall(r"`(test_[\w*]+)(?:\[\w+\])?`", text)
        assert len(names) > 10, page
        for name in names:  # test_bert_* stands for every test of that prefix
            pattern = re.compile(re.escape(name).replace(r"\*", r"\w*") + "$")
            assert any(pattern.match(d) for d in defined), f"{page} names {name}, which no test defines"
        for path in re.findall(r"`(tests/\w+\.py)`", text):
            assert (ROOT / path).is_file(), f"{page} names {path}, which does not exist"


def test_every_table_of_the_pages_starts_with_a_header_and_its_delimiter_row():
    """A row after a blank line starts a new table: without its own header and delimiter it renders as text (the
    strict build does not catch it)."""
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "benchmarks" / "results").glob("*.md")]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            starts = line.startswith("|") and (i == 0 or not lines[i - 1].strip())  # a new block
            if starts and not (i + 1 < len(lines) and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1])):
                broken.append(f"{page.relative_to(ROOT)}:{i + 1}")
    assert not broken, f"table rows without a header and delimiter row before them: {broken}"


def test_readme_lightning_example_trains_and_reads_the_result(tmp_path, monkeypatch, capsys):
    torch.set_default_dtype(torch.float32)  # as a user runs it (the fixture restores float64)
    monkeypatch.chdir(tmp_path)  # checkpoints and logs go here
    code = shortened(readme_python_blocks()[0], "max_epochs=200", "max_epochs=20")
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md (With Lightning)", "exec"), namespace)
    checkpoint, module, callback = namespace["checkpoint"], namespace["module"], namespace["callback"]
    printed = capsys.readouterr().out
    # the last and the best estimate, each labelled (the best is what early stopping reports and trainer.test loads)
    marglik = re.search(r"^marglik: last estimate (\S+), best (\S+) \(epoch (\d+): (.+)\)$", printed, flags=re.MULTILINE)
    assert marglik, printed[-2000:]
    last, best_value, best_epoch = float(marglik.group(1)), float(marglik.group(2)), int(marglik.group(3))
    assert math.isfinite(last) and best_value >= last and marglik.group(4) == checkpoint.best_model_path
    assert {"epoch": best_epoch, "marglik": round(best_value, 4)} in [
        {"epoch": h["epoch"], "marglik": round(h["marglik"], 4)} for h in callback.history]
    best = Path(checkpoint.best_model_path)
    assert best.is_file() and tmp_path in best.parents
    saved = torch.load(best, weights_only=True)["state_dict"]  # trainer.test(ckpt_path="best") loaded it
    assert torch.equal(saved["prior.log_precision"], module.prior.log_precision)
    assert torch.equal(saved["likelihood.log_sigma"], module.likelihood.log_sigma)
    assert len(module.prior.param_names) == module.prior.precision.numel() == 4
    # learned, but the output layer's (the last two tensors), held at the declared precision by default
    assert module.prior.precision[:-2].ne(1.0).all() and module.prior.precision[-2:].eq(1.0).all()
    assert module.likelihood.sigma.item() != 1.0
    assert "test_rmse" in printed
    # each tensor says whether its δ is learned or held, and what map_loss applies: the learned δ on the hidden weight
    # (the declared δ = 1 where the prior guard's last decision kept it), the declared δ = 1 on its bias
    # (biases="decoupled"); the output layer held at the declared δ = 1
    assert module.prior.learned_names() == ["0.weight", "0.bias"] == module.prior.param_names[:2]
    assert callback.output_decision["names"] == ["2.weight", "2.bias"] and callback.output_decision["treatment"] == "fixed"
    lines = [line for line in printed.splitlines() if ": prior precision " in line]
    kept = callback.guard_decisions[-1]["applied"] == "declared"
    weight = r"0\.weight: prior precision \S+ learned, applied 1" if kept else r"0\.weight: prior precision (\S+) learned, applied \1"
    assert len(lines) == 4 and re.fullmatch(weight, lines[0]), lines
    assert re.fullmatch(r"0\.bias: prior precision \S+ learned, applied 1", lines[1]) and "precision 1 learned" not in lines[1]
    assert lines[2:] == ["2.weight: prior precision 1 held, applied 1", "2.bias: prior precision 1 held, applied 1"], lines
    assert re.search(r"^sigma \d\.\d{3} \(true: 0\.1\)$", printed, flags=re.MULTILINE), printed[-2000:]
    # the one call in its predict_step: the predictive's sd holds the noise's and the model's on top
    sd = re.search(r"^predictive sd (\S+), of which noise (\S+)$", printed, flags=re.MULTILINE)
    assert sd and float(sd.group(1)) > float(sd.group(2)) > 0, printed[-2000:]


def test_readme_engine_example_runs_from_plain_pytorch(capsys):
    torch.set_default_dtype(torch.float32)
    code = shortened(readme_python_blocks()[1], "range(100)", "range(20)")
    printed = []
    for _ in range(2):  # seeded: the same number twice
        namespace: dict = {"__name__": "readme_engine_example"}
        exec(compile(code, "README.md (the evidence engine)", "exec"), namespace)
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].startswith("log evidence per datum: "), printed
    per_datum = float(printed[0].split()[-1])
    assert math.isfinite(per_datum) and per_datum < 0  # a categorical evidence is a log probability
    assert namespace["evidence"].n_data == 500


def test_the_front_page_installs_the_cpu_torch_before_the_commands_that_need_it():
    text = README.read_text()
    assert text.index("download.pytorch.org/whl/cpu") < min(text.index(MAIN_JOB), text.index(TESTS))


# the front page's words a practitioner may not know, each defined once in its **Terms.** paragraph
TERMS = {"δ": "*δ*", "ρ": "*ρ*", "points": "*Points*", "cells": "*cells*", "Fixup": "*Fixup*", "Step 1": "*Step 1*",
         "Step 2": "*Step 2*"}


def test_the_front_pages_terms_are_defined_once_before_the_options_use_them():
    text = README.read_text()
    start = text.index("**Terms.**")
    terms = text[start:text.index("\n\n", start)]
    assert start < text.index("## Options")  # before the options and the recommendation that use them
    for word, definition in TERMS.items():
        assert terms.count(definition) == 1, word


def test_the_terms_say_which_precisions_the_defaults_hold_and_decouple():
    from lightning_marglik import MargLikCallback

    text = README.read_text()
    start = text.index("**Terms.**")
    terms = " ".join(text[start:text.index("\n\n", start)].split())
    defaults = {name: p.default for name, p in inspect.signature(MargLikCallback).parameters.items()}
    assert defaults["output_layer"] == "fixed" and "the output layer's, held at the declared δ (`output_layer=\"fixed\"`, " \
        "the default; `callback.output_decision` names the layer)" in terms, terms
    assert "(`biases=\"decoupled\"`, the default)" in terms and "learned δ (≈" not in terms  # no figure of a held δ


def test_the_front_page_says_to_train_small_models_on_one_thread_next_to_the_trainer():
    text = README.read_text()
    after_example = text[text.index("trainer = pl.Trainer("):text.index("**Terms.**")]
    assert "train small models like this one on one thread (`torch.set_num_threads(1)` before the `Trainer`, or " \
        "`OMP_NUM_THREADS=1`)" in after_example


def test_the_selection_page_opens_with_its_command_and_defines_its_steps():
    text = (DOCS / "selection.md").read_text()
    lines = text.splitlines()
    assert lines.index("```bash") < 12, "the first command comes after the page's opening lines"
    for step in ("**Step 1**", "**Step 2**"):
        assert text.index(step) < text.index("```bash") < text.index("## When to trust Step 2"), step
