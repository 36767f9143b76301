"""TensorRT-LLM's DeepGEMM kernels, compiled off the GPU the way FlashInfer compiles them at run
time, into the kernel cache's trtllm_deep_gemm library (TRTLLM_DG_CACHE_DIR).

Two of FlashInfer's modules hand fp8 block-scale GEMMs to TensorRT-LLM's DeepGEMM, which
compiles a kernel at the first use of each configuration (deep_gemm/compiler.cuh,
Compiler::build): it generates a kernel.cu (generateKernel), runs nvcc on it with
DEEPGEMM_NVCC_FLAGS and the include folder FlashInfer passes (csrc/nv_internal/tensorrt_llm), and
renames the cubin to $TRTLLM_DG_CACHE_DIR/cache/<name>/nvcc_kernel.cubin, where the next process
finds it by name:

- fused_moe_90 (the flashinfer MoE axis): the MoE's two grouped GEMMs per rank, GroupedWithOffset,
  at every token count (grouped_gemm_dispatch, fp8_blockscale_gemm_kernel.cuh);
- fp8_blockscale_gemm_90 (every cell of the profile, whatever its MoE backend): the dense fp8
  linear layers. vLLM 0.33.0 picks FlashInferFp8DeepGEMMDynamicBlockScaledKernel first for an
  fp8 block-scale linear on CUDA (vllm/model_executor/kernels/linear/__init__.py,
  _POSSIBLE_FP8_BLOCK_KERNELS) when N % 64 == 0 and K % 128 == 0 (vllm/utils/flashinfer.py,
  should_use_flashinfer_for_blockscale_fp8_gemm; VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER defaults to
  1), and that kernel calls FlashInfer's fp8_blockscale_gemm_sm90 for batches of fewer than 32
  tokens only (torch.cond, `input.shape[0] < 32`; vLLM's own DeepGEMM above), which runs
  gemm_dispatch: a Normal GEMM with one group, swapAB below 32 tokens.

Which configuration a GEMM takes is FlashInfer's get_best_gemm_config of (tokens, N, K, groups,
SMs) as the dispatch calls it. DEEPGEMM_PROGRAM calls those functions of FlashInfer's headers for
every token count a GEMM is called with; best_gemm_config() is the same function in Python, so
that the names a start asks for can be listed and checked without a compiler (check-moe, the
unit tests): the build refuses when the two disagree.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic
from glm5_matrix.kernels import cuda_toolchain, kernel_cache
from glm5_matrix.kernels.kernel_cache import KernelCache

DEEPGEMM_NVCC_FLAGS = (
    "-std=c++17",
    "--gpu-architecture=sm_90a",
    "--ptxas-options=-allow-expensive-optimizations=true",
    "--ptxas-options=--register-usage-level=10",
    "--diag-suppress=161,174,177,940",
    "-D__FORCE_INCLUDE_CUDA_FP16_HPP_FROM_FP16_H__=1",
    "-D__FORCE_INCLUDE_CUDA_BF16_HPP_FROM_BF16_H__=1",
    "-O3",
    "-cubin",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--compiler-options=-fPIC,-O3,-Wno-deprecated-declarations,-Wno-abi",
)
DEEPGEMM_CUBIN = "nvcc_kernel.cubin"
# Every token count a MoE forward may have up to this (vLLM's batches and FlashInfer's
# autotuner buckets stay below it; from 65 tokens on one configuration serves all).
DEEPGEMM_M_MAX = 16384
# vLLM calls FlashInfer's dense fp8 block-scale GEMM below this many tokens only.
DENSE_TOKENS_BELOW = 32
# SM counts of the GPUs whose configurations are compiled: H100 PCIe (114), H100 SXM and H200
# (132). An H20 (78) runs another MoE module (fused_moe_90_h20_prebuilt_d).
DEEPGEMM_SMS = (114, 132)
GROUPED = "GroupedWithOffset"  # fused_moe_90's grouped GEMMs
NORMAL = "Normal"  # fp8_blockscale_gemm_90's dense GEMM

DEEPGEMM_PROGRAM = r"""// Written by glm5-matrix (glm5_matrix.kernels.trtllm_deepgemm): the TensorRT-LLM DeepGEMM
// kernels FlashInfer compiles at run time for fp8 block-scale GEMMs of the given shapes, with
// their sources, from FlashInfer's own functions.
// Arguments: OUT_DIR SMS[,SMS...] TYPE:N:K:GROUPS:TOKENS_MAX [...]
// TYPE: GroupedWithOffset (fused_moe_90's MoE, grouped_gemm_dispatch) or Normal (the dense
// GEMM of fp8_blockscale_gemm_90, gemm_dispatch).
#include "deep_gemm/compiler.cuh"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  std::filesystem::path out(argv[1]);
  std::vector<int> sms_list;
  std::stringstream sms_text(argv[2]);
  for (std::string item; std::getline(sms_text, item, ',');) sms_list.push_back(std::stoi(item));
  std::set<std::string> seen;
  constexpr uint32_t block_k = 128;
  for (int a = 3; a < argc; ++a) {
    char kind[32];
    uint32_t n, k, groups, m_max;
    if (std::sscanf(argv[a], "%31[A-Za-z]:%u:%u:%u:%u", kind, &n, &k, &groups, &m_max) != 5)
      return 2;
    bool const grouped = std::string(kind) == "GroupedWithOffset";
    if (!grouped && std::string(kind) != "Normal") return 2;
    auto const type = grouped ? deep_gemm::GemmType::GroupedWithOffset : deep_gemm::GemmType::Normal;
    for (int sms : sms_list) {
      // grouped_gemm_dispatch: 64 tokens on an H20, else 32; gemm_dispatch: m_threshold 32.
      uint32_t threshold = grouped ? (sms == 78 ? 64 : 32) : 32;
      for (uint32_t m = 1; m <= m_max; ++m) {
        bool swap = m < threshold;
        auto [bm, bn, stages, multicast, smem] =
            swap ? deep_gemm::jit::get_best_gemm_config(n, m, k, groups, sms, false, true)
                 : deep_gemm::jit::get_best_gemm_config(m, n, k, groups, sms);
        // Compiler::build's name as it writes it (num_groups and num_stages twice).
        std::string name = std::string(swap ? "gemm_swapAB_" : "gemm_") + std::to_string(n) +
                           "_" + std::to_string(k) + "_" + std::to_string(bm) + "_" +
                           std::to_string(bn) + "_" + std::to_string(block_k) + "_" +
                           std::to_string(groups) + "_" + std::to_string(stages) +
                           std::to_string(groups) + "_" + std::to_string(stages) + "_" +
                           std::to_string(multicast) + "_" +
                           deep_gemm::jit::gemm_type_to_string(type);
        if (!seen.insert(name).second) continue;
        std::filesystem::create_directories(out / name);
        std::ofstream(out / name / "kernel.cu")
            << deep_gemm::jit::generateKernel(n, k, bm, bn, block_k, groups, stages, multicast,
                                              type, swap);
        std::printf("%s %d %d %u\n", name.c_str(), a - 3, sms, m);
      }
    }
  }
  return 0;
}
"""

# What DEEPGEMM_PROGRAM and best_gemm_config copy from FlashInfer's sources: the build refuses
# when they changed.
_DEEPGEMM_ANCHORS = {
    "deep_gemm/compiler.cuh": (
        'std::string(swapAB ? "gemm_swapAB_" : "gemm_")',
        'std::to_string(num_groups) + "_" + std::to_string(num_stages) +\n'
        '                       std::to_string(num_groups) + "_" + std::to_string(num_stages)',
        "getCacheDir() / name",
        "kKernelName",
        *(f'"{flag}"' for flag in DEEPGEMM_NVCC_FLAGS if not flag.startswith("--compiler")),
        '"-fPIC", "-O3", "-Wno-deprecated-declarations",\n                                           "-Wno-abi"',
        'command = {getNvccCompiler(), tmpSrcPath.string(), "-o",',
    ),
    "deep_gemm/runtime.cuh": ('kJitUseNvcc ? "nvcc_kernel.cubin"',),
    "kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh": (
        # grouped_gemm_dispatch (fused_moe_90)
        "num_device_sms == 78 ? 64 : 32",
        "if (expected_m >= m_per_expert_threshold) {",
        "get_best_gemm_config(expected_m, shape_n, shape_k, num_problems,",
        "get_best_gemm_config(shape_n, expected_m, shape_k, num_problems,\n"
        "                                             num_device_sms, false, true);",
        # gemm_dispatch (fp8_blockscale_gemm_90's dense GEMM)
        "uint32_t m_threshold = 32;\n  if (shape_m >= m_threshold) {",
        "get_best_gemm_config(shape_n, shape_m, shape_k, num_problems,\n"
        "                                             num_device_sms, false, true);",
        "best_num_tma_multicast, deep_gemm::GemmType::Normal, true);",
    ),
}

# What the dense GEMMs' enumeration copies from vLLM's sources (the interpreter's vllm/).
_VLLM_ANCHORS = {
    "model_executor/kernels/linear/__init__.py": (
        "PlatformEnum.CUDA: [\n        FlashInferFp8DeepGEMMDynamicBlockScaledKernel,",
    ),
    "model_executor/kernels/linear/scaled_mm/flashinfer.py": (
        f"condition = input.shape[0] < {DENSE_TOKENS_BELOW}",
        "run_flashinfer_deepgemm_swapAB,",
    ),
    "utils/flashinfer.py": (
        '"flashinfer.gemm", "fp8_blockscale_gemm_sm90"',
        "N_MULTIPLE = 64",
        "K_MULTIPLE = 128",
    ),
    # GLM-5.3-Flash: the dense MLP and the shared experts get the fp8 quant config; the KDA and
    # MLA projections and the vision tower are built without it (bf16 in the checkpoint).
    "models/glm5next/common/model.py": (
        "quant_config=None,  # MLA projections are BF16 in checkpoint",
        "self.shared_experts = Glm5NextMLP(",
    ),
    "models/glm5next/common/kda.py": ("vllm_config.quant_config = None",),
}


def _check_anchors(root: Path, anchors: Mapping[str, Iterable[str]], what: str) -> None:
    for relative, wanted in anchors.items():
        try:
            text = (root / relative).read_text()
        except OSError:
            raise UserError(f"{root / relative}: not found ({what} changed?)") from None
        for anchor in wanted:
            if anchor not in text:
                first = anchor.splitlines()[0]
                raise UserError(
                    f"{root / relative}: no longer holds {first!r}: {what} changed; "
                    "glm5_matrix.kernels.trtllm_deepgemm copies it and must follow"
                )


def check_deepgemm_sources(tensorrt_llm: Path) -> None:
    """UserError when FlashInfer's DeepGEMM compiler no longer reads as DEEPGEMM_PROGRAM and
    DEEPGEMM_NVCC_FLAGS copy it (then the cubins would be compiled for names it never asks)."""
    _check_anchors(tensorrt_llm, _DEEPGEMM_ANCHORS, "FlashInfer's DeepGEMM JIT")


def check_vllm_sources(vllm: Path) -> None:
    """UserError when vLLM no longer routes the dense fp8 linears as dense_gemms() assumes."""
    _check_anchors(vllm, _VLLM_ANCHORS, "vLLM's fp8 block-scale linear dispatch")


# --- which GEMMs, and which kernels they ask for ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM FlashInfer hands to DeepGEMM, per rank: N x K, its groups (the experts; 1 for
    a dense layer), its DeepGEMM type, and the largest token count it is called with."""

    what: str  # the layer, for the record ("moe fc1", "dense gate_up", ...)
    tp: int
    n: int
    k: int
    groups: int
    gemm_type: str  # GROUPED or NORMAL
    tokens_max: int

    def argument(self) -> str:
        """DEEPGEMM_PROGRAM's argument for it."""
        return f"{self.gemm_type}:{self.n}:{self.k}:{self.groups}:{self.tokens_max}"

    def swap_below(self, sms: int) -> int:
        """Below this many tokens the dispatch takes the swapAB kernel."""
        if self.gemm_type == GROUPED:
            return 64 if sms == 78 else 32
        return 32


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config", config)
    return text if isinstance(text, Mapping) else config


