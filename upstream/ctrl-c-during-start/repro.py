"""vLLM swallows a Ctrl-C (SIGINT) that lands while `LLM(...)` waits for its engine core.

Run:  python repro.py --model TINY_MODEL_DIR      (any small model; no tokenizer needed)

The subject starts `LLM(...)`; once the constructor waits for its engine core (the main
thread's stack holds vllm.v1.engine.utils.wait_for_engine_startup), and still does --delay s
later, a thread sends SIGINT to the subject's own pid: a Ctrl-C that reaches the frontend (`kill
-INT PID`; a terminal's Ctrl-C reaches the engine core as well, which then stops, and the
constructor waits for it up to VLLM_ENGINE_READY_TIMEOUT_S). Expected: KeyboardInterrupt out of
`LLM(...)` within --wait s. Seen (vllm 0.32.0): zmq_socket_ctx (vllm/utils/network_utils.py)
catches it and logs it at debug level, and destroys the ZMQ context, the engine-core handshake
socket with it; `LLM(...)` then goes on waiting for an engine core that cannot finish its
handshake (up to VLLM_ENGINE_READY_TIMEOUT_S), or, when the SIGINT comes late enough, returns a
working engine. Either is reported as reproduced: no KeyboardInterrupt within --wait s.

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made. Every process it starts is stopped (subject.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject


def run_subject(model: str, delay: float, wait: float) -> int:
    from vllm import LLM

    main = threading.main_thread().ident
    sent: dict[str, float] = {}

    def waiting_for_engine_core() -> bool:
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            if frame.f_code.co_name == "wait_for_engine_startup":
                return True
            frame = frame.f_back
        return False

    def interrupt_while_waiting() -> None:
        while not waiting_for_engine_core():
            time.sleep(0.05)
        time.sleep(delay)
        if not waiting_for_engine_core():
            return
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(wait)  # LLM() ends within this (raising or returning), or it still waits
        if "ended" not in sent:
            subject.verdict(
                True,
                f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); {wait:.0f} s later LLM() "
                "still runs, no KeyboardInterrupt",
            )
            subject.kill_descendants()
            os._exit(0)

    started = time.monotonic()
    threading.Thread(target=interrupt_while_waiting, daemon=True).start()
    try:
        llm = LLM(model=model, **subject.SMALL_ENGINE)
    except KeyboardInterrupt:
        sent["ended"] = time.monotonic()
        if "at" not in sent:
            raise
        after = time.monotonic() - sent["at"]
        subject.verdict(False, f"LLM() raised KeyboardInterrupt {after:.1f} s after the SIGINT")
        return 0
    sent["ended"] = time.monotonic()
    if "at" not in sent:
        subject.verdict(None, "LLM() was not waiting for its engine core when the SIGINT was due")
        return 2
    subject.verdict(
        True,
        f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); LLM() returned an engine "
        f"{time.monotonic() - sent['at']:.1f} s later, no KeyboardInterrupt",
    )
    llm.llm_engine.engine_core.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--delay", type=float, default=1.0, help="s into the wait")
    parser.add_argument("--wait", type=float, default=60.0, help="s LLM() has to end after it")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.delay, args.wait)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--delay", str(args.delay), "--wait", str(args.wait)]
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
