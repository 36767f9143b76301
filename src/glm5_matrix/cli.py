"""`glm5-matrix`: the matrix's tools, one command each (docs/cli.md): checkpoints (prune,
verify), the KV layout, the cells a vLLM change affects and their guards, the report, CI
pipelines, the kernel cache."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import glm5_matrix

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
    parser.add_argument(
        "--version", action="version", version=f"glm5-matrix {glm5_matrix.__version__}"
    )
    # Not required=True: argparse checks required arguments before unknown ones, and would
    # answer `glm5-matrix --frobnicate` with "COMMAND required" (main() asks for it instead).
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices[command]


def _uv_hint(argv: Sequence[str]) -> str:
    """The command that runs this very command line under a Python uv provides."""
    checkout = Path(__file__).resolve().parents[2]
    source = str(checkout) if (checkout / "pyproject.toml").is_file() else "PATH-TO-CHECKOUT"
    python = ".".join(map(str, glm5_matrix.REQUIRES_PYTHON))
    return shlex.join(["uvx", "--python", python, "--from", source, "glm5-matrix", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    too_old = glm5_matrix.python_too_old(_uv_hint(argv))
    if too_old:  # before anything imports tomllib
        print(too_old, file=sys.stderr)
        return 2
    from glm5_matrix.errors import UserError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("name a COMMAND (glm5-matrix --help lists them)")
    if getattr(args, "func", None) is None:  # a command of actions (guards, kernel-cache)
        _subparser(parser, args.command).error(
            f"name an ACTION (glm5-matrix {args.command} --help lists them)"
        )
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"glm5-matrix {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