def _sizes(config: Mapping[str, Any], *names: str) -> list[int]:
    text = _text_config(config)
    try:
        return [int(text[name]) for name in names]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the model config has no {exc} (needed for its GEMM shapes)") from None


def _split(size: int, tp: int, what: str) -> int:
    if tp < 1 or size % tp:
        raise UserError(f"TP {tp} does not split the {what} {size}")
    return size // tp


def moe_gemms(config: Mapping[str, Any], tps: Sequence[int]) -> list[Gemm]:
    """The MoE's grouped GEMMs per rank at each TP: FC1 (gated: gate and up, 2 x intermediate /
    TP by hidden) and FC2 (hidden by intermediate / TP); every rank holds every expert."""
    text = _text_config(config)
    hidden, inter = _sizes(config, "hidden_size", "moe_intermediate_size")
    experts = text.get("n_routed_experts") or text.get("num_experts")
    if not experts:
        raise UserError("the model config has no 'n_routed_experts' (needed for its GEMM shapes)")
    gemms = []
    for tp in tps:
        part = _split(inter, tp, "MoE intermediate size")
        for what, n, k in (("moe fc1", 2 * part, hidden), ("moe fc2", hidden, part)):
            gemms.append(Gemm(what, tp, n, k, int(experts), GROUPED, DEEPGEMM_M_MAX))
    return gemms


