"""The proof, on a machine without a GPU, that a runner's start loads the kernel cache's FlashInfer
AOT modules and builds nothing (`glm5-matrix kernel-cache check-moe`, docs/flashinfer-moe.md):
FlashInfer's own entries (the CUTLASS MoE's, what vLLM's FLASHINFER_CUTLASS experts call, and the
autotuner's trtllm_utils) are called in a fresh process of the cell's interpreter with the
provider the runner writes, no ninja on PATH and FlashInfer's build replaced by one that raises;
a path the MoE module leaves out must end the process naming the undefined symbol."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import cuda_toolchain, kernel_cache
from glm5_matrix.kernels.flashinfer_aot import (
    ARCH_LIST,
    BUILD_FOLDER,
    MODULE,
    UTILS_MODULE,
    library_folder,
    write_provider,
)
from glm5_matrix.kernels.kernel_cache import KernelCache


def _check_driver(request: dict[str, Any]) -> dict[str, Any]:
    """Run in the cell's interpreter with the provider on sys.path: FlashInfer's own entry of the
    CUTLASS MoE (get_cutlass_fused_moe_module, what vLLM's FLASHINFER_CUTLASS experts call) must
    load the AOT module without building (a ninja run raises here, before it could write), then
    the runner of
    `request["dtypes"]` is made through the module's `init`."""
    import torch
    from flashinfer.jit import cpp_ext
    from flashinfer.jit import env as jit_env

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"FlashInfer went to build {args[1] if len(args) > 1 else args}")

    cpp_ext.run_ninja = no_build
    import flashinfer.jit.core as jit_core

    jit_core.run_ninja = no_build
    artifacts = [
        {"provider": a.provider_id, "path": str(a.path)}
        for a in jit_env.get_aot_artifacts(request["module"])
    ]
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

    result: dict[str, Any] = {"artifacts": artifacts}
    module = get_cutlass_fused_moe_module("90")
    with open("/proc/self/maps") as maps:
        result["mapped"] = sorted(
            {line.split(None, 5)[5].strip() for line in maps if f"{request['module']}.so" in line}
        )
    if request.get("utils"):
        # FlashInfer's autotuner's entry of trtllm_utils (its delay kernel), as at each start.
        from flashinfer.tllm_utils import get_trtllm_utils_module

        get_trtllm_utils_module()
    with open("/proc/self/maps") as maps:
        result["utils_mapped"] = sorted(
            {line.split(None, 5)[5].strip() for line in maps if f"{UTILS_MODULE}.so" in line}
        )
    activation, weight, output = (getattr(torch, name) for name in request["dtypes"])
    print("GLM5-AOT-LOADED " + json.dumps(result), flush=True)
    from flashinfer.tllm_enums import ActivationType

    try:  # FlashInfer's runner, as cutlass_fused_moe makes it (module.init underneath)
        module.MoERunner(
            x_dtype=activation,
            weight_dtype=weight,
            output_dtype=output,
            top_k=8,
            tp_size=1,
            tp_rank=0,
            ep_size=1,
            ep_rank=0,
            cluster_size=1,
            cluster_rank=0,
            enable_alltoall=False,
            use_deepseek_fp8_block_scale=request["block_scale"],
            use_w4_group_scaling=False,
            use_mxfp8_act_scaling=False,
            min_latency_mode=False,
            enable_pdl=False,
            activation_type=ActivationType.Swiglu,
            use_packed_weights=False,
            use_fused_finalize=False,
            use_wfp4afp8_humming=False,
        )
        result["init"] = "made"
    except Exception as exc:  # no GPU here: the runner's first CUDA call fails
        result["init"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return result


def _check_main() -> None:
    request = json.loads(sys.argv[1])
    print("GLM5-AOT-CHECK " + json.dumps(_check_driver(request)), flush=True)


_CHECK = (
    "import sys; sys.path.insert(0, sys.argv[2]); "
    "from glm5_matrix.kernels.aot_check import _check_main; _check_main()"
)

# The runner the profile's MoE path makes (bf16 activations, fp8_e4m3 weights, DeepSeek block
# scales) and one the module leaves out (fp16), made through the module's `init`.
CHECKED_PATHS = {
    "fp8-block-scale": (("bfloat16", "float8_e4m3fn", "bfloat16"), True),
    "fp16": (("float16", "float16", "float16"), False),
}


@dataclasses.dataclass
class Checked:
    path: str
    returncode: int
    result: dict[str, Any] | None
    loaded: dict[str, Any] | None
    error: str  # the last lines of stderr

    def symbol_error(self) -> str | None:
        match = re.search(r"symbol lookup error: .*", self.error)
        return match.group(0) if match else None


def check_module(
    kernels: KernelCache, python: str, environ: Mapping[str, str] | None = None
) -> tuple[list[Checked], dict[str, list[str]], list[str]]:
    """The proof on a machine without a GPU (module doc): in a fresh process per path of
    CHECKED_PATHS, with the provider the runner writes on its PYTHONPATH and nothing FlashInfer
    could build with (no ninja on PATH, and a build attempt raises), FlashInfer's entry loads the
    key folder's module (and, on the block-scale path, FlashInfer's autotuner's entry loads the
    key folder's trtllm_utils); the block-scale runner is made up to its first
    CUDA call, the fp16 runner ends the process naming the undefined symbol. FlashInfer's folders are the key
    folder's, as in a cell: returns the checks, what they wrote into the kernel cache
    (kernel_cache.written: nothing, on a key folder that holds what a runner imports) and how
    the module was made loadable here."""
    environ = dict(os.environ if environ is None else environ)
    module = library_folder(kernels) / MODULE / f"{MODULE}.so"
    if not module.is_file():
        raise UserError(f"{module}: no AOT build of {MODULE} in the kernel cache (build-moe)")
    site = kernels.directory / BUILD_FOLDER / "check-site"
    shutil.rmtree(site, ignore_errors=True)
    write_provider(kernels, site)
    python_lib = cuda_toolchain.site_packages(python, environ)
    # A machine without a GPU has no libcuda.so.1 for the module's loader: the link-time stub.
    utils = library_folder(kernels) / UTILS_MODULE / f"{UTILS_MODULE}.so"
    _, notes = cuda_toolchain.link_libraries(
        cuda_toolchain.cuda_home_of(environ),
        python_lib,
        [module, *([utils] if utils.is_file() else [])],
        kernels.directory / BUILD_FOLDER / "check-link",
    )
    libraries = [
        kernels.directory / BUILD_FOLDER / "check-link",
        *cuda_toolchain.nvidia_lib_dirs(python_lib),
    ]
    path_without_ninja = os.pathsep.join(
        p for p in environ.get("PATH", "").split(os.pathsep) if not (Path(p) / "ninja").exists()
    )
    env = {
        **environ,
        **kernels.environment(),
        "PATH": path_without_ninja,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")])),
        "LD_LIBRARY_PATH": os.pathsep.join(
            filter(None, [*map(str, libraries), environ.get("LD_LIBRARY_PATH")])
        ),
        "FLASHINFER_CUDA_ARCH_LIST": environ.get("FLASHINFER_CUDA_ARCH_LIST", ARCH_LIST),
    }
    source = str(Path(__file__).resolve().parents[2])
    checked = []
    before = kernel_cache.snapshot(env)
    for name, (dtypes, block_scale) in CHECKED_PATHS.items():
        request = {
            "module": MODULE,
            "dtypes": dtypes,
            "block_scale": block_scale,
            # The autotuner loads trtllm_utils at every start that tunes: a key folder without
            # it sends FlashInfer to build it (which raises here).
            "utils": block_scale,
        }
        done = subprocess.run(
            [python, "-c", _CHECK, json.dumps(request), source],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        found: dict[str, dict[str, Any] | None] = {
            "GLM5-AOT-CHECK ": None,
            "GLM5-AOT-LOADED ": None,
        }
        for line in done.stdout.splitlines():
            for prefix in found:
                if line.startswith(prefix):
                    found[prefix] = json.loads(line.removeprefix(prefix))
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        checked.append(
            Checked(
                name, done.returncode, found["GLM5-AOT-CHECK "], found["GLM5-AOT-LOADED "], tail
            )
        )
    return checked, kernel_cache.written(before, kernel_cache.snapshot(env)), notes
