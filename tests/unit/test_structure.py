"""Rules of the code's shape that a reviewer should not have to check by eye.

- no import cycle among pdkv's modules, counting every import: at module level, inside functions and
  under `if TYPE_CHECKING:` (an import inside a function puts off loading a module; it does not break a cycle);
- no import from a unit of a lower layer to one of its own layer or a higher one (support.import_graph.LAYERS,
  drawn in docs/imports.svg);
- no module under pdkv/ over 400 lines, but the known ones below;
- lines fit in 140 columns (ruff's E501, configured in pyproject.toml);
- every exception class lives in pdkv/errors.py, the one tree;
- every package lists its public surface in its `__init__`'s `__all__`, every name listed there resolves (at import
  or, for a heavy one, on first use through the package's `__getattr__`), and a module outside a package imports
  only that surface, never one of the package's own modules; importing a package imports none of the heavy
  libraries its docstring promises to leave out (NOT_AT_IMPORT);
- every outside HTTP surface pdkv calls has one typed client, and every caller uses it: only the modules of
  SURFACE_HOMES name a route of a bootstrap server, a vLLM engine or the proxy (/health, /metrics, /tokenize,
  /query, /register, /deregister, /pdkv/...) in a string, and only those of HTTP_CLIENT_HOMES import an HTTP
  client library.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.import_graph import LAYERS, cycles, dot, import_graph, module_name, unit_of, upward_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdkv"
MAX_LINES = 400
# Over the bound today, each with what would split it; the test fails once one of them fits, so the list only shrinks.
KNOWN_LONG: set[str] = set()


# Where a route of an outside HTTP surface may be named: its one client, the server that serves it, the manifests that
# point probes and scrapers at it.
SURFACE_HOMES = {
    "pdkv.bootstrap.client": "the bootstrap server's client",
    "pdkv.engine_api.client": "a vLLM engine's client (/health, /metrics, /tokenize)",
    "pdkv.proxy_api.messages": "the proxy's routes, shared by its server and its client",
    "pdkv.proxy_api.client": "the proxy's client",
    "pdkv.bootstrap.server": "serves the bootstrap routes",
    "pdkv.proxy.app": "serves the proxy's routes",
    "pdkv.k8s.pods": "a pod's probe path",
    "pdkv.k8s.monitors": "a scrape path in a PodMonitor",
    "pdkv.deploy.plan.launch": "a part's health path, which `pdkv up` probes while it starts (pdkv.deploy.run.process)",
}
SURFACE_ROUTE = re.compile(r"^/(health|metrics|tokenize|query|register|deregister)([/?]|$)|^/pdkv/")
HTTP_CLIENT_LIBS = ("httpx", "requests", "urllib.request", "http.client", "aiohttp.client")
HTTP_CLIENT_HOMES = {
    "pdkv.bootstrap.client": "the bootstrap server's client",
    "pdkv.engine_api.client": "a vLLM engine's client",
    "pdkv.proxy_api.client": "the proxy's client",
    "pdkv.deploy.run.process": "a started part's liveness at its health path, whatever the part",
    "pdkv.planner.measure": "the profile's load on an engine's OpenAI API (its /metrics through pdkv.engine_api)",
}


def surface_calls(package: Path) -> list[str]:
    """'module:line what' for every route of an outside surface named, or HTTP client library imported, outside
    its homes."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if (module not in SURFACE_HOMES and isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and SURFACE_ROUTE.match(node.value)):  # fmt: skip
                found.append(f"{module}:{node.lineno} names {node.value!r}")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if module not in HTTP_CLIENT_HOMES and any(n == lib or n.startswith(lib + ".") for n in names for lib in HTTP_CLIENT_LIBS):
                found.append(f"{module}:{node.lineno} imports {', '.join(names)}")
    return found


def test_the_surface_rule_finds_a_raw_call_and_nothing_else(tmp_path: Path):
    raw = _package(tmp_path / "r", {
        "__init__.py": "",
        "autoscale.py": "import httpx\n\ndef idle(url):\n    return httpx.get(f'{url}/metrics').text\n",
        "drain.py": "def drain(client, url):\n    return client.post(url + '/pdkv/drain')\n",
        "plain.py": "HELP = 'GET /health answers 503'\nLOG = '/metrics of %s: %s'\nPATH = '/healthz'\n",
    })
    assert surface_calls(raw) == ["syn.autoscale:1 imports httpx", "syn.autoscale:4 names '/metrics'",
                                  "syn.drain:2 names '/pdkv/drain'"]


