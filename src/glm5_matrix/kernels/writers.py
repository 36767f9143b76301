"""Who wrote a kernel file: the cell's own processes, another process, or nobody seen.

The kernel cache is shared by every cell and run on a machine, so a file that appeared during an
engine start was not necessarily compiled by it: another process (a warm step, another cell of
`nox -t gpu -j N`, a FlashInfer build by hand) may have written it into the same folders. The
guard fails a cell only for what the cell's own processes wrote.

Linux records no writer for a file, and the exact tools (fanotify with pids, audit, eBPF) need
privileges a runner lacks; inotify gives names but no pid. So a `Watch` runs beside the window
(an engine start, a test phase) and looks, every POLL_S (on a busy machine up to MAX_WAIT_S), at
every process it may read in /proc:

- its open files under a watched library folder that are open for writing (/proc/PID/fd and
  fdinfo's flags): a compiler writing an object in place (ninja's nvcc, cc1plus), or a library
  writing a file; not a library's bookkeeping (kernel_cache.Library.bookkeeping): FlashInfer's
  JIT log is open for appending in every process that logs, and its folder holds every module's
  (seen on the H200: an engine core named the writer of a stranger's 80 module files);
- the output its command line names (`-o PATH`, `--output-file PATH`): nvcc, ptxas, gcc and ld
  hold it from start to end of a compile that takes seconds to minutes (FlashInfer, DeepGEMM,
  TileLang, torch extensions);
- and, through inotify on Triton's folder and each of its <hash>/ folders (a new one watched
  as soon as its event is read, in a thread of its own), Triton's temporary folders, which
  carry the writer's pid in their name (`tmp.pid_<PID>_<uuid>`, triton/runtime/cache.py): a
  Triton kernel is written in microseconds, too fast to be seen open. Each folder is scanned
  right after its watch is added, so a put made in it before (the watch started during a put,
  or a listener not scheduled between the folder's event and the add) is found; a put that
  ended before the scan leaves no pid. One put seen in a <hash>/ names the writer of all of it.

Short in-process writes with no pid in a name stay unseen: DeepGEMM's NVRTC mode, Inductor's
and vLLM's own files, the CUDA driver's cache, and a Triton kernel whose every put ended before
its <hash>/ folder was scanned.

A sighting in a kernel's own folder (Triton's <hash>/, FlashInfer's cached_ops/<module>/,
DeepGEMM's cache/<kernel>/, TileLang's kernels/<key>/, else the file's folder) names the writer of
the files there; one in a temporary folder (the libraries' tmp/, .staging, tmp.pid_*) names a
writer of that library only. Each process is the cell's when it is this process, one of its
descendants, or a member of the cell's kill-domain cgroup (glm5_matrix.machine.kill_domain),
decided when it is first seen (an orphan stays in the cell's cgroup); a writer gone before it
was first seen is nobody's known.

Each look also notes every process outside the cell (its ancestors aside: nox, a shell, which
wait for it) that could have written the cache unseen: one that has a file of it open (for
reading too), mapped (/proc/PID/maps, read at its first look and every MAPS_EVERY looks: a
loaded module stays mapped for the process's life), or its working folder in it, or that was
started pointed at it (a library's variable, or GLM5_MATRIX_KERNEL_CACHE_DIR, in
/proc/PID/environ, read once: how every process of another cell, or a build by hand in the
same cache, is started). A process lives for seconds where its writes take microseconds, so it
is seen where its writes are not.

Each file written in the window is then (attribute()):

- "cell": a process of the cell was seen writing its kernel's folder, or, with nothing seen
  there, the only writers seen in its library's temporary files were the cell's and no process
  outside the cell was seen in the cache (else "unseen"): counted;
- "other": only processes outside the cell were seen writing there: never counted;
- "unseen": no writer known. Counted only when no process outside the cell was seen in the
  cache at all in the window, writing or able to (then the cell's processes are the only ones
  that could have written it); else not counted, said so with those processes. Another process
  in the cache never fails the cell: its unseen write is beside it, seen as able to write. The
  limit: one in none of the ways, too quick to be seen writing, is taken for nobody and its
  write counts (test_control_a_stranger_in_no_way_in_the_cache_is_not_seen). The price: an
  unseen write of the cell's own (a short in-process one) is not counted while another process
  is in the cache, e.g. under `nox -j N` (the cell's compiles through a compiler, ninja's or
  FlashInfer's, DeepGEMM's nvcc, TileLang's, and Triton's puts, are seen and still count).

A use of a kernel by the cell (its module mapped) is not taken as the cell's write: a cell that
waited on FlashInfer's lock while another process built the module then loads it; and Triton
loads its cubins from memory (cuModuleLoadData, triton/backends/nvidia/driver.c), never mapped,
so a use would not find its compiles anyway. Processes of other users cannot be read; they
cannot write this user's cache (root aside).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from glm5_matrix.kernels import kernel_cache
from glm5_matrix.machine import kill_domain, processes

POLL_S = 0.1
MAX_WAIT_S = 0.4  # the longest wait between looks on a busy machine
MAPS_EVERY = 10  # a process outside the cell has its mappings read every this many looks
COMMAND_SHOWN = 120  # characters of a writer's command line kept
CELL, OTHER, UNSEEN = "cell", "other", "unseen"
# Triton's temporary folder for one put (triton/runtime/cache.py: f"tmp.pid_{pid}_{rnd_id}").
_TRITON_TEMP = re.compile(r"^tmp\.pid_(\d+)_")
_OUTPUT_FLAGS = ("-o", "--output-file", "-output-file")
# inotify(7)'s flags.
_IN_CREATE, _IN_MOVED_TO, _IN_ISDIR, _IN_NONBLOCK = 0x100, 0x80, 0x40000000, 0o4000
_ACCMODE, _O_WRONLY, _O_RDWR = 0o3, 0o1, 0o2


@dataclass(frozen=True)
class Sighting:
    """A process seen writing into a library's cache (`writes`), or, for a process outside the
    cell, seen able to (using the cache or started pointed at it): in one kernel's folder
    (`entry`), or in the library's temporary files or anywhere in it (`entry` None)."""

    pid: int
    member: bool | None  # one of the cell's processes; None: gone before it was ever seen
    command: str
    library: str
    entry: str | None
    how: str  # "open for writing", "output of its command line", "triton temp folder", ...
    writes: bool = True


