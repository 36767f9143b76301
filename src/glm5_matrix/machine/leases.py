"""GPU leases: a cell holds its GPUs for as long as it runs, so that cells run side by side
(`nox -t gpu -j N`, or several nox processes on one machine) never share a GPU.

One lock file per device index in one folder shared by every nox process on the machine
($GLM5_MATRIX_LEASE_DIR, default /tmp/glm5-matrix-leases): a GPU is leased while a process
holds an exclusive flock on its file. The OS drops the lock when the holder exits, however it
exits, so a cell that dies leaves no stale lease. The holder writes who it is (cell, pid, since)
into the file, which is how a waiting cell names what it waits for.

A cell asks for cell.gpus devices of its pool: the GPUs preflight found (bounded by the user's
CUDA_VISIBLE_DEVICES; the GLM5_MATRIX_GPUS override numbers its GPUs 0, 1, ...) that meet the
cell's compute capability. It takes them all at once or none: each try locks every free GPU of
the pool, keeps the best `gpus` of them (NVLink, then PCIe, then NUMA neighbours where
`nvidia-smi topo -m` tells; else the lowest indices) and lets the others go, so two cells never
hold part of what each needs. Tries are serialized by a short lock on the folder, so a try sees
every other cell's lease with its holder written. It waits up to $GLM5_MATRIX_LEASE_TIMEOUT
seconds (default 6 hours), saying what it waits for when it starts waiting, when that changes,
and every few minutes. The cell's processes then see exactly its devices:
CUDA_VISIBLE_DEVICES lists them, and CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA number GPUs as
nvidia-smi (and these locks) do.

The lock is held by the cell's nox process (its children do not inherit the file: subprocesses
close it), and the runner lets go once the last process of the cell has ended. A nox process
killed alone (SIGKILL to its pid only) drops the lease while children it left may still run;
nox -j stops a session's whole process group, and Ctrl-C reaches the foreground group.

A lease that does not come within the bound is a LeaseTimeout: the runner skips the cell, or
fails it under GLM5_MATRIX_STRICT. No reservation: a cell that needs many GPUs waits until enough
are free at the same time.

CPU cores the same way: a cell whose engines are bound to named cores (matrix.toml `cores`, the
cores its VLLM_CPU_OMP_THREADS_BIND settings name) leases exactly those, one `core<N>.lock` each,
after its GPUs when it has both (one order for every cell: no two wait on each other). Two such
cells under `nox -t cpu -j 2` on a 2-core box take turns instead of putting six engine processes
on two cores (pd-nixl-cpu-tp2-tp1's prefiller beside pd-nixl-cpu-tp1-tp2 was not healthy after
600 s); a cell that binds nothing leases nothing and runs beside them.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import itertools
import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.machine import hardware
from glm5_matrix.matrix.matrix import Cell, Variant

LEASE_DIR_VARIABLE = "GLM5_MATRIX_LEASE_DIR"
LEASE_TIMEOUT_VARIABLE = "GLM5_MATRIX_LEASE_TIMEOUT"
DEFAULT_LEASE_DIR = Path("/tmp/glm5-matrix-leases")
DEFAULT_TIMEOUT_S = 6 * 3600.0
RECORD_FILE = "lease.json"  # in the cell's results folder
_TRY_LOCK = ".try.lock"
_REPEAT_S = 300.0  # how often an unchanged wait is said again
_MAX_CHOICES = 20_000  # device sets scored before falling back to the lowest indices


@dataclass(frozen=True)
class Kind:
    """What is leased: GPUs (gpu<N>.lock) or CPU cores (core<N>.lock)."""

    key: str  # the lock file's prefix and the key of a holder seen in a record
    noun: str


GPU = Kind("gpu", "GPU")
CORE = Kind("core", "CPU core")


class LeaseTimeout(Exception):
    """No lease within the bound; `record` is what the runner writes to lease.json."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU, as written into its lock file."""

    cell: str
    pid: int
    since: str  # local time, "2026-12-01 12:03:04"
    user: str = ""
    host: str = ""

    def describe(self) -> str:
        text = f"{self.cell} pid {self.pid} since {self.since}"
        others = [
            part
            for part, mine in ((self.user, _user()), (self.host, socket.gethostname()))
            if part and part != mine
        ]
        return f"{text} ({', '.join(others)})" if others else text


