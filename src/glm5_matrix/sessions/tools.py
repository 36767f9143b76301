"""The harness's own tools as nox sessions (report, pipeline, docs): they run in the harness
environment, which holds what they need (junitparser, PyYAML, mkdocs), built and reused like a
cell's (under .nox/tools, or GLM5_MATRIX_VENVS), or in GLM5_MATRIX_PYTHON's interpreter where one
is given. The session's arguments go to `glm5-matrix` (run_module: to another module of that
environment, mkdocs for the docs site); its exit status is the session's."""

from __future__ import annotations

import os
from pathlib import Path

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.sessions.nox_session import NoxSession

ENV = "harness"
VENV = "tools"
VENVS_VARIABLE = "GLM5_MATRIX_VENVS"  # as the runner's


def venv_dir(environ: dict[str, str]) -> Path:
    return Path(environ.get(VENVS_VARIABLE) or repo_root() / ".nox") / VENV


def run(session: NoxSession, argv: list[str]) -> None:
    """`glm5-matrix ARGV...` in the harness environment. `session` is a nox.Session."""
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
