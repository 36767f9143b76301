"""report.md: the matrix report short enough for a CI summary ($GITHUB_STEP_SUMMARY,
`buildkite-agent annotate`)."""

from __future__ import annotations

from html import escape
from typing import Any

from glm5_matrix.matrix.matrix import MATRIX_FILE
from glm5_matrix.report.model import (
    CellReport,
    MatrixReport,
    TestResult,
    figure_verdict,
    format_value,
)


def _md(text: Any) -> str:
    """A table cell: one line, pipes escaped, no HTML of a message rendered as HTML."""
    return escape(str(text), quote=False).replace("\n", " ").replace("|", "\\|").strip()


def _tests_table(
    title: str, column: str, noun: str, rows: list[tuple[CellReport, TestResult]], max_rows: int
) -> list[str]:
    """A section of one row per test (cell, test, its message), at most `max_rows`; none when
    there are no rows."""
    if not rows:
        return []
    lines = ["", f"### {title}", "", f"| cell | test | {column} |", "|---|---|---|"]
    for cell, test in rows[:max_rows]:
        lines.append(f"| `{_md(cell.id)}` | `{_md(test.nodeid)}` | {_md(test.message)} |")
    if len(rows) > max_rows:
        lines.append(f"\n{len(rows) - max_rows} more {noun} in report.html.")
    return lines


def markdown(report: MatrixReport, max_rows: int = 40) -> str:
    """Short enough for $GITHUB_STEP_SUMMARY or `buildkite-agent annotate` (both take far more
    than this: failures and figures are capped at `max_rows` rows each)."""
    lines = [
        "## glm5-matrix report",
        "",
        f"{report.headline()}.",
        "",
        "| cell | outcome | tests | engine starts | wall |",
        "|---|---|---|---|---|",
    ]
    for cell in report.cells:
        wall = cell.describe_wall()
        name = cell.id if cell.in_matrix else f"{cell.id} (not in {MATRIX_FILE})"
        ran = cell.status in ("passed", "failed") or bool(cell.tests)
        lines.append(
            f"| `{_md(name)}` | {_md(cell.label)} | {_md(cell.describe_tests() if ran else '')} "
            f"| {_md(cell.describe_starts() if ran else '')} | {wall} |"
        )
    failures = [(c, t) for c in report.cells for t in c.failures]
    lines += _tests_table("Failures", "first line", "failures", failures, max_rows)
    # A check that skipped inside a cell that ran (no power on this runner, a missing GPU for one
    # test) is the one thing a green row hides; a cell skipped whole says why in its row.
    skips = [
        (c, t)
        for c in report.cells
        if c.status != "skipped"
        for t in c.tests
        if t.outcome == "skipped"
    ]
    lines += _tests_table("Skipped tests", "reason", "skipped tests", skips, max_rows)
    figures = [(c, f) for c in report.cells for f in c.figures]
    if figures:
        lines += [
            "",
            "### Figures",
            "",
            "| cell | figure | value | limit | |",
            "|---|---|---|---|---|",
        ]
        for cell, figure in figures[:max_rows]:
            limit = figure.get("limit")
            shown = "" if limit is None else f"{figure.get('relation') or ''} {format_value(limit)}"
            lines.append(
                f"| `{_md(cell.id)}` | {_md(figure.get('name'))} "
                f"| {_md(format_value(figure.get('value'), figure.get('unit')))} "
                f"| {_md(shown)} | {figure_verdict(figure)} |"
            )
        if len(figures) > max_rows:
            lines.append(f"\n{len(figures) - max_rows} more figures in report.html.")
    return "\n".join(lines) + "\n"