_UNNAMED = "an unnamed holder"  # a lock file the holder could not write (another user's file)


@dataclass
class Lease:
    """Devices held for one cell; a context manager that releases them. A cell that needs no
    GPU gets an empty lease, which changes nothing."""

    cell: str
    gpus: tuple[int, ...] = ()
    pool: tuple[int, ...] = ()
    cores: tuple[int, ...] = ()  # CPU cores its engines are bound to, held like GPUs
    waited_seconds: float = 0.0
    waited_for: list[dict[str, Any]] = field(default_factory=list)  # holders seen, per device
    lock_dir: str | None = None
    _fds: list[int] = field(default_factory=list, repr=False)

    def environment(self) -> dict[str, str]:
        """What every process of the cell gets: exactly its devices."""
        if not self.gpus:
            return {}
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in self.gpus),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }

    def describe(self) -> str:
        if not self.gpus and not self.cores:
            return "no GPU needed"
        held = []
        if self.gpus:
            held.append(f"GPU {_indices(self.gpus)} (pool {_indices(self.pool)})")
        if self.cores:
            held.append(f"CPU cores {_indices(self.cores)}")
        text = ", ".join(held)
        if self.waited_for:
            cells = sorted({str(holder["cell"]) for holder in self.waited_for})
            text += f", after waiting {self.waited_seconds:.0f} s for {', '.join(cells)}"
        return text

    def record(self) -> dict[str, Any]:
        return {
            "cell": self.cell,
            "gpus": list(self.gpus),
            "pool": list(self.pool),
            "cores": list(self.cores),
            "waited_seconds": round(self.waited_seconds, 1),
            "waited_for": self.waited_for,
            "lock_dir": self.lock_dir,
            "timed_out": False,
        }

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the holder's name goes with the lease
            os.close(fd)  # drops the flock

    def joined(self, other: Lease) -> Lease:
        """This lease and `other` (the same cell's cores after its GPUs) as one."""
        joined = Lease(
            self.cell,
            gpus=self.gpus,
            pool=self.pool,
            cores=self.cores or other.cores,
            waited_seconds=self.waited_seconds + other.waited_seconds,
            waited_for=[*self.waited_for, *other.waited_for],
            lock_dir=self.lock_dir or other.lock_dir,
            _fds=[*self._fds, *other._fds],
        )
        self._fds, other._fds = [], []
        return joined

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- what a cell may lease ---------------------------------------------------------------------


def pool(cell: Cell, found: hardware.Hardware) -> tuple[int, ...]:
    """Indices of the GPUs the cell may use: those found that meet its compute capability."""
    minimum = cell.min_compute_capability or (0, 0)
    return tuple(
        index
        for index, capability in zip(found.indices, found.capabilities, strict=True)
        if capability >= minimum
    )


def choose(free: Sequence[int], count: int, topology: hardware.Topology | None) -> tuple[int, ...]:
    """The `count` devices of `free` to lease: for several, the set whose weakest link is the
    closest (NVLink over PCIe), then the one spread over the fewest NUMA nodes, then the closest
    links in sum; ties, one GPU, and an unknown topology take the lowest indices."""
    ordered = sorted(free)
    if count > len(ordered):
        raise ValueError(f"{count} GPUs asked of {len(ordered)}")
    if count == 1 or topology is None or math.comb(len(ordered), count) > _MAX_CHOICES:
        return tuple(ordered[:count])

    def score(devices: tuple[int, ...]) -> tuple[int, int, int]:
        ranks = [topology.rank(a, b) for a, b in itertools.combinations(devices, 2)]
        nodes = {topology.numa.get(gpu, f"unknown-{gpu}") for gpu in devices}
        return min(ranks), -len(nodes), sum(ranks)

    best = tuple(ordered[:count])
    best_score = score(best)
    for devices in itertools.combinations(ordered, count):  # lexicographic: lowest first
        candidate = score(devices)
        if candidate > best_score:
            best, best_score = devices, candidate
    return best


