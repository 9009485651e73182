"""The packages' layering, read from their source with ``ast`` (nothing is imported).

- ``envs``, ``teachers`` and ``transfer_mesh`` import none of our other packages; ``trainer`` imports only
  ``transfer_mesh``; ``agentflow`` may import them all. Every import counts: module level, inside functions, and
  under ``if TYPE_CHECKING:`` (a type-only import is still a dependency on the other package's contracts).
- No import cycle between our modules through module-level imports (the ones that run when a module is first
  imported: not those inside functions, nor those under ``if TYPE_CHECKING:``, which never run). An edge goes to
  the module named (``from pkg import sub`` -> ``pkg.sub``; ``from pkg import name`` -> ``pkg``), not to the
  parent packages Python also initialises on the way: a submodule importing a sibling through its partly
  initialised package is fine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentflow", "envs", "trainer", "teachers", "transfer_mesh")
ALLOWED: dict[str, set[str]] = {
    "envs": set(),
    "teachers": set(),
    "transfer_mesh": set(),
    "trainer": {"transfer_mesh"},
}
"""What each restricted package may import of ours besides itself (``agentflow`` is not restricted)."""


@dataclass(frozen=True)
class Import:
    target: str
    """The absolute dotted name imported (``from a.b import c`` gives ``a.b.c``; it is resolved later)."""
    line: int
    runtime_top_level: bool
    """Runs when the importing module is first imported (module or class body, not under TYPE_CHECKING)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[_module_name(path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> Iterator[Import]:
    """Every import statement of one file, with absolute targets."""
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, top: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno, top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                yield Import(prefix if alias.name == "*" else f"{prefix}.{alias.name}", node.lineno, top)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            top = False
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                yield from visit(child, False)
            else:
                yield from visit(child, top)

    yield from visit(ast.parse(path.read_text(), str(path)), True)


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ours a dotted target names (``a.b.name`` -> ``a.b`` when ``name`` is not a module)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def test_packages_import_only_what_their_layer_allows():
    modules = _sources()
    problems = []
    for module, path in modules.items():
        pkg = module.split(".")[0]
        if pkg not in ALLOWED:
            continue
        allowed = ALLOWED[pkg] | {pkg}
        for imp in _imports(module, path):
            other = imp.target.split(".")[0]
            if other in PACKAGES and other not in allowed:
                problems.append(f"{path.relative_to(ROOT)}:{imp.line}: {pkg} imports {imp.target}")
    assert not problems, "layering violations:\n" + "\n".join(sorted(set(problems)))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan), each as a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _path_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle through the component's first module (for the failure message)."""
    start, members = component[0], set(component)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def module_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Our modules and the modules of ours each one imports at module level (with the line of each edge)."""
    modules = _sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lines: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for imp in _imports(module, path):
            target = _resolve(imp.target, modules) if imp.runtime_top_level else None
            if target is not None and target != module:
                graph[module].add(target)
                lines.setdefault((module, target), imp.line)
    return graph, lines


def test_no_import_cycles_at_module_level():
    graph, lines = module_graph()
    modules = _sources()
    report = []
    for component in _cycles(graph):
        cycle = _path_in(component, graph)
        steps = [f"  {modules[a].relative_to(ROOT)}:{lines[(a, b)]}: {a} imports {b}" for a, b in pairwise(cycle)]
        report.append(" -> ".join(cycle) + "\n" + "\n".join(steps))
    assert not report, "import cycles:\n" + "\n".join(report)


def test_the_checks_see_known_imports():
    """Guard against a parser that silently finds nothing."""
    graph, _ = module_graph()
    assert "trainer.types" in graph["trainer.launcher"]
    assert "transfer_mesh.buckets" in graph["transfer_mesh.transport"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
