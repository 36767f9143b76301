"""glm5_matrix.results.recorder: the per-cell results plugin run for real (pytester) on tests that pass,
fail, skip and record figures; what results.json then holds, and what the runner side
(glm5_matrix.results.closing) adds to it or writes instead."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from glm5_matrix.matrix.context import CONTEXT_VARIABLE, CellContext
from glm5_matrix.results import closing, recorder, schema
from glm5_matrix.verdicts.compare import GreedyOutput

pytest_plugins = ("pytester",)
SRC = str(Path(recorder.__file__).resolve().parents[2])  # for pytest in a subprocess

SUITE = """
import pytest
from glm5_matrix.results.recorder import record_figure, record_engine_start

def test_measures():
    record_engine_start("engine:x", 1.234)
    record_engine_start("engine:y", 2.0, compile={"seconds": None, "entries_added": {"triton": 2}})
    record_figure("layout.block_size", 4352, limit=4352, relation="==", unit="tokens")
    record_figure("repeat.delta", 0.031, limit=0.094, relation="<=", unit="nats")

def test_fails():
    assert False, "planted"

def test_skips():
    pytest.skip("no GPU here")

@pytest.mark.xfail(reason="known upstream", strict=True)
def test_known():
    assert False
"""


def _context(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    ctx = CellContext(
        cell="c",
        id="c",
        slug="c",
        suite="unit",
        env="harness",
        profile=None,
        tp=None,
        gpus=0,
        results_dir=str(out),
    )
    path = out / "context.json"
    path.write_text(ctx.to_json())
    return path


def test_results_json_holds_outcomes_starts_and_figures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CONTEXT_VARIABLE, str(_context(tmp_path)))
    monkeypatch.setattr(recorder, "_STATE", recorder._State())
    pytester.makepyfile(test_cell=SUITE)
    run = pytester.runpytest("-p", "glm5_matrix.results.recorder")
    run.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1)
    data = json.loads((tmp_path / "results" / schema.RESULTS_FILE).read_text())
    assert data["outcomes"] == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1}
    assert data["exit_status"] == 1
    assert data["complete"] is True and data["ended"]["how"] == "finished"
    start, compiled = data["engine_starts"]
    assert start == {"label": "engine:x", "seconds": 1.23, "test": "test_cell.py::test_measures"}
    assert compiled["compile"] == {"seconds": None, "entries_added": {"triton": 2}}
    by_name = {f["name"]: f for f in data["figures"]}
    assert by_name["layout.block_size"] == {
        "name": "layout.block_size",
        "value": 4352,
        "limit": 4352,
        "relation": "==",
        "unit": "tokens",
        "test": "test_cell.py::test_measures",
    }
    assert by_name["repeat.delta"]["relation"] == "<="
    skipped = data["tests"]["test_cell.py::test_skips"]
    assert skipped["outcome"] == "skipped" and "no GPU here" in skipped["reason"]
    # A failure carries its first message line (the report shows it; junit.xml has the rest).
    failed = data["tests"]["test_cell.py::test_fails"]
    assert failed["message"] == "AssertionError: planted"
    assert "message" not in data["tests"]["test_cell.py::test_measures"]
    # An expected failure keeps what it raised beside the registry's reason: a known failure can
    # fail for another reason than the one it is listed for.
    known = data["tests"]["test_cell.py::test_known"]
    assert known["outcome"] == "xfailed" and known["reason"] == "known upstream"
    assert known["message"] == "assert False", known
    assert data["tests"]["test_cell.py::test_known"]["reason"] == "known upstream"
    summary = closing.summarize(tmp_path / "results")
    assert "1 failed, 1 passed, 1 skipped" in summary
    assert "2 engine start(s) (3 s, 2 kernel file(s) compiled)" in summary


OUTPUTS_SUITE = """
from glm5_matrix.results.recorder import record_outputs
from glm5_matrix.verdicts.compare import GreedyOutput