def _fp8_block_128(config: Mapping[str, Any]) -> bool:
    quant = config.get("quantization_config") or _text_config(config).get("quantization_config")
    return (
        isinstance(quant, Mapping)
        and quant.get("quant_method") == "fp8"
        and list(quant.get("weight_block_size") or []) == [128, 128]
    )


def dense_gemms(config: Mapping[str, Any], tps: Sequence[int]) -> list[Gemm]:
    """The dense fp8 linears of a GLM-5.3-Flash config per rank at each TP that vLLM 0.33.0 runs
    through FlashInfer's fp8_blockscale_gemm_sm90 (module doc): the dense MLP of the first
    layers (gate_up: 2 x intermediate / TP by hidden; down: hidden by intermediate / TP) and the
    MoE layers' shared experts (the same with moe_intermediate_size x n_shared_experts). The KDA
    and MLA projections, the vision tower and the MTP layer's eh_proj are bf16 (vLLM builds
    them without the quant config) and never reach it. A shape vLLM's N % 64 / K % 128 rule
    sends elsewhere is left out; a config without fp8 128x128 block scales has none."""
    if not _fp8_block_128(config):
        return []
    text = _text_config(config)
    hidden, inter = _sizes(config, "hidden_size", "intermediate_size")
    layers = list(text.get("mlp_layer_types") or [])
    has_dense = "dense" in layers if layers else int(text.get("first_k_dense_replace") or 0) > 0
    shared = int(text.get("n_shared_experts") or 0) * int(text.get("moe_intermediate_size") or 0)
    gemms = []
    for tp in tps:
        mlps = [("dense", _split(inter, tp, "intermediate size"))] if has_dense else []
        if shared:
            mlps.append(("shared expert", _split(shared, tp, "shared experts' size")))
        for name, part in mlps:
            for what, n, k in (
                (f"{name} gate_up", 2 * part, hidden),
                (f"{name} down", hidden, part),
            ):
                if n % 64 == 0 and k % 128 == 0:
                    gemms.append(Gemm(what, tp, n, k, 1, NORMAL, DENSE_TOKENS_BELOW - 1))
    return gemms


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _smem_size(stages: int, k: int, block_m: int, block_n: int, swap_ab: bool) -> int:
    block_k = 128
    if not swap_ab:
        size = block_m * block_n * 2 + stages * (
            block_m * block_k + block_m * 4 + block_n * block_k
        )
        size += _div_up(_div_up(k, block_k) * 4 * (1 if block_k % block_n == 0 else 2), 8) * 8
    else:
        size = block_n * block_m * 2
        size += stages * (block_m * block_k + _div_up(block_n * 4, 128) * 128 + block_n * block_k)
        size += _div_up(_div_up(k, block_k) * 4, 8) * 8
    return size + stages * 8 * 2


