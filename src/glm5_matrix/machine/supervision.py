"""Whatever ends a cell, nothing it started outlives it.

The runner runs a cell's test command (pytest, or a lint tool) under a supervisor,
`python -m glm5_matrix.machine.supervision [options] -- COMMAND...`, started by the cell's own
interpreter (nothing but the standard library, and NVML where the cell has it). The supervisor:

- is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process whose parent dies (vLLM's
  engine core when pytest is killed, a server's engine core when its server is) is re-parented
  to the supervisor instead of to init, so everything the cell started stays its descendant;
- starts COMMAND in a session of its own, so that a terminal's Ctrl-C reaches the test process
  only through the supervisor, and with PR_SET_PDEATHSIG=SIGINT, so that pytest still runs the
  suites' teardown if the supervisor itself is killed outright;
- takes SIGINT, SIGTERM and SIGHUP as "stop the cell", and gets SIGTERM from the kernel when the
  runner's process dies, even by SIGKILL (PR_SET_PDEATHSIG); it leads a session of its own, so
  that a SIGKILL to the runner's process group does not take it along;
- stops the cell in two steps. First SIGINT to COMMAND's process group, as a Ctrl-C would: pytest
  runs the suites' own teardown (engines shut down through vLLM, servers by process group) for up
  to `grace` seconds. Then every descendant left gets SIGTERM, and `kill_after` seconds later
  SIGKILL. The second step also follows a COMMAND that ended by itself; either way the
  supervisor reaps every descendant before it exits;
- on a GPU cell, says in one line which process already holds memory on the cell's GPUs before
  COMMAND starts (and does not start it), and after the sweep checks that no process of the cell
  still holds any (glm5_matrix.machine.gpu_memory);
- starts COMMAND inside the cell's kill domain (glm5_matrix.machine.kill_domain, `--domain`: a cgroup
  of the run's own where the machine allows one), so that after the sweep whatever is still in it
  is frozen and killed at once; the runner kills the domain too once the supervisor's command
  line returns, so SIGKILL of the supervisor itself still takes the whole cell;
- records how the run ended (glm5_matrix.results.closing.record_ending): afterwards results.json says
  whether the run completed, and junit.xml is there, marked when the run ended early, and which
  kill domain mechanism held the cell (`kill_domain`).

Its exit status is COMMAND's; 128 + the signal that stopped the cell or killed COMMAND; or 1 when
COMMAND succeeded but processes had to be stopped after it, or a GPU stayed held.

In the runner's process (nox's), stop_on_signals() makes SIGTERM and SIGHUP, which would end nox
at once and leave the cell to itself, do what Ctrl-C does: the signal goes on to nox's children
(the supervisor), and nox waits NOX_TIMEOUTS for them to end before it reports the session
interrupted. guard_nox_process(), called as the noxfile loads, does the same for the main nox of
`nox -j` (whose workers lead sessions of their own): a signal goes on to every worker and the
main nox exits only when none of its descendants is left; a worker stops its cell when the main
nox dies. Servers are started through die_with_parent(), so a server goes (SIGTERM, a clean
shutdown of its engine) when the test process that started it goes.

Nothing here selects a process by name: by process id, by process group, or as a descendant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TypedDict

from glm5_matrix.errors import UserError
from glm5_matrix.machine import kill_domain, processes

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 60.0  # for the test command's own teardown after SIGINT
KILL_AFTER_S = 10.0  # from SIGTERM to SIGKILL of what is left
LINGER_S = 3.0  # for descendants of a command that ended by itself to exit on their own
GPU_RELEASE_S = 15.0  # for the driver to free the memory of the cell's stopped processes
POLL_S = 0.1


# nox's session.run waits this long for the supervisor after an interrupt (nox's default,
# 0.3 s, then SIGTERM and SIGKILL, would cut the teardown short).
class NoxTimeouts(TypedDict):
    """session.run's keywords, typed so that **NOX_TIMEOUTS checks against them."""

    interrupt_timeout: float
    terminate_timeout: float


NOX_TIMEOUTS: NoxTimeouts = {
    "interrupt_timeout": GRACE_S + 2 * KILL_AFTER_S + GPU_RELEASE_S + 10.0,
    "terminate_timeout": 10.0,
}
# The main nox's wait for every cell to stop (each worker's own wait, and a margin).
WAIT_ALL_S = NOX_TIMEOUTS["interrupt_timeout"] + NOX_TIMEOUTS["terminate_timeout"] + 15.0


