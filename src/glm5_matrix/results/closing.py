"""What the runner side writes and says about a cell's results: the record of how a run ended
(record_ending, by the cell's supervisor), what the runner's kill domain adds to it after the
supervisor (record_kill_domain), results.json for a cell that preflight skipped (write_skip) and
for one that runs commands instead of pytest (CommandResults), and the summary line the runner
prints at the end of a cell (summarize). Every write of results.json outside the cell's own
plugin (glm5_matrix.results.recorder) is here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from glm5_matrix.files import write_json_atomic
from glm5_matrix.results.junit import mark_junit_incomplete, write_junit
from glm5_matrix.results.schema import (
    CONTEXT_FILE,
    JUNIT_FILE,
    RESULTS_FILE,
    count_outcomes,
    describe_ending,
    ending,
    first_line,
    load,
    mark_interrupted,
)


def record_ending(
    results_dir: Path,
    ended: dict[str, Any] | None,
    exit_status: int,
    wall_seconds: float,
    left_behind: Sequence[str] = (),
    junit: Path | None = None,
    kill_domain: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the cell's supervisor knows once the test command is over, added to the run's own
    results.json (or to a new one when the command wrote none): `ended` where the command could
    not say how it ended (None keeps its own), the cell's exit status, the processes that had to
    be stopped after it, and the kill domain that held the cell's processes (`kill_domain`:
    its mechanism, cgroup, who stopped it, how many it killed). When the run did not complete,
    junit.xml is kept and marked incomplete, or written from these results when pytest wrote none. Returns the record."""
    data = load(results_dir)
    if data is None:
        data = {
            "cell": _context(results_dir),
            "tests": {},
            "outcomes": {},
            "engine_starts": [],
            "figures": [],
            "wall_seconds": round(wall_seconds, 2),
        }
    if ended is not None:
        previous = data.get("ended") or {}
        data["ended"] = {**ended, "test": ended.get("test") or previous.get("test")}
    elif not data.get("ended") or data["ended"].get("how") == "unfinished":
        raise ValueError("the run did not say how it ended: pass `ended`")
    data["complete"] = data["ended"]["how"] == "finished"
    data["exit_status"] = exit_status
    if left_behind:
        data["left_behind"] = list(left_behind)
    if kill_domain is not None:
        data["kill_domain"] = dict(kill_domain)
    if not data["complete"]:
        mark_interrupted(data["tests"])
        data["outcomes"] = count_outcomes(data["tests"])
    write_json_atomic(results_dir / RESULTS_FILE, data)
    if junit is not None and not data["complete"]:
        if junit.is_file():
            mark_junit_incomplete(junit, data["ended"])
        else:
            write_junit(junit, data)
    return data


def record_kill_domain(
    results_dir: Path, domain: Mapping[str, Any], killed: Sequence[int], seconds: float
) -> None:
    """results.json after the runner stopped the cell's kill domain (`domain`: its record, with
    its mechanism; `killed`: the pids it killed, `seconds` after the command began): where the
    supervisor recorded how the run ended, what the runner killed after it; where it did not
    (it was killed, or died), an ending that says so."""
    data = load(results_dir)
    recorded = data is not None and data.get("exit_status") is not None
    stopped = {
        **domain,
        "stopped_by": "supervisor" if recorded else "runner",
        "killed": len(killed),
    }
    if recorded:
        assert data is not None
        if not killed:
            return
        stopped["killed_by_runner"] = len(killed)
        stopped["killed"] = (data.get("kill_domain") or {}).get("killed", 0)
        data["kill_domain"] = stopped
        write_json_atomic(results_dir / RESULTS_FILE, data)
        return
    detail = (
        "the supervisor ended without recording how the run ended (it was killed or died); "
        f"the cell's kill domain ({domain['mechanism']}) killed {len(killed)} "
        "process(es) left"
    )
    record_ending(
        results_dir,
        ending("process-died", detail),
        1,
        seconds,
        [f"pid {pid} killed with the cell's kill domain" for pid in killed],
        junit=results_dir / JUNIT_FILE,
        kill_domain=stopped,
    )


