"""Tables of the docs site rendered from the repository's data when the site is built, so that
no page keeps by hand what a data file or a contract already says: the cells (matrix.toml), what
the matrix catches (mutants/catalogue.toml with the verdicts kept in results-mutants/ and the GPU
verdicts the repository keeps in mutants/gpu-verdicts.toml), and each
data file's contract (every key with its type, default, range and meaning, from the Spec its
loader reads it with). Pure readers: they write nothing and start nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.envs.environments import ENV
from glm5_matrix.matrix.known_failures import REGISTRY
from glm5_matrix.matrix.matrix import MATRIX, Matrix
from glm5_matrix.matrix.profile_schema import PROFILE
from glm5_matrix.mutants import catalogue, record
from glm5_matrix.mutants.catalogue import CATALOGUE, Mutant
from glm5_matrix.report import mutants as mutant_rows
from glm5_matrix.results import gpu_verdicts
from glm5_matrix.results.gpu_verdicts import GPU_VERDICTS, KeptVerdict
from glm5_matrix.sessions import runner
from glm5_matrix.upstream.findings import FINDING

# The data files' contracts, by the name a page's marker gives them (`<!-- table: contract-NAME -->`).
CONTRACTS: dict[str, Spec] = {
    "matrix": MATRIX,
    "profile": PROFILE,
    "env": ENV,
    "known-failures": REGISTRY,
    "catalogue": CATALOGUE,
    "finding": FINDING,
    "gpu-verdicts": GPU_VERDICTS,
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def cells_table(matrix: Matrix) -> str:
    """One row per cell: what it needs, its variants, its tags and CI timeout, what it checks."""
    lines = [
        "| cell | needs | variants | tags | CI timeout | what it checks |",
        "|---|---|---|---|---|---|",
    ]
    for cell in matrix.cells:
        if cell.gpus:
            needs = f"{cell.gpus} GPU{'s' if cell.gpus > 1 else ''}"
            if cell.min_compute_capability:
                needs += f", compute capability >= {cell.min_compute_capability}"
        else:
            needs = "CPU"
            if cell.cores:
                needs += " (cores " + ",".join(map(str, cell.cores)) + ", leased)"
        variants = ", ".join(f"`{v.id}`" for v in cell.variants) if cell.axis else "-"
        tags = " ".join(f"`{t}`" for t in sorted({t for v in cell.variants for t in v.tags}))
        lines.append(
            f"| `{cell.name}` | {needs} | {variants} | {tags} | {cell.timeout_minutes} min "
            f"| {_cell(cell.description)} |"
        )
    return "\n".join(lines) + "\n"


def kept_verdicts(results_dir: Path) -> dict[str, Any]:
    """The verdicts `nox -s mutants` kept in `results_dir` (results.json), or {} where none are."""
    try:
        data = json.loads((results_dir / record.RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _verdict(mutant: Mutant, kept: Mapping[str, Any] | None, gpu: list[KeptVerdict]) -> str:
    here = kept is not None and kept.get("status") != "not-run"
    if not here and not gpu:
        if kept is not None:  # a GPU row not run on the machine that kept results-mutants/
            return mutant_rows.verdict_text(kept)
        return f"no verdict kept here (`nox -s mutants -- --only {mutant.name}`)"
    parts = []
    if here and kept is not None:
        parts.append(mutant_rows.verdict_text(kept))
    if gpu:
        parts.append(mutant_rows.kept_text(gpu))
    text = "; ".join(parts)
    no_power = (kept or {}).get("no_power") or mutant.no_power
    if no_power:
        text += f" (no power: {no_power})"
    return text


def mutants_table(
    mutants: list[Mutant], kept: Mapping[str, Any], gpu: Sequence[KeptVerdict] = ()
) -> str:
    """The catalogue, one row per mutant with its expected catcher and its kept verdicts (the
    run's in `kept`, results-mutants/results.json; the GPU runners' in `gpu`,
    mutants/gpu-verdicts.toml), or none; then the catch rate over the judged ones of mutants
    still in the catalogue (a mutant counted once: its verdict here, else its latest GPU one)."""
    by_name = {r.get("name"): r for r in kept.get("mutants", []) if isinstance(r, dict)}
    on_gpu = gpu_verdicts.by_mutant(gpu)
    lines = [
        "| mutant | cell | area | expected catcher | verdict |",
        "|---|---|---|---|---|",
    ]
    rows = []
    for m in mutants:
        row = by_name.get(m.name)
        kept_gpu = on_gpu.get(m.name, [])
        if row is not None and row.get("status") != "not-run":
            rows.append(row)
        elif kept_gpu:
            judged = [v for v in kept_gpu if v.judged]  # an invalid run hides no judged one
            latest = max(judged or kept_gpu, key=lambda v: v.date)
            rows.append({"name": m.name, "cell": m.cell, "status": latest.status})
        elif row is not None:
            rows.append(row)
        name = f"`{m.name}`" + (" (CI)" if m.ci else "")
        expect = ", ".join(f"`{t}`" for t in m.expect) or "-"
        verdict = _verdict(m, row, kept_gpu)
        lines.append(f"| {name} | `{m.cell}` | {_cell(m.area)} | {expect} | {_cell(verdict)} |")
    if not rows:
        lines += [
            "",
            f"{len(mutants)} mutants in the catalogue; no verdict is kept in this checkout "
            "(`nox -s mutants` keeps them in results-mutants/, and on a GPU in "
            "mutants/gpu-verdicts.toml).",
        ]
    else:
        summary = record.summarize(rows)
        survivors = summary["survivors"]
        lines += [
            "",
            f"{len(mutants)} mutants in the catalogue, {len(rows)} with a kept verdict; caught "
            f"of those judged: **{summary['overall']}**"
            + (f"; survived: {', '.join(f'`{s}`' for s in survivors)}" if survivors else "")
            + ".",
        ]
    return "\n".join(lines) + "\n"


def render(name: str, root: Path, results_dir: Path) -> str:
    """The table `name` ("cells", "mutants", or "contract-NAME" of CONTRACTS) for the checkout
    at `root`."""
    if name.startswith("contract-") and name[len("contract-") :] in CONTRACTS:
        return contracts.markdown(CONTRACTS[name[len("contract-") :]])
    matrix = runner.load(root)
    if name == "cells":
        return cells_table(matrix)
    if name == "mutants":
        cells = {v.id: v.env for v in matrix.variants}
        mutants = catalogue.load_catalogue(root / catalogue.CATALOGUE_FILE, cells)
        gpu = gpu_verdicts.load(root / gpu_verdicts.KEPT_FILE)
        return mutants_table(mutants, kept_verdicts(results_dir), gpu)
    known = ", ".join(["cells", "mutants", *(f"contract-{c}" for c in CONTRACTS)])
    raise ValueError(f"no generated table {name!r} ({known})")
