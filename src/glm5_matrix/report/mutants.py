"""The mutants' table (report.md of `nox -s mutants`), from their results.json record: it only
reads. One row per mutant: its cell, what it breaks, and caught (by which tests) or survived
(with the catalogue's reason), or not run (with the command that runs it); then the catch rate
per cell and overall, over the mutants that were judged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def verdict_text(row: Mapping[str, Any]) -> str:
    status, by = row["status"], row.get("caught_by") or []
    if status == "caught":
        text = "caught by " + ", ".join(f"`{t}`" for t in by)
        if row.get("expected_hit") is False:
            text += " (not the expected test)"
        return text
    if status == "survived":
        return "**survived**" + (f": {row['note']}" if row.get("note") else "")
    if status == "not-run":
        return f"not run here: {row.get('detail', '')}"
    return f"invalid: {row.get('detail', '')}"


def rows_table(data: Mapping[str, Any], breaks: bool = True) -> list[str]:
    """The mutants' rows as a Markdown table (`breaks`: with what each breaks)."""
    head = "| mutant | cell | area |" + (" what it breaks |" if breaks else "") + " verdict |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for row in data.get("mutants", []):
        verdict = verdict_text(row)
        if row.get("no_power"):
            verdict += f" (no power: {row['no_power']})"
        middle = f" {_cell(row['breaks'])} |" if breaks else ""
        lines.append(
            f"| `{row['name']}` | `{row['cell']}` | {_cell(row['area'])} |{middle} {_cell(verdict)} |"
        )
    return lines


def _none_judged(rows: list[Mapping[str, Any]], cell: str) -> str:
    """Why a cell judged none of its mutants: not run on this box, or its control failed (seen
    on the H200: a GPU cell whose control was red read "not run here (GPU)")."""
    statuses = {row["status"] for row in rows if row["cell"] == cell}
    if statuses == {"not-run"}:
        return "not run here (GPU)"
    if "invalid" in statuses:
        return "none judged: its control failed"
    return "none judged"


def render(data: Mapping[str, Any]) -> str:
    rows = data.get("mutants", [])
    lines = [
        "# What the matrix catches",
        "",
        f"{len(rows)} mutants{' (the CI subset)' if data.get('ci') else ''}; "
        f"wall {data.get('wall_seconds', 0) / 60:.1f} min.",
        "",
        *rows_table(data),
    ]
    summary = data.get("summary", {})
    lines += ["", "| cell | caught / judged |", "|---|---|"]
    for cell, rate in summary.get("per_cell", {}).items():
        lines.append(f"| `{cell}` | {_none_judged(rows, cell) if rate == '0/0' else rate} |")
    lines.append(f"| **overall** | **{summary.get('overall', '0/0')}** |")
    controls = data.get("controls", [])
    if controls:
        lines += ["", "Controls (the unpatched copy, the same tests):", ""]
        for c in controls:
            status = "green" if c["status"] == "survived" else c["status"]
            lines.append(f"- `{c['cell']}`: {status} ({c['detail']}), {c['seconds']:.0f} s")
    return "\n".join(lines) + "\n"
