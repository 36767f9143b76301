"""Waiting for a condition in the unit tests that drive real processes (supervision, kill
domains, servers): poll, bounded, and fail saying how long it waited; and whether a process they
started is still alive."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import EllipsisType
from typing import Any

from glm5_matrix.machine import processes


def wait_for(predicate: Callable[[], Any], seconds: float = 30.0) -> Any:
    """The first truthy value of `predicate()` within `seconds`, or an AssertionError."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s")


def alive(pid: int, started: int | EllipsisType | None = ...) -> bool:
    """Whether process `pid` runs (a zombie does not). Given `started`, its start time as read
    when it was seen (processes.start_time; None: it was gone already), only while it is still
    that process, not a later one under its pid."""
    stat = processes.proc_stat(pid)
    if stat is None or stat[0] == "Z":
        return False
    return started is ... or processes.start_time(pid) == started
