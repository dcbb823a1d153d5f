"""No import cycle among the core's modules, found by walking their ASTs.

Every import counts, a function's lazy import included (it hides a loop from the interpreter, not
from the reader); only imports under ``if TYPE_CHECKING:`` do not. Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``, so it is an edge to those packages too, unless they
enclose the importing module (a package importing its own submodules is no loop).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).parents[2] / "core" / "pagellm"


def module_names(package_dir: Path) -> dict[str, Path]:
    names = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports, with their enclosing packages."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                for alias in node.names:  # ``from pkg import mod`` imports the module pkg.mod
                    targets.add(
                        f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    )
            else:
                visit([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)])

    visit(ast.parse(path.read_text()).body)
    enclosing = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    edges = set()
    for target in targets:
        parts = target.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        edges.update(p for p in prefixes if p in modules and p not in enclosing)
    return edges


def import_cycles(package_dir: Path) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    modules = module_names(package_dir)
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for name in sorted(graph):
        if name not in index:
            connect(name)
    return cycles


def test_the_core_has_no_import_cycle():
    assert len(module_names(CORE)) > 50  # the walk sees the whole core
    assert import_cycles(CORE) == []


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_loop_through_a_lazy_import_or_a_package_init_is_a_cycle(tmp_path):
    """A synthetic package: ``plugins/__init__`` imports a registry lazily, the registry imports
    ``plugins.loader`` (which runs ``plugins/__init__``): the loop this issue removed from the core."""
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "plugins/__init__.py": "def load():\n    from pkg.registry import REGISTRY\n",
            "plugins/loader.py": "from . import hooks\n",
            "plugins/hooks.py": "",
            "registry.py": "from pkg.plugins.loader import load_group\nREGISTRY = {}\n",
            "other.py": "import pkg.plugins.hooks\n",
        },
    )
    assert import_cycles(package) == [["pkg.plugins", "pkg.registry"]]


def test_type_checking_imports_and_a_package_importing_its_submodules_are_no_cycle(tmp_path):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.a import A\n",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
            "b.py": "from pkg.a import A\nB = A\n",
        },
    )
    assert import_cycles(package) == []
    (package / "a.py").write_text("from .b import B\nA = 1\n")  # now a real loop: a -> b -> a
    assert import_cycles(package) == [["pkg.a", "pkg.b"]]
