"""The package's import graph (docs/maintaining.md, "The layer map"): no import circle, and the library never
imports the tools or the private verification code.

The graph is read from the source (every ``import`` statement, also those inside functions: a lazy import closes
a circle as surely as one at the top), so it needs no backend and imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "qkvfuse"

# Tools and private verification: the library layers below them never import them (the engine plugins' `verify`
# option uses the public qkvfuse.testing).
TOOLS = ("qkvfuse._verify", "qkvfuse.benchmarks", "qkvfuse.cli", "qkvfuse.__main__")
# The bottom of the ops: what each may import within qkvfuse.
BOTTOM = {"qkvfuse._rope_mode": set(), "qkvfuse._cache_mode": set(),
          "qkvfuse._checks": {"qkvfuse._rope_mode", "qkvfuse._cache_mode"},
          "qkvfuse._library": {"qkvfuse._checks", "qkvfuse._rope_mode", "qkvfuse._cache_mode"}, "qkvfuse.rope": set(),
          "qkvfuse.presets": set()}


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("qkvfuse",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(name: str, modules: Dict[str, Path]) -> str:
    """The module an imported name is: the longest known module prefix (``qkvfuse.ops.split`` -> ``qkvfuse.ops``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def import_graph() -> Dict[str, Set[str]]:
    """``{module: modules of qkvfuse it imports}`` (explicit targets; a package's ``__init__`` is the package)."""
    modules = _modules()
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself.
                wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in wanted:
                if target == "qkvfuse" or target.startswith("qkvfuse."):
                    target = _target(target, modules)
                    if target != name:
                        edges.add(target)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def test_the_graph_is_read():
    graph = import_graph()
    assert "qkvfuse._checks" in graph and "qkvfuse.backends.triton.launch" in graph
    assert "qkvfuse._rope_mode" in graph["qkvfuse._checks"]
    assert "qkvfuse._library" in graph["qkvfuse.ops"]


def test_no_import_circle():
    assert _cycles(import_graph()) == []


def test_cycle_detection_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_does_not_import_tools_or_verification():
    bad = sorted((src, dst) for src, targets in import_graph().items() if not _is_tool(src)
                 for dst in targets if _is_tool(dst))
    assert bad == []


def test_bottom_layers_import_only_what_is_below():
    graph = import_graph()
    for module, allowed in BOTTOM.items():
        assert graph[module] <= allowed, (module, graph[module] - allowed)
