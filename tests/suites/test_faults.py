"""Faults against real cells (the `faults` cell): each case ends a real `nox -s e2e-cpu` or
`nox -s pd-nixl-cpu` run early, the way a user, a CI system or the kernel would, and then checks
what is left the moment nox has exited: no process of the run, no port it listened on, a failing
exit status, and a results.json (and summary line) that says how the run ended and claims no
test the run did not make.

| fault | e2e-cpu | pd-nixl-cpu |
|---|---|---|
| Ctrl-C: SIGINT to nox's process group | engine starting | engine cores starting |
| SIGTERM to nox (`timeout`, CI agents) | engine up | engine cores starting |
| SIGHUP to nox (a closed terminal) | engine starting | - (SIGTERM's path) |
| SIGKILL of the test process (OOM killer) | engine starting | engine cores starting |
| a server killed (SIGKILL) while it starts | - (no server) | its engine core started |
| vLLM's engine core killed mid-generate | greedy test generating | servers just healthy |
| SIGKILL of the supervisor | engine core there 5 s | engine cores there 5 s |
| SIGTERM to the main nox of `nox -j 2` | beside `unit`, engine starting | - |
| SIGKILL of the main nox of `nox -j 2` (judged 10 s after) | beside `unit`, engine starting | - |

Each fault is injected as soon as what it needs is there, read from the run's own output: a
probe plugin (`-p glm5_faults_probe`, written below) records the test process's pid and when
each test starts and enters its call phase; the servers' logs in the cell's results folder say
when they are healthy; the process tree says which processes the servers and engine cores are
(the test process's children leading their own process group are the servers, started in the
order P, D, other; a child with children of its own is an engine core, whose child is its
worker). Nothing is found by name.

This test process makes itself a child subreaper, so that every process a run starts stays its
descendant even when its parent dies: the survivors are its live descendants once nox has exited,
and every process seen during the run (pid and start time) that is still alive. The runs share
the cells' environments (.nox/, or GLM5_MATRIX_VENVS) with the e2e-cpu and pd-nixl-cpu cells
and write their results under this cell's results folder, runs/CASE/.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from glm5_matrix.files import repo_root
from glm5_matrix.machine import kill_domain, processes, supervision
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.results import recorder

POLL_S = 0.25
START_TIMEOUT_S = 420.0  # from nox's start to the fault (an environment may have to be built)
EXIT_TIMEOUT_S = 150.0  # from the fault to nox's exit
AFTER_EXIT_S = 10.0  # how long survivors are watched after nox exited, for the report
HEALTHY = b"Application startup complete"
# What results.json says of a test process that ended by itself after the supervisor's SIGINT.
TEARDOWN = "was interrupted (SIGINT) and ran its teardown"

PROBE = textwrap.dedent(
    '''
    """Loaded into a faulted run's pytest: when it started (its pid) and each test's progress."""
    import json, os, time

    def _note(**event):
        event["t"] = time.time()
        with open(os.environ["GLM5_FAULTS_PROBE"], "a") as out:
            out.write(json.dumps(event) + "\\n")

    def pytest_configure(config):
        context = os.environ.get("GLM5_MATRIX_CONTEXT", "")
        _note(event="start", pid=os.getpid(), cell=os.path.basename(os.path.dirname(context)))

    def pytest_runtest_logstart(nodeid, location):
        _note(event="test", nodeid=nodeid)

    def pytest_runtest_call(item):
        _note(event="call", nodeid=item.nodeid)
    '''
)


class Run:
    """One `nox -s CELL` run of this test (or `nox -j N -s CELL OTHER...`), watched from start to
    exit."""

    def __init__(self, cell: str, folder: Path, others: tuple[str, ...] = (), jobs: int = 0):
        self.cell = cell
        self.others = others
        self.jobs = jobs
        self.folder = folder
        self.results = folder / "results" / cell
        self.first_seen: dict[str, float] = {}  # when a condition first held (for_5s)
        self.log_path = folder / "nox.log"
        self.probe_path = folder / "probe.jsonl"
        self.seen: dict[int, tuple[int | None, str]] = {}  # pid: (start time, command line)
        self.ports: set[int] = set()
        self.nox: subprocess.Popen[bytes] | None = None
        self.injected_at: float | None = None
        self.exit_seconds: float | None = None

    # --- running -------------------------------------------------------------------------------

    def start(self) -> None:
        self.folder.mkdir(parents=True)
        probe_dir = self.folder / "probe"
        probe_dir.mkdir()
        (probe_dir / "glm5_faults_probe.py").write_text(PROBE)
        # A stale run's results where this run writes its own: they must not be read back.
        for cell in (self.cell, *self.others):
            folder = self.folder / "results" / cell
            folder.mkdir(parents=True)
            stale = {"planted": True, "outcomes": {"passed": 6}, "tests": {}, "engine_starts": []}
            stale["wall_seconds"] = 1.0
            (folder / "results.json").write_text(json.dumps(stale))
            (folder / "junit.xml").write_text('<testsuites planted="true"/>')
        env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "GLM5_MATRIX_CONTEXT",
                "GLM5_MATRIX_CELL",
                "GLM5_MATRIX_ROOT",
                "PYTHONPATH",
                "VIRTUAL_ENV",
            )
        }
        env.update(
            GLM5_MATRIX_RESULTS=str(self.folder / "results"),
            GLM5_FAULTS_PROBE=str(self.probe_path),
            PYTHONPATH=str(probe_dir),
            # The faults cell leases the cores its runs' engines bind (matrix.toml `cores`);
            # the runs lease among themselves, not from it (they would wait for it: 6 h).
            GLM5_MATRIX_LEASE_DIR=str(self.folder / "leases"),
        )
        root = repo_root()
        command = [sys.executable, "-m", "nox", "-f", str(root / "noxfile.py")]
        if self.jobs:
            command += ["-j", str(self.jobs)]
        command += ["-s", self.cell, *self.others, "--", "-p", "glm5_faults_probe"]
        with self.log_path.open("wb") as log:
            self.nox = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=root,
                start_new_session=True,  # its own process group, as a terminal gives a job
            )

    def poll(self) -> None:
        """Reap the orphans that came to this process, note every process of the run."""
        _reap_orphans(except_pid=self.nox.pid if self.nox else None)
        live = processes.live_descendants()
        for pid in live:
            if pid not in self.seen:
                self.seen[pid] = (processes.start_time(pid), processes.cmdline(pid))
        self.ports |= processes.listening_ports(live)

    def wait_for(self, what: str, condition: Callable[[Run], Any]) -> Any:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.poll()
            found = condition(self)
            if found:
                return found
            assert self.nox is not None
            if self.nox.poll() is not None:
                pytest.fail(f"nox exited ({self.nox.returncode}) before {what}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                pytest.fail(f"no {what} after {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(POLL_S)

    def inject(self, action: Callable[[], None]) -> None:
        self.poll()
        action()
        self.injected_at = time.monotonic()

    def wait_exit(self) -> int | None:
        """nox's exit status; None when it was still running EXIT_TIMEOUT_S after the fault,
        and then it is killed (SIGKILL), as a CI system would at its timeout."""
        assert self.nox is not None and self.injected_at is not None
        deadline = self.injected_at + EXIT_TIMEOUT_S
        while self.nox.poll() is None:
            self.poll()
            if time.monotonic() >= deadline:
                self.nox.kill()
                self.nox.wait()
                return None
            time.sleep(POLL_S)
        self.exit_seconds = time.monotonic() - self.injected_at
        return self.nox.returncode

    # --- what the run left ---------------------------------------------------------------------

    def survivors(self) -> dict[int, str]:
        """Processes of the run alive now: descendants of this process (a subreaper: orphans
        come back to it), and any process seen during the run, same pid and start time."""
        _reap_orphans(except_pid=None)
        alive = set(processes.live_descendants())
        for pid, (started, _) in self.seen.items():
            stat = processes.proc_stat(pid)
            if stat is not None and stat[0] != "Z" and processes.start_time(pid) == started:
                alive.add(pid)
        return {pid: self.seen.get(pid, (None, processes.cmdline(pid)))[1] for pid in sorted(alive)}

    def kill_survivors(self) -> None:
        """SIGKILL (by pid) whatever a failed case left, so that the next case starts clean."""
        for _ in range(50):
            left = self.survivors()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def ports_listening(self) -> list[int]:
        listening = {port for port, _ in processes.listening_sockets()}
        return sorted(self.ports & listening)

    def results_json(self, cell: str | None = None) -> dict[str, Any]:
        path = self.folder / "results" / (cell or self.cell) / "results.json"
        assert path.is_file(), f"no results.json in {self.results}:\n{self.log_tail()}"
        return dict(json.loads(path.read_text()))

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    # --- the run's own record and process tree ---------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        if not self.probe_path.is_file():
            return []
        return [json.loads(line) for line in self.probe_path.read_text().splitlines() if line]

    def test_process(self, cell: str | None = None) -> int | None:
        cell = cell or self.cell
        starts = [
            e["pid"]
            for e in self.events()
            if e["event"] == "start" and e.get("cell", cell) in (cell, "")
        ]
        return starts[-1] if starts else None

    def last_test(self) -> str | None:
        tests = [e["nodeid"] for e in self.events() if e["event"] == "test"]
        return tests[-1] if tests else None

    def servers(self) -> list[int]:
        """The test process's children that lead their own process group, oldest first."""
        pytest_pid = self.test_process()
        if pytest_pid is None:
            return []
        found = []
        for pid in processes.live_children(pytest_pid):
            stat = processes.proc_stat(pid)
            if stat is not None and stat[2] == pid:
                found.append(pid)
        return sorted(found, key=lambda pid: processes.start_time(pid) or 0)

    def server_logs_healthy(self) -> bool:
        logs = sorted(self.results.glob("server-*.log"))
        return len(logs) == 3 and all(HEALTHY in log.read_bytes() for log in logs)


