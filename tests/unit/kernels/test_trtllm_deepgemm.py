"""glm5_matrix.kernels.trtllm_deepgemm without a GPU: which GEMMs of a model FlashInfer hands to
TensorRT-LLM's DeepGEMM per TP rank (the MoE's grouped GEMMs, the dense fp8 linears), which
kernels they ask for (best_gemm_config, FlashInfer's heuristic in Python, checked against the
names a GPU run compiled), which of them a key folder lacks, and the refusals when FlashInfer's
DeepGEMM JIT or vLLM's dispatch no longer reads as the module copies it. The kernels themselves
are compiled by `glm5-matrix kernel-cache build-moe` (docs/flashinfer-moe.md), which also
checks best_gemm_config against FlashInfer's own function for every GEMM it builds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from scaffold import KERNEL_KEY

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.kernels import kernel_cache, trtllm_deepgemm

GLM_CONFIG = json.loads((repo_root() / "profiles" / "glm-5.3-flash-4l" / "config.json").read_text())

# The TensorRT-LLM DeepGEMM cubins the first H100 run (H100 80GB HBM3, 132 SMs, vLLM 0.33.0,
# 2026-12-06) compiled at run time in e2e-tp1(deep_gemm): the dense fp8 linears' swapAB
# kernels (exported in /work/gpu-run/kernels.tar.gz.000, trtllm_deep_gemm/cache/).
H100_DENSE_TP1 = {
    "gemm_swapAB_24576_4096_128_16_128_1_81_8_1_Normal",
    "gemm_swapAB_4096_12288_128_16_128_1_81_8_1_Normal",
    "gemm_swapAB_4096_2048_128_16_128_1_81_8_1_Normal",
    "gemm_swapAB_4096_4096_128_16_128_1_81_8_1_Normal",
}


def _names(gemms: list[trtllm_deepgemm.Gemm], sms: tuple[int, ...] = (132,)) -> set[str]:
    return set(trtllm_deepgemm.kernel_names(gemms, sms))


def test_moe_gemms_per_rank() -> None:
    found = trtllm_deepgemm.moe_gemms(GLM_CONFIG, [1, 2, 4])
    # FC1 is gated (gate and up: 2 x intermediate), FC2 brings it back to the hidden size; every
    # rank holds all 288 experts.
    assert [(g.tp, g.what, g.n, g.k, g.groups) for g in found] == [
        (1, "moe fc1", 4096, 4096, 288),
        (1, "moe fc2", 4096, 2048, 288),
        (2, "moe fc1", 2048, 4096, 288),
        (2, "moe fc2", 4096, 1024, 288),
        (4, "moe fc1", 1024, 4096, 288),
        (4, "moe fc2", 4096, 512, 288),
    ]
    assert {g.gemm_type for g in found} == {trtllm_deepgemm.GROUPED}
    with pytest.raises(UserError, match="TP 3 does not split the MoE intermediate size 2048"):
        trtllm_deepgemm.moe_gemms(GLM_CONFIG, [3])
    with pytest.raises(UserError, match="no 'moe_intermediate_size'"):
        trtllm_deepgemm.moe_gemms({"hidden_size": 8}, [1])


def test_dense_gemms_are_the_dense_mlp_and_the_shared_experts_per_rank() -> None:
    found = trtllm_deepgemm.dense_gemms(GLM_CONFIG, [1, 2, 4])
    assert [(g.tp, g.what, g.n, g.k) for g in found] == [
        (1, "dense gate_up", 24576, 4096),
        (1, "dense down", 4096, 12288),
        (1, "shared expert gate_up", 4096, 4096),
        (1, "shared expert down", 4096, 2048),
        (2, "dense gate_up", 12288, 4096),
        (2, "dense down", 4096, 6144),
        (2, "shared expert gate_up", 2048, 4096),
        (2, "shared expert down", 4096, 1024),
        (4, "dense gate_up", 6144, 4096),
        (4, "dense down", 4096, 3072),
        (4, "shared expert gate_up", 1024, 4096),
        (4, "shared expert down", 4096, 512),
    ]
    # One group, vLLM's FlashInfer branch: fewer than 32 tokens.
    assert {(g.groups, g.gemm_type, g.tokens_max) for g in found} == {(1, "Normal", 31)}
    # Without fp8 128x128 block scales no linear reaches FlashInfer's block-scale GEMM.
    bf16 = {**GLM_CONFIG, "text_config": dict(GLM_CONFIG["text_config"])}
    bf16.pop("quantization_config", None)
    bf16["text_config"].pop("quantization_config", None)
    assert trtllm_deepgemm.dense_gemms(bf16, [1]) == []
    with pytest.raises(UserError, match="TP 5 does not split the intermediate size 12288"):
        trtllm_deepgemm.dense_gemms(GLM_CONFIG, [5])


def test_the_dense_kernels_at_tp1_are_the_ones_the_h100_compiled() -> None:
    """The H100 run's e2e-tp1(deep_gemm) batches had at most 16 tokens below the 32 where vLLM
    leaves FlashInfer: those token counts ask for exactly the 4 kernels it compiled; the whole
    range adds the 24- and 32-wide tiles of the widest layer (17-31 tokens)."""
    dense = trtllm_deepgemm.dense_gemms(GLM_CONFIG, [1])
    up_to_16 = [dataclasses.replace(g, tokens_max=16) for g in dense]
    assert _names(up_to_16) == H100_DENSE_TP1
    assert _names(dense) == H100_DENSE_TP1 | {
        "gemm_swapAB_24576_4096_128_24_128_1_61_6_1_Normal",
        "gemm_swapAB_24576_4096_128_32_128_1_81_8_1_Normal",
    }
    # The H100 PCIe's 114 SMs pick the same tiles here.
    assert _names(dense, (114,)) == _names(dense)
    everything = trtllm_deepgemm.dense_gemms(GLM_CONFIG, [1, 2, 4])
    assert len(_names(everything, trtllm_deepgemm.DEEPGEMM_SMS)) == 16


def test_the_moe_kernels_are_the_ones_build_moe_compiled_with_flashinfers_function() -> None:
    """The 30 MoE kernels the first build-moe compiled (FlashInfer's get_best_gemm_config, run
    by DEEPGEMM_PROGRAM over every token count up to 16384 on 114 and 132 SMs): per GEMM, three
    swapAB tiles below 32 tokens, a 64-row tile up to 64 and a 128-row one from 65 on."""
    expected = set()
    for n, k in ((4096, 4096), (4096, 2048), (2048, 4096), (4096, 1024), (1024, 4096), (4096, 512)):
        for tile in (
            "swapAB_{n}_{k}_128_16_128_288_8288_8",
            "swapAB_{n}_{k}_128_24_128_288_6288_6",
        ):
            expected.add("gemm_" + tile.format(n=n, k=k) + "_1_GroupedWithOffset")
        for tile in (
            "swapAB_{n}_{k}_128_32_128_288_8288_8",
            "{n}_{k}_64_128_128_288_8288_8",
            "{n}_{k}_128_128_128_288_5288_5",
        ):
            expected.add("gemm_" + tile.format(n=n, k=k) + "_1_GroupedWithOffset")
    moe = trtllm_deepgemm.moe_gemms(GLM_CONFIG, [1, 2, 4])
    asked = trtllm_deepgemm.kernel_names(moe, trtllm_deepgemm.DEEPGEMM_SMS)
    assert set(asked) == expected
    # The token counts that first asked for each tile, as FlashInfer's function gave them.
    assert sorted({first for _, first, _ in asked.values()}) == [1, 17, 25, 32, 65]


def test_a_multicast_tile_is_named_as_compiler_build_names_it() -> None:
    """A large dense GEMM without swap takes TMA multicast 2 (jit_utils.cuh): the name's
    multicast field carries it."""
    config = trtllm_deepgemm.best_gemm_config(4096, 4096, 4096, 1, 132)
    assert config[3] == 2
    gemm = trtllm_deepgemm.Gemm("x", 1, 4096, 4096, 1, trtllm_deepgemm.NORMAL, 4096)
    name = trtllm_deepgemm.kernel_name(gemm, False, config)
    assert name == f"gemm_4096_4096_{config[0]}_{config[1]}_128_1_{config[2]}1_{config[2]}_2_Normal"


def test_absent_kernels_are_those_the_key_folder_lacks(tmp_path: Path) -> None:
    root = {kernel_cache.ROOT_VARIABLE: str(tmp_path / "kernels")}
    kernels = kernel_cache.prepare(kernel_cache.layout(KERNEL_KEY, root))
    dense = [
        dataclasses.replace(g, tokens_max=16) for g in trtllm_deepgemm.dense_gemms(GLM_CONFIG, [1])
    ]
    asked, absent = trtllm_deepgemm.absent_kernels(kernels, dense, (132,))
    assert set(asked) == set(absent) == H100_DENSE_TP1
    cache = kernels.folder(kernel_cache.library("trtllm_deep_gemm")) / "cache"
    for name in sorted(H100_DENSE_TP1)[:3]:
        (cache / name).mkdir(parents=True)
        (cache / name / trtllm_deepgemm.DEEPGEMM_CUBIN).write_bytes(b"\x7fELF")
    (cache / sorted(H100_DENSE_TP1)[3]).mkdir()  # a folder without its cubin: still absent
    assert trtllm_deepgemm.absent_kernels(kernels, dense, (132,))[1] == [sorted(H100_DENSE_TP1)[3]]
    record = {"deepgemm_gemms": [dataclasses.asdict(g) for g in dense]}
    assert trtllm_deepgemm.gemms_of_record(record) == dense


def _tree(root: Path, anchors: dict[str, tuple[str, ...]]) -> None:
    for relative, wanted in anchors.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text("\n".join(wanted))


def test_a_changed_deepgemm_compiler_refuses_the_build(tmp_path: Path) -> None:
    """The DeepGEMM kernels are compiled under the names and flags FlashInfer's compiler.cuh
    uses, copied in DEEPGEMM_PROGRAM and DEEPGEMM_NVCC_FLAGS: a FlashInfer whose compiler reads
    otherwise refuses the build (the kernels would be found under no name it asks)."""
    tree = tmp_path / "tensorrt_llm"
    _tree(tree, trtllm_deepgemm._DEEPGEMM_ANCHORS)
    trtllm_deepgemm.check_deepgemm_sources(tree)
    compiler = tree / "deep_gemm" / "compiler.cuh"
    compiler.write_text(compiler.read_text().replace('"-O3"', '"-O2"'))
    with pytest.raises(UserError, match=r"compiler\.cuh: no longer holds '\"-O3\"'"):
        trtllm_deepgemm.check_deepgemm_sources(tree)


def test_a_vllm_that_routes_the_dense_linears_otherwise_refuses_the_build(tmp_path: Path) -> None:
    """dense_gemms() copies vLLM's dispatch: FlashInfer below 32 tokens, N % 64 and K % 128, the
    FlashInfer/DeepGEMM kernel first, GLM-5.3-Flash's bf16 attention projections. A vLLM that
    moved the threshold (or lost a file) refuses the build."""
    tree = tmp_path / "vllm"
    _tree(tree, trtllm_deepgemm._VLLM_ANCHORS)
    trtllm_deepgemm.check_vllm_sources(tree)
    dispatch = tree / "model_executor" / "kernels" / "linear" / "scaled_mm" / "flashinfer.py"
    dispatch.write_text(dispatch.read_text().replace("< 32", "< 64"))
    with pytest.raises(UserError, match=r"flashinfer\.py: no longer holds 'condition = input"):
        trtllm_deepgemm.check_vllm_sources(tree)
    dispatch.unlink()
    with pytest.raises(UserError, match=r"flashinfer\.py: not found"):
        trtllm_deepgemm.check_vllm_sources(tree)
