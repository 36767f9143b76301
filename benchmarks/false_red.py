"""The false-red rate of every judged greedy comparison, over repeated cell runs, per device:
what the leave-one-out measurement of each run found (glm5_matrix.verdicts.false_red, recorded
by the suites as NAME.false_red.RULE.*), pooled, next to what the runs themselves did (the judged
run's difference over its tolerance, and how many cell runs a comparison failed).

    python benchmarks/false_red.py results/ [more results folders ...] [--json] [--check]

Reads every results.json under the folders given (a results tree, a cell's folder, or copies of
several runs of one cell). Per device (device.model) and comparison: the cell runs, the pooled
leave-one-out judgements and rejections (its rate against the comparison's share), outlying runs
found over all runs held out (with a 95% upper bound on the per-run rate, each run one trial),
the judged run's worst difference over its tolerance (median and largest), and the failures
among the runs; per cell: the pooled rates summed over its comparisons (the union bound the
budget rests on) and the cell runs that failed a greedy comparison. A single run resolves about
1/K; repeated runs pool to finer rates. With --check, exits 1 when a comparison's pooled
outlying runs prove its rate above its share as the suite's self-check proves it in one run
(false_red.trip_count over all the runs held out: a count a rule at its share reaches with
probability at most the share): add reference runs, as the self-check says. A measurement: the suites judge, this reports.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from glm5_matrix.verdicts.false_red import trip_count  # noqa: E402

RESULTS = "results.json"
_FIELDS = ("rate", "judged", "rejected", "rejected_runs", "outliers")


@dataclass
class Comparison:
    """One comparison (NAME, RULE) of one cell on one device, over its runs."""

    runs: int = 0
    judged: int = 0
    rejected: int = 0
    outliers: int = 0
    held_out: int = 0  # runs held out in all (K per cell run)
    share: float | None = None
    ratios: list[float] = field(default_factory=list)  # judged run's worst / tolerance
    failed_runs: int = 0

    @property
    def rate(self) -> float | None:
        return self.rejected / self.judged if self.judged else None


def _upper(successes: int, trials: int, level: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a binomial rate (bisection)."""
    if trials == 0:
        return 1.0
    if successes >= trials:
        return 1.0
    low, high = successes / trials, 1.0
    for _ in range(80):
        mid = (low + high) / 2
        below = sum(
            math.comb(trials, k) * mid**k * (1 - mid) ** (trials - k) for k in range(successes + 1)
        )
        low, high = (mid, high) if below > 1 - level else (low, mid)
    return high


