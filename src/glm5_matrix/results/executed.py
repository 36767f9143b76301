"""Which vLLM source files a cell executes, recorded with coverage.py in every process it starts.

The runner writes a coverage configuration into the cell's results folder and names it in
COVERAGE_PROCESS_START. coverage.py's own `.pth` file (in the cell's venv) then starts
measurement at the start of every Python process of the venv that sees the variable: pytest,
and everything vLLM starts from it (engine cores, API servers, workers: spawned, forked or
started with subprocess). `parallel` gives each process its own data file; `patch = _exit`,
`fork` and `subprocess` make forked children and processes ending in os._exit write theirs, and
`sigterm` a process stopped with SIGTERM. Only the `vllm` package is measured.

After the tests, `python -m glm5_matrix.results.executed OUT --variant ID`, run with the cell's
own interpreter (coverage lives there), combines the data files, writes EXECUTED_FILE (the
executed files relative to vLLM's repository, `vllm/...`) and checks them against the cell's
guards in matrix.toml: a file that no guard covers fails the run with one message naming them.

GLM5_MATRIX_COVERAGE turns it on (`1`) or off (`0`) for a cell whose environment has vLLM.
By default a CPU cell records (on e2e-cpu it cost nothing measurable: 558 s of tests with it,
578 s without, on a loaded 2-core machine) and a GPU cell does not, until its cost is measured
on an H200 (its timing figures are judged against limits, and torch.compile is Python). A process killed with SIGKILL writes nothing, so a list is what the
processes that ended in order executed (the faults cell's killed runs record nothing: it takes
the lists of the cells it runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from glm5_matrix.files import write_atomic, write_json_atomic
from glm5_matrix.matrix.guards import EXECUTED_FILE

COVERAGE_VARIABLE = "GLM5_MATRIX_COVERAGE"
COVERAGE_DIR = "coverage"  # in the results folder: the configuration and the data files
RCFILE = "coveragerc"
PACKAGE = "vllm"


def enabled(environ: Mapping[str, str], gpus: int = 0) -> bool:
    """Whether a cell whose environment has vLLM records what it executes (by default: a CPU
    cell)."""
    value = environ.get(COVERAGE_VARIABLE, "").strip()
    if value in ("", "default"):
        return gpus == 0
    if value in ("1", "0"):
        return value == "1"
    from glm5_matrix.errors import UserError

    raise UserError(f"{COVERAGE_VARIABLE}={value}: expected 1 (record) or 0 (do not)")


def rcfile_text(data_file: Path) -> str:
    return (
        "# Written by glm5_matrix.results.executed: which vLLM files this cell executes.\n"
        "[run]\n"
        f"source_pkgs = {PACKAGE}\n"
        "parallel = true\n"
        f"data_file = {data_file}\n"
        "patch =\n    _exit\n    fork\n    subprocess\n"
        "sigterm = true\n"
        # processes that never import vLLM (helpers, compilers' Python) are not an error
        "disable_warnings =\n    module-not-imported\n    no-data-collected\n"
        "    module-not-measured\n"
    )


def configure(out: Path) -> dict[str, str]:
    """Write the coverage configuration under `out`; the variables that turn it on."""
    folder = out / COVERAGE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    rcfile = folder / RCFILE
    write_atomic(rcfile, rcfile_text(folder / ".coverage"))
    return {"COVERAGE_PROCESS_START": str(rcfile)}


def collect_command(python: Path, out: Path, variant_id: str, matrix_file: Path) -> list[str]:
    """The command, run with the cell's interpreter, that records and checks the list."""
    return [
        str(python),
        "-m",
        "glm5_matrix.results.executed",
        str(out),
        "--variant",
        variant_id,
        "--matrix",
        str(matrix_file),
    ]


def relative_to_vllm(paths: Iterable[str], roots: Sequence[Path]) -> list[str]:
    """Measured files as `vllm/...` (relative to vLLM's repository, as guards name them): each
    root is a folder that holds the vllm package (site-packages, or a source checkout)."""
    found = set()
    for path in paths:
        resolved = Path(path).resolve()
        for root in roots:
            try:
                relative = resolved.relative_to(root)
            except ValueError:
                continue
            if relative.parts and relative.parts[0] == PACKAGE:
                found.add(relative.as_posix())
                break
    return sorted(found)


def package_roots() -> list[Path]:
    """The folders holding the importable vllm package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location).resolve().parent for location in spec.submodule_search_locations]


def combine(out: Path) -> tuple[list[str], int]:
    """Combine the cell's data files (runs where coverage is installed); the measured files and
    how many process data files there were."""
    import coverage

    folder = out / COVERAGE_DIR
    rcfile = folder / RCFILE
    pieces = [p for p in folder.glob(".coverage.*") if p.is_file()]
    cov = coverage.Coverage(config_file=str(rcfile))
    if pieces:  # kept, so that a second collection reads the same
        cov.combine(data_paths=[str(folder)], keep=True)
        cov.save()
    data = cov.get_data()
    # coverage.py also lists the package's files no process ran (with no lines): left out. A file
    # without a statement (an empty __init__.py) never has a line to run, so it is never listed.
    return sorted(f for f in data.measured_files() if data.lines(f)), len(pieces)


def record(
    out: Path, variant_id: str, files: list[str], processes: int, uncovered: list[str]
) -> None:
    """EXECUTED_FILE: what the check read, so a person (and `glm5-matrix guards record`) can."""
    write_json_atomic(
        out / EXECUTED_FILE,
        {
            "variant": variant_id,
            "processes": processes,
            "files": files,
            "uncovered": uncovered,
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_matrix.results.executed",
        description="combine a cell's coverage data, record and check its executed vLLM files",
    )
    parser.add_argument("out", type=Path, help="the cell's results folder")
    parser.add_argument("--variant", required=True, help="the cell variant (nox session name)")
    parser.add_argument("--matrix", type=Path, required=True, help="matrix.toml")
    args = parser.parse_args(argv)
    from glm5_matrix.errors import UserError
    from glm5_matrix.matrix import guards
    from glm5_matrix.matrix.matrix import load_matrix

    try:
        variant = load_matrix(args.matrix).variant(args.variant)
    except (UserError, KeyError) as exc:
        print(f"executed vLLM files: {exc}", file=sys.stderr)
        return 2
    try:
        measured, processes = combine(args.out)
    except ImportError:
        print(
            f"executed vLLM files: coverage is not installed in {sys.executable} "
            f"({COVERAGE_VARIABLE}=0 runs the cell without recording them)",
            file=sys.stderr,
        )
        return 2
    files = relative_to_vllm(measured, package_roots())
    left = guards.uncovered(variant.guards, files)
    record(args.out, variant.id, files, processes, left)
    print(f"{variant.id}: executed {len(files)} vLLM files in {processes} process(es)")
    if processes == 0:
        print(f"{variant.id}: no process recorded coverage data", file=sys.stderr)
        return 1
    if left:
        print(guards.describe_uncovered(variant.id, left, args.matrix), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.pop("COVERAGE_PROCESS_START", None)
    sys.exit(main())
