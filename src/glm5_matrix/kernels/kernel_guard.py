"""The kernel guard as a pytest plugin (`-p glm5_matrix.kernels.kernel_guard`, loaded by the runner).

With the guard on (GLM5_MATRIX_KERNEL_GUARD=1, or GLM5_MATRIX_STRICT=1 unless the guard is set
to 0), a test phase (setup, call, teardown) that passed is turned into a failure when a
library's cache folder gained or rewrote a kernel file during it, naming the files: a request
that compiled a kernel the warm-up did not. Only what the test process and its children wrote
counts (glm5_matrix.kernels.writers watches the writers through each phase); a file another
process wrote into the shared cache meanwhile is named beside the verdict, never a failure. Engine and server starts check themselves as they
come up (glm5_matrix.engines.client, glm5_matrix.engines.servers), so a cold cache fails at the first start;
vLLM's own jit monitor covers in-process compiles after vLLM's warm-up where vLLM activates it
(compiled mode, see engines). With the guard off the plugin does nothing.

The report is amended in pytest_runtest_makereport (an old-style hook wrapper, which every
pytest since 3 runs), so the plugin works with whatever pytest an offline interpreter holds.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from glm5_matrix.kernels import kernel_cache, writers

_WHERE = {"setup": "setup of {}", "call": "{}", "teardown": "teardown of {}"}


class KernelGuard:
    def __init__(self) -> None:
        self.last: kernel_cache.Snapshot = {}
        self.watch: writers.Watch | None = None

    def _look_again(self, now: kernel_cache.Snapshot | None = None) -> set[writers.Sighting]:
        """The sightings since the last call, and a new watch from here on."""
        seen = self.watch.stop() if self.watch is not None else set()
        self.last = kernel_cache.snapshot() if now is None else now
        self.watch = writers.Watch().start()
        return seen

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._look_again()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any) -> Generator[None, Any, None]:
        outcome = yield
        report = outcome.get_result()
        before, now = self.last, kernel_cache.snapshot()
        writes = writers.attribute(kernel_cache.written(before, now), self._look_again(now))
        changed = writers.counted(writes)
        if report.passed and any(changed.values()):
            where = _WHERE.get(call.when, "{}").format(item.nodeid)
            note = writers.describe_not_counted(writes)
            report.outcome = "failed"
            report.longrepr = kernel_cache.describe_written(changed, where) + (
                f" ({note})" if note else ""
            )
        elif report.passed and writes:
            note = writers.describe_not_counted(writes)
            if note:
                report.sections.append(("kernel guard", note))

    def pytest_unconfigure(self, config: Any) -> None:
        if self.watch is not None:
            self.watch.stop()


def pytest_configure(config: Any) -> None:
    if kernel_cache.guard_enabled():
        config.pluginmanager.register(KernelGuard(), "glm5-matrix-kernel-guard")