# --- settings ----------------------------------------------------------------------------------


def lock_dir(environ: dict[str, str]) -> Path:
    return Path(environ.get(LEASE_DIR_VARIABLE) or DEFAULT_LEASE_DIR)


def timeout(environ: dict[str, str]) -> float:
    text = environ.get(LEASE_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise UserError(f"{LEASE_TIMEOUT_VARIABLE}={text!r}: expected seconds >= 0 (or inf)")
    return value


# --- taking a lease ----------------------------------------------------------------------------


def lease_cell(
    variant: Variant,
    found: hardware.Hardware,
    environ: dict[str, str],
    say: Callable[[str], None] = print,
) -> Lease:
    """The lease of a cell that passed preflight: its GPUs, then the CPU cores its engines are
    bound to; empty for a cell that needs neither."""
    cell = variant.cell
    lease = Lease(variant.id)
    if cell.gpus:
        topology = hardware.read_topology(environ) if cell.gpus > 1 else None
        lease = acquire(
            variant.id,
            cell.gpus,
            pool(cell, found),
            lock_dir=lock_dir(environ),
            timeout_s=timeout(environ),
            topology=topology,
            say=say,
        )
    if cell.cores:
        try:
            cores = acquire(
                variant.id,
                len(cell.cores),
                cell.cores,
                lock_dir=lock_dir(environ),
                timeout_s=timeout(environ),
                say=say,
                kind=CORE,
            )
        except BaseException:
            lease.release()
            raise
        lease = lease.joined(cores)
    return lease


def acquire(
    cell: str,
    count: int,
    devices: Sequence[int],
    *,
    lock_dir: Path,
    timeout_s: float,
    topology: hardware.Topology | None = None,
    say: Callable[[str], None] = print,
    poll_s: float = 1.0,
    kind: Kind | None = None,
) -> Lease:
    """Lease `count` GPUs of `devices` for `cell` (or, with kind=CORE, CPU cores), waiting up
    to `timeout_s` seconds."""
    kind = kind or GPU
    devices = tuple(sorted(set(devices)))
    if count > len(devices):
        raise UserError(f"{cell} needs {count} {kind.noun}(s); the pool has {_indices(devices)}")
    try:
        return _acquire(cell, count, devices, lock_dir, timeout_s, topology, say, poll_s, kind)
    except OSError as exc:  # the folder cannot be made or its files opened
        raise UserError(
            f"{kind.noun} lease folder {lock_dir}: {exc.strerror or exc} (set {LEASE_DIR_VARIABLE})"
        ) from None


def _acquire(
    cell: str,
    count: int,
    devices: tuple[int, ...],
    lock_dir: Path,
    timeout_s: float,
    topology: hardware.Topology | None,
    say: Callable[[str], None],
    poll_s: float,
    kind: Kind,
) -> Lease:
    _prepare(lock_dir)
    started = time.monotonic()
    seen: dict[int, dict[str, Any]] = {}  # GPU -> the last holder seen on it
    said, said_at = "", 0.0
    while True:
        with _trying(lock_dir):
            taken, busy = _try_all(lock_dir, devices, kind)
            if len(taken) >= count:
                chosen = choose(list(taken), count, topology)
                for gpu in set(taken) - set(chosen):
                    os.close(taken.pop(gpu))
                _write_holder(taken, cell)
                break
            for fd in taken.values():
                os.close(fd)
        for gpu, holder in busy.items():
            seen[gpu] = {kind.key: gpu, **(asdict(holder) if holder else {"cell": _UNNAMED})}
        waited = time.monotonic() - started
        line = waiting_line(count, devices, busy, kind)
        if waited >= timeout_s:
            message = (
                f"no {kind.noun} lease after {waited:.0f} s ({LEASE_TIMEOUT_VARIABLE}): {line}"
            )
            record = {
                "cell": cell,
                "gpus": [],
                "pool": list(devices) if kind is GPU else [],
                "cores": [],
                "waited_seconds": round(waited, 1),
                "waited_for": list(seen.values()),
                "lock_dir": str(lock_dir),
                "timed_out": True,
            }
            raise LeaseTimeout(message, record)
        now = time.monotonic()
        if line != said:
            bound = "without a bound" if math.isinf(timeout_s) else f"up to {_span(timeout_s)}"
            say(f"{line} (waiting {bound}, {LEASE_TIMEOUT_VARIABLE})")
            said, said_at = line, now
        elif now - said_at >= _REPEAT_S:
            say(f"still {line} ({waited:.0f} s so far)")
            said_at = now
        time.sleep(max(0.0, min(poll_s, timeout_s - waited)))
    return Lease(
        cell,
        gpus=tuple(chosen) if kind is GPU else (),
        pool=devices if kind is GPU else (),
        cores=tuple(chosen) if kind is CORE else (),
        waited_seconds=time.monotonic() - started if seen else 0.0,
        waited_for=list(seen.values()),
        lock_dir=str(lock_dir),
        _fds=[taken[gpu] for gpu in chosen],
    )


def waiting_line(
    count: int, devices: Sequence[int], busy: dict[int, Holder | None], kind: Kind | None = None
) -> str:
    """What a waiting cell says, e.g.
    `waiting for GPU 0: held by e2e-tp1(deep_gemm) pid 1234 since 2026-12-01 12:03:04`."""
    noun = (kind or GPU).noun
    by_holder: dict[str, list[int]] = {}
    for gpu in sorted(busy):
        holder = busy[gpu]
        by_holder.setdefault(holder.describe() if holder else _UNNAMED, []).append(gpu)
    if len(devices) == 1 and count == 1:
        return f"waiting for {noun} {devices[0]}: held by {next(iter(by_holder))}"
    held = "; ".join(
        f"{noun}{'s' if len(gpus) > 1 else ''} {_indices(gpus)} held by {holder}"
        for holder, gpus in by_holder.items()
    )
    free = len(devices) - len(busy)
    return f"waiting for {count} of {noun}s {_indices(devices)} ({free} free): {held}"


def holder_of(lock_dir: Path, gpu: int) -> Holder | None:
    """Who holds `gpu` now, or None when nobody does."""
    _prepare(lock_dir)
    with _trying(lock_dir):
        taken, busy = _try_all(lock_dir, (gpu,))
        for fd in taken.values():
            os.close(fd)
    return busy.get(gpu)


# --- the lock files ----------------------------------------------------------------------------


def _prepare(folder: Path) -> None:
    """The folder, writable by every user of the machine (sticky, like /tmp)."""
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o1777)