def _prctl(option: int, value: int) -> bool:
    return kill_domain.prctl(option, value)


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False elsewhere."""
    return kill_domain.become_subreaper()


def die_with_parent_self(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when this process's parent (thread) dies (Linux)."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


# Runs in the child before the real program: joins the cell's cgroup when it has one (argv[3],
# the cgroup's cgroup.procs, or "-"), so that everything the program starts is inside; sets
# PR_SET_PDEATHSIG, checks that the parent did not die before that (the signal would never come),
# then becomes the program (same pid, so the process group the caller made is the program's).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "if sys.argv[3] != '-':\n"
    "    try:\n"
    "        open(sys.argv[3], 'w').write(str(os.getpid()))\n"
    "    except OSError as exc:\n"
    "        sys.exit(f'glm5-matrix: error: could not join the cell cgroup {sys.argv[3]}: {exc}')\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(128 + int(sys.argv[1]))\n"
    "os.execvp(sys.argv[4], sys.argv[4:])\n"
)


def die_with_parent(
    command: Sequence[str], sig: int = signal.SIGTERM, join: Path | None = None
) -> list[str]:
    """`command` such that it gets `sig` when this process dies: the command line of a small
    Python step that sets PR_SET_PDEATHSIG and then execs `command` in the same process (after
    moving itself into the cgroup whose cgroup.procs is `join`, when given). Start it from the
    thread that lives as long as the process (the main thread): the kernel sends the signal when
    the thread that started it ends. Unchanged on other systems."""
    if not sys.platform.startswith("linux"):
        return list(command)
    step = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(int(sig)), str(os.getpid())]
    return [*step, str(join) if join is not None else "-", *command]


def supervised(
    command: Sequence[str],
    python: str | Path,
    results_dir: Path | None = None,
    gpus: int = 0,
    domain: kill_domain.Domain | None = None,
    register: Path | None = None,
) -> list[str]:
    """The command line that runs `command` under the supervisor, with the cell's `python`
    (which must import glm5_matrix: the runner puts src/ on its PYTHONPATH); the test process
    joins `domain`, and the supervisor adds itself to the watchdog's `register` file."""
    line = [str(python), "-m", "glm5_matrix.machine.supervision", "--parent", str(os.getpid())]
    if results_dir is not None:
        line += ["--results", str(results_dir)]
    if gpus:
        line += ["--gpus", str(gpus)]
    if domain is not None:
        line += ["--domain", domain.argument()]
    if register is not None:
        line += ["--register", str(register)]
    if PARALLEL_WORKER_FLAG in sys.argv:  # a worker of `nox -j`: its parent is the main nox
        line += ["--main-nox", f"{os.getppid()}:{processes.start_time(os.getppid())}"]
    return [*line, "--", *command]


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """In the runner's process: the first SIGINT, SIGTERM or SIGHUP goes on to this process's
    children (the supervisor, or a build step) and raises KeyboardInterrupt, so that nox waits
    for them (NOX_TIMEOUTS) and then reports the session interrupted (exit 130) instead of dying
    mid-cell; later ones are ignored, so a second Ctrl-C cannot cut the teardown short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:
            _say(f"{signal.Signals(signum).name} again: the cell is being stopped")
            return
        received.append(signum)
        for child in processes.live_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


PARALLEL_WORKER_FLAG = "--parallel-worker"  # what nox -j adds to each worker nox's arguments


def guard_nox_process(argv: Sequence[str]) -> str:
    """Called as the noxfile loads, in every nox process. A worker of `nox -j` (it leads a session
    of its own, so no signal to the main nox's group reaches it) gets SIGTERM when the main nox
    dies, even by SIGKILL, and stops its cell as for a SIGTERM. Any other nox (the main one of
    `nox -j`, or one that runs its sessions itself) becomes a child subreaper, so what its
    workers started comes back to it if a worker dies, and takes SIGINT, SIGTERM and SIGHUP as
    "stop every cell": SIGTERM goes on to its children (the workers, or the supervisor), it
    waits until none of its descendants is left (killing what is left after WAIT_ALL_S), and
    only then does nox take it as Ctrl-C (exit status 130). Returns "worker" or "main"."""
    if PARALLEL_WORKER_FLAG in argv:
        die_with_parent_self(signal.SIGTERM)
        return "worker"
    if threading.current_thread() is not threading.main_thread():
        return "main"
    become_subreaper()
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:
            _say(f"{signal.Signals(signum).name} again: the cells are being stopped")
            return
        received.append(signum)
        name = signal.Signals(signum).name
        # nox's own children, the ones that already ended too: its Popen waits on them, and a
        # child reaped here instead would read to nox as one that exited 0 (a SIGTERM to the
        # whole group ends a child without a handler before this runs: `nox -s mutants` read
        # "successful" on the H100, 2026-12-06).
        started = set(processes.live_children()) | set(processes.zombie_children())
        if started:
            _say(f"{name}: stopping every cell, then exiting")
        for child in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)  # as nox -j does: a worker's stop signal
        wait_for_descendants(WAIT_ALL_S, keep=started)
        raise KeyboardInterrupt(name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return "main"


def wait_for_descendants(seconds: float, keep: Collection[int] = ()) -> list[int]:
    """Wait up to `seconds` for every descendant of this process to end, reaping the orphans
    that come to it (a subreaper) but not its children in `keep` (their Popen reaps them); then
    SIGKILL what is left and wait KILL_AFTER_S more. Returns the pids that had to be killed."""
    killed: list[int] = []
    for wait in (seconds, KILL_AFTER_S):
        deadline = time.monotonic() + wait
        while True:
            for pid in processes.zombie_children():
                if pid not in keep:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
            left = processes.live_descendants()
            if not left:
                return killed
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if not killed:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = left
    return killed


def _say(line: str) -> None:
    """One line on stderr; a terminal that is gone (SIGHUP) must not stop the teardown."""
    with contextlib.suppress(OSError):
        print(f"glm5-matrix: {line}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs one command and stops everything below it; see the module docstring."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        parent: int | None = None,
        results_dir: Path | None = None,
        gpus: int = 0,
        grace: float = GRACE_S,
        kill_after: float = KILL_AFTER_S,
        linger: float = LINGER_S,
        domain: kill_domain.Domain | None = None,
        register: Path | None = None,
        main_nox: str | None = None,
    ) -> None:
        self.command = list(command)
        self.domain = domain or kill_domain.Domain(kill_domain.SUBREAPER)
        self.register = register
        self.domain_killed: list[int] = []  # members still there after the sweep
        # PID:START_TIME of the main nox of `nox -j`: when it is gone (killed outright), nobody
        # waits for the cell any more and it is killed at once, without a teardown.
        self.main_nox = main_nox
        self.main_nox_died = False
        self.parent = parent
        self.results_dir = results_dir
        self.gpus = gpus
        self.grace = grace
        self.kill_after = kill_after
        self.linger = linger
        self.stop_signal: int | None = None
        self.runner_died = False
        self.seen: set[int] = set()  # every descendant seen: "a process of the cell"
        self.left_behind: list[str] = []
        self.needed_kill = False  # a process left behind outlived SIGTERM
        self.child: subprocess.Popen[bytes] | None = None
        self.child_status: int | None = None  # a wait status (os.waitpid)
        self.child_overran = False  # still running `grace` seconds after SIGINT
        self.started = time.monotonic()

    # --- signals -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            if self.parent is not None and os.getppid() != self.parent:
                self.runner_died = True  # PR_SET_PDEATHSIG: the runner's process is gone
            elif self._main_nox_gone():
                # A worker of `nox -j` passing on its PR_SET_PDEATHSIG: the main nox is gone and
                # nobody waits for the cell, which _wait_for_child kills at once, as when its
                # once-a-second look finds it first.
                self.main_nox_died = True

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        become_subreaper()
        die_with_parent_self(signal.SIGTERM)
        if os.getsid(0) != os.getpid():
            # A session of its own: a SIGKILL to the runner's process group (`kill -9 -PGID`,
            # nox -j's escalation 2 s after its SIGTERM) ends the runner, not the teardown; the
            # runner's death then stops the cell (PR_SET_PDEATHSIG).
            with contextlib.suppress(OSError):
                os.setsid()
        if self.parent is not None and os.getppid() != self.parent:
            self.stop_signal, self.runner_died = signal.SIGTERM, True
        if self.register is not None:
            kill_domain.register(self.register)  # the watchdog waits for this process too
        held = self._gpus_held_before()
        if held:
            _say(held)
            self._record(1, ending=("gpu-held", None, held))
            return 1
        if self.stop_signal is None:
            join = self.domain.procs_file() if self.domain.is_cgroup else None
            self.child = subprocess.Popen(
                die_with_parent(self.command, signal.SIGINT, join=join), start_new_session=True
            )
            self._wait_for_child()
        self._sweep()
        still_held = self._gpus_held_after()
        code = self._exit_status()
        # Processes a passing command left that stopped on SIGTERM are named and recorded (a
        # library's background helper, e.g. humming-kernels' nvrtc build at vLLM's import);
        # one that had to be killed, or GPU memory still held, fails the cell.
        if (self.needed_kill or still_held) and code == 0:
            code = 1
        if self.left_behind:
            _say(
                f"stopped {len(self.left_behind)} process(es) the test command left behind: "
                + "; ".join(self.left_behind)
            )
        if still_held:
            _say(still_held)
            self.left_behind.append(still_held)
        self._record(code)
        return code

    def _wait_for_child(self) -> None:
        assert self.child is not None
        asked_at: float | None = None
        last_look = 0.0
        while True:
            self._reap()
            if self.child_status is not None:
                return
            now = time.monotonic()
            if now - last_look >= 1.0:
                self.seen.update(processes.live_descendants())
                last_look = now
                if self._main_nox_gone():
                    self.main_nox_died = True
                    self.stop_signal = self.stop_signal or signal.SIGTERM
            # Found by this look or by the stop signal's (_on_signal): nobody waits for the cell.
            if self.main_nox_died:
                self._kill_now()
                return
            if self.stop_signal is not None:
                if asked_at is None:
                    asked_at = now
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.child.pid, signal.SIGINT)
                elif now - asked_at >= self.grace:
                    self.child_overran = True
                    return  # the sweep stops it
            time.sleep(POLL_S)

    def _main_nox_gone(self) -> bool:
        """Whether this cell runs under a `nox -j` whose main nox is dead by now."""
        return bool(self.main_nox) and not kill_domain.same_process_alive(self.main_nox or "")

    def _kill_now(self) -> None:
        """Everything of the cell, SIGKILLed at once: the domain, then any descendant left."""
        if self.domain.is_cgroup:
            self.domain.kill()
        for pid in processes.live_descendants():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        """Collect every child that ended (COMMAND and the orphans re-parented to us)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.child_status = status
                self.child.returncode = os.waitstatus_to_exitcode(status)

    def _sweep(self) -> None:
        """Stop every descendant left: after a command that ended by itself, a short wait for
        them to exit on their own; then SIGTERM (also to any that appear meanwhile), then
        SIGKILL; reap them all. What a command that ended by itself left is `left_behind`."""
        by_itself = self.stop_signal is None and self.child_status is not None
        deadline = time.monotonic() + (self.linger if by_itself else 0.0)
        while True:
            self._reap()
            left = self._left()
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        described: set[int] = set()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            sent: set[int] = set()
            deadline = time.monotonic() + self.kill_after
            while left:
                for pid in set(left) - sent:
                    if by_itself and pid not in described:
                        self.left_behind.append(f"pid {pid}: {processes.cmdline(pid)}")
                        described.add(pid)
                    sent.add(pid)
                    if sig == signal.SIGKILL and by_itself:
                        self.needed_kill = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
                self._reap()
                left = self._left()
        self._reap()
        if self.domain.is_cgroup:
            # Whatever is still in the cell's cgroup, frozen and killed at once.
            for pid in self.domain.kill():
                self.domain_killed.append(pid)
                self.left_behind.append(f"pid {pid} killed with the cell's cgroup")
                self.needed_kill = True
            self._reap()
        for pid in processes.live_descendants():  # in the kernel's hands (state D)
            self.left_behind.append(f"pid {pid} survived SIGKILL: {processes.cmdline(pid)}")
            self.needed_kill = True

    def _left(self) -> list[int]:
        """The cell's live processes: this process's descendants and the cgroup's members."""
        left = set(processes.live_descendants())
        if self.domain.is_cgroup:
            left.update(self.domain.members())
        self.seen.update(left)
        return sorted(left)

    # --- GPUs ----------------------------------------------------------------------------------

    def _gpus(self) -> list[str]:
        from glm5_matrix.machine import gpu_memory

        return gpu_memory.cell_gpus(os.environ, self.gpus)

    def _gpus_held_before(self) -> str | None:
        if not self.gpus:
            return None
        from glm5_matrix.machine import gpu_memory

        found = gpu_memory.holders(self._gpus())
        if not found:
            return None
        return (
            "a GPU of this cell is already held by another process, so the cell does not start: "
            + "; ".join(f"{h.describe()} ({processes.cmdline(h.pid)})" for h in found)
        )

    def _gpus_held_after(self) -> str | None:
        if not self.gpus:
            return None
        from glm5_matrix.machine import gpu_memory

        deadline = time.monotonic() + GPU_RELEASE_S
        while True:
            found = gpu_memory.holders(self._gpus())
            ours = [h for h in found or [] if h.pid in self.seen]
            if not ours:
                return None
            if time.monotonic() >= deadline:
                return (
                    "GPU memory still held by processes of this cell after they were stopped: "
                    + ("; ".join(h.describe() for h in ours))
                )
            time.sleep(1.0)

    # --- how it ended ----------------------------------------------------------------------------

    def _exit_status(self) -> int:
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        assert self.child_status is not None
        if os.WIFSIGNALED(self.child_status):
            return 128 + os.WTERMSIG(self.child_status)
        return os.waitstatus_to_exitcode(self.child_status)

    def _ending(self) -> tuple[str, str | None, str] | None:
        """(how, signal, detail) where the test command could not say it; None where it did."""
        from glm5_matrix.results import schema

        pid = self.child.pid if self.child is not None else None
        if self.main_nox_died:
            main = self.main_nox.partition(":")[0] if self.main_nox else "?"
            return (
                "process-died",
                None,
                f"the main nox (pid {main}) of `nox -j` died; the cell was killed at once",
            )
        if self.runner_died:
            return (
                "process-died",
                None,
                f"the runner (pid {self.parent}) died; the cell was stopped",
            )
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            if self.child is None:
                return ("signal", name, f"{name} before the test command started")
            if self.child_overran:
                how = f"did not end within {self.grace:.0f} s of SIGINT and was killed"
            else:
                how = "was interrupted (SIGINT) and ran its teardown"
            return ("signal", name, f"{name} to the cell: the test process (pid {pid}) {how}")
        assert self.child_status is not None
        if os.WIFSIGNALED(self.child_status):
            name = signal.Signals(os.WTERMSIG(self.child_status)).name
            return ("killed", name, f"the test process (pid {pid}) was killed by {name}")
        recorded = schema.load(self.results_dir) if self.results_dir else None
        if recorded is None or (recorded.get("ended") or {}).get("how") in (None, "unfinished"):
            code = os.waitstatus_to_exitcode(self.child_status)
            return (
                "process-died",
                None,
                f"the test process (pid {pid}) exited with status {code} before its session ended",
            )
        return None

    def _record(self, code: int, ending: tuple[str, str | None, str] | None = None) -> None:
        if self.results_dir is None:
            return
        from glm5_matrix.results import closing, schema

        found = ending or self._ending()
        ended = None if found is None else schema.ending(found[0], found[2], signal=found[1])
        closing.record_ending(
            self.results_dir,
            ended,
            code,
            time.monotonic() - self.started,
            self.left_behind,
            junit=self.results_dir / schema.JUNIT_FILE,
            kill_domain={
                **self.domain.record(),
                "stopped_by": "supervisor",
                "killed": len(self.domain_killed),
            },
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_matrix.machine.supervision",
        description="Run COMMAND; stop and reap everything it starts, whatever ends it.",
    )
    parser.add_argument("--parent", type=int, help="the runner's pid: stop when it is gone")
    parser.add_argument("--results", type=Path, help="the cell's results folder")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs the cell uses")
    parser.add_argument("--grace", type=float, default=GRACE_S)
    parser.add_argument("--kill-after", type=float, default=KILL_AFTER_S)
    parser.add_argument("--linger", type=float, default=LINGER_S)
    parser.add_argument("--domain", help="the cell's kill domain (MECHANISM[:CGROUP])")
    parser.add_argument("--register", type=Path, help="the kill domain watchdog's file")
    parser.add_argument("--main-nox", help="PID:START_TIME of the main nox of `nox -j`")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    try:
        domain = kill_domain.Domain.from_argument(args.domain) if args.domain else None
    except UserError as exc:
        parser.error(str(exc))
    return Supervisor(
        command,
        parent=args.parent,
        results_dir=args.results,
        gpus=args.gpus,
        grace=args.grace,
        kill_after=args.kill_after,
        linger=args.linger,
        domain=domain,
        register=args.register,
        main_nox=args.main_nox,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