@dataclass(frozen=True)
class FileWrite:
    """One kernel file written during a window, and who wrote it (see the module's doc)."""

    library: str
    path: str
    writer: str  # CELL, OTHER or UNSEEN
    counted: bool
    pids: tuple[int, ...] = ()  # the writers seen (none for UNSEEN)
    command: str | None = None
    why: str = ""  # for UNSEEN: why it counts or not, naming the processes outside the cell

    def record(self) -> dict[str, object]:
        return {
            "library": self.library,
            "path": self.path,
            "writer": self.writer,
            "counted": self.counted,
            "pids": list(self.pids),
            "command": self.command,
            "why": self.why,
        }


# --- which folder a file's kernel is ---------------------------------------------------------


def entry(library: str, relative: str) -> str | None:
    """The folder of the kernel `relative` belongs to in `library`'s cache, or None for a file
    in the library's temporary files (kernel_cache.TRANSIENT) or at its top level. Triton keeps
    its temporary folders inside the kernel's <hash>/, so they name their kernel."""
    parts = relative.split("/")
    transient = [i for i, part in enumerate(parts) if kernel_cache.is_transient(part)]
    if library == "triton":
        return parts[0] if len(parts) > 1 and 0 not in transient else None
    if transient:
        return None
    marker = {"flashinfer": "cached_ops", "tilelang": "kernels"}.get(library)
    if marker in parts[:-1]:
        at = parts.index(marker)
        return "/".join(parts[: at + 2]) if at + 2 < len(parts) else None
    if library == "deep_gemm" and len(parts) > 2 and parts[0] == "cache":
        return "/".join(parts[:2])
    return "/".join(parts[:-1]) or None


def _covers(sighted: str, kernel: str) -> bool:
    return sighted == kernel or sighted.startswith(kernel + "/") or kernel.startswith(sighted + "/")


# --- whose process a pid is ------------------------------------------------------------------


