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
    record_engine_start("engine:y", 2.0, compile={"seconds": None, "entries_added": {"triton": 2}})
    record_figure("layout.block_size", 4352, limit=4352, relation="==", unit="tokens")
    record_figure("repeat.delta", 0.031, limit=0.094, relation="<=", unit="nats")

def test_fails():
    assert False, "planted"

def test_skips():
    pytest.skip("no GPU here")
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
    run.assert_outcomes(passed=1, failed=1, skipped=1)
    data = json.loads((tmp_path / "results" / results.RESULTS_FILE).read_text())
    assert data["outcomes"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert data["exit_status"] == 1
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
    summary = results.summarize(tmp_path / "results")
    assert "1 failed, 1 passed, 1 skipped" in summary
    assert "2 engine start(s) (3 s, 2 kernel file(s) compiled)" in summary


def test_a_relation_that_means_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="relation"):
        results.record_figure("x", 1, limit=2, relation="~")
