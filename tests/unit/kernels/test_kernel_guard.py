"""The kernel guard plugin run for real (pytester): a test or fixture that plants a kernel file in
a library's cache folder fails naming it when the guard is on; the same suite passes with the
guard off, and locks or temporary files never trip it. Then the guard's policy: when it is on,
what a refused start says, when vLLM's jit monitor joins."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix.kernels import kernel_cache, kernel_guard

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
        if library.variable:
            monkeypatch.delenv(library.variable, raising=False)
    monkeypatch.delenv("GLM5_MATRIX_STRICT", raising=False)
    triton = tmp_path / "kernels" / "triton"
    triton.mkdir(parents=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    return triton


def test_the_guard_fails_what_compiled_naming_the_kernel(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
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
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "0")
    monkeypatch.setenv("GLM5_MATRIX_STRICT", "1")  # strict, but the guard was turned off
    pytester.makepyfile(test_cell=SUITE)
    pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard").assert_outcomes(passed=4, failed=1)


def test_strict_turns_the_guard_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    monkeypatch.delenv(kernel_guard.GUARD_VARIABLE, raising=False)
    monkeypatch.setenv("GLM5_MATRIX_STRICT", "1")
    pytester.makepyfile(test_cell=SUITE)
    pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard").assert_outcomes(
        passed=2, failed=2, errors=1
    )


STRANGER_SUITE = """
import os, subprocess, sys, time
from pathlib import Path
import pytest

WRITE = '''
import os, sys, time
path, go = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "wb") as out:  # a compile in place, as ninja's nvcc writes an object
    out.write(b"half")
    out.flush()
    time.sleep(3.0)
    out.write(b"rest")
open(path + ".done", "w").close()
'''

@pytest.fixture
def stranger(request):
    # No descendant of this process: started in a session of its own by a launcher that exits,
    # in the setup phase, so that it is re-parented away before the call's watch first looks.
    cache = os.environ["TRITON_CACHE_DIR"]
    path = os.path.join(cache, "STRANGER_" + request.node.name, "_kernel.cubin")
    go = os.path.join(os.path.dirname(cache), request.node.name + ".go")
    launcher = ("import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True,"
                " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    subprocess.run([sys.executable, "-c", launcher, sys.executable, "-c", WRITE, path, go],
                   check=True)

    def compile():
        Path(go).touch()
        deadline = time.monotonic() + 30
        while not os.path.exists(path + ".done"):
            assert time.monotonic() < deadline
            time.sleep(0.05)

    return compile

def test_while_another_process_compiles(stranger):
    stranger()

def test_compiles_itself_while_another_process_compiles(stranger):
    stranger()
    path = Path(os.environ["TRITON_CACHE_DIR"]) / "OWN/_own.cubin"
    path.parent.mkdir(parents=True)
    with path.open("wb") as out:  # held open for writing long enough to be seen
        out.write(b"half")
        out.flush()
        time.sleep(3.0)
        out.write(b"rest")
"""


def test_what_another_process_compiles_never_fails_a_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    """A stranger (no descendant of the test process) compiles during a test: the test passes,
    the files named as not counted; a test that compiles beside it still fails, on its own file."""
    from glm5_matrix.kernels import writers

    # The unit tests may run in a kill-domain cgroup of their own (nox), which the stranger
    # would inherit: here the cell is this process and its descendants.
    monkeypatch.setattr(writers, "_domain_cgroups", lambda pid="self": {})
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    pytester.makepyfile(test_cell=STRANGER_SUITE)
    run = pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard", "-rfE", "-rP")
    run.assert_outcomes(passed=1, failed=1)
    out = run.stdout.str()
    assert "triton: 1 file(s) (OWN/_own.cubin)" in out
    assert "file(s) (STRANGER" not in out
    # Each test: the stranger's kernel and its .done file, named as not counted.
    assert out.count("2 written by process(es) outside the cell") == 2


DEEPGEMM_SUITE = """
import os, subprocess, sys
from pathlib import Path

NAME = "gemm_4096_2048_128_128_128_288_5288_5_1_GroupedWithOffset"
# What FlashInfer's DeepGEMM compiler does in the engine's process at a GEMM's first use
# (deep_gemm/compiler.cuh): the source and the compiler's output in tmp/, then a rename.
COMPILE = '''
import os, sys
from pathlib import Path
root, name = Path(sys.argv[1]), sys.argv[2]
work = root / "tmp" / (name + "_1733450000000_7")
work.mkdir(parents=True)
(work / "kernel.cu").write_text("// generated")
(work / "nvcc_kernel.cubin").write_bytes(b"cubin")  # nvcc -o tmp/.../nvcc_kernel.cubin
(root / "cache" / name).mkdir(parents=True)
os.rename(work / "nvcc_kernel.cubin", root / "cache" / name / "nvcc_kernel.cubin")
'''

