"""glm5_matrix.kernels.flashinfer_aot without a GPU or FlashInfer: the provider package the
runner writes (read the way FlashInfer's jit/env.py reads one), which modules a key folder
lists, the symbols a narrowed build may leave out, the preflight that refuses a start FlashInfer
would spend building, and build-moe's refusals of bad input. The build itself and FlashInfer's
load of its output are checked by `glm5-matrix kernel-cache check-moe` on a machine with the
cell's interpreter (docs/flashinfer-moe.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scaffold import KERNEL_KEY, run_cli

from glm5_matrix.kernels import flashinfer_aot, kernel_cache

# What FlashInfer 0.7.2.post1's _get_aot_providers reads of a provider (flashinfer/jit/env.py).
READ = """
import json, sys
import flashinfer_jit_cache as shim
(provider,) = shim.get_jit_cache_providers()
print(json.dumps({
    "version": shim.__version__,
    "provider": [provider.provider_id, provider.distribution, provider.version],
    "dir": str(provider.jit_cache_dir),
    "archs": sorted(frozenset(provider.cuda_architectures)),
    "modules": sorted(frozenset(provider.modules)),
}))
"""


def _cache(tmp_path: Path) -> kernel_cache.KernelCache:
    root = {kernel_cache.ROOT_VARIABLE: str(tmp_path / "kernels")}
    return kernel_cache.prepare(kernel_cache.layout(KERNEL_KEY, root))


def _module(kernels: kernel_cache.KernelCache, name: str = "fused_moe_90") -> Path:
    folder = flashinfer_aot.library_folder(kernels) / name
    folder.mkdir(parents=True)
    (folder / f"{name}.so").write_bytes(b"\x7fELF")
    (folder / "build.json").write_text(json.dumps({"variant": "fp8-block-scale"}))
    return folder / f"{name}.so"


def test_no_module_no_provider(tmp_path: Path) -> None:
    kernels = _cache(tmp_path)
    (flashinfer_aot.library_folder(kernels) / "fused_moe_90").mkdir()  # a folder, no .so
    assert flashinfer_aot.modules(kernels) == {}
    assert flashinfer_aot.write_provider(kernels, tmp_path / "site") is None
    assert flashinfer_aot.activate(kernels, sys.executable, {}, tmp_path / "site") is None
    assert not (tmp_path / "site").exists()


def test_the_provider_lists_the_key_folders_modules_as_flashinfer_reads_it(tmp_path: Path) -> None:
    kernels = _cache(tmp_path)
    so = _module(kernels)
    site = tmp_path / "site"
    line = flashinfer_aot.activate(kernels, sys.executable, {}, site)
    assert line is not None and "fused_moe_90 (fp8-block-scale)" in line
    read = subprocess.run(
        [sys.executable, "-c", READ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
        check=True,
    )
    found = json.loads(read.stdout)
    assert found == {
        # FlashInfer ignores a provider whose version is not its own.
        "version": KERNEL_KEY["flashinfer-python"],
        "provider": [flashinfer_aot.PROVIDER_ID, flashinfer_aot.PROVIDER_ID, "0.7.2.post1"],
        "dir": str(so.parent.parent),  # <dir>/<module>/<module>.so, as FlashInfer looks it up
        "archs": ["sm90a"],  # exact-arch SASS: loaded on SM90 only
        "modules": ["fused_moe_90"],
    }


def test_an_interpreters_own_flashinfer_jit_cache_is_kept(tmp_path: Path) -> None:
    kernels = _cache(tmp_path)
    _module(kernels)
    own = tmp_path / "own"
    (own / flashinfer_aot.PROVIDER_PACKAGE).mkdir(parents=True)
    (own / flashinfer_aot.PROVIDER_PACKAGE / "__init__.py").write_text("")
    line = flashinfer_aot.activate(
        kernels, sys.executable, {"PYTHONPATH": str(own)}, tmp_path / "s"
    )
    assert line is not None and "not listed" in line
    assert not (tmp_path / "s").exists()


def test_active_module_is_the_key_folders_build(tmp_path: Path) -> None:
    kernels = _cache(tmp_path)
    assert flashinfer_aot.active_module(environ=kernels.environment()) is None
    so = _module(kernels)
    assert flashinfer_aot.active_module(environ=kernels.environment()) == so
    assert flashinfer_aot.active_module(environ={}) is None


def test_only_other_paths_symbols_may_be_left_out() -> None:
    other = [
        "tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner<__half, __half, __half, void, "
        "false, (tensorrt_llm::kernels::cutlass_kernels::Sm90Wfp4Afp8ScaleMode)0>::MoeGemmRunner()",
        "void tensorrt_llm::kernels::cutlass_kernels_oss::tma_warp_specialized_generic_moe_gemm_"
        "kernelLauncher<cutlass::arch::Sm90, float, float, float>(...)",
    ]
    assert flashinfer_aot.path_symbols(other) == []
    own = (
        "tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner<__nv_bfloat16, __nv_fp8_e4m3, "
        "__nv_bfloat16, void, false, (Sm90Wfp4Afp8ScaleMode)0>::getConfigs() const"
    )
    block = (
        "tensorrt_llm::kernels::fp8_blockscale_gemm::CutlassFp8BlockScaleGemmRunner<...>::moeGemm"
    )
    assert flashinfer_aot.path_symbols([*other, own, block]) == [own, block]


def test_ninja_edges_of_a_flashinfer_build_file(tmp_path: Path) -> None:
    ninja = tmp_path / "build.ninja"
    ninja.write_text(
        "rule cuda_compile\n  command = nvcc\n\n"
        "build /b/common_logger.o: compile /s/logger.cpp\n"
        "build /b/x_binding.cuda.o: cuda_compile /s/binding.cu\n"
        "  cuda_cflags = -O3\n"
        "build /b/fused_moe_90.so: link /b/common_logger.o /b/x_binding.cuda.o\n"
    )
    edges = flashinfer_aot._ninja_edges(ninja)
    assert edges["/b/common_logger.o"] == ("compile", "/s/logger.cpp")
    assert edges["/b/x_binding.cuda.o"] == ("cuda_compile", "/s/binding.cu")
    assert edges["/b/fused_moe_90.so"][0] == "link"


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--jobs", "0"], "--jobs 0: must be at least 1"),
        (["--export", "/nonexistent/x.tar.gz"], "/nonexistent: folder not found"),
        (["--profile", "no-such-model"], "no-such-model"),
        (["--tp", "3"], "TP 3 does not split the MoE intermediate size 2048"),
    ],
)
def test_build_moe_refuses_bad_input_in_one_line_creating_nothing(
    tmp_path: Path, arguments: list[str], said: str
) -> None:
    root = tmp_path / "kernels"
    done = run_cli(
        "kernel-cache",
        "build-moe",
        *arguments,
        env={**os.environ, kernel_cache.ROOT_VARIABLE: str(root)},
        timeout=120,
    )
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not root.exists()


def _flashinfer_resolving_to(site: Path, provider: str, path: str) -> None:
    """A stand-in for FlashInfer's jit/env.py whose get_aot_artifacts answers one artifact."""
    package = site / "flashinfer" / "jit"
    package.mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "env.py").write_text(
        "import collections, pathlib\n"
        "A = collections.namedtuple('A', 'provider_id path cuda_architectures')\n"
        f"def get_aot_artifacts(name):\n    return (A({provider!r}, pathlib.Path({path!r}), None),)\n"
    )


