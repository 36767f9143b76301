"""glm5-matrix: the test matrix for GLM-5.3-Flash on vLLM. Each session below is a cell: a suite
of tests in its own environment, on the hardware it names. A bare `nox` runs only `plan` (marked
*): which cells this machine can run, starting nothing.

    nox -s e2e-cpu                 one cell (no GPU needed)
    nox -t cpu -j 2                every CPU cell, two at a time
    nox -s report                  the report of results/ (results/report/report.html)
"""

# For developers. Thin on purpose: the cells are data (matrix.toml), the logic is
# glm5_matrix.sessions.runner. Every session uses venv_backend="none" because the hardware
# preflight must run before any environment is built; the runner then builds the cell's own uv
# venv. More commands:
#
#     nox -l --json                  the cells for machines (every one, with its tags)
#     nox -s "e2e-tp1(deep_gemm)"    one variant of a cell;  nox -t kv-simple  cells by tag
#     nox -s e2e-tp1 -- --model /ckpt/GLM-5.3-Flash-4L --vllm 0.33.1 -k layout
#     nox -t gpu -j 8                cells side by side, each on its own leased GPUs
#     nox -s pipeline -- buildkite   a CI pipeline from the matrix (or -- github)
#     nox -s warm -- -t gpu          compile what the GPU cells need into the kernel cache first
#
# Every cell allows nox's parallel mode (-j): a GPU cell leases its GPUs before it builds
# anything (glm5_matrix.machine.leases), so parallel cells never share one. plan, lock and bench
# run alone.

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "src"))

# First, before anything that needs tomllib (Python 3.11): an older Python gets one line.
import glm5_matrix

_TOO_OLD = glm5_matrix.python_too_old(
    shlex.join(["uvx", "--python", "3.11", "--from", "nox>=2026.8", "nox", *sys.argv[1:]])
)
if _TOO_OLD:
    sys.exit(_TOO_OLD)

import nox  # noqa: E402

from glm5_matrix import cli  # noqa: E402
from glm5_matrix.envs import environments  # noqa: E402
from glm5_matrix.errors import UserError  # noqa: E402
from glm5_matrix.machine import hardware, supervision  # noqa: E402
from glm5_matrix.matrix.matrix import Cell, Matrix  # noqa: E402
from glm5_matrix.sessions import runner, tools, warm  # noqa: E402
from glm5_matrix.upstream import session as upstream_session  # noqa: E402

# -j (cells side by side) came with nox 2026.08; an older nox refuses to run this file.
nox.needs_version = ">=2026.8"

nox.options.default_venv_backend = "none"
# A bare `nox` only prints the plan, and `nox -l` marks it (*) as what a bare `nox` runs. Not
# under --json: nox's `-l --json` reports only the selected sessions, and must report every cell.
if "--json" not in sys.argv:
    nox.options.sessions = ["plan"]
nox.options.error_on_missing_interpreters = True
# A signal to nox stops every cell and nox exits only once they are gone; a worker of `nox -j`
# stops its cell when the main nox dies (glm5_matrix.machine.supervision.guard_nox_process).
supervision.guard_nox_process(sys.argv)

try:
    MATRIX: Matrix = runner.load()
    hardware.check_override(os.environ)
except UserError as exc:  # a malformed matrix, env file or variable: a line each, non-zero exit
    sys.exit("\n".join(f"glm5-matrix: error: {line}" for line in str(exc).splitlines()))


def _register(cell: Cell) -> None:
    if cell.axis is None:

        def session(session: nox.Session) -> None:
            runner.run_variant(session, MATRIX.variant(cell.name))

        session.__doc__ = cell.description
        nox.session(name=cell.name, tags=cell.variants[0].tags, allow_parallel=True)(session)
        return

    axis_name = cell.axis.name

    def parametrized(session: nox.Session, **axis: str) -> None:
        runner.run_variant(session, MATRIX.variant(f"{cell.name}({axis[axis_name]})"))

    parametrized.__doc__ = cell.description
    params = [nox.param(v.value, id=v.value, tags=v.tags) for v in cell.variants]
    nox.session(name=cell.name, allow_parallel=True)(
        nox.parametrize(axis_name, params)(parametrized)
    )