def best_gemm_config(
    shape_m: int,
    shape_n: int,
    shape_k: int,
    num_groups: int,
    num_sms: int,
    grouped_contiguous: bool = False,
    swap_ab: bool = False,
) -> tuple[int, int, int, int, int]:
    """FlashInfer's deep_gemm::jit::get_best_gemm_config (jit_utils.cuh), line for line: (block_m,
    block_n, stages, TMA multicast, shared memory)."""
    block_m_list = [64 if (not grouped_contiguous and shape_m <= 64) else 128]

    def blocks(bm: int, bn: int) -> int:
        return _div_up(shape_m, bm) * _div_up(shape_n, bn) * num_groups

    def waves(bm: int, bn: int) -> int:
        return _div_up(blocks(bm, bn), num_sms)

    def last_wave(bm: int, bn: int) -> int:
        return blocks(bm, bn) % num_sms or num_sms

    best_m = best_n = 0
    for bm in block_m_list:
        for bn in range(16, 129, 8):
            if best_m == 0:
                better = True
            elif waves(bm, bn) != waves(best_m, best_n):
                better = waves(bm, bn) < waves(best_m, best_n)
            else:
                util, best_util = last_wave(bm, bn), last_wave(best_m, best_n)
                better = util > best_util or (
                    util == best_util and (bm > best_m or (bm == best_m and bn < best_n))
                )
            if better:
                best_m, best_n = bm, bn
    stages = smem = 0
    for candidate in (6, 5, 4) if 128 % best_n else (8, 7, 6, 5, 4):
        size = _smem_size(candidate, shape_k, best_m, best_n, swap_ab)
        if size <= 232448:  # sm90's shared memory
            stages, smem = candidate, size
            break
    along, block, long_side = (
        (shape_n, best_n, shape_m) if not swap_ab else (shape_m, best_m, shape_n)
    )
    legal = along % (block * 2) == 0 and num_sms % 2 == 0
    multicast = 2 if long_side >= 1024 and legal and num_groups == 1 else 1
    return best_m, best_n, stages, multicast, smem


