"""Which cells a vLLM change should run: the changed paths against the vLLM source paths each
cell guards (matrix.toml: guard_sets, guards, axis_guards).

A guard is a file (`vllm/v1/attention/backends/gdn_attn.py`) or a folder ending in `/`
(`vllm/v1/core/`). A changed file matches a file guard equal to it or a folder guard holding it;
a changed folder (ending in `/`) matches every guard inside it. `glm5-matrix affected PATH...`
prints the matching cells, one per line; the generated pipelines use the same guards.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix


def normalize(path: str) -> str:
    """A changed path as git prints it, relative to vLLM's repository: no leading ./ or /."""
    path = path.strip().replace("\\", "/")
    while path.startswith("./"):
        path = path[2:]
    return path.lstrip("/")


def matches(changed: str, guard: str) -> bool:
    changed = normalize(changed)
    if guard.endswith("/"):
        return changed.startswith(guard) or (changed.endswith("/") and guard.startswith(changed))
    return changed == guard or (changed.endswith("/") and guard.startswith(changed))


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
    from glm5_matrix.profiles import repo_root

    matrix = load_matrix(args.matrix or repo_root() / MATRIX_FILE)
    changed: list[str] = []
    for path in args.paths:
        changed += sys.stdin.read().split() if path == "-" else [path]
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
