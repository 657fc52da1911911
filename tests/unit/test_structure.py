"""Rules of the code's shape that a reviewer should not have to check by eye.

- no import cycle among pdkv's modules, counting every import: at module level, inside functions and
  under `if TYPE_CHECKING:` (an import inside a function puts off loading a module; it does not break a cycle);
- no import from a unit of a lower layer to one of its own layer or a higher one (support.import_graph.LAYERS,
  drawn in docs/imports.svg);
- no module under pdkv/ over 400 lines, but the known ones below;
- lines fit in 140 columns (ruff's E501, configured in pyproject.toml);
- every exception class lives in pdkv/errors.py, the one tree;
- every package lists its public surface in its `__init__`'s `__all__`.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.import_graph import LAYERS, cycles, dot, import_graph, unit_of, upward_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdkv"
MAX_LINES = 400
# Over the bound today, each with what would split it; the test fails once one of them fits, so the list only shrinks.
KNOWN_LONG = {
    "pdkv/protocol.py",  # four wires and the proxy's record: one module per wire is the next split
}


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "syn" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "syn"


def test_a_cycle_hidden_inside_a_function_or_under_type_checking_is_found(tmp_path: Path):
    in_function = _package(tmp_path / "f", {
        "__init__.py": "",
        "a.py": "from syn.b import helper\n",
        "b.py": "def helper():\n    from syn import a\n    return a\n",
    })
    assert cycles(import_graph(in_function)) == [["syn.a", "syn.b"]]
    type_checking = _package(tmp_path / "t", {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from syn.b import B\n",
        "b.py": "from . import a\nclass B: ...\n",
    })
    assert cycles(import_graph(type_checking)) == [["syn.a", "syn.b"]]
    no_cycle = _package(tmp_path / "n", {"__init__.py": "", "a.py": "import syn.b\n", "b.py": "import json\n"})
    assert cycles(import_graph(no_cycle)) == []


def test_no_import_cycle_counting_every_import():
    graph = import_graph(PACKAGE)
    assert "pdkv.connector.pulls" in graph["pdkv.connector.scheduler"]  # the walk sees pdkv's imports at all
    assert "pdkv.bootstrap.client" in graph["pdkv.proxy.health"]  # and those inside functions
    assert cycles(graph) == []


def test_every_module_is_in_a_layer_and_no_import_goes_up_or_sideways():
    graph = import_graph(PACKAGE)
    for module in graph:
        unit_of(module)  # KeyError names a module no layer holds
    assert upward_imports(graph) == []
    upward = upward_imports({"pdkv.errors": {"pdkv.cli.app"}, "pdkv.cli.app": set()})
    assert upward == ["pdkv.errors -> pdkv.cli.app (pdkv.errors -> pdkv.cli)"]
    assert len({u for layer in LAYERS for u in layer}) == sum(len(layer) for layer in LAYERS)


def test_the_drawing_is_current():
    """docs/imports.dot is what tests/support/import_graph.py draws today (docs/imports.svg is made from it)."""
    assert (ROOT / "docs" / "imports.dot").read_text() == dot(import_graph(PACKAGE)), (
        "run: python3 tests/support/import_graph.py --dot docs/imports.dot && dot -Tsvg docs/imports.dot -o docs/imports.svg")


def test_no_module_over_400_lines_but_the_known_ones():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {path for path, n in sizes.items() if n > MAX_LINES}
    assert over - set(KNOWN_LONG) == set(), {p: sizes[p] for p in over - set(KNOWN_LONG)}
    assert set(KNOWN_LONG) - over == set(), "fits now: take it off KNOWN_LONG"


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_lines_fit_the_configured_length():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install 'pdkv[test]')")
    done = subprocess.run([*ruff, "check", "--select", "E501", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _is_exception(base: ast.expr) -> bool:
    name = getattr(base, "id", getattr(base, "attr", ""))
    builtin = getattr(builtins, name, None)
    return name.endswith(("Error", "Exception")) or (isinstance(builtin, type) and issubclass(builtin, BaseException))


def test_every_exception_class_lives_in_pdkv_errors():
    elsewhere = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(_is_exception(b) for b in node.bases)
    ]
    assert elsewhere == []


def test_every_package_lists_its_public_surface_in_all():
    missing = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
               and not any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                           for n in ast.parse(p.read_text()).body)]
    assert missing == []
