"""glm5_matrix.engines.startup_interrupts against a start shaped like vLLM's: a wait inside a
frame that swallows KeyboardInterrupt (vLLM's launch_core_engines, whose zmq_socket_ctx logs it
and goes on), then a wait for a ready message that never comes (MPClient's, once the engine core
stopped on the same Ctrl-C). The SIGINT is sent to the main thread while it waits in the
swallowing frame (the sending thread waits until that frame says it is entered), so where it
lands does not depend on timing or load. The real thing, vLLM's own start, is the faults cell's
(e2e-cpu stopped while its engine starts)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from glm5_matrix.engines import startup_interrupts

HERE = (("launch_core_engines", os.path.basename(__file__)),)
READY_WAIT_S = 5.0


@dataclass
class Sigint:
    """A SIGINT for the main thread, sent once it is inside the swallowing frame."""

    entered: threading.Event = field(default_factory=threading.Event)
    sent: threading.Event = field(default_factory=threading.Event)


@pytest.fixture(autouse=True)
def python_default_handler() -> Iterator[None]:
    """Every test starts and ends with Python's own SIGINT handler; one that leaks a handler
    fails itself and no other test."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        yield
    finally:
        leaked = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert leaked is signal.default_int_handler, f"SIGINT handler left installed: {leaked!r}"


def launch_core_engines(sigint: Sigint) -> None:
    """Named as vLLM's frame: waits until the SIGINT was sent, swallowing KeyboardInterrupt."""
    try:
        sigint.entered.set()
        sigint.sent.wait(10)
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass  # what vllm.utils.network_utils.zmq_socket_ctx does


def fake_start(sigint: Sigint) -> float:
    """vLLM's start after a Ctrl-C: the swallowing wait, then a wait that nothing ends."""
    started = time.monotonic()
    launch_core_engines(sigint)
    threading.Event().wait(READY_WAIT_S)
    return time.monotonic() - started


def _sigint_main_thread_soon() -> Sigint:
    sigint = Sigint()
    main = threading.main_thread().ident
    assert main is not None

    def fire() -> None:
        if sigint.entered.wait(30):
            signal.pthread_kill(main, signal.SIGINT)
        sigint.sent.set()

    threading.Thread(target=fire, daemon=True).start()
    return sigint


def test_the_control_a_swallowed_sigint_is_lost() -> None:
    """Without the wrapper the interrupt is gone and the start waits on (the defect)."""
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
    sigint = _sigint_main_thread_soon()
    with (
        pytest.raises(KeyboardInterrupt) as caught,
        startup_interrupts.reaching_the_caller(HERE, redeliver_s=60) as held,
    ):
        launch_core_engines(sigint)  # held there, and the engine then fails its start
        raise RuntimeError("Engine core initialization failed")
    assert held() == 1
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_start_that_returned_after_a_held_sigint_raises_on_the_way_out() -> None:
    sigint = _sigint_main_thread_soon()
    with (
        pytest.raises(KeyboardInterrupt, match="during the engine start"),
        startup_interrupts.reaching_the_caller(HERE, redeliver_s=60),
    ):
        launch_core_engines(sigint)  # the engine came up all the same


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


class _InterruptedStart(threading.Thread):
    def start(self) -> None:
        raise KeyboardInterrupt  # a Ctrl-C landing before the wrapped block begins


def test_a_sigint_before_the_block_begins_restores_the_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI saw this (a SIGINT raised in the wrapper's own setup, on a loaded box): the wrapper's
    handler stayed installed, so every later start in the process ran unwrapped."""
    monkeypatch.setattr(startup_interrupts.threading, "Thread", _InterruptedStart)
    with (
        pytest.raises(KeyboardInterrupt),
        startup_interrupts.reaching_the_caller(HERE),
    ):
        pytest.fail("the block ran after its setup was interrupted")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
