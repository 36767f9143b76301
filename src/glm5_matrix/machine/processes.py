"""The processes a test run starts: finding them in /proc, stopping them by process group or by
id, and telling whether any survived. Engines (in-process LLMs and their spawned workers) and
servers (subprocesses in their own groups) both rely on it; nothing here selects a process by
name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a live process from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    if not Path("/proc").is_dir():  # not Linux: ask the kernel whether the group has anyone
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for pid in _all_pids():
        stat = proc_stat(pid)
        if stat is not None and stat[2] == pgid and stat[0] != "Z":
            members.append(pid)
    return members


def _process_table() -> tuple[dict[int, list[int]], dict[int, str]]:
    """({parent: [children]}, {pid: state}) of every process, from /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for candidate in _all_pids():
        stat = proc_stat(candidate)
        if stat is None:
            continue
        states[candidate] = stat[0]
        children.setdefault(stat[1], []).append(candidate)
    return children, states


def live_descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of `pid` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    children, states = _process_table()
    found, todo = [], list(children.get(root, []))
    while todo:
        child = todo.pop()
        if states.get(child) != "Z":
            found.append(child)
        todo += children.get(child, [])
    return sorted(found)


def live_children(pid: int | None = None) -> list[int]:
    """Live (non-zombie) direct children of `pid` (default: this process)."""
    root = os.getpid() if pid is None else pid
    children, states = _process_table()
    return sorted(c for c in children.get(root, []) if states.get(c) != "Z")


def zombie_children(pid: int | None = None) -> list[int]:
    """Children of `pid` (default: this process) that ended and wait to be reaped."""
    root = os.getpid() if pid is None else pid
    children, states = _process_table()
    return sorted(c for c in children.get(root, []) if states.get(c) == "Z")


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot, /proc/PID/stat field 22), or None when it is
    gone: a pid and its start time name one process even after the pid is reused."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(raw[raw.rfind(")") + 2 :].split()[19])


def listening_ports(pids: Iterable[int]) -> set[int]:
    """TCP ports (IPv4 and IPv6) that the processes `pids` listen on, from their open sockets
    (/proc/PID/fd) and the kernel's socket tables (/proc/net/tcp, tcp6)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return {port for port, inode in listening_sockets() if inode in inodes}


def listening_sockets() -> list[tuple[int, str]]:
    """(port, socket inode) of every TCP socket in LISTEN state on this host (IPv4 and IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN; field 9 is the inode.
                if len(fields) > 9 and fields[3] == "0A":
                    found.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return found


def stop_process_group(
    proc: subprocess.Popen[Any], grace_seconds: float = 20.0, kill_seconds: float = 10.0
) -> bool:
    """SIGTERM the process group led by `proc`, wait up to `grace_seconds` for every member,
    then SIGKILL what is left. Returns True when the group was empty in the end.

    `proc` must have been started with start_new_session=True (its pid is its group id).
    """
    return stop_process_groups([proc], grace_seconds, kill_seconds)


def stop_process_groups(
    procs: Sequence[subprocess.Popen[Any]], grace_seconds: float = 20.0, kill_seconds: float = 10.0
) -> bool:
    """stop_process_group() for several groups at once: all get SIGTERM together, so stopping
    N servers takes one grace period, not N. True when every group was empty in the end."""

    def wait_empty(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            for proc in procs:
                proc.poll()  # reap the leader, or it stays a zombie member of the group
            if not any(group_members(proc.pid) for proc in procs):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    for sig, seconds in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, kill_seconds)):
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        if wait_empty(seconds):
            break
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
    return not any(group_members(proc.pid) for proc in procs)


def stdlib_helper_pids() -> set[int]:
    """Python's multiprocessing resource tracker: started by the first spawn and kept for the
    life of the interpreter by design; it is not an engine process."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def new_descendants(before: set[int]) -> set[int]:
    """Live descendants of this process that were not there in `before`, less stdlib helpers."""
    return set(live_descendants()) - before - stdlib_helper_pids()


def reap_descendants(before: set[int], timeout: float) -> list[str]:
    """Wait up to `timeout` for descendants started after `before` to exit; kill any left (by
    id) and return their descriptions, so the caller can fail on them."""
    deadline = time.monotonic() + timeout
    while True:
        new = new_descendants(before)
        if not new or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    leftovers = []
    for pid in sorted(new):
        leftovers.append(f"pid {pid}: {cmdline(pid)}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return leftovers


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"
