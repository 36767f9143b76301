"""glm5_matrix.engines.startup_interrupts against a start shaped like vLLM's: a wait inside a
frame that swallows KeyboardInterrupt (vLLM's launch_core_engines, whose zmq_socket_ctx logs it
and goes on), then a wait for a ready message that never comes (MPClient's, once the engine core
stopped on the same Ctrl-C). The SIGINT is sent to the main thread while it waits in the
swallowing frame, so where it lands does not depend on timing. The real thing, vLLM's own start,
is the faults cell's (e2e-cpu stopped while its engine starts)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from glm5_matrix.engines import startup_interrupts

HERE = (("launch_core_engines", os.path.basename(__file__)),)
READY_WAIT_S = 3.0


def launch_core_engines(sent: threading.Event) -> None:
    """Named as vLLM's frame: waits until the SIGINT was sent, swallowing KeyboardInterrupt."""
    try:
        sent.wait(10)
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass  # what vllm.utils.network_utils.zmq_socket_ctx does


def fake_start(sent: threading.Event) -> float:
    """vLLM's start after a Ctrl-C: the swallowing wait, then a wait that nothing ends."""
    started = time.monotonic()
    launch_core_engines(sent)
    threading.Event().wait(READY_WAIT_S)
    return time.monotonic() - started


def _sigint_main_thread_soon() -> threading.Event:
    sent = threading.Event()
    main = threading.main_thread().ident
    assert main is not None

    def fire() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)
        sent.set()

    threading.Thread(target=fire, daemon=True).start()
    return sent


def test_the_control_a_swallowed_sigint_is_lost() -> None:
    """Without the wrapper the interrupt is gone and the start waits on (the defect)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seconds = fake_start(_sigint_main_thread_soon())
    assert seconds >= READY_WAIT_S


def test_a_swallowed_sigint_is_raised_once_outside_the_swallowing_frame() -> None:
    started = time.monotonic()
    with (
        pytest.raises(KeyboardInterrupt),
        startup_interrupts.reaching_the_caller(HERE, redeliver_s=0.1) as held,
    ):
        fake_start(_sigint_main_thread_soon())
    assert time.monotonic() - started < READY_WAIT_S / 2
    assert held() >= 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_start_that_failed_after_a_sigint_raises_keyboardinterrupt_from_it() -> None:
    sent = _sigint_main_thread_soon()
    with (
        pytest.raises(KeyboardInterrupt) as caught,
        startup_interrupts.reaching_the_caller(HERE, redeliver_s=60) as held,
    ):
        launch_core_engines(sent)  # held there, and the engine then fails its start
        raise RuntimeError("Engine core initialization failed")
    assert held() == 1
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_start_that_returned_after_a_held_sigint_raises_on_the_way_out() -> None:
    sent = _sigint_main_thread_soon()
    with (
        pytest.raises(KeyboardInterrupt, match="during the engine start"),
        startup_interrupts.reaching_the_caller(HERE, redeliver_s=60),
    ):
        launch_core_engines(sent)  # the engine came up all the same


def test_no_sigint_no_effect() -> None:
    with startup_interrupts.reaching_the_caller(HERE, redeliver_s=0.05) as held:
        time.sleep(0.2)
    assert held() == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_it_does_nothing() -> None:
    seen: list[object] = []

    def run() -> None:
        with startup_interrupts.reaching_the_caller(HERE):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
