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


def live_descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of `pid` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for candidate in _all_pids():
        stat = proc_stat(candidate)
        if stat is None:
            continue
        states[candidate] = stat[0]
        children.setdefault(stat[1], []).append(candidate)
    found, todo = [], list(children.get(root, []))
    while todo:
        child = todo.pop()
        if states.get(child) != "Z":
            found.append(child)
        todo += children.get(child, [])
    return sorted(found)


def stop_process_group(
    proc: subprocess.Popen[Any], grace_seconds: float = 20.0, kill_seconds: float = 10.0
) -> bool:
    """SIGTERM the process group led by `proc`, wait up to `grace_seconds` for every member,
    then SIGKILL what is left. Returns True when the group was empty in the end.

    `proc` must have been started with start_new_session=True (its pid is its group id).
    """
    pgid = proc.pid

    def wait_empty(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            proc.poll()  # reap the leader, or it stays a zombie member of the group
            if not group_members(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    for sig, seconds in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, kill_seconds)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        if wait_empty(seconds):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    return not group_members(pgid)


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
