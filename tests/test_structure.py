"""The package's shape: no module imports (even lazily, inside a function) a module that imports it."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "slotinfer"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """Every slotinfer module ``name`` imports anywhere in its body (a package counts as its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module or ""
            for alias in node.names:
                full = f"{where}.{alias.name}"
                out.add(full if full in mods else where)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert "slotinfer.engine" in graph["slotinfer.batch"]  # the graph holds what it should,
    assert "slotinfer.batch" in graph["slotinfer.model"]  # lazy imports inside functions included
    assert _cycles(graph) == []
