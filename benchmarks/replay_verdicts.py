"""Every greedy verdict of recorded cell runs judged again offline, under the rule as merged at
5b96543 ("previous") and the rule now ("revised"): the false-red rate each measures on the
runs' own reference runs (leave-one-out, and its self-check's outlying runs), the recorded runs,
compared paths and controls judged again, and where a runner-up control would be steered with
what power (glm5_matrix.verdicts.replay). Optionally, cell runs simulated from the noise the
reference runs show (its base deviations and the jumps of a few runs at a few decode steps,
fitted per comparison), on which the same replay measures each rule's rate and its self-check's
trip rate.

    python benchmarks/replay_verdicts.py tests/unit/data/h100-2026-12-06b [more ...]
        [--rule previous|revised|both] [--resamples N] [--simulate CELLS [--jump-scale X]]
        [--json] [--check]

Reads every cell run folder under the paths given: outputs.json (or outputs.json.gz) beside
results.json (or .gz), as a cell writes them. A folder under results-mutants' runs/NAME/ whose
NAME does not start with "control-" is a mutant's run: it must be red, whatever the rule (its
failures are listed). With --check, exits 1 when the revised rule fails a recorded faithful run,
rejects a reference run leave-one-out, trips its self-check, or leaves a control, or the
runner-up step it steers at, below the comparison's min_power; or a mutant's run is green. No
GPU, no vLLM: what a GPU measured, judged again by a reviewer on any machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from glm5_matrix.verdicts import replay  # noqa: E402
from glm5_matrix.verdicts.replay import REVISED, RULES, Replayed  # noqa: E402

OUTPUTS, RESULTS = "outputs.json", "results.json"


def _read(folder: Path, name: str) -> Any:
    for path, opener in ((folder / name, open), (folder / f"{name}.gz", gzip.open)):
        if path.is_file():
            with opener(path, "rt") as handle:  # type: ignore[operator]
                return json.load(handle)
    return None


def cell_folders(paths: list[Path]) -> list[Path]:
    """Every folder under `paths` holding a cell run's outputs and results."""
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path}: no such file or folder")
        candidates = [path] if path.is_dir() else [path.parent]
        if path.is_dir():
            candidates += sorted(p.parent for p in path.rglob(f"{OUTPUTS}*"))
        for folder in candidates:
            has_results = any((folder / f).is_file() for f in (RESULTS, f"{RESULTS}.gz"))
            has_outputs = any((folder / f).is_file() for f in (OUTPUTS, f"{OUTPUTS}.gz"))
            if has_results and has_outputs and folder not in found:
                found.append(folder)
    if not found:
        raise SystemExit(f"no cell run ({OUTPUTS} beside {RESULTS}) under {paths}")
    return found


def _where(folder: Path) -> str:
    """A cell run folder's short name: CELL, or RUN/CELL under results-mutants/runs/."""
    if folder.parent.parent.name == "runs":
        return f"{folder.parent.name}/{folder.name}"
    return folder.name


def mutant_of(folder: Path) -> str | None:
    """The mutant a cell run folder ran (results-mutants/runs/MUTANT/CELL), None for a faithful
    run (a cell's own, or a mutant's control)."""
    parent = folder.parent
    if parent.parent.name == "runs" and not parent.name.startswith("control-"):
        return parent.name
    return None


@dataclass
class CellRun:
    folder: Path
    cell: str
    device: str
    mutant: str | None
    failures: list[str]
    replayed: dict[str, list[Replayed]] = field(default_factory=dict)  # rule -> comparisons
    recorded: list[replay.Recorded] = field(default_factory=list)


def load(folder: Path, rules: tuple[str, ...], resamples: int) -> CellRun:
    results, outputs = _read(folder, RESULTS), _read(folder, OUTPUTS)
    figures = results.get("figures", [])
    by_name = {f.get("name"): f for f in figures}
    device = str(by_name.get("device.model", {}).get("value", "unknown"))
    failures = [
        f"{node.rpartition('::')[2]}: {str(test.get('message', '')).splitlines()[0][:160]}"
        for node, test in results.get("tests", {}).items()
        if test.get("outcome") in ("failed", "error")
    ]
    run = CellRun(folder, str(results["cell"].get("id")), device, mutant_of(folder), failures)
    run.recorded = replay.recorded_comparisons(outputs, figures)
    for rule in rules:
        run.replayed[rule] = [replay.replay(c, rule, resamples) for c in run.recorded]
    return run


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4g}"


