"""glm5-matrix cells as nox sessions.

Thin on purpose: the cells are data (matrix.toml), the logic is glm5_matrix.sessions.runner. Every
session uses venv_backend="none" because the hardware preflight must run before any
environment is built; the runner then builds the cell's own uv venv.

    nox -l                       # the cells, one line each (--json for machines)
    nox                          # what would run on this box (nothing heavy)
    nox -s e2e-cpu               # a cell;  nox -s "e2e-tp1(deep_gemm)"  one of its variants
    nox -t kv-simple             # cells by tag
    nox -s e2e-tp1 -- --model /ckpt/GLM-5.3-Flash-4L --vllm 0.33.1 -k layout
    nox -t gpu -j 8              # cells side by side, each on its own leased GPUs
    nox -s report                # the matrix report from results/ (results/report/)
    nox -s pipeline -- buildkite # a CI pipeline from the matrix (or -- github)

    nox -s warm -- -t gpu        # compile what the GPU cells need into the kernel cache first

Every cell allows nox's parallel mode (-j): a GPU cell leases its GPUs before it builds
anything (glm5_matrix.machine.leases), so parallel cells never share one. plan, lock and bench run alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "src"))

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.machine import hardware, supervision
from glm5_matrix.matrix.matrix import Cell, Matrix
from glm5_matrix.sessions import runner, tools, warm
from glm5_matrix.upstream import session as upstream_session

# -j (cells side by side) came with nox 2026.08; an older nox refuses to run this file.
nox.needs_version = ">=2026.8"

nox.options.default_venv_backend = "none"
# A bare `nox` only prints the plan. The default is left unset while listing, because nox's
# `-l --json` reports only the selected sessions and must report every cell.
if not {"-l", "--list", "--list-sessions", "--json"} & set(sys.argv):
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
    """Compile what the selected cells need into this machine's kernel cache (-- -t gpu, or cells;
    --export FILE)."""
    warm.run(session, MATRIX)


@nox.session(tags=["meta"])
def bench(session: nox.Session) -> None:
    """Benchmarks: `nox -l` time, cold vs warm environment builds (-- --help for options)."""
    session.run(sys.executable, "benchmarks/matrix_timings.py", *session.posargs, external=True)


# --- the harness's tools: they read results and matrix data, and run in the harness env ----------


@nox.session(tags=["meta"])
def report(session: nox.Session) -> None:
    """The matrix report from results/: report.md, report.html, junit.xml (-- --help)."""
    tools.run(session, ["report", *session.posargs])


@nox.session(tags=["meta"])
def docs(session: nox.Session) -> None:
    """The docs site, docs/ built strictly into site/ (-- serve: read it while editing).

    mkdocs --strict: a broken link or anchor, or a page missing from mkdocs.yml's nav, fails it;
    `-- serve` serves it at http://127.0.0.1:8000."""
    args = session.posargs or ["build", "--strict"]
    tools.run_module(session, "mkdocs", args)


@nox.session(tags=["meta"])
def upstream(session: nox.Session) -> None:
    """The vLLM defects the matrix found, reproduced on the CPU build: `reproduced` or `not
    reproduced on vLLM X` each (-- --controls: also the defect-absent runs; -- NAME picks)."""
    upstream_session.run(session)


@nox.session(tags=["meta"])
def pipeline(session: nox.Session) -> None:
    """A CI pipeline generated from matrix.toml: -- buildkite, or -- github [--output FILE]."""
    if not session.posargs:
        session.error("say which: nox -s pipeline -- buildkite (or github) [--output FILE]")
    tools.run(session, ["pipeline", *session.posargs])


@nox.session(tags=["meta"])
def mutants(session: nox.Session) -> None:
    """vLLM regressions planted in copies of the cells' environments: caught or survived
    (mutants/catalogue.toml; -- --ci for the CI subset, --jobs N, --only NAME, --list)."""
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