def results_files(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_file() and path.name == RESULTS:
            found.append(path)
        elif path.is_dir():
            found += sorted(path.rglob(RESULTS))
        else:
            raise SystemExit(f"{path}: neither a results folder nor a {RESULTS}")
    if not found:
        raise SystemExit(f"no {RESULTS} under {', '.join(map(str, paths))}")
    return found


def _figures(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in data.get("figures", []) if isinstance(f, dict) and "name" in f}


def _device(figures: dict[str, dict[str, Any]]) -> str:
    if "device.model" in figures:
        return str(figures["device.model"]["value"])
    for name, figure in figures.items():
        if name.endswith(".device") and ".false_red." in name:
            return str(figure["value"])
    return "unknown (recorded before issue 48)"


def collect(files: list[Path]) -> dict[str, Any]:
    """{device: {cell: {"runs": n, "failed": n, "comparisons": {NAME[RULE]: Comparison}}}}."""
    table: dict[str, Any] = defaultdict(dict)
    for path in files:
        data = json.loads(path.read_text())
        if "cell" not in data or data.get("skipped"):
            continue
        figures = _figures(data)
        cell = str(data["cell"].get("id", path.parent.name))
        entry = table[_device(figures)].setdefault(
            cell, {"runs": 0, "failed": 0, "comparisons": defaultdict(Comparison)}
        )
        entry["runs"] += 1
        comparisons = entry["comparisons"]
        seen: set[str] = set()
        for name, figure in figures.items():
            if ".false_red." not in name or not name.endswith(".rate"):
                continue
            base = name[: -len(".rate")]
            if not isinstance(figure["value"], (int, float)):
                continue  # "not measured: ..."
            comparison, _, rule = base.partition(".false_red.")
            found = comparisons[f"{comparison} [{rule}]"]
            found.runs += 1
            found.share = figure.get("limit")
            found.judged += int(figures[f"{base}.judged"]["value"])
            found.rejected += int(figures[f"{base}.rejected"]["value"])
            found.outliers += int(figures[f"{base}.outliers"]["value"])
            found.held_out += _runs_of(figures, comparison)
            seen.add(comparison)
        failed_any = False
        for name, figure in figures.items():
            if not name.endswith(".worst_delta") or figure.get("limit") in (None, 0):
                continue
            comparison = name.split(".", 1)[0]
            key = next((k for k in comparisons if k.startswith(f"{comparison} [")), None)
            value = figure["value"]
            ratio = math.inf if value == "inf" else float(value) / float(figure["limit"])
            found = comparisons[key or f"{comparison} [agreement]"]
            found.ratios.append(ratio)
            if ratio > 1.0:
                found.failed_runs += 1
                failed_any = True
        failures = [t for t in data.get("tests", {}).values() if t.get("outcome") == "failed"]
        if failed_any or any(
            "tolerance" in str(t.get("message", "")) and "> tolerance" in str(t.get("message"))
            for t in failures
        ):
            entry["failed"] += 1
    return table


def _runs_of(figures: dict[str, dict[str, Any]], comparison: str) -> int:
    figure = figures.get(f"{comparison}.reference_repeats")
    return int(figure["value"]) if figure else 0


def report(table: dict[str, Any]) -> tuple[list[str], bool]:
    """(the lines to print, whether --check finds a comparison proven over its share)."""
    lines, over = [], False
    for device, cells in sorted(table.items()):
        lines.append(f"device: {device}")
        for cell, entry in sorted(cells.items()):
            lines.append(
                f"  {cell}: {entry['runs']} cell run(s), {entry['failed']} failed a greedy "
                "comparison"
            )
            summed = 0.0
            for key, found in sorted(entry["comparisons"].items()):
                text = f"    {key}: "
                if found.judged:
                    rate = found.rate or 0.0
                    summed += rate
                    upper = _upper(found.outliers, found.held_out)
                    share = found.share
                    text += (
                        f"{found.runs} run(s), leave-one-out {found.rejected}/{found.judged} "
                        f"(rate {rate:.3g}, share {share:.3g}); outlying runs {found.outliers}/"
                        f"{found.held_out} (95% upper bound {upper:.3g})"
                    )
                    proof = trip_count(found.held_out, share) if share else None
                    if proof is not None and found.outliers >= proof:
                        over = True
                        text += (
                            f" -- PROVEN OVER ITS SHARE ({found.outliers} >= {proof} outlying "
                            "runs): add reference runs"
                        )
                else:
                    text += "no leave-one-out figures"
                if found.ratios:
                    shown = sorted(found.ratios)
                    text += (
                        f"; judged run / tolerance median {statistics.median(shown):.3g}, max "
                        f"{shown[-1]:.3g}, {found.failed_runs} of {len(shown)} over"
                    )
                lines.append(text)
            if summed:
                lines.append(
                    f"    summed pooled rates (the union bound of a cell run): {summed:.3g}"
                )
    return lines, over


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="the pooled figures as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a share is proven broken")
    args = parser.parse_args(argv)
    table = collect(results_files(args.paths))
    lines, over = report(table)
    if args.json:
        print(
            json.dumps(
                {
                    device: {
                        cell: {
                            "runs": entry["runs"],
                            "failed": entry["failed"],
                            "comparisons": {
                                k: {**vars(c), "rate": c.rate}
                                for k, c in entry["comparisons"].items()
                            },
                        }
                        for cell, entry in cells.items()
                    }
                    for device, cells in table.items()
                },
                indent=2,
                default=str,
            )
        )
    else:
        print("\n".join(lines))
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
