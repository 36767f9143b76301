"""The mutants' table (glm5_matrix.report.mutants): a cell that judged none of its mutants says
why, from the rows it has."""

from __future__ import annotations

from glm5_matrix.report import mutants as table


def _row(cell: str, status: str) -> dict[str, str]:
    return {"name": f"{cell}-{status}", "cell": cell, "area": "a", "breaks": "b", "status": status}


def test_a_cell_judging_none_says_whether_it_ran() -> None:
    """Seen on the H200: offload-tp1(offloading)'s control failed, and its line read "not run
    here (GPU)" on the GPU that had just run it."""
    rows = [_row("gpu-cell", "not-run"), _row("red-control", "invalid"), _row("ok", "caught")]
    summary = {"per_cell": {"gpu-cell": "0/0", "red-control": "0/0", "ok": "1/1 (100%)"}}
    text = table.render({"mutants": rows, "summary": {**summary, "overall": "1/1 (100%)"}})
    assert "| `gpu-cell` | not run here (GPU) |" in text
    assert "| `red-control` | none judged: its control failed |" in text
    assert "| `ok` | 1/1 (100%) |" in text
