"""The README's options table of MargLikCallback says what the signature says: every option, its default."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from lightning_marglik import MargLikCallback

README = Path(__file__).resolve().parents[1] / "README.md"


def options_table() -> list:
    """``(option, default)`` of each row under "### Options of `MargLikCallback`"."""
    section = README.read_text().split("### Options of `MargLikCallback`", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section.split("\n\n", 2)[1], flags=re.MULTILINE)
    assert rows, "the options table was not found under its heading"
    return rows


def test_readme_options_table_matches_the_signature():
    parameters = inspect.signature(MargLikCallback).parameters
    rows = options_table()
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), f"options listed twice: {names}"
    assert set(names) == set(parameters), (
        f"not in the README table: {sorted(set(parameters) - set(names))}; "
        f"not arguments of MargLikCallback: {sorted(set(names) - set(parameters))}"
    )
    for name, default in rows:
        assert ast.literal_eval(default) == parameters[name].default, (
            f"README says {name} defaults to {default}, the signature says {parameters[name].default!r}"
        )