def _open(path: Path) -> tuple[int, bool]:
    """(fd, writable) of a lock file, made on first use; another user's file that is not
    writable is still lockable read-only."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_RDWR, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), False
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # whatever the umask: other users' cells lock the same file
    return fd, True


@contextlib.contextmanager
def _trying(folder: Path) -> Iterator[None]:
    """One try at a time on the machine (held for microseconds)."""
    fd, _ = _open(folder / _TRY_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_all(
    folder: Path, devices: Sequence[int], kind: Kind | None = None
) -> tuple[dict[int, int], dict[int, Holder | None]]:
    """Lock every free device: ({gpu: fd} taken, {gpu: holder} busy)."""
    taken: dict[int, int] = {}
    busy: dict[int, Holder | None] = {}
    for gpu in devices:
        fd, _ = _open(folder / f"{(kind or GPU).key}{gpu}.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy[gpu] = _read_holder(fd)
            os.close(fd)
            continue
        taken[gpu] = fd
    return taken, busy


def _write_holder(taken: dict[int, int], cell: str) -> None:
    holder = Holder(
        cell=cell,
        pid=os.getpid(),
        since=time.strftime("%Y-%m-%d %H:%M:%S"),
        user=_user(),
        host=socket.gethostname(),
    )
    data = (json.dumps(asdict(holder), sort_keys=True) + "\n").encode()
    for fd in taken.values():
        with contextlib.suppress(OSError):  # a read-only file: the lease holds, unnamed
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> Holder | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return Holder(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def _indices(devices: Sequence[int]) -> str:
    return ",".join(str(gpu) for gpu in devices)
