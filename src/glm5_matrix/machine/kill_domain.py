"""A cell's kill domain: every process the cell starts, stopped together whatever died first.

The runner creates one per cell run before its test command starts, and the test process joins
it before it runs anything of its own (the first step of its command line, before exec), so
everything it starts is inside. Stopping the domain kills every member at once, wherever the
members were re-parented and whichever process of the cell is already gone. Three mechanisms,
the first this machine allows:

- ``cgroup-v2``: a cgroup of its own on the cgroup2 hierarchy (the unified one, or the
  ``unified`` mount beside v1 controllers); stopping writes ``cgroup.kill``, which the kernel
  carries out on every member, forks in flight included (what systemd's KillMode=control-group
  and container runtimes rely on);
- ``cgroup-v1-freezer``: a cgroup on the v1 freezer hierarchy; stopping freezes it (no member
  can run, fork or exit), SIGKILLs every pid in ``cgroup.procs``, thaws it so the kills land, and
  waits for it to empty;
- ``subreaper``, where no cgroup is writable: the runner becomes a child subreaper (prctl
  PR_SET_CHILD_SUBREAPER) before the supervisor starts, so the supervisor's orphans come back to
  it rather than to init, and the test process gets PR_SET_PDEATHSIG tied to the supervisor;
  stopping kills the runner's live descendants.

A mechanism counts only after a probe: a short-lived process is moved into the new cgroup and
killed through it; a step that fails picks the next mechanism. GLM5_MATRIX_KILL_DOMAIN names
one (``cgroup-v2``, ``cgroup-v1-freezer``, ``subreaper``) or ``auto`` (the default).

Who stops the domain: the supervisor, after its teardown (glm5_matrix.machine.supervision); the runner,
when the supervisor's command line returns, however it ended (a SIGKILL of the supervisor
included); and a watchdog (``python -m glm5_matrix.machine.kill_domain watch``) that the runner starts in
a session of its own, which stops the domain once the runner and the supervisor are both gone.
Any one of the three is enough. Stopping is idempotent and removes the cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.machine import processes

VARIABLE = "GLM5_MATRIX_KILL_DOMAIN"
CGROUP_V2, CGROUP_V1, SUBREAPER = "cgroup-v2", "cgroup-v1-freezer", "subreaper"
MECHANISMS = (CGROUP_V2, CGROUP_V1, SUBREAPER)
PREFIX = "glm5-matrix-"
EMPTY_TIMEOUT_S = 10.0  # for the members of a killed domain to be gone
POLL_S = 0.05
WATCH_POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """prctl(2) with one argument (Linux); False elsewhere or when it fails."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, value, 0, 0, 0)) == 0


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False elsewhere."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def _alive(pid: int) -> bool:
    stat = processes.proc_stat(pid)
    return stat is not None and stat[0] != "Z"


@dataclass(frozen=True)
class Domain:
    """One cell run's kill domain: its mechanism and, for a cgroup, the cgroup's folder."""

    mechanism: str
    path: Path | None = None

    # --- naming it to another process ------------------------------------------------------------

    def argument(self) -> str:
        """MECHANISM or MECHANISM:PATH, what from_argument() reads back."""
        return self.mechanism if self.path is None else f"{self.mechanism}:{self.path}"

    @classmethod
    def from_argument(cls, value: str) -> Domain:
        mechanism, _, path = value.partition(":")
        if mechanism not in MECHANISMS or (mechanism == SUBREAPER) != (not path):
            raise UserError(
                f"kill domain {value!r}: not MECHANISM[:PATH] ({', '.join(MECHANISMS)})"
            )
        return cls(mechanism, Path(path) if path else None)

    def record(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "cgroup": None if self.path is None else str(self.path),
        }

    def describe(self) -> str:
        return self.mechanism + ("" if self.path is None else f" ({self.path})")

    # --- joining it ------------------------------------------------------------------------------

    @property
    def is_cgroup(self) -> bool:
        return self.path is not None

    def procs_file(self) -> Path:
        assert self.path is not None
        return self.path / "cgroup.procs"

    def join(self, pid: int = 0) -> None:
        """Move `pid` (0: this process) into the cgroup; nothing to do for the subreaper."""
        if self.path is not None:
            self.procs_file().write_text(f"{pid or os.getpid()}\n")

    # --- who is in it ----------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.path is None or self.path.is_dir()

    def members(self) -> list[int]:
        """Live (non-zombie) processes of the domain: the cgroup's, sub-cgroups included; for the
        subreaper, this process's live descendants."""
        if self.path is None:
            return processes.live_descendants()
        found: set[int] = set()
        for folder in self._folders():
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        return sorted(pid for pid in found if _alive(pid))

    def _folders(self) -> list[Path]:
        """The cgroup and its sub-cgroups, deepest first (the order rmdir needs)."""
        assert self.path is not None
        if not self.path.is_dir():
            return []
        found = [Path(root) for root, _, _ in os.walk(self.path)]
        return sorted(found, key=lambda p: len(p.parts), reverse=True)

    # --- stopping it -----------------------------------------------------------------------------

    def kill(self, timeout: float = EMPTY_TIMEOUT_S) -> list[int]:
        """SIGKILL every member at once, wait up to `timeout` for them to be gone, remove the
        cgroup. Returns the pids that were members. Safe to call again, and from any process;
        the members' parents reap them (a zombie is no longer a member)."""
        killed = self.members()
        if self.mechanism == CGROUP_V2 and self.path is not None and self.path.is_dir():
            with contextlib.suppress(OSError):
                (self.path / "cgroup.kill").write_text("1\n")
        elif self.mechanism == CGROUP_V1 and self.path is not None and self.path.is_dir():
            killed = self._freeze_and_kill()
        else:
            for pid in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._wait_empty(timeout)
        self.remove()
        return killed

    def _freeze_and_kill(self) -> list[int]:
        """v1: freeze (members can neither run, fork nor exit), SIGKILL each, thaw."""
        folders = self._folders()
        for folder in reversed(folders):  # parents first: the freeze goes down the tree
            with contextlib.suppress(OSError):
                (folder / "freezer.state").write_text("FROZEN\n")
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            states = []
            for folder in folders:
                with contextlib.suppress(OSError):
                    states.append((folder / "freezer.state").read_text().strip())
            if all(state == "FROZEN" for state in states):
                break
            time.sleep(POLL_S)
        killed = self.members()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for folder in reversed(folders):
            with contextlib.suppress(OSError):
                (folder / "freezer.state").write_text("THAWED\n")
        return killed

    def _wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if not self.members():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def remove(self) -> None:
        """Remove the cgroup (and any sub-cgroup) once it is empty (a zombie is no member)."""
        if self.path is None:
            return
        deadline = time.monotonic() + 2.0
        while self.path.is_dir():
            for folder in self._folders():
                with contextlib.suppress(OSError):
                    folder.rmdir()
            if not self.path.is_dir() or time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)