def test_a_start_is_refused_when_flashinfer_would_not_take_the_kernel_caches_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """refuse_unless_resolved asks FlashInfer (get_aot_artifacts, in a fresh process) where the
    module comes from before an engine starts: elsewhere than the kernel cache is an
    AssertionError naming both (a 48-minute build avoided), the kernel cache's is its path."""
    kernels = _cache(tmp_path)
    monkeypatch.setenv(kernel_cache.ACTIVE_VARIABLE, str(kernels.directory))
    assert flashinfer_aot.refuse_unless_resolved() is None  # no module: nothing to ask
    so = _module(kernels)
    other = tmp_path / "other"
    _flashinfer_resolving_to(other, "flashinfer-python", "/site/flashinfer/data/aot/x.so")
    monkeypatch.setenv("PYTHONPATH", str(other))
    with pytest.raises(AssertionError, match="not to the kernel cache's"):
        flashinfer_aot.refuse_unless_resolved()
    ours = tmp_path / "ours"
    _flashinfer_resolving_to(ours, flashinfer_aot.PROVIDER_ID, str(so))
    monkeypatch.setenv("PYTHONPATH", str(ours))
    assert flashinfer_aot.refuse_unless_resolved() == so


def test_the_provider_lists_trtllm_utils_beside_fused_moe_90(tmp_path: Path) -> None:
    """build-moe puts FlashInfer's trtllm_utils (the autotuner's delay kernel) beside the MoE
    module: the one provider lists both, so neither is built at a start."""
    kernels = _cache(tmp_path)
    _module(kernels)
    _module(kernels, flashinfer_aot.UTILS_MODULE)
    site = tmp_path / "site"
    line = flashinfer_aot.activate(kernels, sys.executable, {}, site)
    assert line is not None and "trtllm_utils" in line and "fused_moe_90" in line
    read = subprocess.run(
        [sys.executable, "-c", READ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
        check=True,
    )
    assert json.loads(read.stdout)["modules"] == ["fused_moe_90", "trtllm_utils"]


def test_build_moe_exports_both_modules_their_kernels_and_the_generated_sources() -> None:
    moe = {
        "module": "fused_moe_90",
        "deepgemm_kernels": [{"name": "gemm_swapAB_4096_2048_128_16_128_1_81_8_1_Normal"}],
        "generated_sources": "flashinfer/.cache/flashinfer/0.7.2.post1/90a/generated/x",
    }
    assert flashinfer_aot.exported([moe, {"module": "trtllm_utils"}]) == [
        "flashinfer_aot/fused_moe_90/",
        "trtllm_deep_gemm/cache/gemm_swapAB_4096_2048_128_16_128_1_81_8_1_Normal/",
        "flashinfer/.cache/flashinfer/0.7.2.post1/90a/generated/x/",
        "flashinfer_aot/trtllm_utils/",
    ]
