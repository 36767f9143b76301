"""`glm5-matrix` console script: one subcommand per tool, each defined next to its logic."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from glm5_matrix.errors import UserError

# Each module exposes register(subparsers), which adds its subcommand(s) and sets `func`.
_COMMAND_MODULES = (
    "glm5_matrix.checkpoints",
    "glm5_matrix.models.layout",
    "glm5_matrix.matrix.guards",
    "glm5_matrix.report.command",
    "glm5_matrix.pipelines.generate",
    "glm5_matrix.kernels.kernel_archive",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5-matrix", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"glm5-matrix {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
