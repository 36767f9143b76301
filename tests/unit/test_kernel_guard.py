"""The kernel guard plugin run for real (pytester): a test or fixture that plants a kernel file in
a library's cache folder fails naming it when the guard is on; the same suite passes with the
guard off, and locks or temporary files never trip it."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix.kernels import kernel_cache

pytest_plugins = ("pytester",)

SUITE = """
import os
from pathlib import Path
import pytest

def plant(relative):
    path = Path(os.environ["TRITON_CACHE_DIR"]) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("compiled")

@pytest.fixture(scope="module")
def engine():
    plant("SETUP/_setup_kernel.cubin")  # what an engine start compiling would do
    yield

def test_compiles_during_the_call():
    plant("CALL/_fwd_kernel.cubin")

def test_compiles_nothing():
    pass

def test_writes_only_a_lock_and_a_temp_file():
    plant("tmp.pid_1_abc/_fwd_kernel.cubin")
    plant("lock")

def test_after_a_compiling_fixture(engine):
    pass

def test_fails_by_itself():
    plant("OWN/_own_kernel.cubin")
    assert False, "its own failure"
"""


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for library in kernel_cache.LIBRARIES:
        monkeypatch.delenv(library.variable, raising=False)
    monkeypatch.delenv("GLM5_MATRIX_STRICT", raising=False)
    triton = tmp_path / "kernels" / "triton"
    triton.mkdir(parents=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    return triton


def test_the_guard_fails_what_compiled_naming_the_kernel(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "1")
    pytester.makepyfile(test_cell=SUITE)
    run = pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard", "-rfE")
    run.assert_outcomes(passed=2, failed=2, errors=1)
    out = run.stdout.str()
    assert "during test_cell.py::test_compiles_during_the_call" in out
    assert "triton: 1 file(s) (CALL/_fwd_kernel.cubin)" in out
    assert "during setup of test_cell.py::test_after_a_compiling_fixture" in out
    assert "triton: 1 file(s) (SETUP/_setup_kernel.cubin)" in out
    # A test that failed by itself keeps its own failure.
    assert "its own failure" in out and "(OWN/_own_kernel.cubin)" not in out


def test_with_the_guard_off_the_same_suite_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "0")
    monkeypatch.setenv("GLM5_MATRIX_STRICT", "1")  # strict, but the guard was turned off
    pytester.makepyfile(test_cell=SUITE)
    pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard").assert_outcomes(passed=4, failed=1)


def test_strict_turns_the_guard_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    monkeypatch.delenv(kernel_cache.GUARD_VARIABLE, raising=False)
    monkeypatch.setenv("GLM5_MATRIX_STRICT", "1")
    pytester.makepyfile(test_cell=SUITE)
    pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard").assert_outcomes(
        passed=2, failed=2, errors=1
    )
