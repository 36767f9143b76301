"""mutants/catalogue.toml: one [[mutant]] table per planted regression.

Fields: name (unique, [a-z0-9-]), patch (a file in mutants/patches/, a unified diff against the
pinned vLLM package files, paths a/vllm/... b/vllm/...), cell (a matrix variant id, e.g.
"e2e-cpu" or "e2e-tp1(deep_gemm)"), area (what the matrix claims to guard), breaks (what the
regression does), select (the pytest -k expression of the tests that can catch it: runs stay
short), expect (the tests expected to catch it), and optional: ci (run in .ci/run's subset),
no_power (where the catching comparison has no power), note (why it may survive, or the check
expected to catch it once written)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from glm5_matrix.errors import UserError, load_toml

CATALOGUE_FILE = Path("mutants") / "catalogue.toml"
PATCHES_DIR = Path("mutants") / "patches"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_REQUIRED = {"name": str, "patch": str, "cell": str, "area": str, "breaks": str, "select": str}
_OPTIONAL = {"expect": list, "ci": bool, "no_power": str, "note": str}


@dataclass(frozen=True)
class Mutant:
    name: str
    patch: Path  # absolute
    cell: str  # the matrix variant id
    env: str  # the cell's environment (envs/NAME.toml)
    area: str
    breaks: str
    select: str  # pytest -k expression
    expect: tuple[str, ...] = ()
    ci: bool = False
    no_power: str | None = None
    note: str | None = None


def load_catalogue(path: Path, cells: Mapping[str, str]) -> list[Mutant]:
    """Read the catalogue; `cells` maps every matrix variant id to its environment. A defect is
    a UserError naming the file, the entry and the field."""
    data = load_toml(path, "mutant catalogue")
    unknown = set(data) - {"mutant"}
    if unknown:
        raise UserError(f"{path}: unknown top-level keys {sorted(unknown)} (only [[mutant]])")
    entries = data.get("mutant", [])
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{path}: no [[mutant]] entries")
    patches = path.parent / PATCHES_DIR.name
    mutants: list[Mutant] = []
    seen: set[str] = set()
    for number, entry in enumerate(entries, 1):
        where = f"{path}: mutant {entry.get('name') or number}"
        for key, value in entry.items():
            expected = _REQUIRED.get(key) or _OPTIONAL.get(key)
            if expected is None:
                known = ", ".join([*_REQUIRED, *_OPTIONAL])
                raise UserError(f"{where}: {key}: unknown field (known: {known})")
            if not isinstance(value, expected):
                raise UserError(f"{where}: {key}: expected {expected.__name__}, got {value!r}")
        for key in _REQUIRED:
            if not str(entry.get(key, "")).strip():
                raise UserError(f"{where}: {key}: missing")
        name = entry["name"]
        if not _NAME.match(name):
            raise UserError(f"{where}: name: lower-case letters, digits and dashes only")
        if name in seen:
            raise UserError(f"{where}: name: defined twice")
        seen.add(name)
        if entry["cell"] not in cells:
            raise UserError(f"{where}: cell: {entry['cell']!r} is not a variant of the matrix")
        patch = patches / entry["patch"]
        if not patch.is_file():
            raise UserError(f"{where}: patch: {patch} not found")
        expect = entry.get("expect", [])
        if not all(isinstance(e, str) and e for e in expect):
            raise UserError(f"{where}: expect: a list of test names")
        mutants.append(
            Mutant(
                name=name,
                patch=patch.resolve(),
                cell=entry["cell"],
                env=cells[entry["cell"]],
                area=entry["area"],
                breaks=" ".join(entry["breaks"].split()),
                select=entry["select"],
                expect=tuple(expect),
                ci=entry.get("ci", False),
                no_power=" ".join(entry["no_power"].split()) if "no_power" in entry else None,
                note=" ".join(entry["note"].split()) if "note" in entry else None,
            )
        )
    return mutants


def control_selection(mutants: list[Mutant]) -> str:
    """The -k expression of a cell's control run: every test any of its mutants selects."""
    parts = sorted({m.select for m in mutants})
    return parts[0] if len(parts) == 1 else " or ".join(f"({p})" for p in parts)