def _domain_cgroups(pid: int | str = "self") -> dict[str, str]:
    """{hierarchy: path} of the cgroups of `pid` that are a kill domain's (kill_domain.PREFIX)."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hierarchy, _, path = line.rpartition(":")
            if any(part.startswith(kill_domain.PREFIX) for part in path.split("/")):
                found[hierarchy] = path
    return found


def _cgroups(pid: int) -> dict[str, str]:
    found = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hierarchy, _, path = line.rpartition(":")
            found[hierarchy] = path
    return found


@dataclass
class Cell:
    """The cell's processes: `root` (this process) and its descendants, and the members of the
    kill-domain cgroups `domain` ({hierarchy: path}, those of this process by default)."""

    root: int = field(default_factory=os.getpid)
    domain: dict[str, str] | None = None
    _known: dict[tuple[int, int | None], bool] = field(default_factory=dict)
    _last: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.domain is None:
            self.domain = _domain_cgroups()

    def member(self, pid: int) -> bool | None:
        """Whether `pid` is the cell's, decided once per process (pid and start time) while it
        lives; for a process gone, what was decided when it was last seen (None: never seen)."""
        started = processes.start_time(pid)
        if started is None:
            return self._last.get(pid)
        key = (pid, started)
        if key not in self._known:
            self._known[key] = self._is_member(pid)
        self._last[pid] = self._known[key]
        return self._known[key]

    def _is_member(self, pid: int) -> bool:
        seen, at = set(), pid
        while at > 1 and at not in seen:
            if at == self.root or (at != pid and self._last.get(at)):
                return True  # this process, or below one of the cell's
            seen.add(at)
            stat = processes.proc_stat(at)
            at = stat[1] if stat is not None else 0
        if self.domain:
            theirs = _cgroups(pid)
            for hierarchy, path in self.domain.items():
                mine = theirs.get(hierarchy, "")
                if mine == path or mine.startswith(path + "/"):
                    return True
        return False


# --- looking -----------------------------------------------------------------------------------


class _Inotify:
    """Triton's folders through inotify(7) (ctypes; nothing without it): its top level, where
    each kernel's <hash>/ folder is made, and each <hash>/, where a put makes its temporary
    folder tmp.pid_<PID>_<uuid> (triton/runtime/cache.py). A new <hash>/ is watched as soon as
    its event is read (the put comes after the compile's first stage)."""

    def __init__(self, folders: Mapping[str, Path]) -> None:
        self.fd = -1
        self.watches: dict[int, str] = {}  # watch -> relative folder ("" for the top level)
        self.found: list[tuple[int, str]] = []  # (pid, <hash>) found by a scan, not yet returned
        folder = folders.get("triton")
        if folder is None:
            return
        try:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.fd = int(self.libc.inotify_init1(_IN_NONBLOCK))
        except (OSError, AttributeError):
            self.fd = -1
            return
        self.root = folder
        self._add("")

    def _add(self, relative: str) -> None:
        """Watch a folder, then scan what it holds already: whatever was made in it between its
        own creation and this watch (a put under way when the watch starts, or made before the
        listener read the folder's event) is found as if an event had come. At the top level
        each <hash>/ found is watched (and scanned) in turn; in a <hash>/ each temporary folder
        found names its writer. A put that ended before the scan (its temporary folder already
        removed) leaves no pid: its files are the unseen's (see attribute())."""
        path = self.root / relative if relative else self.root
        wd = int(self.libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_CREATE | _IN_MOVED_TO))
        if wd < 0:
            return
        self.watches[wd] = relative
        with contextlib.suppress(OSError):
            for child in os.scandir(path):
                if not child.is_dir(follow_symlinks=False):
                    continue
                match = _TRITON_TEMP.match(child.name)
                if relative and match:
                    self.found.append((int(match.group(1)), relative))
                elif not relative and not kernel_cache.is_transient(child.name):
                    self._add(child.name)

    def writers(self) -> list[tuple[int, str]]:
        """(pid, <hash>) of each Triton temporary folder made since the last call."""
        while self.fd >= 0:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # BlockingIOError: nothing more to read
                break
            offset = 0
            while offset + 16 <= len(data):
                wd, mask, _cookie, size = struct.unpack_from("iIII", data, offset)
                name = os.fsdecode(data[offset + 16 : offset + 16 + size].split(b"\0", 1)[0])
                offset += 16 + size
                where = self.watches.get(wd)
                if where is None:
                    continue
                match = _TRITON_TEMP.match(name)
                if where == "" and mask & _IN_ISDIR and not kernel_cache.is_transient(name):
                    self._add(name)  # and what it holds already
                elif where and match:
                    self.found.append((int(match.group(1)), where))
        found, self.found = self.found, []
        return found

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _writable(pid: int, fd: str) -> bool:
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & _ACCMODE in (_O_WRONLY, _O_RDWR)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _outputs(pid: int) -> list[str]:
    """The output paths the command line of `pid` names (-o PATH, -oPATH, --output-file=PATH),
    made absolute against its working folder."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    if b"\0-o" not in raw and b"-output-file" not in raw:  # most processes: no output named
        return []
    argv = [os.fsdecode(a) for a in raw.split(b"\0")]
    found = []
    for i, arg in enumerate(argv):
        if arg in _OUTPUT_FLAGS and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--output-file="):
            found.append(arg.split("=", 1)[1])
        elif arg.startswith("-o") and len(arg) > 2 and arg[2] in "/.":
            found.append(arg[2:])
    if any(not os.path.isabs(p) for p in found):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            return [p for p in found if os.path.isabs(p)]
        found = [os.path.join(cwd, p) for p in found]
    return [os.path.normpath(p) for p in found]


def _ancestors(pid: int) -> set[int]:
    """The ancestors of `pid` (nox, a shell: they wait for the cell, they write no kernel)."""
    found: set[int] = set()
    stat = processes.proc_stat(pid)
    while stat is not None and stat[1] > 1 and stat[1] not in found:
        found.add(stat[1])
        stat = processes.proc_stat(stat[1])
    return found


_POINTERS = (
    *(lib.variable for lib in kernel_cache.LIBRARIES if lib.variable),
    kernel_cache.ACTIVE_VARIABLE,
)


def _pointed_at(pid: int, folders: Mapping[str, Path]) -> list[str]:
    """The libraries whose watched folder the environment `pid` started with points at: a
    library's variable naming it or a folder above it, or the kernel cache's key folder."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return []
    if not any(name.encode() in raw for name in _POINTERS):  # most processes
        return []
    variables = {lib.variable: lib.name for lib in kernel_cache.LIBRARIES if lib.variable}
    found = []
    for item in raw.split(b"\0"):
        name, _, value = os.fsdecode(item).partition("=")
        if name not in _POINTERS or not value:
            continue
        pointed = os.path.realpath(value)
        for library, folder in folders.items():
            if name == kernel_cache.ACTIVE_VARIABLE:
                hit = str(folder).startswith(pointed + os.sep)
            else:
                hit = variables[name] == library and (pointed + os.sep).startswith(
                    str(folder) + os.sep
                )
            if hit and library not in found:
                found.append(library)
    return found