def engine_core_of(parent: int | None) -> int | None:
    """The engine core among `parent`'s children: the one with a child (its worker)."""
    if parent is None:
        return None
    for child in processes.live_children(parent):
        if processes.live_children(child):
            return child
    return None


def _reap_orphans(except_pid: int | None) -> None:
    """Collect the exit status of this process's children that ended (orphans of a faulted
    run come here, this process being a subreaper), except `except_pid` (Popen waits on nox)."""
    for pid in _zombie_children():
        if pid != except_pid:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = processes.proc_stat(int(name))
            if stat is not None and stat[1] == me and stat[0] == "Z":
                found.append(int(name))
    return found


# --- the faults --------------------------------------------------------------------------------


def engine_starting(run: Run) -> bool:
    """The e2e engine's processes are there: its engine core, and the core's worker."""
    return engine_core_of(run.test_process()) is not None


def engine_up(run: Run) -> bool:
    """The first test's call phase began: the module's engine fixture is set up."""
    return any(e["event"] == "call" for e in run.events()) and run.test_process() is not None


def generating(run: Run) -> bool:
    """The greedy test's call phase began: it generates from its first line."""
    return any(e["event"] == "call" and "test_greedy" in e["nodeid"] for e in run.events())


def for_5s(condition: Callable[[Run], Any]) -> Callable[[Run], bool]:
    """`condition`, once it has held for 5 s (from the first poll that saw it)."""

    def waited(run: Run) -> bool:
        if condition(run):
            run.first_seen.setdefault(condition.__name__, time.monotonic())
        seen = run.first_seen.get(condition.__name__)
        return seen is not None and time.monotonic() - seen >= 5.0

    waited.__name__ = f"{condition.__name__}_for_5s"
    return waited