# --- choosing a mechanism ------------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, root, fstype, super options) of each cgroup mount, from mountinfo."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if " - " not in line:
                continue
            dash = fields.index("-")
            fstype, options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[4], fields[3], fstype, options))
    return found


def _own_cgroups() -> dict[str, str]:
    """{controllers (v1: "freezer", "cpu,cpuacct"; v2: ""): path} of this process."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            found[controllers] = path
    return found


def _under_mount(mount: str, root: str, path: str) -> Path:
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(mount) / relative.lstrip("/")


def parent_cgroup(mechanism: str) -> Path | None:
    """The folder under which this process's cgroup for `mechanism` lives, or None."""
    own = _own_cgroups()
    for mount, root, fstype, options in _mounts():
        if mechanism == CGROUP_V2 and fstype == "cgroup2" and "" in own:
            return _under_mount(mount, root, own[""])
        if mechanism == CGROUP_V1 and fstype == "cgroup" and "freezer" in options.split(","):
            for controllers, path in own.items():
                if "freezer" in controllers.split(","):
                    return _under_mount(mount, root, path)
    return None


def _make_cgroup(mechanism: str, name: str) -> Domain:
    """A new cgroup for `mechanism`, proved by killing a probe through it; raises OSError."""
    parent = parent_cgroup(mechanism)
    if parent is None or not parent.is_dir():
        raise OSError(f"no {mechanism} hierarchy mounted here")
    folder = parent / f"{PREFIX}{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    folder.mkdir()
    domain = Domain(mechanism, folder)
    try:
        needed = "cgroup.kill" if mechanism == CGROUP_V2 else "freezer.state"
        if not (folder / needed).exists():
            raise OSError(f"{folder} has no {needed}")
        _probe(domain)
    except OSError:
        domain.kill(timeout=2.0)  # a probe may still be inside: no cgroup is left behind
        raise
    return domain


