"""The catalogue's table: every mutant of mutants/catalogue.toml with the verdict measured on this
box (results-mutants/results.json, when a run left one) and the GPU verdicts the repository keeps
(mutants/gpu-verdicts.toml), as one Markdown table. What a docs page or the README renders:

    python -m glm5_matrix.mutants.table            # prints it
    from glm5_matrix.mutants.table import render_catalogue
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_matrix.files import repo_root
from glm5_matrix.mutants import catalogue
from glm5_matrix.mutants.catalogue import Mutant
from glm5_matrix.report import mutants as report
from glm5_matrix.results import gpu_verdicts
from glm5_matrix.results.gpu_verdicts import KeptVerdict


def table(
    mutants: Sequence[Mutant],
    kept: Sequence[KeptVerdict],
    measured: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """The Markdown table (pure): per mutant its cell, area, expected catchers, the verdict
    measured here (`measured`: results.json rows by name; a GPU row not run here is left out)
    and the kept GPU verdicts, newest first; then the catch rate over what was judged."""
    measured = measured or {}
    gpu = gpu_verdicts.by_mutant(kept)
    lines = [
        "| mutant | cell | area | expected catcher | verdict |",
        "|---|---|---|---|---|",
    ]
    caught = judged = 0
    for m in mutants:
        parts = []
        row = measured.get(m.name)
        if row is not None and row.get("status") != "not-run":
            parts.append(report.verdict_text(row))
            judged += row["status"] in ("caught", "survived")
            caught += row["status"] == "caught"
        if gpu.get(m.name):
            parts.append(report.kept_text(gpu[m.name]))
            latest = max(gpu[m.name], key=lambda v: v.date)
            judged += 1
            caught += latest.status == "caught"
        verdict = "; ".join(parts) or "not run yet" + (f" ({m.note})" if m.note else "")
        name = f"`{m.name}`" + (" (CI)" if m.ci else "")
        expect = ", ".join(f"`{t}`" for t in m.expect) or "-"
        lines.append(f"| {name} | `{m.cell}` | {_cell(m.area)} | {expect} | {_cell(verdict)} |")
    lines += [
        "",
        f"{caught} of {judged} judged verdicts caught (each GPU model counted once per mutant, its latest).",
    ]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_catalogue(root: Path | None = None, results: Path | None = None) -> str:
    """The table for the checkout at `root` (default: this one): its catalogue, its kept GPU
    verdicts, and the rows of `results` (default: results-mutants/results.json, if there)."""
    from glm5_matrix.sessions import runner

    root = root or repo_root()
    matrix = runner.load()
    cells = {v.id: v.env for v in matrix.variants}
    mutants = catalogue.load_catalogue(root / catalogue.CATALOGUE_FILE, cells)
    kept = gpu_verdicts.load(root / gpu_verdicts.KEPT_FILE)
    path = results or root / "results-mutants" / "results.json"
    measured: dict[str, Mapping[str, Any]] = {}
    if path.is_file():
        measured = {r["name"]: r for r in json.loads(path.read_text()).get("mutants", [])}
    return table(mutants, kept, measured)


if __name__ == "__main__":
    sys.stdout.write(render_catalogue())
