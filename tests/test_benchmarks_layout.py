"""The benchmarks as a newcomer finds them: every script answers ``--help`` from where it lives (its imports
and paths resolve after a move), and ``benchmarks/README.md`` lists every script and results file there is."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(
    p for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("investigations/*.py")] if not p.name.startswith("_")
)

# One process runs every script's --help, so that torch and Lightning are imported once, and the scripts'
# own sys.path entries (examples/, benchmarks/) stay out of the test session.
HELP_ALL = r"""
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
results = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = "returned without --help exiting: it ran"
    except SystemExit as stop:
        results[path] = "ok" if stop.code == 0 and "usage" in out.getvalue() else f"exit {stop.code}"
    except Exception as err:  # an import or path that the move broke
        results[path] = f"{type(err).__name__}: {err}"
print(json.dumps(results))
"""


def test_every_benchmark_script_answers_help_from_its_place():
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(SCRIPTS) > 20
    assert {path: r for path, r in results.items() if r != "ok"} == {}


def test_the_benchmarks_readme_lists_every_script_and_results_file():
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`((?:investigations/)?\w+\.py)`", readme))
    assert {str(p.relative_to(BENCHMARKS)) for p in SCRIPTS} <= listed
    results = set(re.findall(r"`results/(\w+\.md)`", readme))
    assert {p.name for p in (BENCHMARKS / "results").glob("*.md")} <= results
    assert all((BENCHMARKS / name).exists() for name in listed), "the README names a script that is not there"
    assert all((BENCHMARKS / "results" / name).exists() for name in results)


def test_a_results_page_of_sections_keeps_what_another_command_wrote_meanwhile(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # for this test only, as the scripts' own entries stay out
    from _common import HAND_WRITTEN, read_data, write_sections

    page = tmp_path / "page.md"
    write_sections(page, "# Title", ["a", "b"], {"b": {"text": "## B, first", "runs": [1]}})
    page.write_text(page.read_text().replace(HAND_WRITTEN, HAND_WRITTEN + "\nA reading."))
    # two commands started before either wrote: each writes only its own section
    write_sections(page, "# Title", ["a", "b"], {"a": {"text": "## A", "runs": [2]}})
    text = write_sections(page, "# Title", ["a", "b"], {"b": {"text": "## B, again", "runs": [3]}})
    assert text.index("## A") < text.index("## B, again") < text.index("A reading.")
    assert "## B, first" not in text
    assert read_data(page) == {"a": {"text": "## A", "runs": [2]}, "b": {"text": "## B, again", "runs": [3]}}
