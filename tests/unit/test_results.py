"""glm5_matrix.results: the per-cell results plugin run for real (pytester) on tests that pass,
fail, skip and record figures; what results.json then holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm5_matrix import results
from glm5_matrix.context import CONTEXT_VARIABLE, CellContext

pytest_plugins = ("pytester",)

SUITE = """
import pytest
from glm5_matrix.results import record_figure, record_engine_start

def test_measures():
    record_engine_start("engine:x", 1.234)
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
    monkeypatch.setattr(results, "_STATE", results._State())
    pytester.makepyfile(test_cell=SUITE)
    run = pytester.runpytest("-p", "glm5_matrix.results")
    run.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1)
    data = json.loads((tmp_path / "results" / results.RESULTS_FILE).read_text())
    assert data["outcomes"] == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1}
    assert data["exit_status"] == 1
    (start,) = data["engine_starts"]
    assert start == {"label": "engine:x", "seconds": 1.23, "test": "test_cell.py::test_measures"}
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
    assert data["tests"]["test_cell.py::test_known"]["reason"] == "known upstream"
    assert "1 failed, 1 passed, 1 skipped" in results.summarize(tmp_path / "results")


def test_a_relation_that_means_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="relation"):
        results.record_figure("x", 1, limit=2, relation="~")


def test_first_line() -> None:
    assert results.first_line("\n  AssertionError: x\nmore") == "AssertionError: x"
    assert results.first_line("") == ""
    assert len(results.first_line("y" * 1000)) == 300


def _ctx() -> dict:
    return {"id": "lint", "slug": "lint", "cell": "lint"}


def test_a_preflight_skip_is_recorded_and_clears_the_old_run(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text("<testsuites/>")  # an earlier run's
    (tmp_path / results.RESULTS_FILE).write_text("{}")
    results.write_skip(tmp_path, _ctx(), "e2e-tp2 needs 2 GPU(s); found no GPU")
    assert not (tmp_path / "junit.xml").exists()
    data = json.loads((tmp_path / results.RESULTS_FILE).read_text())
    assert data["skipped"] == "e2e-tp2 needs 2 GPU(s); found no GPU"
    for key in ("cell", "exit_status", "wall_seconds", "outcomes", "tests", "engine_starts"):
        assert key in data, key
    assert data["tests"] == {} and data["figures"] == []


class CommandFailed(Exception):
    """Stands for nox.command.CommandFailed (an Exception with the reason as its text)."""


def test_command_cell_records_each_command(tmp_path: Path) -> None:
    recorded = results.CommandResults(tmp_path, _ctx())
    with recorded.command(["ruff", "check", "."]):
        pass
    with pytest.raises(CommandFailed), recorded.command(["mypy"]):
        raise CommandFailed("Returned code 1")
    data = json.loads((tmp_path / results.RESULTS_FILE).read_text())
    assert data["exit_status"] == 1
    assert data["outcomes"] == {"passed": 1, "failed": 1}
    assert data["tests"]["command: mypy"]["message"] == "Returned code 1"
    assert data["tests"]["command: ruff check ."]["outcome"] == "passed"


def test_an_interrupted_command_cell_writes_nothing(tmp_path: Path) -> None:
    recorded = results.CommandResults(tmp_path, _ctx())
    with pytest.raises(KeyboardInterrupt), recorded.command(["mypy"]):
        raise KeyboardInterrupt
    assert not (tmp_path / results.RESULTS_FILE).exists()