def describe(replayed: Replayed, recorded: replay.Recorded) -> str:
    m = replayed.measurement
    if replayed.judged_by == replay.AGREEMENT:
        bound = f"tolerance {_num(replayed.tolerance)}"
    else:
        bound = f"bounds {_num(min(replayed.bounds))}..{_num(max(replayed.bounds))}"
    text = (
        f"{replayed.rule:8s} {replayed.judged_by:17s} {bound}; LOO {m.rejected}/{m.judged}"
        f", outlying {len(m.outliers)} (trips at {m.trip_at}){' TRIPPED' if m.tripped else ''}"
    )
    if replayed.rate_at_half is not None:
        text += f", at half {replayed.rate_at_half:.3g}"
    for v in replayed.runs:
        at = f" at step {v.step}" if v.step is not None else ""
        text += f"; run {v.slug} {_num(v.value)}/{_num(v.bound)}{at} {'ok' if v.passed else 'RED'}"
    for slug, rejected, of in replayed.paths:
        text += f"; path {slug} {rejected}/{of} rejected"
    for v in replayed.controls:
        steered = (
            f" (steered at step {recorded.control_step})"
            if recorded.control_step is not None
            else ""
        )
        text += (
            f"; control {v.slug}{steered} power {_num(v.power)} at step {v.step} "
            f"{'ok' if v.passed else 'WEAK'}"
        )
    if replayed.steer is not None:
        s = replayed.steer
        text += (
            f"; runner-up steered at step {s.step}: margin {_num(s.value)} = power {_num(s.power)}"
        )
    elif replayed.judged_by != replay.AGREEMENT:
        text += "; no step to steer a runner-up control at"
    return text


def problems(run: CellRun) -> list[str]:
    """What --check fails on, for the revised rule: a reference run rejected leave-one-out,
    and, for a faithful run, anything that makes it red (_red); a mutant's run green."""
    found = [
        f"{run.folder} {r.name}: {r.measurement.rejected} of {r.measurement.judged} reference "
        "runs rejected leave-one-out"
        for r in run.replayed[REVISED]
        if r.measurement.rejected
    ]
    if run.mutant is not None:
        if not run.failures:
            found.append(f"{run.folder}: the mutant {run.mutant}'s run is green")
        return found
    for recorded in run.recorded:
        steer = next(r.steer for r in run.replayed[REVISED] if r.name == recorded.name)
        if recorded.control_step is not None and (steer is None or not steer.passed):
            found.append(f"{run.folder} {recorded.name}: no runner-up step with power")
    return found + [f"{run.folder} {why}" for why in _red(run, REVISED)]


def _red(run: CellRun, rule: str) -> list[str]:
    """Why a faithful cell run is red under `rule`: a recorded run judged red, a self-check
    tripped, or a control (or, for a runner-up control, the step the rule steers at) short of
    min_power."""
    found = []
    for replayed, recorded in zip(run.replayed[rule], run.recorded, strict=True):
        found += [f"{replayed.name}: run {v.slug}" for v in replayed.runs if not v.passed]
        if replayed.measurement.tripped:
            found.append(f"{replayed.name}: self-check")
        steered = recorded.control_step
        if steered is not None and replayed.steer is not None and replayed.steer.step != steered:
            if not replayed.steer.passed:  # the rule would steer elsewhere: judged there
                found.append(f"{replayed.name}: no runner-up step with power")
            continue
        found += [f"{replayed.name}: control {v.slug}" for v in replayed.controls if not v.passed]
    return found


def summary(runs: list[CellRun], rules: tuple[str, ...]) -> list[str]:
    lines = [
        "",
        "pooled over every cell run's reference runs (a mutant's too: its patch acts after them):",
    ]
    for rule in rules:
        pooled: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for run in runs:
            for replayed in run.replayed[rule]:
                entry = pooled[f"{replayed.name} [{replayed.judged_by}]"]
                m = replayed.measurement
                entry[0] += m.rejected
                entry[1] += m.judged
                entry[2] += m.tripped
                entry[3] += 1
        lines.append(f"  {rule}:")
        for key, (rejected, judged, tripped, cells) in sorted(pooled.items()):
            upper = replay.clopper_pearson_upper(rejected, judged)
            lines.append(
                f"    {key}: {cells} cell run(s), leave-one-out {rejected}/{judged} (rate "
                f"{rejected / judged:.3g}, 95% upper {upper:.3g}), self-check tripped in {tripped}"
            )
        rejected = sum(v[0] for v in pooled.values())
        judged = sum(v[1] for v in pooled.values())
        lines.append(f"    all comparisons: leave-one-out {rejected}/{judged}")
        faithful = [run for run in runs if run.mutant is None]
        red = [(run, _red(run, rule)) for run in faithful]
        red = [(run, why) for run, why in red if why]
        lines.append(
            f"    faithful cell runs red by a verdict, a self-check or a control's power: "
            f"{len(red)} of {len(faithful)}"
            + "".join(
                f"\n      {run.folder.name} ({run.cell}): {'; '.join(why)}" for run, why in red
            )
        )
    return lines