def both_cells_running(run: Run) -> bool:
    """Under -j: the e2e engine core is there, and the other cell's test process started."""
    return engine_starting(run) and all(run.test_process(c) is not None for c in run.others)


def engines_starting(run: Run) -> bool:
    """The three servers are there and each has started its engine core."""
    found = run.servers()
    return len(found) == 3 and all(processes.live_children(pid) for pid in found)


def prefill_engine_starting(run: Run) -> bool:
    found = run.servers()
    return bool(found) and bool(processes.live_children(found[0]))


def servers_healthy(run: Run) -> bool:
    return run.server_logs_healthy() and len(run.servers()) == 3


def _signal_group(sig: int) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        assert run.nox is not None
        os.killpg(run.nox.pid, sig)  # nox leads its group (start_new_session)

    return inject


def _signal_nox(sig: int) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        assert run.nox is not None
        os.kill(run.nox.pid, sig)

    return inject


def _kill_test_process(run: Run) -> None:
    pid = run.test_process()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def _kill_supervisor(run: Run) -> None:
    """SIGKILL of the cell's supervisor: the test process's parent."""
    pid = run.test_process()
    assert pid is not None
    stat = processes.proc_stat(pid)
    assert stat is not None and stat[1] not in (0, 1, os.getpid()), stat
    os.kill(stat[1], signal.SIGKILL)