def test_judges():
    cold = GreedyOutput([5, 7], [-1.0, -2.0], [{5: -1.0, 9: -3.5}, {7: -2.0, 5: -2.25}], 0)
    record_outputs("repeat.cold", [cold, cold])
    record_outputs("repeat.stale_block", [GreedyOutput([9], [-0.5], [{9: -0.5}], None)])
"""


def test_outputs_json_keeps_what_was_judged_and_never_an_earlier_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The raw outputs behind the figures lie beside results.json; an outputs.json left by an
    earlier run is removed when the session starts, so a run that records none leaves none."""
    monkeypatch.setenv(CONTEXT_VARIABLE, str(_context(tmp_path)))
    monkeypatch.setattr(recorder, "_STATE", recorder._State())
    path = tmp_path / "results" / schema.OUTPUTS_FILE
    pytester.makepyfile(test_cell=OUTPUTS_SUITE)
    pytester.runpytest("-p", "glm5_matrix.results.recorder").assert_outcomes(passed=1)
    data = json.loads(path.read_text())
    assert data["complete"] is True and data["cell"] == "c"
    cold = data["outputs"]["repeat.cold"]
    assert cold["test"] == "test_cell.py::test_judges" and len(cold["outputs"]) == 2
    assert cold["outputs"][0] == {
        "token_ids": [5, 7],
        "logprobs": [-1.0, -2.0],
        "top_logprobs": [{"5": -1.0, "9": -3.5}, {"7": -2.0, "5": -2.25}],
        "cached_tokens": 0,
    }
    assert data["outputs"]["repeat.stale_block"]["outputs"][0]["cached_tokens"] is None
    # What the writer wrote, the reader (GreedyOutput.from_json) gives back as it was.
    back = GreedyOutput.from_json(cold["outputs"][0])
    assert back == GreedyOutput([5, 7], [-1.0, -2.0], [{5: -1.0, 9: -3.5}, {7: -2.0, 5: -2.25}], 0)
    # The next run records nothing: the earlier file must not be read back as its own.
    monkeypatch.setattr(recorder, "_STATE", recorder._State())
    pytester.makepyfile(test_cell="def test_nothing():\n    pass\n")
    pytester.runpytest("-p", "glm5_matrix.results.recorder").assert_outcomes(passed=1)
    assert not path.exists()


def test_a_relation_that_means_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="relation"):
        recorder.record_figure("x", 1, limit=2, relation="~")


# A test process killed outright (here: by itself) mid-test, as the OOM killer would.
KILLED = """
import os, signal
from glm5_matrix.results.recorder import record_engine_start

def test_first():
    pass

def test_killed():
    record_engine_start("engine:y", 2.0)
    os.kill(os.getpid(), signal.SIGKILL)

def test_never_run():
    pass
"""


