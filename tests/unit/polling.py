"""Waiting for a condition in the unit tests that drive real processes (supervision, kill
domains): poll, bounded, and fail saying how long it waited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], seconds: float = 30.0) -> Any:
    """The first truthy value of `predicate()` within `seconds`, or an AssertionError."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s")
