"""glm5_matrix.results.executed: coverage.py records the vLLM files a cell executes in every
process it starts (forked, spawned, started with subprocess, ended with os._exit), and the cell
fails when its guards miss one. Driven for real on a stand-in `vllm` package: real coverage.py,
real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from scaffold import SRC

from glm5_matrix.matrix import guards
from glm5_matrix.results import executed

pytest.importorskip("coverage")

# Each module is imported by a different kind of process; `unused` by none.
PROGRAM = """
import multiprocessing as mp, os, subprocess, sys

def forked():
    import vllm.forked

def spawned():
    import vllm.spawned

def exits():
    import vllm.exits
    os._exit(0)

if __name__ == "__main__":
    import vllm.main
    for method, target in (("fork", forked), ("spawn", spawned), ("fork", exits)):
        process = mp.get_context(method).Process(target=target)
        process.start()
        process.join()
        assert process.exitcode == 0
    subprocess.run([sys.executable, "-c", "import vllm.child"], check=True)
    pid = os.fork()
    if pid == 0:
        import vllm.raw_fork
        os._exit(0)
    os.waitpid(pid, 0)
"""
MODULES = ("main", "forked", "spawned", "exits", "child", "raw_fork", "unused")
RAN = [f"vllm/{name}.py" for name in ("__init__", *MODULES[:-1])]


def _matrix(tmp_path, guarded):
    path = tmp_path / "matrix.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [cells.probe]
            description = "a cell"
            suite = "e2e"
            env = "cpu"
            tests = ["tests/suites/test_e2e.py"]
            guards = {json.dumps(guarded)}
            """
        )
    )
    return path


def _run_cell(tmp_path, measure=True):
    """The stand-in cell: a program over a `vllm` package, under the runner's configuration."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("VERSION = 0\n")
    for name in MODULES:
        (site / "vllm" / f"{name}.py").write_text(f"NAME = {name!r}\n")
    (tmp_path / "program.py").write_text(PROGRAM)
    out = tmp_path / "results"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    env["PYTHONPATH"] = os.pathsep.join((str(SRC), str(site)))
    if measure:
        env.update(executed.configure(out))
    subprocess.run([sys.executable, str(tmp_path / "program.py")], env=env, check=True)
    env.pop("COVERAGE_PROCESS_START", None)
    return out, env


def _collect(tmp_path, out, env, guarded):
    command = executed.collect_command(sys.executable, out, "probe", _matrix(tmp_path, guarded))
    return subprocess.run(command, env=env, capture_output=True, text=True)


def test_every_kind_of_process_is_recorded_and_nothing_else(tmp_path):
    out, env = _run_cell(tmp_path)
    result = _collect(tmp_path, out, env, ["vllm/"])
    assert result.returncode == 0, result.stderr
    data = json.loads((out / guards.EXECUTED_FILE).read_text())
    assert data["files"] == sorted(RAN)  # never vllm/unused.py
    assert data["processes"] >= 6 and data["uncovered"] == []
    assert f"executed {len(RAN)} vLLM files" in result.stdout


def test_a_file_no_guard_covers_fails_the_cell_naming_it(tmp_path):
    out, env = _run_cell(tmp_path)
    guarded = [f for f in RAN if f != "vllm/raw_fork.py"] + ["vllm/unused.py"]
    result = _collect(tmp_path, out, env, guarded)
    assert result.returncode == 1
    assert "probe executed 1 vLLM file(s) that none of its guards covers" in result.stderr
    assert result.stderr.strip().endswith("vllm/raw_fork.py")
    data = json.loads((out / guards.EXECUTED_FILE).read_text())
    assert data["uncovered"] == ["vllm/raw_fork.py"]


def test_a_run_that_recorded_nothing_fails(tmp_path):
    """The control: the same program without the configuration leaves no data, and an empty
    list must not pass as a cell that executes nothing unguarded."""
    out, env = _run_cell(tmp_path, measure=False)
    (out / executed.COVERAGE_DIR).mkdir()
    (out / executed.COVERAGE_DIR / executed.RCFILE).write_text(
        executed.rcfile_text(out / executed.COVERAGE_DIR / ".coverage")
    )
    result = _collect(tmp_path, out, env, ["vllm/"])
    assert result.returncode == 1
    assert "no process recorded coverage data" in result.stderr


def test_measured_paths_are_named_relative_to_vllms_repository(tmp_path):
    site = tmp_path / "lib" / "site-packages"
    measured = [
        str(site / "vllm" / "v1" / "core" / "block_pool.py"),
        str(site / "torch" / "nn" / "modules" / "linear.py"),  # not vLLM
        str(tmp_path / "elsewhere" / "vllm" / "x.py"),  # not under a vllm root
    ]
    assert executed.relative_to_vllm(measured, [site.resolve()]) == ["vllm/v1/core/block_pool.py"]


@pytest.mark.parametrize(
    ("value", "gpus", "on"),
    [("1", 0, True), ("0", 0, False), ("", 0, True), ("1", 2, True), ("", 1, False)],
)
def test_the_variable_turns_it_on_or_off_and_a_cpu_cell_records_by_default(value, gpus, on):
    assert executed.enabled({executed.COVERAGE_VARIABLE: value}, gpus) is on


def test_a_bad_variable_is_one_clear_error():
    with pytest.raises(guards.UserError, match="GLM5_MATRIX_COVERAGE=yes: expected 1"):
        executed.enabled({executed.COVERAGE_VARIABLE: "yes"})