def kernel_name(gemm: Gemm, swap_ab: bool, config: tuple[int, int, int, int, int]) -> str:
    """Compiler::build's name for the kernel (num_groups and num_stages twice, as it writes it)."""
    bm, bn, stages, multicast, _ = config
    prefix = "gemm_swapAB_" if swap_ab else "gemm_"
    g = gemm.groups
    return (
        f"{prefix}{gemm.n}_{gemm.k}_{bm}_{bn}_128_{g}_{stages}{g}_{stages}_{multicast}_"
        f"{gemm.gemm_type}"
    )


def kernel_names(
    gemms: Iterable[Gemm], sms: Sequence[int] = DEEPGEMM_SMS
) -> dict[str, tuple[Gemm, int, int]]:
    """{kernel name: (its GEMM, the first token count that asks for it, on how many SMs)} of
    every kernel the dispatch asks for, computed as DEEPGEMM_PROGRAM computes it."""
    found: dict[str, tuple[Gemm, int, int]] = {}
    for gemm in gemms:
        for count in sms:
            last = None
            for m in range(1, gemm.tokens_max + 1):
                swap = m < gemm.swap_below(count)
                config = (
                    best_gemm_config(gemm.n, m, gemm.k, gemm.groups, count, False, True)
                    if swap
                    else best_gemm_config(m, gemm.n, gemm.k, gemm.groups, count)
                )
                if (swap, config) == last:
                    continue
                last = (swap, config)
                found.setdefault(kernel_name(gemm, swap, config), (gemm, m, count))
    return found


