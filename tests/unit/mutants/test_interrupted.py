"""`nox -s mutants` stopped by a signal, with real processes and a real SIGTERM: the run stops
the cell it is running, starts nothing else, records every control and mutant it did not judge
as interrupted (results.json, report.md, the printed table), never as caught or survived, and
exits 128 + 15. On the first H100 run (2026-12-06) a SIGTERM in the middle of
mamba-v2-hit-state-from-previous-block ended "Session mutants was successful" with no row for
the mutant.

The cell's nox is a stand-in here (GLM5_MATRIX_MUTANTS_WRAP puts a command before the cell's:
a process that waits, and on SIGTERM writes what a stopped cell records, as the runner's
supervision does, and exits 130), and the copy of the cell's environment is not built (minutes
and gigabytes): what is under test is the mutants run's handling of the signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from polling import alive, wait_for
from scaffold import ROOT, environ_with_src

from glm5_matrix.machine import processes
from glm5_matrix.mutants import record
from glm5_matrix.sessions import runner

MUTANT = "aligner-one-alignment-too-many"  # an e2e-cpu mutant: runnable on this box

# The cell: says it started (its pid), then waits; SIGTERM: the cell's record of a stop, exit 130.
CELL = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, time
    results = pathlib.Path(os.environ["GLM5_MATRIX_RESULTS"]) / os.environ["TEST_SLUG"]
    def stop(signum, frame):
        results.mkdir(parents=True, exist_ok=True)
        (results / "results.json").write_text(json.dumps({"ended": {
            "how": "signal", "signal": "SIGTERM",
            "test": "tests/suites/test_e2e.py::test_kv_layout"}, "tests": {}}))
        sys.exit(130)
    signal.signal(signal.SIGTERM, stop)
    pathlib.Path(os.environ["TEST_STARTED"]).write_text(str(os.getpid()))
    time.sleep(600)
    """
)

# mutants.run's main, its environments' copies stood in for (see the module doc).
MAIN = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from glm5_matrix.mutants import patching, run
    run.source_venv = lambda matrix, variant, say: Path(sys.argv[1])
    patching.control_copy = lambda source, target: patching.Applied(target, (), {}, {})
    patching.apply_patch = lambda source, target, patch: patching.Applied(target, (), {}, {})
    sys.exit(run.main(["--only", sys.argv[2]]))
    """
)


def test_a_sigterm_mid_run_records_interrupted_and_exits_non_zero(tmp_path: Path) -> None:
    out, started, log = tmp_path / "results-mutants", tmp_path / "started", tmp_path / "out.txt"
    slug = runner.load(ROOT).variant("e2e-cpu").slug
    env = {
        **environ_with_src(),
        "GLM5_MATRIX_MUTANTS_RESULTS": str(out),
        "GLM5_MATRIX_MUTANTS_WRAP": f"{sys.executable} -c '{CELL}'",
        "GLM5_MATRIX_GPUS": "",
        "TEST_SLUG": slug,
        "TEST_STARTED": str(started),
    }
    env.pop("GLM5_MATRIX_PYTHON", None)
    with log.open("w") as sink:
        run = subprocess.Popen(
            [sys.executable, "-c", MAIN, str(tmp_path), MUTANT],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(started.exists, seconds=60)
        cell = int(started.read_text())
        cell_start = processes.start_time(cell)
        run.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM: stopping the cells" in log.read_text(), seconds=30)
        run.send_signal(signal.SIGTERM)  # ignored: the cell's teardown is under way
        assert run.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
        if started.exists():  # whatever happened, no stand-in cell is left behind
            pid = int(started.read_text())
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert "SIGTERM again: the cells are being stopped" in text
    assert not alive(cell, cell_start)  # the cell was stopped, and waited for
    data = json.loads((out / record.RESULTS_FILE).read_text())
    assert data["ended"] == {
        "how": "signal",
        "signal": "SIGTERM",
        "interrupted": ["control of e2e-cpu", MUTANT],
    }
    (control,) = data["controls"]
    assert control["status"] == "interrupted"
    assert control["detail"] == (
        "stopped by SIGTERM, not judged; the cell recorded: signal during test_kv_layout"
    )
    (row,) = data["mutants"]
    assert row["name"] == MUTANT and row["status"] == "interrupted"
    assert row["detail"] == "not started: the run was stopped by SIGTERM"
    assert data["summary"]["judged"] == 0 and data["summary"]["interrupted"] == 1
    # The printed table (and report.md) say so, above the rows.
    for shown in (text, (out / record.REPORT_FILE).read_text()):
        assert "**This run was interrupted by SIGTERM**" in shown
        assert f"| `{MUTANT}` | `e2e-cpu` |" in shown and "**interrupted**: not started" in shown
        assert "caught by" not in shown and "**survived**" not in shown
    # The copy the control ran in is removed as after any run.
    assert not (out / "work" / f"control-{slug}").exists()
