"""The package's rooms import one way: each room (a subpackage, or a module at the top) imports
only the rooms below it in ROOMS, and no modules import each other in a circle. Every import
counts, lazy ones inside functions too: a circle through them is still a circle."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from scaffold import SRC

# Bottom to top. A room may import its own modules and the rooms before it, never one after.
ROOMS = (
    "errors",
    "contracts",  # the one reader of the TOML data files' contracts (it reads through errors)
    "files",
    "cache",
    "matrix",
    "envs",
    "results",
    "machine",
    "verdicts",
    "report",
    "pipelines",  # the CI pipelines generated from the matrix, and their checks
    "kernels",
    "models",
    "checkpoints",
    "engines",
    "sessions",
    "upstream",  # nox -s upstream: the reproductions of vLLM defects (upstream/ at the root)
    "mutants",  # plants regressions in copies of the cells' environments and runs the cells
    "docs",  # the docs site's tables rendered from the repository's data (mkdocs hook)
    "cli",  # the entry point: it finds its subcommands' modules by name
)


def _modules(src: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((src / "glm5_matrix").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports (a name imported from a package counts as its
    submodule when it is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            named += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    found = set()
    for name in named:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module and name != "glm5_matrix":
            found.add(name)
    return found


def _room(module: str) -> str:
    return module.split(".")[1]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def layering_problems(src: Path) -> list[str]:
    modules = _modules(src)
    graph = {m: _imports(m, p, modules) for m, p in modules.items() if m != "glm5_matrix"}
    problems = [f"{m} is in no room of ROOMS" for m in graph if _room(m) not in ROOMS]
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            here, there = _room(module), _room(other)
            if here in ROOMS and there in ROOMS and ROOMS.index(there) > ROOMS.index(here):
                problems.append(f"{module} imports {other}: {there} is above {here}")
    problems += [f"circle: {' -> '.join(c)}" for c in _circles(graph)]
    return problems


def test_the_package_imports_only_downward_and_in_no_circle() -> None:
    assert layering_problems(SRC) == []


def test_an_upward_import_and_its_circle_are_caught(tmp_path: Path) -> None:
    shutil.copytree(SRC / "glm5_matrix", tmp_path / "glm5_matrix")
    profiles = tmp_path / "glm5_matrix" / "matrix" / "profiles.py"
    profiles.write_text(
        profiles.read_text() + "\n\ndef _late():\n    from glm5_matrix.sessions import runner\n"
    )
    problems = layering_problems(tmp_path)
    assert (
        "glm5_matrix.matrix.profiles imports glm5_matrix.sessions.runner: sessions is above matrix"
        in problems
    )
    assert any(p.startswith("circle: ") and "glm5_matrix.matrix.profiles" in p for p in problems)


def test_a_new_room_must_be_placed(tmp_path: Path) -> None:
    shutil.copytree(SRC / "glm5_matrix", tmp_path / "glm5_matrix")
    (tmp_path / "glm5_matrix" / "attic").mkdir()
    (tmp_path / "glm5_matrix" / "attic" / "__init__.py").write_text("")
    assert layering_problems(tmp_path) == ["glm5_matrix.attic is in no room of ROOMS"]