def test_a_killed_run_leaves_the_tests_it_made_and_the_one_it_was_in(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CONTEXT_VARIABLE, str(_context(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", SRC)
    pytester.makepyfile(test_cell=KILLED)
    run = pytester.runpytest_subprocess("-p", "glm5_matrix.results.recorder")
    assert run.ret == -9
    data = json.loads((tmp_path / "results" / schema.RESULTS_FILE).read_text())
    assert data["complete"] is False
    assert data["ended"]["how"] == "unfinished"
    assert data["ended"]["test"] == "test_cell.py::test_killed"
    assert data["tests"]["test_cell.py::test_first"]["outcome"] == "passed"
    # Started, never finished: not a pass; the test after it was never started.
    assert data["tests"]["test_cell.py::test_killed"]["outcome"] == "running"
    assert "test_cell.py::test_never_run" not in data["tests"]
    assert data["engine_starts"][0]["label"] == "engine:y"  # written as it happened
    # What the cell's supervisor then adds.
    junit = tmp_path / "results" / schema.JUNIT_FILE
    ended = schema.ending("killed", "the test process (pid 1) was killed by SIGKILL", "SIGKILL")
    closing.record_ending(tmp_path / "results", ended, 137, 3.0, junit=junit)
    data = json.loads((tmp_path / "results" / schema.RESULTS_FILE).read_text())
    assert data["ended"]["test"] == "test_cell.py::test_killed"  # kept from the run's record
    assert data["outcomes"] == {"passed": 1, "interrupted": 1}
    assert data["exit_status"] == 137
    line = closing.summarize(tmp_path / "results")
    assert line.startswith(
        "INCOMPLETE, the test process was killed by SIGKILL during test_cell.py::test_killed: "
        "of the tests that ran: 1 interrupted, 1 passed;"
    ), line
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    names = [case.get("name") for case in suite.iter("testcase")]
    assert names == ["test_first", "test_killed", "run ended early"]
    assert suite.get("tests") == "3" and suite.get("errors") == "2"
    prop = suite.find("properties/property")
    assert prop is not None and prop.attrib == {"name": "glm5-matrix.complete", "value": "false"}


INTERRUPTED = """
def test_first():
    pass

def test_interrupted():
    raise KeyboardInterrupt

def test_never_run():
    pass
"""


def test_an_interrupted_run_says_so_and_its_junit_is_marked(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CONTEXT_VARIABLE, str(_context(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", SRC)
    junit = tmp_path / "results" / schema.JUNIT_FILE
    pytester.makepyfile(test_cell=INTERRUPTED)
    run = pytester.runpytest_subprocess("-p", "glm5_matrix.results.recorder", f"--junitxml={junit}")
    assert run.ret == 2
    data = json.loads((tmp_path / "results" / schema.RESULTS_FILE).read_text())
    assert data["complete"] is False
    assert data["ended"]["how"] == "signal" and data["ended"]["signal"] == "SIGINT"
    assert data["ended"]["test"] == "test_cell.py::test_interrupted"
    assert data["outcomes"] == {"passed": 1, "interrupted": 1}
    # The supervisor knows more: the cell got SIGTERM, and asked pytest to stop with SIGINT.
    ended = schema.ending("signal", "SIGTERM to the cell", "SIGTERM")
    closing.record_ending(tmp_path / "results", ended, 143, 1.0, junit=junit)
    closing.record_ending(tmp_path / "results", ended, 143, 1.0, junit=junit)  # idempotent
    text = junit.read_text()
    assert text.count("glm5-matrix.complete") == 1
    assert 'message="stopped by SIGTERM during test_cell.py::test_interrupted"' in text
    assert 'name="test_first"' in text  # pytest's own record is kept
    assert closing.summarize(tmp_path / "results").startswith(
        "INCOMPLETE, stopped by SIGTERM during test_cell.py::test_interrupted: of the tests "
        "that ran: 1 interrupted, 1 passed;"
    )


def test_a_run_that_recorded_nothing_says_so(tmp_path: Path) -> None:
    assert closing.summarize(tmp_path).endswith("this run recorded no results")
    # A folder whose results.json lacks "complete" (an older run) counts as complete.
    (tmp_path / schema.RESULTS_FILE).write_text(
        json.dumps({"outcomes": {"passed": 2}, "engine_starts": [], "wall_seconds": 3})
    )
    assert closing.summarize(tmp_path).startswith("2 passed;")


def test_an_ending_must_be_known() -> None:
    with pytest.raises(ValueError, match="ending"):
        schema.ending("vanished", "?")


def test_first_line() -> None:
    assert schema.first_line("\n  AssertionError: x\nmore") == "AssertionError: x"
    assert schema.first_line("") == ""
    assert len(schema.first_line("y" * 1000)) == 300


def _ctx() -> dict:
    return {"id": "lint", "slug": "lint", "cell": "lint"}


def test_a_preflight_skip_is_recorded_and_clears_the_old_run(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text("<testsuites/>")  # an earlier run's
    (tmp_path / schema.RESULTS_FILE).write_text("{}")
    closing.write_skip(tmp_path, _ctx(), "e2e-tp2 needs 2 GPU(s); found no GPU")
    assert not (tmp_path / "junit.xml").exists()
    data = json.loads((tmp_path / schema.RESULTS_FILE).read_text())
    assert data["skipped"] == "e2e-tp2 needs 2 GPU(s); found no GPU"
    for key in ("cell", "exit_status", "wall_seconds", "outcomes", "tests", "engine_starts"):
        assert key in data, key
    assert data["tests"] == {} and data["figures"] == []


DOMAIN = {"mechanism": "cgroup-v2", "cgroup": "/sys/fs/cgroup/glm5-matrix-e2e-cpu-1"}


def test_the_kill_domain_after_the_supervisor_recorded_the_run(tmp_path: Path) -> None:
    """The runner's record once it stopped the cell's kill domain: where the supervisor said how
    the run ended, results.json is left as it is unless the runner killed what was left, and
    then it says how many each of them killed."""
    ended = schema.ending("finished", "pytest ended its session with exit status 0")
    stopped = {**DOMAIN, "stopped_by": "supervisor", "killed": 1}
    closing.record_ending(tmp_path, ended, 0, 2.0, kill_domain=stopped)
    before = (tmp_path / schema.RESULTS_FILE).read_text()
    closing.record_kill_domain(tmp_path, DOMAIN, [], 2.5)
    assert (tmp_path / schema.RESULTS_FILE).read_text() == before
    closing.record_kill_domain(tmp_path, DOMAIN, [41, 42], 2.5)
    data = json.loads((tmp_path / schema.RESULTS_FILE).read_text())
    assert data["kill_domain"] == {
        **DOMAIN,
        "stopped_by": "supervisor",
        "killed": 1,  # the supervisor's count
        "killed_by_runner": 2,
    }
    assert data["ended"]["how"] == "finished" and data["exit_status"] == 0


def test_the_kill_domain_after_a_supervisor_that_died(tmp_path: Path) -> None:
    """No record of how the run ended (the supervisor was killed, or died): the runner's says
    so, a failure naming what its kill domain killed, with junit.xml written to match."""
    (tmp_path / schema.CONTEXT_FILE).write_text(json.dumps(_ctx()))
    closing.record_kill_domain(tmp_path, DOMAIN, [41, 42], 7.25)
    data = json.loads((tmp_path / schema.RESULTS_FILE).read_text())
    assert data["cell"] == _ctx()
    assert data["complete"] is False and data["exit_status"] == 1
    assert data["ended"]["how"] == "process-died"
    assert "the cell's kill domain (cgroup-v2) killed 2 process(es)" in data["ended"]["detail"]
    assert data["left_behind"] == [
        "pid 41 killed with the cell's kill domain",
        "pid 42 killed with the cell's kill domain",
    ]
    assert data["kill_domain"] == {**DOMAIN, "stopped_by": "runner", "killed": 2}
    assert (tmp_path / schema.JUNIT_FILE).is_file()
    assert closing.summarize(tmp_path).startswith("INCOMPLETE")


class CommandFailed(Exception):
    """Stands for nox.command.CommandFailed (an Exception with the reason as its text)."""


def test_command_cell_records_each_command(tmp_path: Path) -> None:
    recorded = closing.CommandResults(tmp_path, _ctx())
    with recorded.command(["ruff", "check", "."]):
        pass
    with pytest.raises(CommandFailed), recorded.command(["mypy"]):
        raise CommandFailed("Returned code 1")
    data = json.loads((tmp_path / schema.RESULTS_FILE).read_text())
    assert data["exit_status"] == 1
    assert data["outcomes"] == {"passed": 1, "failed": 1}
    assert data["tests"]["command: mypy"]["message"] == "Returned code 1"
    assert data["tests"]["command: ruff check ."]["outcome"] == "passed"


def test_an_interrupted_command_cell_writes_nothing(tmp_path: Path) -> None:
    recorded = closing.CommandResults(tmp_path, _ctx())
    with pytest.raises(KeyboardInterrupt), recorded.command(["mypy"]):
        raise KeyboardInterrupt
    assert not (tmp_path / schema.RESULTS_FILE).exists()