for _cell in MATRIX.cells:
    _register(_cell)


@nox.session(tags=["meta"])
def plan(session: nox.Session) -> None:
    """What each cell needs and whether it would run on this box (starts nothing)."""
    found = hardware.detect()
    session.log(f"hardware: {found.describe()}")
    for variant in MATRIX.variants:
        verdict = hardware.check(variant.cell, found)
        state = "runs " if verdict.runnable else "skips"
        session.log(f"{state} {variant.id:<28} {' '.join(variant.tags)}")


@nox.session(tags=["meta"])
def lock(session: nox.Session) -> None:
    """Refresh constraints/NAME.txt from envs/NAME.toml with uv (`-- cpu` for one env)."""
    envs = environments.load_envs(runner.repo_root())
    for name in session.posargs or sorted(envs):
        if name not in envs:
            session.error(f"unknown environment {name!r} (envs: {', '.join(sorted(envs))})")
        path = environments.lock(envs[name], run=lambda cmd: session.run(*cmd, external=True))
        session.log(f"wrote {path}")


@nox.session(name="warm", tags=["meta"])
def warm_session(session: nox.Session) -> None:
    """Compile what cells need into the kernel cache: -- -t gpu, or -- CELL... [--export FILE]."""
    warm.run(session, MATRIX)


@nox.session(tags=["meta"])
def bench(session: nox.Session) -> None:
    """Benchmarks: `nox -l` time, cold vs warm environment builds (-- --help for options)."""
    session.run(sys.executable, "benchmarks/matrix_timings.py", *session.posargs, external=True)


# --- the harness's tools: they read results and matrix data, and run in the harness env ----------


@nox.session(tags=["meta"])
def report(session: nox.Session) -> None:
    """The matrix report from results/: report.md, report.html, junit.xml (-- --help)."""
    tools.run(session, ["report", *session.posargs], cli.build_parser())


@nox.session(tags=["meta"])
def docs(session: nox.Session) -> None:
    """The docs site, docs/ built strictly into site/ (-- serve: read it while editing).

    mkdocs --strict: a broken link or anchor, or a page missing from mkdocs.yml's nav, fails it;
    `-- serve` serves it on 127.0.0.1 at a free port it prints."""
    tools.run_module(session, "mkdocs", tools.docs_arguments(list(session.posargs)))


@nox.session(tags=["meta"])
def upstream(session: nox.Session) -> None:
    """The vLLM defects the matrix found, each script run as it is (-- --controls, --vllm, NAME).

    Each says `reproduced` or `not reproduced on vLLM X`; --controls also runs the defect-absent
    runs, --vllm SPEC (or GLM5_MATRIX_VLLM) tests another vLLM, --env NAME another environment,
    GLM5_MATRIX_PYTHON an interpreter that holds vLLM already; NAME picks one."""
    upstream_session.run(session)


@nox.session(tags=["meta"])
def pipeline(session: nox.Session) -> None:
    """A CI pipeline generated from matrix.toml: -- buildkite, or -- github [--output FILE]."""
    if not session.posargs:
        session.error("say which: nox -s pipeline -- buildkite (or github) [--output FILE]")
    tools.run(session, ["pipeline", *session.posargs], cli.build_parser())


@nox.session(tags=["meta"])
def mutants(session: nox.Session) -> None:
    """vLLM regressions planted in copies of the cells' environments, each caught or survived.

    mutants/catalogue.toml; -- --ci for the CI subset, --jobs N, --only NAME, --list."""
    # The harness first, whatever PYTHONPATH already holds kept (a box's vLLM bundle on it).
    path = [str(Path(__file__).parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    session.run(
        sys.executable,
        "-m",
        "glm5_matrix.mutants.run",
        *session.posargs,
        env={"PYTHONPATH": os.pathsep.join(path)},
        external=True,
    )