def _compile_deepgemm_program(
    build: Path, csrc: Path, env: Mapping[str, str], cuda_home: Path, objects: Sequence[Path]
) -> Path:
    """DEEPGEMM_PROGRAM compiled against FlashInfer's headers, linked with the module's own
    common objects (logger, exceptions, string and environment utilities)."""
    source = build / "deepgemm" / "deepgemm_kernels.cu"
    source.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(source, DEEPGEMM_PROGRAM)
    program = source.with_suffix("")
    nv = csrc / "nv_internal"
    common = [
        o
        for o in objects
        if o.name
        in {f"common_{n}.o" for n in ("envUtils", "logger", "stringUtils", "tllmException")}
    ]
    includes = [f"-I{nv / 'tensorrt_llm'}", f"-I{nv}", f"-I{nv / 'include'}"]
    extra = env.get("FLASHINFER_EXTRA_CUDAFLAGS", "").split()
    links = env.get("FLASHINFER_EXTRA_LDFLAGS", "").split()
    command = [
        str(cuda_home / "bin" / "nvcc"),
        "-std=c++17",
        str(source),
        *map(str, common),
        *includes,
        *extra,
        "-o",
        str(program),
        f"-L{cuda_home / 'lib64'}",
        f"-L{cuda_home / 'lib64' / 'stubs'}",
        *links,
        "-lnvrtc",
        "-lcuda",
        "-lcudart",
    ]
    cuda_toolchain.run(command, env, 10)
    return program