def _kill_prefill_server(run: Run) -> None:
    os.kill(run.servers()[0], signal.SIGKILL)


def _kill_engine_core(run: Run) -> None:
    """The e2e engine (the test process's engine core) or the prefill server's engine core."""
    parent = run.servers()[0] if run.cell.startswith("pd") else run.test_process()
    core = engine_core_of(parent)
    assert core is not None, f"no engine core under pid {parent}"
    os.kill(core, signal.SIGKILL)


@dataclass(frozen=True)
class Fault:
    cell: str
    name: str
    when: Callable[[Run], Any]
    inject: Callable[[Run], None]
    # what results.json must say: ("signal", "SIGTERM"), ("killed", "SIGKILL"), ("process-died",
    # None) for a dead supervisor, or ("finished", None) where the test process itself saw the
    # failure and ended its session
    ending: tuple[str, str | None]
    # Under `nox -j 2`, with these cells beside `cell` (each must end as `ending` says).
    others: tuple[str, ...] = ()
    # Survivors are judged AFTER_EXIT_S after nox exited rather than at once: a SIGKILLed nox
    # cannot wait for anything, what it ran must be gone by then.
    settle: bool = False

    @property
    def id(self) -> str:
        return f"{'+'.join((self.cell, *self.others))}:{self.name}"


# Which faults against which cell, and when. SIGHUP takes the path SIGTERM takes (in nox's
# process and in the supervisor), so it runs against one cell. A fault while the engines start
# leaves the same processes to stop as one once they are ready and costs far less (three servers
# take minutes to be healthy on two cores), so only e2e's SIGTERM and the engine-core kills, which
# need a generate, wait for ready engines; the pd one also shows the servers' ports freed.
E2E, PD = "e2e-cpu", "pd-nixl-cpu"
SIGINT, SIGTERM, SIGHUP, SIGKILL = signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL
DIED: tuple[str, str | None] = ("process-died", None)
J2 = ("unit",)  # the cell beside e2e-cpu under -j 2: its own tests run for minutes
FAULTS = [
    Fault(E2E, "ctrl-c", engine_starting, _signal_group(SIGINT), ("signal", "SIGINT")),
    Fault(E2E, "sigterm", engine_up, _signal_nox(SIGTERM), ("signal", "SIGTERM")),
    Fault(E2E, "sighup", engine_starting, _signal_nox(SIGHUP), ("signal", "SIGHUP")),
    Fault(E2E, "sigkill-pytest", engine_starting, _kill_test_process, ("killed", "SIGKILL")),
    Fault(E2E, "kill-engine-core", generating, _kill_engine_core, ("finished", None)),
    Fault(PD, "ctrl-c", engines_starting, _signal_group(SIGINT), ("signal", "SIGINT")),
    Fault(PD, "sigterm", engines_starting, _signal_nox(SIGTERM), ("signal", "SIGTERM")),
    Fault(PD, "sigkill-pytest", engines_starting, _kill_test_process, ("killed", "SIGKILL")),
    Fault(PD, "kill-server", prefill_engine_starting, _kill_prefill_server, ("finished", None)),
    Fault(PD, "kill-engine-core", servers_healthy, _kill_engine_core, ("finished", None)),
    # The supervisor itself killed outright (an OOM kill, a `kill -9` of the wrong pid): the
    # runner kills the cell's kill domain and records the death.
    Fault(E2E, "sigkill-supervisor", for_5s(engine_starting), _kill_supervisor, DIED),
    Fault(PD, "sigkill-supervisor", for_5s(engines_starting), _kill_supervisor, DIED),
    # Two cells under `nox -j 2`: each worker nox leads a session of its own.
    Fault(E2E, "j2-sigterm", both_cells_running, _signal_nox(SIGTERM), ("signal", "SIGTERM"), J2),
    Fault(E2E, "j2-sigkill", both_cells_running, _signal_nox(SIGKILL), DIED, J2, True),
]


