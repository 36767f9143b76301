"""The kernel guard: its policy, and its pytest plugin (`-p glm5_matrix.kernels.kernel_guard`,
loaded by the runner).

The policy: the guard is on with GLM5_MATRIX_KERNEL_GUARD=1, or GLM5_MATRIX_STRICT=1 unless the
guard is set to 0 (guard_enabled); with it on, an engine or server start whose own processes
compiled a kernel is refused naming the files (refuse_compiled, by glm5_matrix.engines.starts: a
cold cache fails at the first start), and compiled-mode engines run vLLM's jit monitor in error
mode (jit_monitor_mode), which covers in-process compiles after vLLM's warm-up where vLLM
activates it.

The plugin: with the guard on, a test phase (setup, call, teardown) that passed is turned into a
failure when a library's cache folder gained or rewrote a kernel file during it, naming the
files: a request that compiled a kernel the warm-up did not. Only what the test process and its
children wrote counts (glm5_matrix.kernels.writers watches the writers through each phase); a
file another process wrote into the shared cache meanwhile is named beside the verdict, never a
failure. With the guard off the plugin does nothing.

The report is amended in pytest_runtest_makereport (an old-style hook wrapper, which every
pytest since 3 runs), so the plugin works with whatever pytest an offline interpreter holds.
pytest is imported only once pytest configures the plugin: the runner reads the policy in nox's
own interpreter, which need not have pytest.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

from glm5_matrix.kernels import kernel_cache, writers
from glm5_matrix.machine import hardware

if TYPE_CHECKING:
    import pytest

GUARD_VARIABLE = "GLM5_MATRIX_KERNEL_GUARD"


# --- the policy --------------------------------------------------------------------------------


class KernelCompiled(RuntimeError):
    """A kernel was compiled while the guard was on (after the warm-up)."""


def guard_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """GLM5_MATRIX_KERNEL_GUARD=1 turns the guard on, =0 off; unset, it follows
    GLM5_MATRIX_STRICT."""
    environ = os.environ if environ is None else environ
    value = environ.get(GUARD_VARIABLE, "").strip().lower()
    if value:
        return value in ("1", "true", "yes", "on")
    return hardware.strict(dict(environ))


# Results of tuners that time their candidates on the GPU, per library (paths under its folder):
# FlashInfer's managed autotune store, <workspace>/.cache/flashinfer/autotune/v2/<environment
# hash>/ (flashinfer/autotuner/autotuner.py, one engine rank: vLLM's use_flashinfer_autotune_v2),
# and vLLM's own files of it for several ranks (vllm/model_executor/warmup/
# flashinfer_autotune_cache.py). Keyed by the GPU model: no build off the GPU can make them.
GPU_MEASURED = {
    "flashinfer": (".cache/flashinfer/autotune/",),
    "vllm": ("flashinfer_autotune_cache/",),
}


def gpu_measured(changed: Mapping[str, list[str]]) -> int:
    """How many of the files are results a tuner measured on this GPU model (GPU_MEASURED)."""
    return sum(
        1
        for name, paths in changed.items()
        for path in paths
        if any(path.startswith(prefix) for prefix in GPU_MEASURED.get(name, ()))
    )


def describe_written(changed: Mapping[str, list[str]], where: str, shown: int = 4) -> str:
    """One line naming what was compiled: per library, how many files and the first few, and
    what to run: the warm step, on this GPU model when tuners measured something here."""
    parts = []
    for name, paths in sorted(changed.items()):
        if not paths:
            continue
        listed = ", ".join(paths[:shown]) + (
            f", ... {len(paths) - shown} more" if len(paths) > shown else ""
        )
        parts.append(f"{name}: {len(paths)} file(s) ({listed})")
    measured = gpu_measured(changed)
    advice = (
        f" -- {measured} of them autotune results FlashInfer measured on this GPU model, which no "
        "build off the GPU makes: run `nox -s warm -- CELL` on this GPU model first (with "
        "--export FILE, the archive records the model)"
        if measured
        else " -- run `nox -s warm -- CELL` on this machine first"
    )
    return (
        f"kernels compiled after the warm-up during {where} ({GUARD_VARIABLE} is on): "
        + "; ".join(parts)
        + advice
    )


def refuse_compiled(changed: Mapping[str, list[str]], where: str, note: str = "") -> None:
    """Raise KernelCompiled naming the files when something was compiled and the guard is on
    (`note`: what was written but not counted, writers.describe_not_counted)."""
    if any(changed.values()) and guard_enabled():
        raise KernelCompiled(describe_written(changed, where) + (f" ({note})" if note else ""))


def jit_monitor_mode(enforce_eager: bool) -> str | None:
    """ "error" when the guard is on, the engine is not eager and this vLLM has the jit monitor
    (ObservabilityConfig.jit_monitor_mode, vLLM 0.33), else None.

    vLLM activates its monitor only after its own JIT warm-up, which enforce_eager turns off
    (vllm/config/vllm.py:1766-1784, v1/worker/gpu_worker.py:1126-1138); it then hooks Triton's
    jit and autotuner, TileLang's jit and CuTeDSL's compile, and in error mode raises in the
    worker naming the kernel (vllm/utils/jit_monitor.py). It counts any first compile in the
    process after vLLM's warm-up, a disk-cache hit included (triton/runtime/jit.py:893-905):
    a stricter check than the cache's, which sees only what was written.
    """
    if enforce_eager or not guard_enabled():
        return None
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return (
        "error" if "jit_monitor_mode" in getattr(EngineArgs, "__dataclass_fields__", {}) else None
    )


# --- the pytest plugin -------------------------------------------------------------------------

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

    def pytest_runtest_makereport(  # a hook wrapper (marked in pytest_configure)
        self, item: pytest.Item, call: Any
    ) -> Generator[None, Any, None]:
        outcome = yield
        report = outcome.get_result()
        before, now = self.last, kernel_cache.snapshot()
        writes = writers.attribute(kernel_cache.written(before, now), self._look_again(now))
        changed = writers.counted(writes)
        if report.passed and any(changed.values()):
            where = _WHERE.get(call.when, "{}").format(item.nodeid)
            note = writers.describe_not_counted(writes)
            report.outcome = "failed"
            report.longrepr = describe_written(changed, where) + (f" ({note})" if note else "")
        elif report.passed and writes:
            note = writers.describe_not_counted(writes)
            if note:
                report.sections.append(("kernel guard", note))

    def pytest_unconfigure(self, config: Any) -> None:
        if self.watch is not None:
            self.watch.stop()


def pytest_configure(config: Any) -> None:
    if guard_enabled():
        # Marked here, where pytest runs: the runner imports this module for the policy in
        # nox's interpreter, which need not have pytest.
        import pytest

        pytest.hookimpl(hookwrapper=True)(KernelGuard.pytest_runtest_makereport)
        config.pluginmanager.register(KernelGuard(), "glm5-matrix-kernel-guard")
