"""The package layering of DESIGN.md, checked on the source: imports point one way, no product
module imports test helpers, and no two files import each other (directly or around a cycle).

    engine/   imports none of our packages
    workers/  engine/
    router/   engine/, workers/
    cluster/  engine/, workers/, router/
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "workers", "router", "cluster")
ALLOWED = {
    "engine": set(),
    "workers": {"engine"},
    "router": {"engine", "workers"},
    "cluster": {"engine", "workers", "router"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str, lazy: bool = True) -> set[str]:
    """What this file imports: every import statement, or with lazy=False only those that run
    when the module loads (not inside a function)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    nodes = ast.walk(tree) if lazy else _load_time_nodes(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _load_time_nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        yield from _load_time_nodes(node)


def _graph() -> dict[str, set[str]]:
    """Load-time imports between our files. `from engine import cpu_kernels` is an edge to
    engine.cpu_kernels (a package's __init__ runs too, but its own imports are its own edges)."""
    mods = _modules()
    graph = {}
    for m, p in mods.items():
        found = {i for i in _imports(p, m, lazy=False) if i in mods and i != m}
        graph[m] = {i for i in found if not any(j.startswith(i + ".") for j in found)}
    return graph


def test_packages_import_only_the_packages_below_them():
    bad = []
    for module, path in _modules().items():
        pkg = module.split(".")[0]
        for imported in _imports(path, module):
            top = imported.split(".")[0]
            if top == "tests" or (top in PACKAGES and top != pkg and top not in ALLOWED[pkg]):
                bad.append(f"{module} imports {imported}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_files():
    graph = _graph()
    # Importing a submodule runs its package's __init__ first; a package __init__ that only
    # describes its files imports nothing and cannot close a cycle.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The checks above read real import statements, lazy ones too."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from cluster.app import build_app\n")
    assert "cluster.app" in _imports(f, "engine.m")
