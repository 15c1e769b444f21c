"""The package's shape: no module imports (even lazily, inside a function) a module that imports it,
nor does any room (a folder of the package, or a module at its root); the folders and root modules
are the rooms docs/architecture.md names; the checkpoint sits below the engine; every variable is
read in one place; a benchmark loads slotinfer before MLX."""

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
    assert "slotinfer.engine.engine" in graph["slotinfer.batch"]  # the graph holds what it should,
    assert "slotinfer.text.gguf_tokenizer" in graph["slotinfer.text.tokenizer"]  # lazy imports included
    assert _cycles(graph) == []


def _room(module: str) -> str:
    """The room a module stands in: its folder under the package, or itself at the root."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_room_imports_a_room_that_imports_it():
    mods = _modules()
    rooms: dict[str, set[str]] = {}
    for name, path in mods.items():
        if name == "slotinfer":
            continue
        rooms.setdefault(_room(name), set()).update(
            _room(m) for m in _imports(name, path, mods) if m != "slotinfer" and _room(m) != _room(name))
    assert {"slotinfer.kv", "slotinfer.text"} <= rooms["slotinfer.engine"]  # the graph holds what it should
    assert _cycles(rooms) == []


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_checkpoint_sits_below_the_engine():
    """The engine runs a checkpoint and never imports it; the checkpoint imports nothing that drives it."""
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    below = _reaches(graph, "slotinfer.checkpoint")
    assert not below & {"slotinfer.engine.engine", "slotinfer.batch", "slotinfer.classify", "slotinfer.model",
                        "slotinfer.inferencer"}, sorted(below)
    assert "slotinfer.checkpoint" in _reaches(graph, "slotinfer.model")
    assert "slotinfer.model" not in _reaches(graph, "slotinfer.engine.engine")


def _documented_rooms() -> tuple[set[str], set[str]]:
    """The folders (``name/``) and root modules (``name.py``) in docs/architecture.md's table of rooms."""
    import re

    text = (PKG.parent / "docs" / "architecture.md").read_text()
    table = text.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and "---" not in line][1:]
    where = " ".join(row.split("|")[2] for row in rows)  # the second column: where the room lives
    names = re.findall(r"`([\w.]+/?)`", where)
    return {n.rstrip("/") for n in names if n.endswith("/")}, {n for n in names if n.endswith(".py")}


def test_the_folders_are_the_rooms_the_architecture_page_names():
    folders, root = _documented_rooms()
    assert folders and root  # the parser finds the table
    here = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert here == folders, f"folders not in docs/architecture.md: {sorted(here - folders)}; " \
                            f"named there but absent: {sorted(folders - here)}"
    at_root = {p.name for p in PKG.glob("*.py")}
    assert at_root == root, f"root modules not in docs/architecture.md: {sorted(at_root - root)}; " \
                            f"named there but absent: {sorted(root - at_root)}"


def test_every_slotinfer_variable_is_read_in_settings_and_documented():
    """A SLOTINFER_* name in the package appears in settings.py's reads, and each one settings.py
    reads has its row in docs/configuration.md's table."""
    import re

    name = re.compile(r"SLOTINFER_[A-Z0-9_]+")
    read = re.compile(r"""os\.environ\.get\(\s*["'](SLOTINFER_[A-Z0-9_]+)|_flag\(\s*["'](SLOTINFER_[A-Z0-9_]+)"""
                      r"""|_whole\(\s*["'](SLOTINFER_[A-Z0-9_]+)""")
    settings = (PKG / "settings.py").read_text()
    in_settings = {next(g for g in m.groups() if g) for m in read.finditer(settings)}
    elsewhere = {}
    for path in PKG.rglob("*.py"):
        if path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            if "environ" in line or "getenv" in line:
                for n in name.findall(line):
                    elsewhere.setdefault(n, path.relative_to(PKG.parent))
    assert not elsewhere, f"read outside slotinfer/settings.py: {elsewhere}"
    table = (PKG.parent / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(SLOTINFER_[A-Z0-9_]+)` \|", table, re.M))
    assert in_settings and in_settings <= rows, f"undocumented: {sorted(in_settings - rows)}"


def _first_imports(path: Path) -> dict[str, int]:
    """The line of the first top-level import of each top package a script names."""
    first: dict[str, int] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for n in names:
            first.setdefault(n.split(".")[0], node.lineno)
    return first


def test_every_benchmark_imports_slotinfer_before_mlx(tmp_path):
    """slotinfer installs the optimized BLAS before mlx.core loads; a script importing MLX first
    measures MLX's reference BLAS (f32 matmul ~30x slower on CPU) and says so only in a warning."""
    late = tmp_path / "late.py"
    late.write_text("import time\nimport mlx.core as mx\n\nimport slotinfer\n")
    assert _first_imports(late) == {"time": 1, "mlx": 2, "slotinfer": 4}  # the checker sees the wrong order
    wrong = {}
    for path in sorted((PKG.parent / "benchmarks").glob("*.py")):
        first = _first_imports(path)
        if "mlx" in first and first.get("slotinfer", 1 << 30) > first["mlx"]:
            wrong[path.name] = first
    assert not wrong, f"import slotinfer before mlx in: {wrong}"
