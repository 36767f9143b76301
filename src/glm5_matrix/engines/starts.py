"""What every engine and server start does once it is up, in one place: count the kernel files
the libraries' caches gained or rewrote since `before` (glm5_matrix.kernels.kernel_cache) that the
start's own processes wrote (glm5_matrix.kernels.writers: `watch` looked at the writers since
`before`), record the start with what it compiled and what others wrote into the cell's results,
and refuse it when it compiled under the kernel guard (glm5_matrix.kernels.kernel_guard)."""

from __future__ import annotations

from collections.abc import Callable

from glm5_matrix.kernels import kernel_cache, kernel_guard, writers
from glm5_matrix.results.recorder import record_engine_start


def account_start(
    label: str,
    seconds: float,
    before: kernel_cache.Snapshot,
    compile_seconds: Callable[[], float | None],
    what: str,
    watch: writers.Watch | None = None,
) -> None:
    """Record the start `label` that took `seconds` (and the torch.compile seconds vLLM reports,
    asked only now), then refuse it, naming `what` started, if the kernel guard is on and its
    processes compiled. Without a `watch` every file written counts, each said to be unwatched (writers.unwatched)."""
    changed = kernel_cache.written(before, kernel_cache.snapshot())
    writes = (
        writers.attribute(changed, watch.stop())
        if watch is not None
        else writers.unwatched(changed)
    )
    compiled = writers.counted(writes)
    record_engine_start(
        label,
        seconds,
        compile=kernel_cache.compile_record(
            compiled,
            compile_seconds(),
            before,
            [w.record() for w in writes],
            guard=kernel_guard.guard_enabled(),
        ),
    )
    kernel_guard.refuse_compiled(compiled, what, writers.describe_not_counted(writes))
