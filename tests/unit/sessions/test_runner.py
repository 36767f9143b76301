"""glm5_matrix.sessions.runner's own steps that need no environment: a cell starts with an empty results
folder, and its command line runs under the supervisor."""

from __future__ import annotations

import os
from pathlib import Path

from glm5_matrix.machine import supervision
from glm5_matrix.sessions import runner


def test_a_cell_starts_with_an_empty_results_folder(tmp_path: Path) -> None:
    out = tmp_path / "results" / "e2e-cpu"
    (out / "site").mkdir(parents=True)
    (out / "results.json").write_text('{"outcomes": {"passed": 6}}')  # an earlier run's
    runner.empty_results_dir(out)
    assert out.is_dir() and list(out.iterdir()) == []
    runner.empty_results_dir(tmp_path / "new")  # a first run: made
    assert (tmp_path / "new").is_dir()


def test_the_command_runs_under_the_supervisor(tmp_path: Path) -> None:
    line = supervision.supervised(["python", "-m", "pytest", "-x"], "/venv/bin/python", tmp_path, 2)
    assert line == [
        "/venv/bin/python",
        "-m",
        "glm5_matrix.machine.supervision",
        "--parent",
        str(os.getpid()),
        "--results",
        str(tmp_path),
        "--gpus",
        "2",
        "--",
        "python",
        "-m",
        "pytest",
        "-x",
    ]
    # nox waits for the supervisor's whole teardown before it gives up on it.
    waited = supervision.NOX_TIMEOUTS["interrupt_timeout"]
    assert waited > supervision.GRACE_S + 2 * supervision.KILL_AFTER_S