def _probe(domain: Domain) -> None:
    """Move a sleeping process into the domain and kill it through the domain."""
    probe = subprocess.Popen(
        ["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True
    )
    try:
        domain.join(probe.pid)
        if domain.members() != [probe.pid]:
            raise OSError(f"a process moved into {domain.path} is not listed there")
        domain.kill(timeout=5.0)
        try:
            probe.wait(timeout=5.0)
        except subprocess.TimeoutExpired as exc:
            raise OSError(f"a process in {domain.path} outlived its kill") from exc
        if probe.returncode != -signal.SIGKILL:
            raise OSError(f"the probe in {domain.path} ended with {probe.returncode}")
        domain.path.mkdir()  # type: ignore[union-attr]  # kill() removed it: a fresh one
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


def create(
    name: str, environ: Mapping[str, str] | None = None, say: Callable[[str], Any] | None = None
) -> Domain:
    """The kill domain for one cell run named `name` (the cell's slug): the first mechanism of
    MECHANISMS that works here, or the one GLM5_MATRIX_KILL_DOMAIN names (one clear error when
    that one does not work)."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(VARIABLE, "auto") or "auto"
    if wanted not in (*MECHANISMS, "auto"):
        raise UserError(f"{VARIABLE}={wanted}: not one of auto, {', '.join(MECHANISMS)}")
    reasons = []
    for mechanism in (CGROUP_V2, CGROUP_V1) if wanted == "auto" else (wanted,):
        if mechanism == SUBREAPER:
            break
        try:
            return _make_cgroup(mechanism, _safe(name))
        except OSError as exc:
            if wanted != "auto":
                raise UserError(f"{VARIABLE}={wanted}: {exc}") from exc
            reasons.append(f"{mechanism}: {exc}")
    if not become_subreaper() and sys.platform.startswith("linux"):
        raise UserError("no kill domain: no writable cgroup and PR_SET_CHILD_SUBREAPER failed")
    if reasons and say is not None:
        say("kill domain: no writable cgroup (" + "; ".join(reasons) + "), subreaper instead")
    return Domain(SUBREAPER)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


# --- the watchdog ----------------------------------------------------------------------------------


def watch_command(domain: Domain, runner: int, python: str | Path, register: Path) -> list[str]:
    """The watchdog's command line: it stops `domain` once `runner` and every process that
    registered itself in the file `register` (the supervisor) are gone, or exits when the
    domain is removed by someone else."""
    return [
        str(python),
        "-m",
        "glm5_matrix.machine.kill_domain",
        "watch",
        domain.argument(),
        "--pid",
        f"{runner}:{processes.start_time(runner)}",
        "--register",
        str(register),
    ]


def start_watchdog(domain: Domain, register: Path) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of a cgroup domain (none for the subreaper: nothing outlives the
    processes it would watch) in a session of its own, so no process group signal reaches it."""
    if not domain.is_cgroup:
        return None
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        watch_command(domain, os.getpid(), sys.executable, register),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )


def register(file: Path, pid: int | None = None) -> None:
    """Add a process (default: this one) to those the watchdog waits for."""
    pid = pid or os.getpid()
    with file.open("a") as out:
        out.write(f"{pid}:{processes.start_time(pid)}\n")


def same_process_alive(entry: str) -> bool:
    """Whether PID:START_TIME names a live process (the same one: pids are reused)."""
    pid, _, started = entry.partition(":")
    return _alive(int(pid)) and str(processes.start_time(int(pid))) == started


def watch(domain: Domain, pids: Sequence[str], register_file: Path | None) -> int:
    """The watchdog's loop (see watch_command()). Returns 0."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only SIGKILL ends it before its work is done
    while domain.exists():
        watched = list(pids)
        if register_file is not None:
            with contextlib.suppress(OSError):
                watched += register_file.read_text().split()
        if not any(same_process_alive(entry) for entry in watched):
            domain.kill()
            break
        time.sleep(WATCH_POLL_S)
    if register_file is not None:
        with contextlib.suppress(OSError):
            register_file.unlink()
    return 0


@dataclass
class Held:
    """A kill domain held for one supervised command by the runner (see held())."""

    domain: Domain
    register: Path | None  # the watchdog's file, where the supervisor adds itself
    killed: list[int] = field(default_factory=list)  # members left when the command returned


@contextlib.contextmanager
def held(domain: Domain) -> Iterator[Held]:
    """In the runner: `domain` (new, from create()) and its watchdog for the command run inside
    the block; however the block ends, every member left is killed and the cgroup removed
    (`killed` says which pids were still there), and the watchdog, which then finds its cgroup
    gone, is reaped."""
    register_file = None
    watchdog = None
    if domain.is_cgroup:
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}watch-")
        os.close(fd)
        register_file = Path(path)
        watchdog = start_watchdog(domain, register_file)
    state = Held(domain, register_file)
    try:
        yield state
    finally:
        state.killed = domain.kill()
        if watchdog is not None:
            try:
                watchdog.wait(timeout=10 * WATCH_POLL_S)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait()
        if register_file is not None:
            with contextlib.suppress(OSError):
                register_file.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_matrix.machine.kill_domain")
    sub = parser.add_subparsers(dest="action", required=True)
    watcher = sub.add_parser("watch", help="stop DOMAIN once every watched process is gone")
    watcher.add_argument("domain")
    watcher.add_argument("--pid", action="append", default=[], help="PID:START_TIME to watch")
    watcher.add_argument("--register", type=Path, help="file of more PID:START_TIME lines")
    killer = sub.add_parser("kill", help="stop DOMAIN now")
    killer.add_argument("domain")
    args = parser.parse_args(argv)
    try:
        domain = Domain.from_argument(args.domain)
    except UserError as exc:
        parser.error(str(exc))
    if args.action == "kill":
        print(len(domain.kill()))
        return 0
    return watch(domain, args.pid, args.register)


if __name__ == "__main__":
    sys.exit(main())
