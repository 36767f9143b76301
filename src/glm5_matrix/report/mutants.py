"""The mutants' table (report.md of `nox -s mutants`), from their results.json record and the
GPU verdicts the repository keeps (glm5_matrix.results.gpu_verdicts): it only reads. One row per
mutant: its cell, what it breaks, and caught (by which tests) or survived (with the catalogue's
reason), or not run here (with the command that runs it) and then what a GPU runner measured;
then the catch rate per cell and overall, over the mutants that were judged, here or kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from glm5_matrix.results.gpu_verdicts import KeptVerdict, by_mutant


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def kept_text(kept: Sequence[KeptVerdict]) -> str:
    """The kept GPU verdicts of one mutant, newest first, for a table cell."""
    ordered = sorted(kept, key=lambda v: (v.date, v.gpu), reverse=True)
    return "; ".join(v.describe() for v in ordered)


def verdict_text(row: Mapping[str, Any], kept: Sequence[KeptVerdict] = ()) -> str:
    """The verdict measured here; a GPU row not run here shows what a GPU runner measured."""
    if row["status"] == "not-run" and kept:
        return kept_text(kept)
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
    if status == "interrupted":
        return f"**interrupted**: {row.get('detail', '')}"
    return f"invalid: {row.get('detail', '')}"


def rows_table(
    data: Mapping[str, Any], breaks: bool = True, kept: Sequence[KeptVerdict] = ()
) -> list[str]:
    """The mutants' rows as a Markdown table (`breaks`: with what each breaks; `kept`: the GPU
    verdicts the repository keeps, shown where a row was not run here)."""
    head = "| mutant | cell | area |" + (" what it breaks |" if breaks else "") + " verdict |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    gpu = by_mutant(kept)
    for row in data.get("mutants", []):
        verdict = verdict_text(row, gpu.get(row.get("name", ""), []))
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
    if "interrupted" in statuses:
        return "none judged: the run was interrupted"
    if "invalid" in statuses:
        return "none judged: its control failed"
    return "none judged"


def render(data: Mapping[str, Any], kept: Sequence[KeptVerdict] = ()) -> str:
    """report.md: the run's rows (GPU rows not run here with the kept GPU verdicts), the rates
    measured here, the controls, and the kept GPU verdicts with their own rates."""
    rows = data.get("mutants", [])
    lines = [
        "# What the matrix catches",
        "",
        f"{len(rows)} mutants{' (the CI subset)' if data.get('ci') else ''}; "
        f"wall {data.get('wall_seconds', 0) / 60:.1f} min.",
        "",
        *_ended(data.get("ended") or {}),
        *rows_table(data, kept=kept),
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
    if kept:
        lines += ["", *kept_rates(kept)]
    return "\n".join(lines) + "\n"


def _ended(ended: Mapping[str, Any]) -> list[str]:
    """A line atop the table when the run did not finish."""
    if ended.get("how") == "signal":
        stopped = ", ".join(f"`{n}`" for n in ended.get("interrupted", [])) or "nothing"
        return [
            f"**This run was interrupted by {ended.get('signal')}**: not judged, and recorded as "
            f"interrupted: {stopped}. The other rows are earlier verdicts or this run's.",
            "",
        ]
    if ended.get("how") == "running":
        return ["**This run is still running (or ended without a word)**: rows may be missing.", ""]
    return []


def kept_rates(kept: Sequence[KeptVerdict]) -> list[str]:
    """The kept GPU verdicts' catch rate per GPU model (each mutant's latest there)."""
    latest: dict[tuple[str, str], KeptVerdict] = {}
    for verdict in sorted(kept, key=lambda v: v.date):
        latest[(verdict.gpu, verdict.mutant)] = verdict
    per_gpu: dict[str, list[int]] = {}
    for (gpu, _), verdict in sorted(latest.items()):
        counts = per_gpu.setdefault(gpu, [0, 0, 0])
        counts[0] += verdict.status == "caught"
        counts[1] += verdict.judged
        counts[2] += not verdict.judged
    lines = ["GPU verdicts kept in mutants/gpu-verdicts.toml (each mutant's latest per GPU):", ""]
    lines += [
        f"- {gpu}: {c} of {j} judged caught" + (f", {n} not judged" if n else "")
        for gpu, (c, j, n) in per_gpu.items()
    ]
    return lines