def _mapped(pid: int, prefixes: tuple[str, ...]) -> list[str]:
    """The files under `prefixes` that `pid` has mapped (/proc/PID/maps: a loaded library)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    if not any(prefix in text for prefix in prefixes):  # most processes
        return []
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, device, inode[, path]
        path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
        if path.startswith(prefixes):
            found.add(path)
    return sorted(found)


class Watch:
    """Sightings of writers into the library folders, taken every `poll` seconds in a thread
    from start() until stop() (use it as a context manager, or call stop())."""

    def __init__(
        self,
        folders: Mapping[str, Path] | None = None,
        cell: Cell | None = None,
        poll: float = POLL_S,
    ) -> None:
        watched = kernel_cache.watched() if folders is None else folders
        self.folders = {name: Path(os.path.realpath(f)) for name, f in watched.items()}
        self.cell = cell or Cell()
        self._ancestors = _ancestors(self.cell.root)
        self._alive: set[int] = set()  # the pids of the last look
        self._looks = 0
        self._prefixes = tuple(str(folder) + os.sep for folder in self.folders.values())
        self.poll = poll
        self.sightings: set[Sighting] = set()
        self.unreadable: set[int] = set()  # processes whose open files this user cannot read
        self.lost: set[int] = set()  # writers seen only after they were gone
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._reading = threading.Lock()  # one reader of the inotify fd at a time
        self._inotify: _Inotify | None = None

    def start(self) -> Watch:
        self._inotify = _Inotify(self.folders)
        self._threads = [
            threading.Thread(target=target, name=f"kernel-writers-{name}", daemon=True)
            for name, target in (("look", self._run), ("listen", self._listen))
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> set[Sighting]:
        """Stop looking (one last look first) and return the sightings."""
        if self._threads:
            self._stop.set()
            for thread in self._threads:
                thread.join()
            self._threads = []
            self.look()
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        with self._lock:
            return set(self.sightings)

    def _run(self) -> None:
        """Look at the processes every `poll` seconds, or twice as long as a look takes where
        that is longer (a busy machine with many processes: a third of one core), up to
        MAX_WAIT_S (so a compile of that long is seen whatever the load)."""
        self.look()  # at once; it also decides whose every process is, so it is not timed
        wait = self.poll
        while not self._stop.wait(wait):
            started = time.monotonic()
            self.look()
            wait = min(max(self.poll, 2 * (time.monotonic() - started)), MAX_WAIT_S)

    def _listen(self) -> None:
        """Read inotify's events as they come, in a thread of their own: Triton's puts are over
        in microseconds, so a new <hash>/ folder must be watched at once, not after a look."""
        fd = self._inotify.fd if self._inotify is not None else -1
        while fd >= 0 and not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                select.select([fd], [], [], self.poll)
            self._read_inotify()

    def _where(self, path: str) -> tuple[str, str] | None:
        if not path.startswith(self._prefixes):
            return None
        for name, folder in self.folders.items():
            prefix = str(folder) + os.sep
            if path.startswith(prefix):
                return name, path[len(prefix) :]
        return None

    def _saw(
        self, pid: int, library: str, kernel: str | None, how: str, writes: bool = True
    ) -> None:
        member = self.cell.member(pid)
        with self._lock:
            if member is None:  # gone before it was ever seen: whose it was is not known
                self.lost.add(pid)
                command = "(gone before it was seen)"
            else:
                command = " ".join(processes.cmdline(pid).split())[:COMMAND_SHOWN]
            self.sightings.add(Sighting(pid, member, command, library, kernel, how, writes))

    def _able(self, pid: int, fds: list[str], first: bool) -> None:
        """For a process outside the cell (not one of the cell's ancestors, which wait for it):
        whether it could have written the cache unseen (see the module's doc). `fds`: its files
        in the cache not open for writing; `first`: its first look."""
        if self.cell.member(pid) is not False or pid in self._ancestors:
            return
        if first:
            self._started_pointed(pid)
        self._has_open(pid, fds)
        self._works_in(pid)
        if first or self._looks % MAPS_EVERY == 0:
            self._has_mapped(pid)

    def _started_pointed(self, pid: int) -> None:
        for library in _pointed_at(pid, self.folders):
            self._saw(pid, library, None, "started with the cache in its environment", False)

    def _has_open(self, pid: int, fds: list[str]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                place = self._where(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if place is not None:
                    self._saw(pid, place[0], entry(*place), "has a file of it open", False)

    def _works_in(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            place = self._where(os.path.join(os.readlink(f"/proc/{pid}/cwd"), "."))
            if place is not None:
                self._saw(pid, place[0], entry(*place), "works in it", False)

    def _has_mapped(self, pid: int) -> None:
        for path in _mapped(pid, self._prefixes):
            place = self._where(path)
            if place is not None:
                self._saw(pid, place[0], entry(*place), "has a file of it mapped", False)

    def _read_inotify(self) -> None:
        with self._reading:
            found = self._inotify.writers() if self._inotify is not None else []
        for pid, kernel in found:
            self._saw(pid, "triton", kernel, "triton temp folder")

    def look(self) -> None:
        """One look at every process's open files and command line (and inotify's events)."""
        self._read_inotify()
        alive: set[int] = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            alive.add(pid)
            first = pid not in self._alive
            if first:  # known from now on, should it write and exit soon
                self.cell.member(pid)
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except PermissionError:
                self.unreadable.add(pid)
                fds = []
            except OSError:
                continue
            others = []  # its open files in the cache not open for writing (or bookkeeping)
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                place = self._where(target)
                if place is None:
                    continue
                if _writable(pid, fd) and kernel_cache.is_kernel(*place):
                    self._saw(pid, place[0], entry(*place), "open for writing")
                else:
                    others.append(fd)
            for output in _outputs(pid):
                place = self._where(output)
                if place is not None:
                    self._saw(pid, place[0], entry(*place), "output of its command line")
            self._able(pid, others, first)
        self._alive = alive
        self._looks += 1


# --- judging -------------------------------------------------------------------------------------


def _writer(seen: list[Sighting]) -> tuple[str, tuple[int, ...], str | None] | None:
    """Who the writers `seen` say wrote a file: the cell where one of them is the cell's,
    another process where one of them is known to be outside it, else (only writers gone
    before they were seen) nobody known; None with no writer."""
    own = [s for s in seen if s.member]
    if own:
        return CELL, tuple(sorted({s.pid for s in own})), own[0].command
    outside = [s for s in seen if s.member is False]
    if outside:
        return OTHER, tuple(sorted({s.pid for s in outside})), outside[0].command
    if seen:
        return UNSEEN, tuple(sorted({s.pid for s in seen})), seen[0].command
    return None


def _outsiders(seen: list[Sighting], shown: int = 3) -> str:
    """The processes outside the cell that were seen in the cache (or gone before they were
    seen), as a few words: pid (how)."""
    by_pid: dict[int, str] = {}
    for s in sorted(seen, key=lambda s: (s.pid, not s.writes, s.how)):
        if s.member is not True:
            by_pid.setdefault(s.pid, "wrote it" if s.writes else s.how)
    listed = ", ".join(f"{pid} ({how})" for pid, how in list(by_pid.items())[:shown])
    return listed + (f", ... {len(by_pid) - shown} more" if len(by_pid) > shown else "")


def attribute(changed: Mapping[str, list[str]], sightings: Iterable[Sighting]) -> list[FileWrite]:
    """Who wrote each file of `changed` ({library: [relative paths]}, kernel_cache.written),
    and whether it counts against the cell (see the module's doc): the writers seen in the
    file's kernel folder decide; without one, those in the library's temporary files, where
    they are all the cell's or all another's; without either the file is unseen, and counts only
    when no process outside the cell was seen in the cache at all in the window."""
    seen = list(sightings)
    wrote = [s for s in seen if s.writes]
    outsiders = _outsiders(seen)
    writes = []
    for library, paths in sorted(changed.items()):
        in_library = [s for s in wrote if s.library == library]
        temporary = [s for s in in_library if s.entry is None]
        mixed = len({s.member is True for s in temporary}) > 1
        for path in paths:
            kernel = entry(library, path)
            there = [
                s for s in in_library if s.entry is not None and kernel and _covers(s.entry, kernel)
            ]
            found = _writer(there)
            if found is None and not mixed:
                found = _writer(temporary)
                if found is not None and found[0] == CELL and outsiders:
                    # The cell in the library's temporary files names no kernel: beside a
                    # process outside the cell in the cache, the file may be that one's.
                    found = None
            if found is not None and found[0] != UNSEEN:
                writer, pids, command = found
                writes.append(FileWrite(library, path, writer, writer == CELL, pids, command))
            else:
                if found is not None:  # only by processes gone before they were seen
                    why = f"written by process(es) gone before they were seen: {outsiders}"
                elif outsiders:
                    why = f"processes outside the cell were in the cache: {outsiders}"
                else:
                    why = "no process outside the cell was in the cache"
                counts = found is None and not outsiders
                writes.append(FileWrite(library, path, UNSEEN, counts, why=why))
    return writes


UNWATCHED_WHY = "not watched: the kernel guard is off, so no writer was looked for"


def unwatched(changed: Mapping[str, list[str]]) -> list[FileWrite]:
    """Each file of `changed` written in a window nobody watched (the guard off: no Watch ran):
    counted, as every written file was before writers were told apart, and said as such; never
    "no process outside the cell was in the cache", which only a watch can tell (seen on the
    H200: a stranger's fused_moe_90 objects written during an unguarded start were reported so)."""
    return [
        FileWrite(library, path, UNSEEN, True, why=UNWATCHED_WHY)
        for library, paths in sorted(changed.items())
        for path in paths
    ]


def counted(writes: Iterable[FileWrite]) -> dict[str, list[str]]:
    """{library: [files counted against the cell]}, every library of `writes` listed."""
    found: dict[str, list[str]] = {}
    for write in writes:
        found.setdefault(write.library, [])
        if write.counted:
            found[write.library].append(write.path)
    return found


def describe_not_counted(writes: Iterable[FileWrite], shown: int = 3) -> str:
    """One line on the files written but not counted against the cell, or ''."""
    left = [w for w in writes if not w.counted]
    if not left:
        return ""
    by_other = [w for w in left if w.writer == OTHER]
    parts = []
    if by_other:
        pids = sorted({p for w in by_other for p in w.pids})
        parts.append(
            f"{len(by_other)} written by process(es) outside the cell "
            f"({', '.join(map(str, pids[:shown]))}: {by_other[0].command})"
        )
    unseen = [w for w in left if w.writer != OTHER]
    if unseen:
        parts.append(f"{len(unseen)} whose writer was not seen ({unseen[0].why})")
    return "kernel files not counted against the cell: " + "; ".join(parts)
