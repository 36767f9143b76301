"""Wall time of the selected cells run one after another (`nox ...`) and side by side
(`nox ... -j N`), on the machine it runs on.

    python benchmarks/parallel_cells.py -t cpu -j 2
    python benchmarks/parallel_cells.py -s "e2e-tp1(deep_gemm)" "offload-tp1(simple)" -j 2
    python benchmarks/parallel_cells.py -t gpu -j 8 --repeat 2 --json gpu-j8.json

A warm-up run (serial, skipped with --no-warmup) first builds the cells' environments and fills
the caches, so both timed runs reuse them and differ only in how the cells are scheduled. The
serial and parallel runs then alternate for --repeat rounds. Printed: each run's wall time and
every session's status and duration (from nox's --report), and the speed-up of the medians.
Cells whose hardware is missing skip in a second, so select what runs here. Both runs must
pass; a failed session is printed and makes the exit status 1 (its time is not comparable).
Not a test: rerun it where the numbers matter; on a shared box, under the box's heavy lock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_nox(selection: list[str], jobs: int | None, label: str, log_dir: Path) -> dict[str, Any]:
    report = log_dir / f"{label}.report.json"
    log = log_dir / f"{label}.log"
    command = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), *selection]
    command += ["--report", str(report)]
    if jobs is not None:
        command += ["-j", str(jobs)]
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - started
    sessions = json.loads(report.read_text())["sessions"] if report.is_file() else []
    return {
        "label": label,
        "jobs": jobs or 1,
        "wall_seconds": round(wall, 1),
        "exit_status": code,
        "log": str(log),
        "sessions": [
            {
                "session": max(s["signatures"], key=len) if s["signatures"] else s["name"],
                "result": s["result"],
                "seconds": round(s.get("duration") or 0.0, 1),
            }
            for s in sessions
        ],
    }


def show(run: dict[str, Any]) -> None:
    print(f"{run['label']}: {run['wall_seconds']:.1f} s wall (exit {run['exit_status']})")
    for session in run["sessions"]:
        print(f"    {session['session']:<28} {session['result']:<8} {session['seconds']:>7.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("-t", "--tags", nargs="+", help="cells by tag, as nox -t")
    chosen.add_argument("-s", "--sessions", nargs="+", help="cells by name, as nox -s")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="nox -j of the parallel run")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of serial + parallel")
    parser.add_argument("--no-warmup", action="store_true", help="time cold builds too")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.jobs < 2:
        parser.error("-j must be at least 2")
    selection = ["-t", *args.tags] if args.tags else ["-s", *args.sessions]

    figures: dict[str, Any] = {"selection": selection, "jobs": args.jobs, "runs": []}
    with tempfile.TemporaryDirectory(prefix="glm5-parallel-bench-") as tmp:
        logs = Path(tmp)
        if not args.no_warmup:
            warmup = run_nox(selection, None, "warm-up", logs)
            show(warmup)
            figures["warmup"] = warmup
        for round_ in range(args.repeat):
            # Alternate which goes first, so that a cache warmed by the first does not favour
            # one mode throughout.
            order = [None, args.jobs] if round_ % 2 == 0 else [args.jobs, None]
            for jobs in order:
                label = f"{'serial' if jobs is None else f'-j {jobs}'} #{round_ + 1}"
                run = run_nox(selection, jobs, label, logs)
                show(run)
                figures["runs"].append(run)
        failed = [run for run in figures["runs"] if run["exit_status"] != 0]
        for run in failed:
            print(f"{run['label']} failed; its log:\n{Path(run['log']).read_text()[-4000:]}")

    serial = [r["wall_seconds"] for r in figures["runs"] if r["jobs"] == 1]
    parallel = [r["wall_seconds"] for r in figures["runs"] if r["jobs"] != 1]
    figures["serial_median_seconds"] = statistics.median(serial)
    figures["parallel_median_seconds"] = statistics.median(parallel)
    speedup = figures["serial_median_seconds"] / figures["parallel_median_seconds"]
    figures["speedup"] = round(speedup, 2)
    print(
        f"serial {figures['serial_median_seconds']:.1f} s, -j {args.jobs} "
        f"{figures['parallel_median_seconds']:.1f} s (median of {len(serial)}): "
        f"speed-up {speedup:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
