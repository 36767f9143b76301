"""TensorRT-LLM's DeepGEMM kernels, compiled off the GPU the way FlashInfer's fused_moe_90 compiles
them at run time, into the kernel cache's trtllm_deep_gemm library (TRTLLM_DG_CACHE_DIR).

fused_moe_90's fp8 block-scale grouped GEMMs are DeepGEMM kernels that the module compiles at
first use of each configuration (deep_gemm/compiler.cuh, Compiler::build): it generates a
kernel.cu (generateKernel), runs nvcc on it with DEEPGEMM_NVCC_FLAGS and the include folder
FlashInfer passes (csrc/nv_internal/tensorrt_llm, fused_moe/core.py), and renames the cubin to
$TRTLLM_DG_CACHE_DIR/cache/<name>/nvcc_kernel.cubin, where the next process finds it by name.
Which configuration a GEMM takes is FlashInfer's get_best_gemm_config of (tokens, N, K,
experts, SMs) as grouped_gemm_dispatch (fp8_blockscale_gemm_kernel.cuh) calls it; the program
below calls those functions of FlashInfer's headers for every token count up to M_MAX.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
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
# SM counts of the GPUs whose configurations are compiled: H100 PCIe (114), H100 SXM and H200
# (132). An H20 (78) runs another module (fused_moe_90_h20_prebuilt_d).
DEEPGEMM_SMS = (114, 132)

DEEPGEMM_PROGRAM = r"""// Written by glm5-matrix (glm5_matrix.kernels.trtllm_deepgemm): the TensorRT-LLM DeepGEMM
// kernels FlashInfer's fused_moe_90 compiles at run time for fp8 block-scale MoE GEMMs of the
// given shapes, with their sources, from FlashInfer's own functions.
// Arguments: OUT_DIR M_MAX SMS[,SMS...] N:K:GROUPS [N:K:GROUPS...]
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
  if (argc < 5) return 2;
  std::filesystem::path out(argv[1]);
  uint32_t m_max = std::strtoul(argv[2], nullptr, 10);
  std::vector<int> sms_list;
  std::stringstream sms_text(argv[3]);
  for (std::string item; std::getline(sms_text, item, ',');) sms_list.push_back(std::stoi(item));
  std::set<std::string> seen;
  constexpr uint32_t block_k = 128;
  auto const type = deep_gemm::GemmType::GroupedWithOffset;
  for (int a = 4; a < argc; ++a) {
    uint32_t n, k, groups;
    if (std::sscanf(argv[a], "%u:%u:%u", &n, &k, &groups) != 3) return 2;
    for (int sms : sms_list) {
      uint32_t threshold = sms == 78 ? 64 : 32;  // grouped_gemm_dispatch
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
        std::printf("%s %u %u %u %d %u\n", name.c_str(), n, k, groups, sms, m);
      }
    }
  }
  return 0;
}
"""

# What DEEPGEMM_PROGRAM copies from FlashInfer's sources: the build refuses when they changed.
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
        "num_device_sms == 78 ? 64 : 32",
        "if (expected_m >= m_per_expert_threshold) {",
        "get_best_gemm_config(expected_m, shape_n, shape_k, num_problems,",
        "get_best_gemm_config(shape_n, expected_m, shape_k, num_problems,\n"
        "                                             num_device_sms, false, true);",
    ),
}


def check_deepgemm_sources(tensorrt_llm: Path) -> None:
    """UserError when FlashInfer's DeepGEMM compiler no longer reads as DEEPGEMM_PROGRAM and
    DEEPGEMM_NVCC_FLAGS copy it (then the cubins would be compiled for names it never asks)."""
    for relative, anchors in _DEEPGEMM_ANCHORS.items():
        text = (tensorrt_llm / relative).read_text()
        for anchor in anchors:
            if anchor not in text:
                first = anchor.splitlines()[0]
                raise UserError(
                    f"{tensorrt_llm / relative}: no longer holds {first!r}: FlashInfer's DeepGEMM "
                    "JIT changed; glm5_matrix.kernels.trtllm_deepgemm copies it and must follow"
                )


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """One fp8 block-scale MoE of a model at one TP size: its two grouped GEMMs per rank."""

    hidden: int
    intermediate: int
    experts: int
    tp: int

    def gemms(self) -> list[tuple[int, int, int]]:
        """(N, K, groups) of FC1 (gated: gate and up) and FC2, per rank (TP splits the
        intermediate size; every rank holds every expert)."""
        inter = self.intermediate // self.tp
        return [(2 * inter, self.hidden, self.experts), (self.hidden, inter, self.experts)]


def moe_shapes(config: Mapping[str, Any], tps: Sequence[int]) -> list[MoeShape]:
    """The MoE shapes of a Hugging Face config (its text_config when it has one) at each TP."""
    text = config.get("text_config", config)
    try:
        hidden, inter = int(text["hidden_size"]), int(text["moe_intermediate_size"])
        experts = int(text.get("n_routed_experts") or text["num_experts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the model config has no MoE sizes ({exc})") from None
    for tp in tps:
        if tp < 1 or inter % tp:
            raise UserError(f"TP {tp} does not split the MoE intermediate size {inter}")
    return [MoeShape(hidden, inter, experts, tp) for tp in tps]


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
    shapes: Sequence[MoeShape],
    *,
    csrc: Path,
    objects: Sequence[Path],
    env: Mapping[str, str],
    cuda_home: Path,
    library_paths: Sequence[Path],
    jobs: int,
    niceness: int,
) -> list[dict[str, Any]]:
    """Compile the DeepGEMM kernels fused_moe_90 would compile for `shapes` into the kernel
    cache's trtllm_deep_gemm library (skipping those it holds); one record per kernel."""
    check_deepgemm_sources(csrc / "nv_internal" / "tensorrt_llm")
    program = _compile_deepgemm_program(build, csrc, env, cuda_home, objects)
    sources = build / "deepgemm" / "kernels"
    shutil.rmtree(sources, ignore_errors=True)
    arguments = [f"{n}:{k}:{g}" for shape in shapes for n, k, g in shape.gemms()]
    paths = os.pathsep.join([*map(str, library_paths), env.get("LD_LIBRARY_PATH", "")])
    listed = subprocess.run(
        [
            str(program),
            str(sources),
            str(DEEPGEMM_M_MAX),
            ",".join(map(str, DEEPGEMM_SMS)),
            *dict.fromkeys(arguments),
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
        name, n, k, groups, sms, m = line.split()
        if name in records:
            continue
        records[name] = {
            "name": name,
            "n": int(n),
            "k": int(k),
            "experts": int(groups),
            "first_tokens": int(m),
            "sms": int(sms),
        }

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