def test_a_moe_gemm_first_used():
    subprocess.run([sys.executable, "-c", COMPILE, os.environ["TRTLLM_DG_CACHE_DIR"], NAME],
                   check=True)

def test_a_moe_gemm_found_in_the_cache():
    path = Path(os.environ["TRTLLM_DG_CACHE_DIR"]) / "cache" / NAME / "nvcc_kernel.cubin"
    assert path.is_file()
"""


def test_a_trtllm_deepgemm_kernel_compiled_by_the_cell_fails_the_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, caches: Path
) -> None:
    """The DeepGEMM kernels FlashInfer's CUTLASS MoE compiles at run time are in the kernel
    cache (TRTLLM_DG_CACHE_DIR) and counted: a test whose process compiled one fails naming
    it; the next test, which finds it there, passes."""
    folder = caches.parent / "trtllm_deep_gemm"
    folder.mkdir()
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(folder))
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    pytester.makepyfile(test_cell=DEEPGEMM_SUITE)
    run = pytester.runpytest("-p", "glm5_matrix.kernels.kernel_guard", "-rf")
    run.assert_outcomes(passed=1, failed=1)
    out = run.stdout.str()
    assert "during test_cell.py::test_a_moe_gemm_first_used" in out
    assert (
        "trtllm_deep_gemm: 1 file(s) (cache/gemm_4096_2048_128_128_128_288_5288_5_1_"
        "GroupedWithOffset/nvcc_kernel.cubin)"
    ) in out


# --- the policy, as the engines' starts and the runner read it ---------------------------------


def test_guard_setting_follows_strict_unless_set(monkeypatch) -> None:
    monkeypatch.delenv(kernel_guard.GUARD_VARIABLE, raising=False)
    monkeypatch.delenv("GLM5_MATRIX_STRICT", raising=False)
    assert not kernel_guard.guard_enabled()
    monkeypatch.setenv("GLM5_MATRIX_STRICT", "1")
    assert kernel_guard.guard_enabled()
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "0")  # the warm step turns it off
    assert not kernel_guard.guard_enabled()
    monkeypatch.delenv("GLM5_MATRIX_STRICT")
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    assert kernel_guard.guard_enabled()


def test_refuse_compiled_names_the_files_when_the_guard_is_on(monkeypatch) -> None:
    changed = {"triton": [f"K{i}/k{i}.cubin" for i in range(6)], "flashinfer": []}
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "0")
    kernel_guard.refuse_compiled(changed, "the start of engine e")  # off: nothing
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    kernel_guard.refuse_compiled({"triton": []}, "the start of engine e")  # nothing compiled
    with pytest.raises(kernel_guard.KernelCompiled) as raised:
        kernel_guard.refuse_compiled(changed, "the start of engine e")
    message = str(raised.value)
    assert "during the start of engine e" in message
    assert "triton: 6 file(s) (K0/k0.cubin, K1/k1.cubin, K2/k2.cubin, K3/k3.cubin, ... 2 more)" in (
        message
    )
    assert "flashinfer" not in message and "\n" not in message


def test_jit_monitor_mode_needs_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "0")
    assert kernel_guard.jit_monitor_mode(False) is None
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    assert kernel_guard.jit_monitor_mode(True) is None  # vLLM disables it under enforce_eager
    try:
        import vllm.engine.arg_utils  # noqa: F401
    except ImportError:  # the harness environment: no vLLM, so no monitor to ask for
        assert kernel_guard.jit_monitor_mode(False) is None
    else:
        assert kernel_guard.jit_monitor_mode(False) == "error"


def test_autotune_results_measured_on_the_gpu_point_at_the_warm_step_on_this_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FlashInfer's autotuner writes what it measured per GPU model (the first H100 run's
    flashinfer start: 43 entries and a manifest naming the GPU under autotune/v2/<hash>/): no
    build off the GPU makes them, so the line says to warm on this GPU model."""
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    entries = [
        f".cache/flashinfer/autotune/v2/8ad65a9be513f4ab/entries/{i:024x}.json" for i in range(3)
    ]
    changed = {
        "flashinfer": [*entries, ".cache/flashinfer/0.7.2.post1/90a/cached_ops/trtllm_utils/x.o"],
        "vllm": ["flashinfer_autotune_cache/abc/autotune_configs_dp0_rank1.json"],
    }
    assert kernel_guard.gpu_measured(changed) == 4
    with pytest.raises(kernel_guard.KernelCompiled) as raised:
        kernel_guard.refuse_compiled(changed, "the start of engine e")
    message = str(raised.value)
    assert "4 of them autotune results FlashInfer measured on this GPU model" in message
    assert "`nox -s warm -- CELL` on this GPU model first" in message
    # A compile that a build off the GPU could have made keeps the plain advice.
    with pytest.raises(kernel_guard.KernelCompiled) as raised:
        kernel_guard.refuse_compiled({"flashinfer": changed["flashinfer"][3:]}, "x")
    assert "on this machine first" in str(raised.value)
    assert "measured" not in str(raised.value)
