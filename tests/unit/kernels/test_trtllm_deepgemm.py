"""glm5_matrix.kernels.trtllm_deepgemm without a GPU: the MoE shapes of a model per TP rank, and
the refusal when FlashInfer's DeepGEMM JIT no longer reads as the module copies it. The kernels
themselves are compiled by `glm5-matrix kernel-cache build-moe` (docs/flashinfer-moe.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import trtllm_deepgemm

GLM_CONFIG = {
    "text_config": {"hidden_size": 4096, "moe_intermediate_size": 2048, "n_routed_experts": 288}
}


def test_moe_shapes_per_rank() -> None:
    tp1, tp2, tp4 = trtllm_deepgemm.moe_shapes(GLM_CONFIG, [1, 2, 4])
    # FC1 is gated (gate and up: 2 x intermediate), FC2 brings it back to the hidden size.
    assert tp1.gemms() == [(4096, 4096, 288), (4096, 2048, 288)]
    assert tp2.gemms() == [(2048, 4096, 288), (4096, 1024, 288)]
    assert tp4.gemms() == [(1024, 4096, 288), (4096, 512, 288)]
    with pytest.raises(UserError, match="TP 3 does not split"):
        trtllm_deepgemm.moe_shapes(GLM_CONFIG, [3])
    with pytest.raises(UserError, match="no MoE sizes"):
        trtllm_deepgemm.moe_shapes({"hidden_size": 8}, [1])


def test_a_changed_deepgemm_compiler_refuses_the_build(tmp_path: Path) -> None:
    """The DeepGEMM kernels are compiled under the names and flags FlashInfer's compiler.cuh
    uses, copied in DEEPGEMM_PROGRAM and DEEPGEMM_NVCC_FLAGS: a FlashInfer whose compiler reads
    otherwise refuses the build (the kernels would be found under no name it asks)."""
    tree = tmp_path / "tensorrt_llm"
    for relative, anchors in trtllm_deepgemm._DEEPGEMM_ANCHORS.items():
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        (tree / relative).write_text("\n".join(anchors))
    trtllm_deepgemm.check_deepgemm_sources(tree)
    compiler = tree / "deep_gemm" / "compiler.cuh"
    compiler.write_text(compiler.read_text().replace('"-O3"', '"-O2"'))
    with pytest.raises(UserError, match=r"compiler\.cuh: no longer holds '\"-O3\"'"):
        trtllm_deepgemm.check_deepgemm_sources(tree)
