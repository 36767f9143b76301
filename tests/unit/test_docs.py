"""The docs against the code: docs/configuration.md names every GLM5_* variable the code reads,
every setting a cell gives and every tool session, and renders every data file's contract, each
key of which says what it means; the site's pages are the ones mkdocs.yml's nav lists. Each
check is a function that returns what is missing, shown to find a planted omission."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.docs import tables
from glm5_matrix.files import repo_root
from glm5_matrix.matrix import matrix

ROOT = repo_root()
REFERENCE = ROOT / "docs" / "configuration.md"
# Where the code that reads variables lives: the package, the noxfile, the suites a cell runs,
# the benchmarks, CI's script, and the profiles (their [weights] checkpoint_variables).
READERS = ("src/**/*.py", "noxfile.py", "tests/suites/**/*.py", "benchmarks/**/*.py", ".ci/run")
VARIABLE = re.compile(r"\bGLM5_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")
# The pages whose names other pages, helpers and readers link to: keep them.
STABLE_PAGES = (
    "index",
    "cells",
    "configuration",
    "ci",
    "kernel-cache",
    "verdicts",
    "catches",
    "stopping",
    "found-in-vllm",
    "architecture",
    "benchmarks",
    "troubleshooting",
    "journal",
)


def sections(text: str) -> dict[str, str]:
    """The page's `## ` sections by heading (each with its `###` subsections)."""
    found: dict[str, str] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            found[heading] = ""
        elif heading:
            found[heading] += line + "\n"
    return found


def named(text: str) -> set[str]:
    """Everything the text puts in backticks."""
    return set(re.findall(r"`([^`\n]+)`", text))


def missing(names: Iterable[str], text: str) -> list[str]:
    """The names `text` does not name in backticks."""
    return sorted(set(names) - named(text))


def variables_read(root: Path) -> set[str]:
    """The GLM5_* variable names written anywhere in the code under `root`."""
    found: set[str] = set()
    for pattern in READERS:
        for path in root.glob(pattern):
            if path.is_file():
                found |= set(VARIABLE.findall(path.read_text(errors="replace")))
    for path in root.glob("profiles/*/profile.toml"):
        weights = tomllib.loads(path.read_text()).get("weights", {})
        found |= set(weights.get("checkpoint_variables", []))
    return found


def undocumented(spec: Spec) -> list[str]:
    """The contract's keys that say nothing of what they mean (a named entry of a table, `NAME`,
    is its table's doc)."""
    return [
        row.key
        for row in contracts.reference(spec)
        if not row.doc.strip() and not row.key.endswith(".NAME")
    ]


def settings_used(root: Path) -> set[str]:
    """The cell settings the matrix gives (axis names become settings too) and the suites and
    engines ask for by name."""
    data = tomllib.loads((root / matrix.MATRIX_FILE).read_text())
    found: set[str] = set()
    for cell in data.get("cells", {}).values():
        found |= set(cell.get("settings", {}))
        if "axis" in cell and cell["axis"].get("name") != "env":
            found.add(cell["axis"]["name"])
    for pattern in ("src/**/*.py", "tests/suites/**/*.py"):
        for path in root.glob(pattern):
            found |= set(re.findall(r"\.setting\(\"([a-z_]+)\"", path.read_text()))
    return found


def tool_sessions(noxfile: Path) -> set[str]:
    """The sessions the noxfile defines with @nox.session (the cells come from matrix.toml)."""
    names = set()
    for node in ast.walk(ast.parse(noxfile.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = call.func if call else decorator
            if ast.unparse(target) != "nox.session":
                continue
            given = [k.value for k in (call.keywords if call else []) if k.arg == "name"]
            names.add(given[0].value if given and isinstance(given[0], ast.Constant) else node.name)
    return names


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return sections(REFERENCE.read_text())


def test_every_variable_the_code_reads_is_in_the_reference(reference):
    read = variables_read(ROOT)
    assert {"GLM5_MATRIX_GPUS", "GLM5_PRUNED_MODEL", "GLM5_MATRIX_CACHE"} <= read  # the scan works
    assert missing(read, reference["Environment variables"]) == []


def test_a_variable_missing_from_the_reference_is_found(tmp_path, reference):
    """The control: a variable planted in the code and absent from the page is reported."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "new.py").write_text('X = os.environ.get("GLM5_MATRIX_PLANTED")\n')
    read = variables_read(tmp_path)
    assert read == {"GLM5_MATRIX_PLANTED"}
    assert missing(read, reference["Environment variables"]) == ["GLM5_MATRIX_PLANTED"]
    # A prefix is no variable: environ_without("GLM5_MATRIX_") reads none.
    assert VARIABLE.findall('environ_without("GLM5_MATRIX_")') == []


@pytest.mark.parametrize("name", sorted(tables.CONTRACTS))
def test_every_contract_is_rendered_with_a_meaning_for_each_key(name, reference):
    marker = f"<!-- table: contract-{name} -->"
    assert sum(marker in text for text in reference.values()) == 1, f"{marker} not on the page"
    assert undocumented(tables.CONTRACTS[name]) == []


def test_a_key_without_a_meaning_is_found():
    """The control: a key added to a contract with no doc is reported, a named entry is not."""
    planted = contracts.table(
        {
            "said": Spec("int", "what it means"),
            "unsaid": Spec("int"),
            "entries": contracts.entries(Spec("str"), "named strings"),
        }
    )
    assert undocumented(planted) == ["unsaid"]


def test_every_cell_setting_is_in_the_reference(reference):
    used = settings_used(ROOT)
    assert {"moe_backend", "kv_connector", "prefill_tp"} <= used
    assert missing(used, reference["matrix.toml"]) == []


def test_every_tool_session_is_in_the_reference(reference):
    sessions = tool_sessions(ROOT / "noxfile.py")
    assert {"plan", "report", "docs", "mutants"} <= sessions
    assert missing(sessions, reference["The nox sessions"]) == []


def test_the_site_lists_every_page_and_keeps_their_names():
    """mkdocs --strict (nox -s docs) fails on a page missing from the nav; this says so without
    building, and keeps the page names others link to."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def files(nav: Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [f for value in nav.values() for f in files(value)]
        return [f for item in nav for f in files(item)]

    listed = files(config["nav"])
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(listed) == pages
    assert {f"{name}.md" for name in STABLE_PAGES} <= set(pages)