@pytest.fixture(scope="module")
def subreaper() -> Iterator[None]:
    if not supervision.become_subreaper():
        pytest.skip("needs Linux (PR_SET_CHILD_SUBREAPER)")
    yield


@pytest.fixture(scope="module")
def runs_dir(cell: CellContext, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = Path(cell.results_dir) if cell.results_dir else tmp_path_factory.mktemp("faults")
    return base / "runs"


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_fault_leaves_nothing_behind(fault: Fault, subreaper: None, runs_dir: Path) -> None:
    run = Run(
        fault.cell, runs_dir / fault.id.replace(":", "-"), fault.others, 2 * bool(fault.others)
    )
    run.start()
    try:
        run.wait_for(f"the moment for {fault.name}", fault.when)
        tests_before = len([e for e in run.events() if e["event"] == "test"])
        run.inject(lambda: fault.inject(run))
        code = run.wait_exit()
        survivors = run.survivors()
        ports = run.ports_listening()
        later = survivors
        if survivors or fault.settle:  # how many are still there a while later (the measure)
            time.sleep(AFTER_EXIT_S)
            later = run.survivors()
        # What is judged: at exit, or (a SIGKILLed nox) AFTER_EXIT_S later.
        judged, ports = (later, run.ports_listening()) if fault.settle else (survivors, ports)
        recorder.record_figure(
            f"faults.{fault.id}.survivors",
            len(survivors),
            limit=None if fault.settle else 0,
            relation=None if fault.settle else "==",
        )
        recorder.record_figure(
            f"faults.{fault.id}.survivors_after_10s", len(later), limit=0, relation="=="
        )
        recorder.record_figure(f"faults.{fault.id}.ports_seen", sorted(run.ports))
        recorder.record_figure(f"faults.{fault.id}.ports_listening", ports, limit=[], relation="==")
        recorder.record_figure(f"faults.{fault.id}.nox_exit_status", code)
        recorder.record_figure(
            f"faults.{fault.id}.exit_seconds",
            None if run.exit_seconds is None else round(run.exit_seconds, 1),
            unit="s",
        )
        print(
            f"\n{fault.id}: nox exit {code} {run.exit_seconds} s after the fault; "
            f"{len(survivors)} survivor(s) at exit, {len(later)} {AFTER_EXIT_S:.0f} s later; "
            f"ports seen {sorted(run.ports)}, still listening {ports}"
        )
        assert code is not None, f"nox still running {EXIT_TIMEOUT_S:.0f} s after the fault"
        assert not judged, f"processes of the run alive after nox exited: {judged}"
        assert not ports, f"ports of the run still listening: {ports}"
        if fault.when is servers_healthy:  # the port check saw the servers' ports
            assert len(run.ports) >= 3, f"ports seen: {sorted(run.ports)}"
        assert code != 0, f"nox exited 0 after {fault.name}:\n{run.log_tail()}"
        # The test running when the fault hit: the last one started before it, or one started
        # while the fault took effect.
        started = [e["nodeid"] for e in run.events() if e["event"] == "test"]
        if fault.others:
            for cell in (fault.cell, *fault.others):
                _check_cell_record(fault, run, cell)
        else:
            _check_results(fault, run, started[max(tests_before - 1, 0) :])
    finally:
        run.kill_survivors()


def _check_cell_record(fault: Fault, run: Run, cell: str) -> None:
    """One cell of a `nox -j` run: its own record says it was stopped, claims no test it did not
    start, and its junit.xml is marked incomplete (the main nox prints no summary it was
    killed before)."""
    data = run.results_json(cell)
    assert not data.get("planted"), f"{cell}: results.json is the earlier run's"
    assert data.get("exit_status") not in (0, None), (cell, data.get("exit_status"))
    assert data.get("complete") is False, (cell, data.get("ended"))
    how, sig = fault.ending
    ended = data.get("ended") or {}
    assert ended.get("how") == how and ended.get("signal") == sig, (cell, ended)
    if how == "signal":
        assert TEARDOWN in ended.get("detail", ""), (cell, ended)
    started = {e["nodeid"] for e in run.events() if e["event"] == "test"}
    assert set(data["tests"]) <= started, (cell, set(data["tests"]) - started)
    assert data["kill_domain"]["mechanism"] in kill_domain.MECHANISMS, data.get("kill_domain")
    junit = (run.folder / "results" / cell / "junit.xml").read_text()
    assert 'name="glm5-matrix.complete" value="false"' in junit, (cell, junit[:400])


def _check_results(fault: Fault, run: Run, at_fault: list[str]) -> None:
    data = run.results_json()
    assert not data.get("planted"), "results.json is the earlier run's, read back as this one's"
    assert data.get("exit_status") not in (0, None), data.get("exit_status")
    started = {e["nodeid"] for e in run.events() if e["event"] == "test"}
    claimed = set(data["tests"])
    assert claimed <= started, (
        f"results.json claims tests this run did not start: {claimed - started}"
    )
    how, sig = fault.ending
    ended = data.get("ended") or {}
    summary = [line for line in run.log_tail(400).splitlines() if f"nox > {fault.cell}: " in line]
    assert summary, f"no summary line:\n{run.log_tail()}"
    outcomes = data["outcomes"]
    if how == "finished":
        # The test process saw the failure itself: the tests that needed the dead process fail.
        assert data.get("complete", True), ended
        failed = [
            t for t in at_fault if data["tests"].get(t, {}).get("outcome") in ("failed", "error")
        ]
        assert failed, f"none of {at_fault} failed: {outcomes}"
        if fault.name == "kill-server":
            assert "passed" not in outcomes, outcomes
            assert "server-prefill.log" in run.log_path.read_text(errors="replace")
        return
    assert data.get("complete") is False, f"a run ended by {fault.name} says it completed: {ended}"
    assert ended.get("how") == how and ended.get("signal") == sig, ended
    if how == "signal":
        # The test process ended by itself, within the supervisor's grace, after its teardown;
        # not by the SIGTERM that follows (vLLM swallows a Ctrl-C during an engine start:
        # glm5_matrix.engines.startup_interrupts).
        assert TEARDOWN in ended.get("detail", ""), ended
    domain = data.get("kill_domain") or {}
    assert domain.get("mechanism") in kill_domain.MECHANISMS, domain
    if fault.inject is _kill_supervisor:
        # The runner stopped the domain and says the supervisor ended without a record.
        assert domain.get("stopped_by") == "runner", domain
        assert "supervisor ended without recording" in ended.get("detail", ""), ended
    if ended.get("test") is not None:
        assert ended["test"] in at_fault, (ended, at_fault)
        assert data["tests"][ended["test"]]["outcome"] not in ("passed", "running"), data["tests"]
    assert "INCOMPLETE" in summary[-1], summary[-1]
    junit = (run.results / "junit.xml").read_text()
    assert 'planted="true"' not in junit
    assert 'name="glm5-matrix.complete" value="false"' in junit, junit[:400]
