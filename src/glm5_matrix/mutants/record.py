"""results.json and report.md of a mutants run, written atomically into its results folder.

A run of some mutants (--only, --ci) updates their rows and keeps the others' from earlier runs,
so the table always shows the whole catalogue's latest verdicts."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from glm5_matrix.files import repo_root, write_atomic, write_json_atomic
from glm5_matrix.mutants import verdicts
from glm5_matrix.mutants.catalogue import Mutant
from glm5_matrix.report import mutants as table
from glm5_matrix.results import gpu_verdicts

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


class _Outcome(Protocol):
    """What glm5_matrix.mutants.run records of one run (its Outcome)."""

    @property
    def mutant(self) -> Mutant | None: ...
    @property
    def cell(self) -> str: ...
    @property
    def verdict(self) -> verdicts.Verdict: ...
    @property
    def seconds(self) -> float: ...
    @property
    def results_dir(self) -> str | None: ...
    @property
    def patched_files(self) -> tuple[str, ...]: ...


def row(outcome: _Outcome) -> dict[str, Any]:
    m, v = outcome.mutant, outcome.verdict
    base: dict[str, Any] = {
        "cell": outcome.cell,
        "status": v.status,
        "detail": v.detail,
        "caught_by": list(v.caught_by),
        "expected_hit": v.expected_hit,
        "seconds": round(outcome.seconds, 1),
        "results_dir": outcome.results_dir,
    }
    if m is None:
        return base
    return {
        "name": m.name,
        "patch": m.patch.name,
        "env": m.env,
        "area": m.area,
        "breaks": m.breaks,
        "select": m.select,
        "expect": list(m.expect),
        "ci": m.ci,
        "no_power": m.no_power,
        "note": m.note,
        "patched_files": list(outcome.patched_files),
        **base,
    }


def merge(
    previous: list[dict[str, Any]], new: list[dict[str, Any]], key: str
) -> list[dict[str, Any]]:
    """`previous` rows with those of `new` replaced (by `key`), new ones appended. A row that
    says only "not run here" (a GPU entry on a CPU box) leaves a verdict measured elsewhere
    (copied in from a GPU machine's results-mutants/) as it is."""
    fresh = {r[key]: r for r in new}
    merged = []
    for r in previous:
        newer = fresh.pop(r[key], r)
        measured = r.get("status") in (verdicts.CAUGHT, verdicts.SURVIVED)
        merged.append(r if measured and newer.get("status") == verdicts.NOT_RUN else newer)
    return merged + [r for r in new if r[key] in fresh]


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    per_cell, overall = verdicts.catch_rates([(r["cell"], r["status"]) for r in rows])
    return {
        "per_cell": {cell: rate.describe() for cell, rate in per_cell.items()},
        "overall": overall.describe(),
        "caught": overall.caught,
        "judged": overall.judged,
        "not_run": sum(r["status"] == verdicts.NOT_RUN for r in rows),
        "interrupted": sum(r["status"] == verdicts.INTERRUPTED for r in rows),
        "survivors": [r["name"] for r in rows if r["status"] == verdicts.SURVIVED],
    }


def write(
    out: Path,
    controls: Sequence[_Outcome],
    outcomes: Sequence[_Outcome],
    wall_seconds: float,
    ci: bool = False,
    order: Sequence[str] = (),
    ended: Mapping[str, Any] | None = None,
) -> Path:
    """`ended`: how this run ended ({"how": "running" | "finished" | "signal", ...}), recorded
    as the file's own and shown atop the table."""
    out.mkdir(parents=True, exist_ok=True)
    # Two sessions may share the folder (cells split between them): read, merge and write
    # under one lock.
    with (out / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write(out, controls, outcomes, wall_seconds, ci, order, ended)


def _write(
    out: Path,
    controls: Sequence[_Outcome],
    outcomes: Sequence[_Outcome],
    wall_seconds: float,
    ci: bool,
    order: Sequence[str],
    ended: Mapping[str, Any] | None,
) -> Path:
    path = out / RESULTS_FILE
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = {}
    rows = merge(previous.get("mutants", []), [row(o) for o in outcomes], "name")
    if order:
        rank = {name: i for i, name in enumerate(order)}
        rows.sort(key=lambda r: rank.get(r["name"], len(rank)))
    data = {
        "ci": ci,
        "wall_seconds": round(wall_seconds, 1),
        "ended": dict(ended or {"how": "finished"}),
        "controls": merge(previous.get("controls", []), [row(c) for c in controls], "cell"),
        "mutants": rows,
        "summary": summarize(rows),
    }
    write_json_atomic(path, data)
    kept = gpu_verdicts.load(repo_root() / gpu_verdicts.KEPT_FILE)
    write_atomic(out / REPORT_FILE, table.render(data, kept))
    return path


def kept_verdicts(
    outcomes: Sequence[_Outcome],
    controls: Sequence[_Outcome],
    gpu_cells: set[str],
    gpu: str,
    date: str,
    how: str,
) -> list[gpu_verdicts.KeptVerdict]:
    """The verdicts of this run to keep in the repository (gpu_verdicts): a mutant of a cell
    that needs a GPU (`gpu_cells`), judged caught or survived, on the GPU model `gpu`, with its
    cell's vLLM version (from the run's results.json) and its control's wall time. Nothing on a
    box without a GPU ("cpu: ..."): a CPU run never writes the file."""
    if not gpu or gpu.startswith("cpu:"):
        return []
    control_seconds = {c.cell: c.seconds for c in controls}
    found = []
    for outcome in outcomes:
        m, v = outcome.mutant, outcome.verdict
        if m is None or outcome.cell not in gpu_cells:
            continue
        if v.status not in (verdicts.CAUGHT, verdicts.SURVIVED):
            continue
        found.append(
            gpu_verdicts.KeptVerdict(
                mutant=m.name,
                status=v.status,
                gpu=gpu,
                vllm=_vllm_version(outcome.results_dir),
                date=date,
                how=how,
                detail=v.detail,
                source=str(outcome.results_dir or ""),
                caught_by=tuple(v.caught_by),
                seconds=round(outcome.seconds, 1),
                control_seconds=(
                    round(control_seconds[outcome.cell], 1)
                    if outcome.cell in control_seconds
                    else None
                ),
            )
        )
    return found


def _vllm_version(results_dir: str | None) -> str:
    try:
        data = json.loads((Path(results_dir or "") / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return "unknown"
    return str((data.get("versions") or {}).get("vllm") or "unknown")


def keep(path: Path, new: Sequence[gpu_verdicts.KeptVerdict]) -> Path | None:
    """Write `new` into the kept file (replacing the same mutant's verdict on the same GPU model
    and vLLM version, keeping every other); None when there is nothing new."""
    if not new:
        return None
    merged = gpu_verdicts.updated(gpu_verdicts.load(path), new)
    write_atomic(path, gpu_verdicts.dumps(merged))
    return path
