"""mutants/catalogue.toml: one [[mutant]] table per planted regression.

Fields: name (unique, [a-z0-9-]), patch (a file in mutants/patches/, a unified diff against the
pinned vLLM package files, paths a/vllm/... b/vllm/...), cell (a matrix variant id, e.g.
"e2e-cpu" or "e2e-tp1(deep_gemm)"), area (what the matrix claims to guard), breaks (what the
regression does), select (the pytest -k expression of the tests that can catch it: runs stay
short), expect (the tests expected to catch it), and optional: ci (run in .ci/run's subset),
no_power (where the catching comparison has no power), note (why it may survive, or the check
expected to catch it once written)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec

CATALOGUE_FILE = Path("mutants") / "catalogue.toml"
PATCHES_DIR = Path("mutants") / "patches"


def _text(doc: str, required: bool = True) -> Spec:
    return Spec("str", doc, required=required, nonempty=True)


MUTANT = contracts.table(
    {
        "name": Spec(
            "str",
            "the mutant's name",
            required=True,
            pattern=r"[a-z0-9][a-z0-9-]*",
            pattern_says="lower-case letters, digits and dashes",
        ),
        "patch": _text("a unified diff in mutants/patches/ against the pinned vLLM's files"),
        "cell": _text("the matrix variant it runs in, e.g. e2e-cpu or e2e-tp1(deep_gemm)"),
        "area": _text("what the matrix claims to guard"),
        "breaks": _text("what the regression does"),
        "select": _text("the pytest -k expression of the tests that can catch it"),
        "expect": contracts.strings("the tests expected to catch it"),
        "ci": Spec("bool", "in .ci/run's subset", default=False),
        "no_power": _text("where the catching comparison has no power", required=False),
        "note": _text("why it may survive, or the check expected to catch it", required=False),
    },
    "one planted regression",
)
CATALOGUE = contracts.table(
    {
        "mutant": Spec(
            "list",
            "[[mutant]] entries",
            required=True,
            nonempty=True,
            unique_by="name",
            items=MUTANT,
        )
    },
    "mutants/catalogue.toml: the planted vLLM regressions",
)


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
    """Read the catalogue (CATALOGUE); `cells` maps every matrix variant id to its environment.
    Each defect is a line of one UserError naming the file, the entry and the key."""
    data = contracts.read(path, CATALOGUE, "mutant catalogue")
    patches = path.parent / PATCHES_DIR.name
    found = []
    for entry in data["mutant"]:
        where = f"mutant {entry['name']!r}"
        if entry["cell"] not in cells:
            hint = contracts.nearest(entry["cell"], cells)
            found.append(
                contracts.Problem(
                    f"{where}.cell", f"{entry['cell']!r} is not a variant of the matrix{hint}"
                )
            )
        if not (patches / entry["patch"]).is_file():
            found.append(
                contracts.Problem(f"{where}.patch", f"{patches / entry['patch']} not found")
            )
    contracts.raise_for(path, found)
    return [
        Mutant(
            name=entry["name"],
            patch=(patches / entry["patch"]).resolve(),
            cell=entry["cell"],
            env=cells[entry["cell"]],
            area=entry["area"],
            breaks=" ".join(entry["breaks"].split()),
            select=entry["select"],
            expect=tuple(entry.get("expect", ())),
            ci=entry["ci"],
            no_power=" ".join(entry["no_power"].split()) if "no_power" in entry else None,
            note=" ".join(entry["note"].split()) if "note" in entry else None,
        )
        for entry in data["mutant"]
    ]


def control_selection(mutants: list[Mutant]) -> str:
    """The -k expression of a cell's control run: every test any of its mutants selects."""
    parts = sorted({m.select for m in mutants})
    return parts[0] if len(parts) == 1 else " or ".join(f"({p})" for p in parts)