def build_deepgemm(
    kernels: KernelCache,
    build: Path,
    gemms: Sequence[Gemm],
    *,
    csrc: Path,
    vllm: Path | None,
    objects: Sequence[Path],
    env: Mapping[str, str],
    cuda_home: Path,
    library_paths: Sequence[Path],
    jobs: int,
    niceness: int,
) -> list[dict[str, Any]]:
    """Compile the DeepGEMM kernels FlashInfer would compile for `gemms` into the kernel cache's
    trtllm_deep_gemm library (skipping those it holds); one record per kernel. `vllm`: the
    interpreter's vllm/ package, whose dispatch of the dense GEMMs is checked (None: there is
    no vLLM, and a dense GEMM refuses the build)."""
    check_deepgemm_sources(csrc / "nv_internal" / "tensorrt_llm")
    if any(g.gemm_type == NORMAL for g in gemms):
        if vllm is None:
            raise UserError("the interpreter has no vLLM: the dense GEMMs' dispatch is vLLM's")
        check_vllm_sources(vllm)
    program = _compile_deepgemm_program(build, csrc, env, cuda_home, objects)
    sources = build / "deepgemm" / "kernels"
    shutil.rmtree(sources, ignore_errors=True)
    paths = os.pathsep.join([*map(str, library_paths), env.get("LD_LIBRARY_PATH", "")])
    first: dict[str, Gemm] = {}
    for gemm in gemms:
        first.setdefault(gemm.argument(), gemm)  # a GEMM two TP sizes share: its first
    asked = list(first.values())
    listed = subprocess.run(
        [
            str(program),
            str(sources),
            ",".join(map(str, DEEPGEMM_SMS)),
            *(g.argument() for g in asked),
        ],
        capture_output=True,
        text=True,
        env={**env, "LD_LIBRARY_PATH": paths},
        check=False,
    )
    if listed.returncode != 0:
        raise UserError(f"{program}: failed ({listed.stderr.strip()[-300:]})")
    cache = kernels.folder(kernel_cache.library("trtllm_deep_gemm")) / "cache"
    include = csrc / "nv_internal" / "tensorrt_llm"
    nvcc = str(cache_nvcc(env, cuda_home))
    records: dict[str, dict[str, Any]] = {}
    for line in listed.stdout.splitlines():
        name, index, sms, m = line.split()
        gemm = asked[int(index)]
        records.setdefault(
            name,
            {
                "name": name,
                "layer": gemm.what,
                "tp": gemm.tp,
                "n": gemm.n,
                "k": gemm.k,
                "groups": gemm.groups,
                "first_tokens": int(m),
                "sms": int(sms),
            },
        )
    # The names FlashInfer's own functions gave must be the ones best_gemm_config() gives, which
    # check-moe and the unit tests rely on.
    mirrored = {name: (m, sms) for name, (_, m, sms) in kernel_names(asked).items()}
    programs = {name: (r["first_tokens"], r["sms"]) for name, r in records.items()}
    if mirrored != programs:
        only = sorted(
            n for n in set(mirrored) | set(programs) if mirrored.get(n) != programs.get(n)
        )
        raise UserError(
            f"FlashInfer's get_best_gemm_config and glm5_matrix.kernels.trtllm_deepgemm."
            f"best_gemm_config disagree on {len(only)} kernel(s) ({only[0]}): FlashInfer's "
            "DeepGEMM heuristics changed; the copy must follow"
        )

    def compile_one(record: dict[str, Any]) -> dict[str, Any]:
        target = cache / record["name"] / DEEPGEMM_CUBIN
        work = sources / record["name"]
        if target.is_file():
            return {**record, "compiled_now": False, "sha256": cuda_toolchain.sha256(target)}
        started = time.monotonic()
        cuda_toolchain.run(
            [
                nvcc,
                str(work / "kernel.cu"),
                "-o",
                str(work / DEEPGEMM_CUBIN),
                *DEEPGEMM_NVCC_FLAGS,
                f"-I{include}",
            ],
            env,
            niceness,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{DEEPGEMM_CUBIN}.{os.getpid()}.tmp")
        shutil.copyfile(work / DEEPGEMM_CUBIN, staging)
        os.replace(staging, target)
        return {
            **record,
            "compiled_now": True,
            "seconds": round(time.monotonic() - started, 1),
            "sha256": cuda_toolchain.sha256(target),
            "source_sha256": cuda_toolchain.sha256(work / "kernel.cu"),
        }

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(compile_one, records.values()))


def cache_nvcc(env: Mapping[str, str], cuda_home: Path) -> Path:
    """The nvcc the DeepGEMM compiler runs: TRTLLM_DG_NVCC_COMPILER, else $CUDA_HOME/bin/nvcc."""
    chosen = env.get("TRTLLM_DG_NVCC_COMPILER")
    return Path(chosen) if chosen else cuda_home / "bin" / "nvcc"


def gemms_of_record(record: Mapping[str, Any]) -> list[Gemm]:
    """The GEMMs a build record (fused_moe_90's build.json) compiled kernels for."""
    return [Gemm(**gemm) for gemm in record.get("deepgemm_gemms", [])]


def absent_kernels(
    kernels: KernelCache, gemms: Sequence[Gemm], sms: Sequence[int] = DEEPGEMM_SMS
) -> tuple[dict[str, tuple[Gemm, int, int]], list[str]]:
    """Every kernel the dispatch asks for `gemms` on `sms` SMs (kernel_names), and those of them
    the key folder's trtllm_deep_gemm library lacks: a start on such a GPU compiles each of
    those with nvcc at its first use (and the guard refuses it)."""
    asked = kernel_names(gemms, sms)
    cache = kernels.folder(kernel_cache.library("trtllm_deep_gemm")) / "cache"
    return asked, sorted(name for name in asked if not (cache / name / DEEPGEMM_CUBIN).is_file())
