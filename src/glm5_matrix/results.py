"""Per-cell results: a pytest plugin that writes results.json (outcome and wall time per test,
engine starts and what each compiled, the figures the suites measured), and the summary the
runner prints at the end of a cell.

Engines and servers call record_engine_start() when one comes up; suites call record_figure()
for each number they measure and judge (a block size against the planner's, a delta against
its noise floor). The plugin files each under the test (or fixture setup) that was running.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"


@dataclass
class EngineStart:
    label: str
    seconds: float
    test: str | None
    # What the start compiled (glm5_matrix.kernel_cache.compile_record): "seconds", the
    # torch.compile time vLLM reports (null when unknown; the kernel JITs of FlashInfer, Triton,
    # TileLang and DeepGEMM are not timed by their libraries), and "entries_added", the files
    # each library's cache gained or rewrote during the start. Left out when not measured.
    compile: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["compile"] is None:
            del data["compile"]
        return data


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


def record_engine_start(label: str, seconds: float, compile: dict[str, Any] | None = None) -> None:
    """Record that an engine or server `label` came up after `seconds` of start-up, and what
    it compiled meanwhile when that was measured."""
    _STATE.engine_starts.append(EngineStart(label, round(seconds, 2), _STATE.current_test, compile))


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
        elif report.failed:
            entry["outcome"] = "error" if report.when != "call" else "failed"
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
                "engine_starts": [s.to_json() for s in _STATE.engine_starts],
                "figures": [asdict(f) for f in _STATE.figures],
            },
        )


def summarize(results_dir: Path) -> str:
    """One line for the end of a cell: outcomes, engine starts, wall time."""
    path = results_dir / RESULTS_FILE
    if not path.is_file():
        return f"no {RESULTS_FILE} in {results_dir}"
    data = json.loads(path.read_text())
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(data["outcomes"].items())) or "no tests"
    starts = data["engine_starts"]
    start_seconds = sum(s["seconds"] for s in starts)
    compiled = [s["compile"]["entries_added"] for s in starts if s.get("compile")]
    files = (
        f", {sum(sum(c.values()) for c in compiled)} kernel file(s) compiled" if compiled else ""
    )
    return (
        f"{outcomes}; {len(starts)} engine start(s) ({start_seconds:.0f} s{files}); "
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