def _context(results_dir: Path) -> Any:
    try:
        return json.loads((results_dir / CONTEXT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _record(context: dict[str, Any], exit_status: int, wall: float, **rest: Any) -> dict[str, Any]:
    """A results.json body with every contract key, for the writers that are not the plugin."""
    tests: dict[str, dict[str, Any]] = rest.pop("tests", {})
    return {
        "cell": context,
        "exit_status": exit_status,
        "complete": True,
        "wall_seconds": round(wall, 2),
        "outcomes": count_outcomes(tests),
        "tests": tests,
        "engine_starts": [],
        "figures": [],
        **rest,
    }


def write_skip(results_dir: Path, context: dict[str, Any], reason: str) -> None:
    """A cell that preflight skipped (its hardware is missing): results.json says why, so that
    a report tells "skipped: needs 2 GPU(s) ..." from "not run". Whatever an earlier run left
    in the folder goes first: nothing of it is this run's."""
    for name in (RESULTS_FILE, JUNIT_FILE, CONTEXT_FILE):
        (results_dir / name).unlink(missing_ok=True)
    write_json_atomic(results_dir / RESULTS_FILE, _record(context, 0, 0.0, skipped=reason))


class CommandResults:
    """results.json for a cell that runs commands rather than pytest (lint): one entry per
    command, named `command: ruff check .`. Written when the last command passed or when one
    failed; a cell interrupted in between writes none, which a report shows as interrupted."""

    def __init__(self, results_dir: Path, context: dict[str, Any]) -> None:
        self.path = results_dir / RESULTS_FILE
        self.context = context
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    @contextmanager
    def command(self, argv: Sequence[str]) -> Iterator[None]:
        name = "command: " + " ".join(argv)
        started = time.monotonic()
        try:
            yield
        except Exception as exc:  # nox's CommandFailed: the command ran and failed
            seconds = round(time.monotonic() - started, 3)
            message = first_line(str(exc)) or "failed"
            self.tests[name] = {"outcome": "failed", "seconds": seconds, "message": message}
            self.write(exit_status=1)
            raise
        self.tests[name] = {"outcome": "passed", "seconds": round(time.monotonic() - started, 3)}

    def write(self, exit_status: int = 0) -> None:
        wall = time.monotonic() - self.started
        write_json_atomic(self.path, _record(self.context, exit_status, wall, tests=self.tests))


def summarize(results_dir: Path) -> str:
    """One line for the end of a cell: outcomes, engine starts, wall time; a run that ended
    early says so first, and counts only the tests it made."""
    data = load(results_dir)
    if data is None:
        return f"no {RESULTS_FILE} in {results_dir}: this run recorded no results"
    if data.get("skipped"):
        return f"skipped: {data['skipped']} -> {results_dir / RESULTS_FILE}"
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(data["outcomes"].items())) or "no tests"
    starts = data["engine_starts"]
    start_seconds = sum(s["seconds"] for s in starts)
    compiled = [s["compile"]["entries_added"] for s in starts if s.get("compile")]
    files = (
        f", {sum(sum(c.values()) for c in compiled)} kernel file(s) compiled" if compiled else ""
    )
    line = (
        f"{outcomes}; {len(starts)} engine start(s) ({start_seconds:.0f} s{files}); "
        f"wall {data['wall_seconds']:.0f} s -> {results_dir / RESULTS_FILE}"
    )
    if not data.get("complete", True):
        ran = outcomes if data["outcomes"] else "no test ran"
        line = f"INCOMPLETE, {describe_ending(data.get('ended') or {})}: " + line.replace(
            outcomes, f"of the tests that ran: {ran}", 1
        )
    if data.get("left_behind"):
        line += f"; {len(data['left_behind'])} process(es) left behind were stopped"
    return line
