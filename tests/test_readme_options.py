"""The options tables of MargLikCallback say what the signature says.

The callback reference (docs/callback.md) lists every option with its default; the README's summary
lists five of them, with the same defaults, and names the default `rank_by` of `select_models`.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from lightning_marglik import MargLikCallback, select_models

ROOT = Path(__file__).resolve().parents[1]
HEADINGS = {"docs/callback.md": "## Options of `MargLikCallback`", "README.md": "## Options"}


def options_table(path: str) -> list:
    """``(option, default)`` of each row of the first table under the page's options heading."""
    text = (ROOT / path).read_text()
    assert f"\n{HEADINGS[path]}\n" in text, f"{path}: the heading {HEADINGS[path]!r} was not found"
    section = text.split(f"\n{HEADINGS[path]}\n", 1)[1]
    table = re.search(r"^\|.*?(?=\n\n|\Z)", section, flags=re.MULTILINE | re.DOTALL)
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table.group(0) if table else "", flags=re.MULTILINE)
    assert rows, f"{path}: the options table was not found under {HEADINGS[path]!r}"
    return rows


def check_defaults(path: str, rows: list) -> None:
    parameters = inspect.signature(MargLikCallback).parameters
    for name, default in rows:
        assert name in parameters, f"{path} lists {name}, which is not an argument of MargLikCallback"
        assert ast.literal_eval(default) == parameters[name].default, (
            f"{path} says {name} defaults to {default}, the signature says {parameters[name].default!r}"
        )


def test_reference_options_table_matches_the_signature():
    parameters = inspect.signature(MargLikCallback).parameters
    rows = options_table("docs/callback.md")
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), f"options listed twice: {names}"
    assert set(names) == set(parameters), (
        f"not in the docs/callback.md table: {sorted(set(parameters) - set(names))}; "
        f"not arguments of MargLikCallback: {sorted(set(names) - set(parameters))}"
    )
    check_defaults("docs/callback.md", rows)


def test_readme_summary_is_five_options_with_the_signatures_defaults():
    rows = options_table("README.md")
    assert len(rows) == 5 and len({name for name, _ in rows}) == 5, rows
    check_defaults("README.md", rows)


def test_readme_names_select_models_default_rank_by():
    named = re.findall(r'`select_models`\' default\s+re-estimate \(`rank_by="([\w-]+)"`\)', (ROOT / "README.md").read_text())
    assert named == [inspect.signature(select_models).parameters["rank_by"].default], named
