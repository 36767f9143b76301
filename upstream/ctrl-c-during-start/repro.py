"""vLLM swallows a Ctrl-C (SIGINT) that lands while `LLM(...)` waits for its engine core.

Run:  python repro.py --model TINY_MODEL_DIR      (any small model; no tokenizer needed)

The subject starts `LLM(...)`; once the constructor waits for its engine core (the main
thread's stack holds vllm.v1.engine.utils.wait_for_engine_startup), and still does --delay s
later, a thread sends SIGINT to the subject's own pid: a Ctrl-C that reaches the frontend (`kill
-INT PID`; a terminal's Ctrl-C reaches the engine core as well, which then stops, and the
constructor waits for it up to VLLM_ENGINE_READY_TIMEOUT_S). Expected: KeyboardInterrupt out of
`LLM(...)`. Seen (vllm 0.32.0): zmq_socket_ctx (vllm/utils/network_utils.py) catches it, logs it
at debug level and destroys the ZMQ context, the engine-core handshake socket with it; `LLM(...)`
then goes on waiting for its engine core (up to VLLM_ENGINE_READY_TIMEOUT_S), or returns a
working engine.

No verdict depends on how long the engine takes to start, or on how long anything takes after
the SIGINT: the script watches what becomes of the KeyboardInterrupt. A trace function on the
main thread (standard library only; it changes nothing) sees the exit of every `with
zmq_socket_ctx(...)` block that a KeyboardInterrupt reaches, and whether that exit suppressed it
(contextlib's __exit__ returned True). Reproduced: zmq_socket_ctx suppressed the
KeyboardInterrupt (from then on no KeyboardInterrupt can come out of LLM()), or LLM() returned
after the SIGINT. Not reproduced: the KeyboardInterrupt went through zmq_socket_ctx and out of
LLM(). No verdict: the SIGINT was not sent while LLM() waited for its engine core, or the
KeyboardInterrupt never reached zmq_socket_ctx. What LLM() does after a suppression (returns, or
still waits --wait s later) is reported in the detail, not judged.

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made (also when --timeout s pass first: a slow machine gives
no verdict, never a wrong one). Every process it starts is stopped (subject.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject

WATCHED = "zmq_socket_ctx"  # vllm/utils/network_utils.py
WAITING = "wait_for_engine_startup"  # vllm/v1/engine/utils.py


class ExitWatch:
    """A trace function for the main thread: records, for each exit of a `with WATCHED(...)`
    block that a KeyboardInterrupt reaches, whether contextlib's __exit__ suppressed it."""

    def __init__(self) -> None:
        self.exits: list[tuple[float, bool]] = []  # (monotonic time, suppressed)
        self.changed = threading.Event()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != "__exit__":
            return None
        if not frame.f_code.co_filename.endswith("contextlib.py"):
            return None
        owner = frame.f_locals.get("self")
        gen = getattr(owner, "gen", None)
        code = getattr(gen, "gi_code", None)
        if getattr(code, "co_name", None) != WATCHED:
            return None
        typ = frame.f_locals.get("typ")
        if not (isinstance(typ, type) and issubclass(typ, KeyboardInterrupt)):
            return None

        def on_return(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "return":  # arg: __exit__'s value (None when it raised)
                self.exits.append((time.monotonic(), arg is True))
                self.changed.set()
            return on_return

        return on_return

    def suppressed(self) -> float | None:
        return next((at for at, s in self.exits if s), None)


def run_subject(model: str, delay: float, wait: float, within: float) -> int:
    from vllm import LLM

    main = threading.main_thread().ident
    sent: dict[str, float] = {}
    watch = ExitWatch()
    ended = threading.Event()

    def waiting_for_engine_core() -> bool:
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            if frame.f_code.co_name == WAITING:
                return True
            frame = frame.f_back
        return False

    def where_main_waits() -> str:
        """The main thread's innermost frame in vllm (function, file:line)."""
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            path = frame.f_code.co_filename
            if "/vllm/" in path:
                return (
                    f"{frame.f_code.co_name}, vllm/{path.rsplit('/vllm/', 1)[1]}:{frame.f_lineno}"
                )
            frame = frame.f_back
        return "outside vllm"

    def interrupt_while_waiting() -> None:
        while not waiting_for_engine_core():
            if ended.is_set():
                return
            time.sleep(0.05)
        time.sleep(delay)
        if not waiting_for_engine_core():
            return
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        # Wait for what becomes of it: LLM() ends, or zmq_socket_ctx suppresses it.
        deadline = time.monotonic() + within
        while not ended.is_set() and watch.suppressed() is None:
            if time.monotonic() > deadline:
                subject.verdict(
                    None,
                    f"{within:.0f} s after the SIGINT LLM() still runs and no zmq_socket_ctx "
                    "exit saw a KeyboardInterrupt",
                )
                subject.kill_descendants()
                os._exit(2)
            watch.changed.wait(0.2)
        if ended.wait(wait):
            return  # the main thread reports
        at = watch.suppressed()
        assert at is not None
        subject.verdict(
            True,
            f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); zmq_socket_ctx suppressed the "
            f"KeyboardInterrupt {at - sent['at']:.1f} s later; {wait:.0f} s after that LLM() "
            f"still runs (no KeyboardInterrupt), in {where_main_waits()}",
        )
        subject.kill_descendants()
        os._exit(0)

    started = time.monotonic()
    threading.Thread(target=interrupt_while_waiting, daemon=True).start()
    sys.settrace(watch)
    try:
        llm = LLM(model=model, **subject.SMALL_ENGINE)
    except KeyboardInterrupt:
        sys.settrace(None)
        ended.set()
        if "at" not in sent:
            raise
        after = time.monotonic() - sent["at"]
        if not watch.exits:
            subject.verdict(None, "the KeyboardInterrupt never reached zmq_socket_ctx")
            return 2
        if watch.suppressed() is not None:  # another KeyboardInterrupt (a second SIGINT?)
            subject.verdict(
                True,
                "zmq_socket_ctx suppressed a KeyboardInterrupt; a later one "
                f"came out of LLM() {after:.1f} s after the SIGINT",
            )
            return 0
        subject.verdict(
            False,
            f"the KeyboardInterrupt went through zmq_socket_ctx (not suppressed) and out of "
            f"LLM() {after:.1f} s after the SIGINT (sent {sent['at'] - started:.1f} s into LLM())",
        )
        return 0
    except Exception as exc:
        sys.settrace(None)
        ended.set()
        if "at" in sent and watch.suppressed() is not None:
            subject.verdict(
                True,
                f"zmq_socket_ctx suppressed the KeyboardInterrupt; LLM() then raised {exc!r}"[:400],
            )
            return 0
        subject.verdict(None, f"LLM() failed: {exc!r}"[:400])
        return 2
    sys.settrace(None)
    ended.set()
    if "at" not in sent:
        subject.verdict(None, "LLM() was not waiting for its engine core when the SIGINT was due")
        llm.llm_engine.engine_core.shutdown()
        return 2
    at = watch.suppressed()
    how = f"zmq_socket_ctx suppressed it {at - sent['at']:.1f} s later; " if at is not None else ""
    subject.verdict(
        True,
        f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); {how}LLM() returned a working "
        f"engine {time.monotonic() - sent['at']:.1f} s after the SIGINT, no KeyboardInterrupt",
    )
    llm.llm_engine.engine_core.shutdown()
    return 0


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--delay", type=float, default=1.0, help="s into the wait")
    parser.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="s to watch LLM() after a suppression (reported, not judged)",
    )
    parser.add_argument(
        "--within",
        type=float,
        default=900.0,
        help="s after the SIGINT for LLM() to end or zmq_socket_ctx to see it",
    )
    parser.add_argument("--timeout", type=float, default=2400.0, help="s for it all: no verdict")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.delay, args.wait, args.within)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--delay", str(args.delay), "--wait", str(args.wait)]
    command += ["--within", str(args.within)]
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
