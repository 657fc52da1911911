"""pdkv's import graph from the source (ast, nothing imported), its cycles, its layers, and a Graphviz drawing.

Every import counts: at module level, inside functions, under `if TYPE_CHECKING:`; an import inside a
function may put off loading a module, never break a cycle (docs/imports.md).

    python3 tests/support/import_graph.py --dot docs/imports.dot   # then: dot -Tsvg docs/imports.dot -o docs/imports.svg
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A unit is a package or a top-level module (pdkv.proxy.kv is a unit of its own, below the
# rest of pdkv.proxy); a module's unit is the longest one naming it. A unit imports only units of lower
# layers, never one of its own layer or above.
LAYERS: list[tuple[str, ...]] = [
    ("pdkv", "pdkv.errors", "pdkv.bounds"),
    ("pdkv.tp_heads", "pdkv.auth"),
    ("pdkv.wire", "pdkv.geometry", "pdkv.metrics", "pdkv.peer_address", "pdkv.service", "pdkv.tinymodel", "pdkv.randmodel"),
    ("pdkv.transport", "pdkv.bootstrap", "pdkv.engine_api", "pdkv.proxy_api"),
    ("pdkv.connector", "pdkv.doctor", "pdkv.bench", "pdkv.proxy.kv", "pdkv.planner"),
    ("pdkv.proxy",),
    ("pdkv.trace",),
    ("pdkv.deploy.plan",),
    ("pdkv.deploy.run",),
    ("pdkv.deploy",),
    ("pdkv.k8s", "pdkv.top"),
    ("pdkv.cli",),
    ("pdkv.__main__",),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` its imports name, wherever they stand in it (`from a import b` names
    a.b when that is a module and not a name a's `__all__` lists, else a). A name a package imports on first use
    (PEP 562) is one its `__all__` lists, so importing it names the package, and the package's `__getattr__`
    names the module it comes from (an import inside a function, which counts as every import does). The
    package's parent is the root its module names start from."""
    root = package.parent
    modules = {module_name(p, root): p for p in package.rglob("*.py")}
    surface = {name: public_names(path) for name, path in modules.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        edges.add(target)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package_name = package_name.rpartition(".")[0]
                    base = f"{package_name}.{base}" if base else package_name
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules and alias.name not in surface.get(base, ()):
                        edges.add(f"{base}.{alias.name}")
                    elif base in modules:
                        edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def public_names(path: Path) -> set[str]:
    """The names a module's `__all__` lists (empty without one)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str) -> str:
    units = [u for layer in LAYERS for u in layer if module == u or module.startswith(u + ".")]
    if not units:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    return max(units, key=len)


def layer_of(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every import from one unit to another of its own layer or a higher one, as 'a -> b (unit -> unit)'."""
    wrong = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ua, ub = unit_of(a), unit_of(b)
            if ua != ub and layer_of(ub) >= layer_of(ua):
                wrong.append(f"{a} -> {b} ({ua} -> {ub})")
    return wrong


def unit_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for a, targets in graph.items():
        edges = units.setdefault(unit_of(a), set())
        edges.update(unit_of(b) for b in targets if unit_of(b) != unit_of(a))
    return units


def dot(graph: Mapping[str, Iterable[str]]) -> str:
    """The units and their imports in Graphviz's DOT, one row per layer (lowest at the bottom)."""
    units = unit_graph(graph)
    sizes = {u: sum(1 for m in graph if unit_of(m) == u) for u in units}
    lines = ["// pdkv's import graph by unit (tests/support/import_graph.py); every import counts, inside functions too.",
             "digraph pdkv {", '  rankdir=BT; newrank=true; node [shape=box, fontname="Helvetica", fontsize=11];',
             '  edge [color="#777777", arrowsize=0.6];']
    for i, layer in enumerate(LAYERS):
        present = [u for u in layer if u in units]
        lines.append(f'  subgraph cluster_{i} {{ label="layer {i}"; fontsize=10; color="#cccccc"; rank=same;')
        for u in present:
            label = u.removeprefix("pdkv.") if u != "pdkv" else "pdkv (__init__)"
            n = sizes[u]
            lines.append(f'    "{u}" [label="{label}\\n{n} module{"s" * (n != 1)}"];')
        lines.append("  }")
    for a in sorted(units):
        for b in sorted(units[a]):
            lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dot", type=Path, help="write the DOT drawing here")
    args = parser.parse_args(argv)
    graph = import_graph(ROOT / "pdkv")
    found, wrong = cycles(graph), upward_imports(graph)
    for group in found:
        print("cycle:", " <-> ".join(group))
    for line in wrong:
        print("upward:", line)
    if args.dot:
        args.dot.write_text(dot(graph))
    print(f"{len(graph)} modules, {sum(len(e) for e in graph.values())} imports, {len(found)} cycles, {len(wrong)} upward imports")
    return 1 if found or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