def test_every_outside_http_surface_is_called_through_its_one_client():
    assert surface_calls(PACKAGE) == []
    modules = set(import_graph(PACKAGE))
    assert set(SURFACE_HOMES) | set(HTTP_CLIENT_HOMES) <= modules, "a home that is gone: take it off the list"


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
    assert "pdkv.bootstrap" in graph["pdkv.proxy.health"]  # and those inside functions
    assert "pdkv.bootstrap.client" in graph["pdkv.bootstrap"]  # a lazy surface's too, inside its __getattr__
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


# What importing a package must not import, as its docstring promises: the names that need these are imported on
# first use (PEP 562), so `pdkv --help` stays instant and a host without vLLM runs the proxy and `pdkv up`.
NOT_AT_IMPORT = {
    "pdkv.transport": ("mooncake", "torch", "triton"),
    "pdkv.bootstrap": ("aiohttp", "httpx"),
    "pdkv.connector": ("vllm", "torch"),
}
# Names a surface lists that this tier does not resolve, each with why and where they are resolved.
RESOLVED_ELSEWHERE = {
    "pdkv.connector.PdkvConnector": "imports vLLM; tests/integration/test_vllm_versions.py resolves it as vLLM does",
}


def packages(package: Path) -> set[str]:
    """The sub-packages of `package` (those with an `__init__.py`), by module name; `package` itself is not one."""
    return {module_name(p, package.parent) for p in package.rglob("__init__.py") if p.parent != package}


def reaches_inside(graph: dict[str, set[str]], pkgs: set[str]) -> list[str]:
    """'a -> b (P)' for every import of a module b inside package P (not P's `__init__`) by a module a outside P."""
    found = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            outside = [p for p in pkgs if b.startswith(p + ".") and not (a == p or a.startswith(p + "."))]
            if outside:
                found.append(f"{a} -> {b} ({min(outside, key=len)})")
    return found


def test_the_surface_rule_finds_a_reach_inside_and_nothing_else(tmp_path: Path):
    lazy = "__all__ = ['Heavy']\n\ndef __getattr__(name):\n    from syn.codec.heavy import Heavy\n    return Heavy\n"
    pkg = _package(tmp_path / "s", {
        "__init__.py": "",
        "wire/__init__.py": "from syn.wire.frames import Frame\n__all__ = ['Frame']\n",
        "wire/frames.py": "from syn.wire.ids import Id\nclass Frame: ...\n",
        "wire/ids.py": "Id = str\n",
        "codec/__init__.py": lazy,
        "codec/heavy.py": "class Heavy: ...\n",
        "proxy/__init__.py": "__all__ = []\n",
        "proxy/app.py": "from syn.wire import Frame\nfrom syn.wire.ids import Id\n\ndef f():\n    from syn.codec import Heavy\n",
    })
    graph = import_graph(pkg)
    assert reaches_inside(graph, packages(pkg)) == ["syn.proxy.app -> syn.wire.ids (syn.wire)"]
    assert "syn.codec.heavy" in graph["syn.codec"]  # a name on first use: the package imports its module


def test_outside_modules_import_only_a_package_s_surface():
    assert reaches_inside(import_graph(PACKAGE), packages(PACKAGE)) == []


def test_every_name_a_surface_lists_resolves():
    """A name on first use is a string in its package's `__getattr__`: a typo there would show only in a caller."""
    unresolved = []
    for package in sorted(packages(PACKAGE)):
        module = importlib.import_module(package)
        unresolved += [f"{package}.{name}" for name in module.__all__
                       if f"{package}.{name}" not in RESOLVED_ELSEWHERE and not hasattr(module, name)]
    assert unresolved == []
    assert set(RESOLVED_ELSEWHERE) <= {f"{p}.{n}" for p in packages(PACKAGE) for n in importlib.import_module(p).__all__}


@pytest.mark.parametrize("package", sorted(NOT_AT_IMPORT))
def test_importing_a_package_imports_nothing_heavy(package: str):
    heavy = NOT_AT_IMPORT[package]
    code = f"import sys, {package}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"importing {package} imports {done.stdout.strip()}"
