"""`repr(LLM)` waits forever when the engine core dies while the call is in flight.

Run:  python repro.py --model TINY_MODEL_DIR      (any small model; no tokenizer needed)
      python repro.py --model DIR --workaround   (vLLM's cached repr set first: the control)

The subject starts `LLM(...)`, stops its engine core (SIGSTOP: a busy or hung engine core),
calls `repr(llm)` in a thread (LLM.__repr__ -> collective_rpc("get_model_inspection") ->
SyncMPClient.call_utility, which waits on a bare Future.result()), then kills the engine core
(SIGKILL). vLLM notices (its engine-core monitor marks the client dead and shuts it down), but
nothing fails the pending utility future. Expected: repr() raises EngineDeadError (or returns)
within seconds of the engine core's death. Seen (vllm 0.32.0, 0.33.0): it is still waiting
--wait s later. pytest reprs a traceback's arguments, so a test that fails with an LLM in a
frame hangs the same way.

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


def run_subject(model: str, wait: float, workaround: bool) -> int:
    from vllm import LLM

    llm = LLM(model=model, **subject.SMALL_ENGINE)
    if workaround:  # what the harness does (glm5_matrix/engines/client.py)
        llm._cached_repr = f"LLM(model={model!r})"
    cores = [
        pid
        for pid in subject.children(os.getpid())
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    if not cores:
        subject.verdict(None, "no engine core process found")
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
    time.sleep(1.0)  # the utility request is sent (to a stopped engine core)
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    died = time.monotonic()
    thread.join(wait)
    if thread.is_alive():
        dead = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_dead", None)
        subject.verdict(
            True,
            f"repr(llm) still waiting {time.monotonic() - died:.0f} s after the engine core was "
            f"killed (client marked dead: {dead})",
        )
    else:
        what = ", ".join(f"{k} {v}" for k, v in outcome.items())
        subject.verdict(False, f"repr(llm) {what} {time.monotonic() - died:.1f} s after the kill")
    sys.stdout.flush()
    os._exit(0)  # the thread may still be blocked in vLLM; the runner stops what is left


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--wait", type=float, default=30.0, help="s to wait for repr()")
    parser.add_argument("--workaround", action="store_true", help="set LLM._cached_repr first")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.wait, args.workaround)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--wait", str(args.wait)] + (["--workaround"] if args.workaround else [])
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
