"""Which cells a vLLM change should run: the changed paths against the vLLM source paths each
cell guards (matrix.toml: guard_sets, guards, axis_guards).

A guard is a file (`vllm/v1/attention/backends/gdn_attn.py`) or a folder ending in `/`
(`vllm/v1/core/`). A changed file matches a file guard equal to it or a folder guard holding it;
a changed folder (`vllm/v1/` or `vllm/v1`) matches every guard inside it. Changed paths are
relative to vLLM's repository, as `git diff --name-only` prints them; git's `a/` and `b/`
prefixes are dropped, and an absolute path is an error. `glm5-matrix affected PATH...` prints
the matching cells, one per line; the generated pipelines use the same guards.
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


def _run(args: argparse.Namespace) -> int:
    from glm5_matrix.matrix.profiles import repo_root

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
