"""The harness's own tools as nox sessions (report, pipeline, docs): they run in the harness
environment, which holds what they need (junitparser, PyYAML, mkdocs), built and reused like a
cell's (under .nox/tools, or GLM5_MATRIX_VENVS), or in GLM5_MATRIX_PYTHON's interpreter where one
is given. The session's arguments go to `glm5-matrix` (run_module: to another module of that
environment, mkdocs for the docs site); its exit status is the session's.

The arguments of `glm5-matrix` are parsed first here, in nox's own process, by the command's own
parser (the noxfile hands in `glm5_matrix.cli.build_parser()`), and the command's preflight
checks its inputs: `--help` answers, and a bad argument or input is one line, before the
environment is built."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

from glm5_matrix.engines import servers
from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.sessions.nox_session import NoxSession

ENV = "harness"
VENV = "tools"


def venv_dir(environ: dict[str, str]) -> Path:
    return environments.venvs_base(environ) / VENV


def parse(session: NoxSession, argv: list[str], parser: argparse.ArgumentParser) -> bool:
    """Whether `glm5-matrix ARGV...` is to run: False where it only asked for help (printed
    here); a bad argument, or an input the command's preflight refuses, ends the session with
    argparse's or the preflight's one line."""
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        if not exc.code:  # --help, --version
            print(printed.getvalue(), end="")
            return False
        lines = errors.getvalue().strip().splitlines() or ["bad arguments"]
        session.error(lines[-1])
    preflight = getattr(args, "preflight", None)
    if preflight is not None:
        try:
            preflight(args)
        except UserError as exc:
            session.error(f"glm5-matrix {args.command}: error: {exc}")
    return True


def run(session: NoxSession, argv: list[str], parser: argparse.ArgumentParser) -> None:
    """`glm5-matrix ARGV...` in the harness environment, once parse() has passed it.
    `session` is a nox.Session; `parser` the CLI's (glm5_matrix.cli.build_parser())."""
    if parse(session, argv, parser):
        run_module(session, "glm5_matrix.cli", argv)


def run_module(session: NoxSession, module: str, argv: list[str]) -> None:
    """`python -m MODULE ARGV...` in the harness environment, the harness's src/ on PYTHONPATH."""
    environ = dict(os.environ)
    try:
        env = environments.load_envs(repo_root())[ENV]
        built = environments.build(
            env,
            venv_dir(environ),
            run=lambda cmd: session.run_install(*cmd, external=True, silent=True),
        )
    except UserError as exc:
        session.error(str(exc))
    src = str(repo_root() / "src")
    run_env = {
        **built.environment,
        "PYTHONPATH": os.pathsep.join(p for p in (src, environ.get("PYTHONPATH")) if p),
    }
    session.run(str(built.python), "-m", module, *argv, env=run_env, external=True)


def docs_arguments(posargs: list[str]) -> list[str]:
    """mkdocs' arguments for `nox -s docs -- ARGS`: a strict build by default; `serve` on
    127.0.0.1 at a port the OS says is free (mkdocs' own default, 8000, is a fixed port another
    server may hold), unless the caller names an address."""
    if not posargs:
        return ["build", "--strict"]
    if posargs[0] == "serve" and not any(
        a in ("-a", "--dev-addr") or a.startswith("--dev-addr=") for a in posargs
    ):
        return [*posargs, "--dev-addr", f"{servers.HOST}:{servers.free_ports(1)[0]}"]
    return list(posargs)