def simulation(runs: list[CellRun], cells: int, jump_scale: float) -> list[str]:
    lines = ["", f"simulated: {cells} cell runs per comparison, jump rate x{jump_scale:g}:"]
    seen = 0
    for run in runs:
        if run.mutant is not None:
            continue
        for recorded in run.recorded:
            if recorded.steps == 1:  # its runs' first steps are simulated with the whole run's
                continue
            seen += 1
            mixture = replay.fit_mixture(recorded.references)
            lines.append(f"  {_where(run.folder)} {recorded.name}: {mixture.describe()}")
            # A comparison judged by logprobs has a prefill step of its own (NAME_prefill).
            for prefill in (False, True)[: 2 if recorded.judged_by == replay.AGREEMENT else 1]:
                for found in replay.simulated_rates(
                    recorded, cells, seed=seen, jump_scale=jump_scale, prefill=prefill
                ):
                    what = "its prefill step" if prefill else "whole runs"
                    lines.append(
                        f"    {what:16s} {found.rule:8s} {found.judged_by:17s} LOO "
                        f"{found.rejected}/{found.judged} (rate {found.rate:.3g}); outlying runs "
                        f"{found.outlying}/{found.runs}, self-check tripped {found.tripped}/"
                        f"{found.cells} (bound {found.trip_bound():.2g}, share {found.share:g})"
                        + (f", {found.broken} broken" if found.broken else "")
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--rule", choices=(*RULES, "both"), default="both")
    parser.add_argument(
        "--resamples", type=int, default=0, help="the rate at half the runs, resampled"
    )
    parser.add_argument(
        "--simulate", type=int, default=0, metavar="CELLS", help="simulated cell runs"
    )
    parser.add_argument("--jump-scale", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    rules = RULES if args.rule == "both" else (args.rule,)
    if args.check and REVISED not in rules:
        rules = (*rules, REVISED)
    runs = [load(folder, rules, args.resamples) for folder in cell_folders(args.paths)]
    if args.json:
        print(json.dumps([_as_json(run) for run in runs], indent=2, default=str))
    else:
        lines = []
        for run in runs:
            lines.append(f"{run.folder}: {run.cell} on {run.device}")
            if run.mutant:
                lines.append(f"  mutant {run.mutant}")
            for failure in run.failures:
                lines.append(f"  failed: {failure}")
            for index, recorded in enumerate(run.recorded):
                lines.append(f"  {recorded.name} ({len(recorded.references)} runs):")
                for rule in rules:
                    lines.append(f"    {describe(run.replayed[rule][index], recorded)}")
        lines += summary(runs, rules)
        if args.simulate:
            lines += simulation(runs, args.simulate, args.jump_scale)
        print("\n".join(lines))
    if args.check:
        found = [p for run in runs for p in problems(run)]
        for problem in found:
            print(f"check: {problem}", file=sys.stderr)
        return 1 if found else 0
    return 0


def _as_json(run: CellRun) -> dict[str, Any]:
    return {
        "folder": str(run.folder),
        "cell": run.cell,
        "device": run.device,
        "mutant": run.mutant,
        "failures": run.failures,
        "comparisons": {
            rule: [
                {
                    "name": r.name,
                    "judged_by": r.judged_by,
                    "tolerance": r.tolerance,
                    "bounds": r.bounds,
                    "rejected": r.measurement.rejected,
                    "judged": r.measurement.judged,
                    "outliers": len(r.measurement.outliers),
                    "tripped": r.measurement.tripped,
                    "rate_at_half": r.rate_at_half,
                    "runs": [vars(v) for v in r.runs],
                    "paths": r.paths,
                    "controls": [{**vars(v), "power": v.power} for v in r.controls],
                    "steer": None if r.steer is None else {**vars(r.steer), "power": r.steer.power},
                }
                for r in replayed
            ]
            for rule, replayed in run.replayed.items()
        },
    }


if __name__ == "__main__":
    sys.exit(main())
