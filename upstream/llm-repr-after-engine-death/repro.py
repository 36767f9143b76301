"""`repr(LLM)` waits forever when the engine core dies while the call is in flight.

Run:  python repro.py --model TINY_MODEL_DIR      (any small model; no tokenizer needed)
      python repro.py --model DIR --workaround   (vLLM's cached repr set first: the control)

The subject starts `LLM(...)`, stops its engine core (SIGSTOP: a busy or hung engine core),
calls `repr(llm)` in a thread (LLM.__repr__ -> collective_rpc("get_model_inspection") ->
SyncMPClient.call_utility, which waits on a bare Future.result()), and once that thread waits
in Future.result() (the request is sent), kills the engine core (SIGKILL). vLLM notices: its
engine-core monitor thread (MPClientEngineMonitor) marks the client dead and shuts it down,
which ends the thread that completes utility futures (EngineCoreOutputQueueThread). Expected:
repr() raises EngineDeadError (or returns). Seen (vllm 0.32.0): it waits forever.

No verdict depends on how long anything takes. Reproduced: the engine core is dead, both of
those threads have ended, and the future repr() waits on is still pending, so that nothing in
the process can ever complete it (repr() is still waiting --wait s later: reported, not judged).
Not reproduced: repr() returned or raised. No verdict: --within s after the kill neither had
happened, or the setup did not go as described (no engine core process, say). pytest reprs a
traceback's arguments, so a test that fails with an LLM in a frame hangs the same way.

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made (also when --timeout s pass first: a slow machine gives
no verdict, never a wrong one). Every process it starts is stopped (subject.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject

MONITOR = "MPClientEngineMonitor"  # vllm/v1/engine/core_client.py, the threads' names
OUTPUTS = "EngineCoreOutputQueueThread"


def _in(thread: threading.Thread, name: str, file_part: str) -> bool:
    """Whether `thread`'s stack holds a frame of function `name` from a file matching."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == name and file_part in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def _until(condition: Any, within: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def run_subject(model: str, wait: float, within: float, workaround: bool) -> int:
    from vllm import LLM

    llm = LLM(model=model, **subject.SMALL_ENGINE)
    if workaround:  # what the harness does (glm5_matrix/engines/client.py)
        llm._cached_repr = f"LLM(model={model!r})"
    client = llm.llm_engine.engine_core
    cores = [
        pid
        for pid in subject.children(os.getpid())
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    if not cores or not _threads(MONITOR) or not _threads(OUTPUTS):
        subject.verdict(None, f"no engine core process ({cores}) or no {MONITOR}/{OUTPUTS}")
        return 2
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    outcome: dict[str, str] = {}

    def call_repr() -> None:
        try:
            outcome["returned"] = repr(llm)[:60]
        except Exception as exc:
            outcome["raised"] = type(exc).__name__

    thread = threading.Thread(target=call_repr, daemon=True)
    thread.start()
    # The utility request is sent once the thread waits in Future.result() (call_utility sends,
    # then waits); a repr that needs no request (the workaround) ends instead.
    waiting = lambda: _in(thread, "result", "concurrent")  # noqa: E731
    if not _until(lambda: not thread.is_alive() or waiting(), within):
        subject.verdict(None, f"repr() neither ended nor waited on a future within {within:.0f} s")
        return _leave(2)
    pending = [f for f in getattr(client, "utility_results", {}).values() if not f.done()]
    before = "ended before the kill" if not thread.is_alive() else "waiting in Future.result()"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    died = time.monotonic()
    # vLLM's reaction to the death ends with both threads gone (the monitor shuts the client
    # down, which stops the output thread), unless repr() ends first.
    gone = lambda: not _threads(MONITOR) and not _threads(OUTPUTS)  # noqa: E731
    if not _until(lambda: not thread.is_alive() or gone(), within):
        subject.verdict(
            None,
            f"{within:.0f} s after the kill repr() still runs and vLLM's "
            f"{MONITOR}/{OUTPUTS} threads too",
        )
        return _leave(2)
    dead = getattr(getattr(client, "resources", None), "engine_dead", None)
    if not thread.is_alive():
        what = ", ".join(f"{k} {v}" for k, v in outcome.items())
        subject.verdict(
            False, f"repr(llm) {what} {time.monotonic() - died:.1f} s after the kill ({before})"
        )
        return _leave(0)
    still = [f for f in pending if not f.done()]
    if not pending or not still:
        # completed, or there was nothing to complete: repr() must end now
        if _until(lambda: not thread.is_alive(), within):
            what = ", ".join(f"{k} {v}" for k, v in outcome.items())
            subject.verdict(
                False,
                f"repr(llm) {what} {time.monotonic() - died:.1f} s after "
                f"the kill (its future was completed)",
            )
            return _leave(0)
        subject.verdict(
            None,
            f"repr() still runs {within:.0f} s after its future completed "
            f"({len(pending)} pending before the kill)",
        )
        return _leave(2)
    gone_after = time.monotonic() - died
    thread.join(wait)
    subject.verdict(
        True,
        f"the engine core was killed; {gone_after:.1f} s later vLLM's {MONITOR} and {OUTPUTS} "
        f"threads had ended (client marked dead: {dead}) and repr(llm)'s future was still "
        f"pending, with nothing left to complete it; {time.monotonic() - died:.0f} s after the "
        f"kill repr(llm) " + ("still waits" if thread.is_alive() else f"ended: {outcome}"),
    )
    return _leave(0)


def _leave(status: int) -> int:
    sys.stdout.flush()
    os._exit(status)  # the repr thread may still be blocked in vLLM; the runner stops the rest


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="s to watch repr() once nothing can end it (reported, not judged)",
    )
    parser.add_argument(
        "--within", type=float, default=600.0, help="s for each step to happen (else: no verdict)"
    )
    parser.add_argument("--workaround", action="store_true", help="set LLM._cached_repr first")
    parser.add_argument("--timeout", type=float, default=2400.0, help="s for it all: no verdict")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.wait, args.within, args.workaround)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--wait", str(args.wait), "--within", str(args.within)]
    command += ["--workaround"] if args.workaround else []
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
