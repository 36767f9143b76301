"""What every reproduction here shares: the subject (the part that runs vLLM) runs in a child
process of its own session; when it ends, however it ends, nothing of it may be left. Standard
library only, so that a reproduction runs in any environment that has vLLM (copy this file next
to the reproduction's folder, or run it from a checkout).

A subject prints its verdict as one line `RESULT {"reproduced": true|false, "vllm": ..., "detail":
...}`; run() prints the subject's output to stderr (vLLM logs to stdout), the verdict as the last
line of stdout, and returns 0 when the check was made, 2 when it was not (no verdict, a verdict
of null, or processes left behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

MARK = "RESULT "


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


# The smallest engine the LLM() reproductions start on the tiny hybrid (vLLM's CPU build).
SMALL_ENGINE = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 2,
    "kv_cache_memory_bytes": 256 << 20,
}


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _live(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose /proc stat field `field` (after the name) is `value`."""
    found = []
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None and int(fields[field]) == value and fields[0] != "Z":
            found.append(pid)
    return found


def group(pgid: int) -> list[int]:
    """Live (not zombie) members of process group `pgid`."""
    return _live(2, pgid)


def children(pid: int) -> list[int]:
    return _live(1, pid)


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def free_port() -> int:
    """A port free on 127.0.0.1 now (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_descendants() -> None:
    """SIGKILL every descendant of this process (a subject that gives up on vLLM stops what vLLM
    started before it exits)."""
    for pid in reversed(descendants(os.getpid())):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def verdict(reproduced: bool | None, detail: str) -> None:
    """The subject's verdict line (None: no check was made)."""
    try:
        from vllm import __version__ as version
    except ImportError:
        version = None
    print(MARK + json.dumps({"reproduced": reproduced, "vllm": version, "detail": detail}))
    sys.stdout.flush()


def stop_group(proc: subprocess.Popen[str], grace: float = 10.0) -> list[int]:
    """Wait up to `grace` s for the group led by `proc` to empty; kill what is left (SIGCONT
    first: a stopped member dies on SIGKILL too, but its children may be stopped as well) and
    return the pids that were left."""
    deadline = time.monotonic() + grace
    while group(proc.pid) and time.monotonic() < deadline:
        proc.poll()
        time.sleep(0.2)
    left = group(proc.pid)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    proc.wait()
    deadline = time.monotonic() + 10
    while group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run(command: Sequence[str], timeout: float) -> int:
    """The subject `command` in a session of its own (see the module docstring)."""
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    out = ""
    try:
        out, _ = proc.communicate(timeout=timeout)
        leftovers = stop_group(proc)
    except BaseException as exc:  # past the timeout, or interrupted: what it printed, then stop
        if isinstance(exc, subprocess.TimeoutExpired):
            print(f"the subject ran past {timeout:.0f} s", file=sys.stderr)
        leftovers = stop_group(proc, grace=0)
        out = (out or "") + (proc.communicate()[0] or "")
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
    sys.stderr.write(out or "")
    found = [line[len(MARK) :] for line in (out or "").splitlines() if line.startswith(MARK)]
    if leftovers:
        print(f"killed {len(leftovers)} process(es) the subject left: {leftovers}", file=sys.stderr)
    if not found or leftovers:
        why = "processes left behind" if leftovers else "the subject gave no verdict"
        print(json.dumps({"reproduced": None, "vllm": None, "detail": why}))
        return 2
    print(found[-1])
    return 0 if json.loads(found[-1])["reproduced"] is not None else 2
