"""The recorder inside the cell: a pytest plugin (`-p glm5_matrix.results.recorder`, loaded by
the runner) that writes results.json (outcome and wall time per test, engine starts and what each
compiled, the figures the suites measured, the first line of each failure, whether the run
completed and how it ended).

Engines and servers call record_engine_start() when one comes up; suites call record_figure()
for each number they measure and judge (a block size against the planner's, a delta against
its noise floor). The plugin files each under the test (or fixture setup) that was running.

results.json is rewritten as each test starts and ends and at each engine start, marked `"complete": false`
with `"ended": {"how": "unfinished", "test": ...}` until pytest ends its session: a run killed
outright leaves the tests it made and the one it was in. The cell's supervisor
(glm5_matrix.machine.supervision) then calls record_ending() (glm5_matrix.results.closing) with
what only it knows (the signal that stopped the cell, the test process killed or dead), and keeps
junit.xml, marked incomplete, or writes one from results.json when pytest could not.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.files import write_json_atomic
from glm5_matrix.results.schema import (
    OUTPUTS_FILE,
    RESULTS_FILE,
    count_outcomes,
    ending,
    first_line,
    installed_versions,
    mark_interrupted,
)


@dataclass
class EngineStart:
    label: str
    seconds: float
    test: str | None
    # What the start compiled (glm5_matrix.kernels.kernel_cache.compile_record): "seconds", the
    # torch.compile time vLLM reports (null when unknown; the kernel JITs of FlashInfer, Triton,
    # TileLang and DeepGEMM are not timed by their libraries), "entries_added", the kernel files
    # each library's cache gained or rewrote during the start that count against it (its own
    # processes wrote them, glm5_matrix.kernels.writers), "not_counted", those per library that
    # another process wrote (or whose writer was not seen while another process wrote the
    # cache), "written", each file written (at most kernel_cache.FILES_LISTED, the counted ones
    # first; "written_total" says how many) with "library",
    # "path", "writer" ("cell", "other", "unseen"), "pids", "command" and "counted",
    # "files_before", the kernel files the cache held when it began (0: a cold start), and
    # "guard", whether the kernel guard was on (a start that compiled under it was refused).
    # Left out when not measured.
    compile: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["compile"] is None:
            del data["compile"]
        return data


@dataclass
class Figure:
    """A number a suite measured, with what it was judged against (when it was)."""

    name: str  # dotted, e.g. "repeat.noise_max", "layout.block_size"
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
    # Scored outputs by name (record_outputs), written to outputs.json beside results.json.
    outputs: dict[str, Any] = field(default_factory=dict)
    # Called after each record, so that results.json has it at once (set by the plugin).
    on_record: Any = None


_STATE = _State()


def record_engine_start(label: str, seconds: float, compile: dict[str, Any] | None = None) -> None:
    """Record that an engine or server `label` came up after `seconds` of start-up, and what
    it compiled meanwhile when that was measured."""
    _STATE.engine_starts.append(EngineStart(label, round(seconds, 2), _STATE.current_test, compile))
    if _STATE.on_record is not None:
        _STATE.on_record()


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
    if _STATE.on_record is not None:
        _STATE.on_record()


def figures() -> list[Figure]:
    return list(_STATE.figures)


def scored_json(output: Any) -> dict[str, Any]:
    """A greedy output with its scores (glm5_matrix.verdicts.compare.Scored) as JSON: candidate
    token ids become strings, as JSON keys must be."""
    return {
        "token_ids": [int(t) for t in output.token_ids],
        "logprobs": [float(v) for v in output.logprobs],
        "top_logprobs": [
            {str(t): float(v) for t, v in step.items()} for step in output.top_logprobs
        ],
        "cached_tokens": getattr(output, "cached_tokens", None),
    }


def record_outputs(name: str, outputs: list[Any]) -> None:
    """Keep the greedy outputs a comparison judged (the reference's repeats, a run, a control)
    under `name`, in the cell's outputs.json: the raw data behind its figures, so that a run on a
    lent GPU can be judged again, by another rule, without the GPU. A name recorded twice in one
    session keeps its last outputs."""
    _STATE.outputs[name] = {
        "test": _STATE.current_test,
        "outputs": [scored_json(o) for o in outputs],
    }
    if _STATE.on_record is not None:
        _STATE.on_record()


class ResultsPlugin:
    """Registered by tests/suites/conftest.py when the cell has a results folder."""

    def __init__(self, results_dir: Path, context: dict[str, Any]) -> None:
        self.path = results_dir / RESULTS_FILE
        self.outputs_path = results_dir / OUTPUTS_FILE
        # This session's outputs alone: a file from an earlier run is never read back as ours.
        self.outputs_path.unlink(missing_ok=True)
        self.context = context
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        # Read once: results.json is rewritten at every test start and end.
        self.versions = installed_versions()
        self.running: str | None = None  # the test between its logstart and logfinish
        self.interruption: dict[str, Any] | None = None
        _STATE.on_record = self.write_partial

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        _STATE.current_test = self.running = nodeid
        self.tests.setdefault(nodeid, {"outcome": "running", "seconds": 0.0, "phases": {}})
        self.write_partial()

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.running = None

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.tests.setdefault(
            report.nodeid, {"outcome": "running", "seconds": 0.0, "phases": {}}
        )
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry["phases"][report.when] = report.outcome
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xpassed" if report.passed else "xfailed"
            if report.wasxfail:
                entry["reason"] = str(report.wasxfail)
            if not report.passed:  # what it raised: a known failure may fail for another reason
                entry["message"] = first_line(_failure_message(report))
        elif report.failed:
            entry["outcome"] = "error" if report.when != "call" else "failed"
            entry.setdefault("message", first_line(_failure_message(report)))
        elif report.skipped and entry["outcome"] in ("running", "passed"):
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        elif report.when == "call" and entry["outcome"] == "running":
            entry["outcome"] = "passed"
        if report.when == "teardown":
            self.write_partial()

    def pytest_keyboard_interrupt(self, excinfo: Any) -> None:
        """A KeyboardInterrupt (SIGINT) or pytest.exit(): the session ends without its tests."""
        if isinstance(excinfo.value, KeyboardInterrupt):
            self.interruption = ending(
                "signal",
                "the test process was interrupted (SIGINT) and ran its teardown",
                signal="SIGINT",
                test=self.running,
            )
        else:
            self.interruption = ending("exit", f"pytest.exit(): {excinfo.value}", test=self.running)

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        if self.interruption is not None:
            self.write(int(exitstatus), False, self.interruption)
        else:
            detail = f"pytest ended its session with exit status {int(exitstatus)}"
            self.write(int(exitstatus), True, ending("finished", detail))
        _STATE.on_record = None

    def write_partial(self) -> None:
        unfinished = ending(
            "unfinished", "the run had not ended when this was written", test=self.running
        )
        self.write(None, False, unfinished)

    def write(self, exit_status: int | None, complete: bool, ended: dict[str, Any]) -> None:
        tests = {nodeid: dict(entry) for nodeid, entry in self.tests.items()}
        partial = ended["how"] == "unfinished"
        if not partial:
            mark_interrupted(tests)
        write_json_atomic(
            self.path,
            {
                "cell": self.context,
                "pid": os.getpid(),
                "exit_status": exit_status,
                "complete": complete,
                "ended": ended,
                "wall_seconds": round(time.monotonic() - self.started, 2),
                "outcomes": count_outcomes(tests),
                "tests": tests,
                "engine_starts": [s.to_json() for s in _STATE.engine_starts],
                "figures": [asdict(f) for f in _STATE.figures],
                "versions": self.versions,
            },
            compact=partial,  # rewritten for every test: kept cheap until the last write
        )
        if _STATE.outputs:
            write_json_atomic(
                self.outputs_path,
                {"cell": self.context.get("id"), "complete": complete, "outputs": _STATE.outputs},
                compact=True,
            )


def _failure_message(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    return str(getattr(report, "longreprtext", "") or report.longrepr or "")


def pytest_configure(config: Any) -> None:
    """Loaded with `-p glm5_matrix.results.recorder` by the runner: record results into the cell's folder."""
    from glm5_matrix.matrix.context import CONTEXT_VARIABLE, current

    if not os.environ.get(CONTEXT_VARIABLE):
        return
    ctx = current()
    if ctx.results_dir:
        plugin = ResultsPlugin(Path(ctx.results_dir), json.loads(ctx.to_json()))
        config.pluginmanager.register(plugin, "glm5-matrix-results")
