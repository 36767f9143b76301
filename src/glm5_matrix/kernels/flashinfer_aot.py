"""FlashInfer modules compiled ahead of time, off the GPU, and loaded from the kernel cache.

FlashInfer's CUTLASS MoE module for SM90, `fused_moe_90`, is 248 objects and a link (about 48
minutes on 16 cores, longer than a lent GPU runner lives). The profile's MoE path (vLLM's
FLASHINFER_CUTLASS with DeepSeek fp8 block scales: bf16 activations, fp8_e4m3 weights) needs 15
of them: the binding, the runner instantiations, the block-scale GEMM runner, the bf16 x fp8 MoE
GEMM runner, the TMA-WS input and mixed utilities, and 8 common files (FP8_BLOCK_SCALE_SOURCES;
found with `nm -u` over the objects: the grouped GEMMs of this path are DeepGEMM kernels that
fused_moe_90 compiles at run time with nvcc, none of the 220 CUTLASS `*.generated.cu`). nvcc
needs no GPU, so `glm5-matrix kernel-cache build-moe` compiles those 15 objects on any machine
with FlashInfer's own generator (gen_cutlass_fused_moe_sm90_module: its build.ninja, flags and
sources, the sources narrowed to the 15) and links them with FlashInfer's own link rule into
<key folder>/flashinfer_aot/fused_moe_90/fused_moe_90.so, beside build.json (every object with
its source, compile command, seconds and sha256, and the symbols left out).

How FlashInfer loads a module without building it, read in flashinfer-python 0.7.2.post1
(flashinfer/jit/core.py JitSpecNvcc.try_load / build, flashinfer/jit/env.py get_aot_artifacts):
its JIT path always writes build.ninja with all 248 sources and runs ninja, so a JIT folder
with 15 objects is rebuilt whole at the next start; only an AOT artifact is loaded as it is:
<flashinfer>/data/aot/<module>/<module>.so, or a module listed by a `flashinfer_jit_cache`
package's providers (how FlashInfer's flashinfer-jit-cache wheels ship them). The kernel cache
uses the second, without writing into the installed FlashInfer: write_provider() writes a
`flashinfer_jit_cache` package into a folder the runner puts on the cell's PYTHONPATH (the
cell's plugin site), whose one provider names the key folder's flashinfer_aot/ and the modules
it holds. FlashInfer checks the provider's version against its own and the module's SM90a
target against the GPU, then loads the .so (tvm_ffi.load_module, a dlopen) and builds nothing.
An interpreter that has a real flashinfer_jit_cache keeps it (write_provider is not called).

What is not in the module: the other dtypes' MoE GEMM runners (fp16, bf16 x bf16, fp32, fp8 x
fp8, int4/int8 weights, fp4 and MXFP4) and the 220 CUTLASS instantiations. The .so leaves their
symbols undefined (build.json lists them); the loader binds functions at their first call, so
loading succeeds and a process that takes another path dies at its first call into it with
"symbol lookup error: ... undefined symbol: <the symbol>". vLLM's FLASHINFER_CUTLASS with fp8
block scales never calls them (the GPU run shows it: 0 compiles, no symbol error).

Beside it, FlashInfer's trtllm_utils (the autotuner's delay kernel, which FlashInfer's JIT path
built at the H100's first flashinfer start) is built whole the same way and listed by the same
provider (build_utils_module). The DeepGEMM kernels both FlashInfer modules compile at run time
are glm5_matrix.kernels.trtllm_deepgemm's; the proof that a start builds nothing is
glm5_matrix.kernels.aot_check's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic, write_json_atomic
from glm5_matrix.kernels import cuda_toolchain, kernel_cache, trtllm_deepgemm
from glm5_matrix.kernels.kernel_cache import KernelCache

MODULE = "fused_moe_90"
# FlashInfer's TensorRT-LLM utilities (the autotuner's delay kernel): built whole.
UTILS_MODULE = "trtllm_utils"
# FlashInfer's CUDA target of the module (gen_cutlass_fused_moe_sm90_module: sm90a_nvcc_flags).
TARGET = "sm90a"
ARCH_LIST = "9.0a"
# The sources of fused_moe_90 the fp8 block-scale path needs, relative to FlashInfer's csrc/.
FP8_BLOCK_SCALE_SOURCES = (
    "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu",
    "fused_moe/cutlass_backend/cutlass_fused_moe_instantiation.cu",
    "fused_moe/cutlass_backend/deepgemm_jit_setup.cu",
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu",
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_kernels_bf16_fp8.cu",
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_tma_warp_specialized_input.cu",
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu",
    "nv_internal/cpp/common/envUtils.cpp",
    "nv_internal/cpp/common/logger.cpp",
    "nv_internal/cpp/common/stringUtils.cpp",
    "nv_internal/cpp/common/tllmException.cpp",
    "nv_internal/cpp/common/memoryUtils.cu",
    "nv_internal/tensorrt_llm/kernels/preQuantScaleKernel.cu",
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/cutlass_heuristic.cpp",
    "nv_internal/tensorrt_llm/kernels/lora/lora.cpp",
)
VARIANT = "fp8-block-scale"
BUILD_RECORD = "build.json"
PROVIDER_PACKAGE = "flashinfer_jit_cache"
PROVIDER_ID = "glm5-matrix-kernel-cache"
# Where a build keeps its objects: inside the key folder, never exported (kernel_cache.TRANSIENT).
BUILD_FOLDER = ".glm5-build"


def library_folder(kernels: KernelCache) -> Path:
    return kernels.folder(kernel_cache.library("flashinfer_aot"))


def modules(kernels: KernelCache) -> dict[str, Path]:
    """{module: its .so} of every AOT module the key folder holds."""
    folder = library_folder(kernels)
    if not folder.is_dir():
        return {}
    return {
        entry.name: entry / f"{entry.name}.so"
        for entry in sorted(folder.iterdir())
        if (entry / f"{entry.name}.so").is_file()
    }


def active_module(module: str = MODULE, environ: Mapping[str, str] | None = None) -> Path | None:
    """The AOT build of `module` in the active key folder (the cell's), if it holds one."""
    environ = os.environ if environ is None else environ
    active = environ.get(kernel_cache.ACTIVE_VARIABLE)
    if not active:
        return None
    path = Path(active) / kernel_cache.library("flashinfer_aot").folder / module / f"{module}.so"
    return path if path.is_file() else None


_RESOLVE = (
    "import json, sys; "
    "from flashinfer.jit import env; "
    "print(json.dumps([[a.provider_id, str(a.path)] for a in env.get_aot_artifacts(sys.argv[1])]))"
)


def refuse_unless_resolved(module: str = MODULE, python: str | None = None) -> Path | None:
    """Where the active key folder holds an AOT build of `module`, an AssertionError unless
    FlashInfer, asked the way it asks at load (get_aot_artifacts, in a fresh process of this
    interpreter and environment), resolves `module` to it: a provider FlashInfer ignores (another
    version, another GPU target) would send the engine's first start into building all of the
    module (48 minutes for fused_moe_90 on 16 cores) before any guard could say so. Returns the
    module's path, or None when the key folder holds none."""
    path = active_module(module)
    if path is None:
        return None
    done = subprocess.run(
        [python or sys.executable, "-c", _RESOLVE, module],
        capture_output=True,
        text=True,
        timeout=kernel_cache.PROBE_TIMEOUT_S,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    found = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    assert found == [[PROVIDER_ID, str(path)]], (
        f"FlashInfer resolves {module} to {found} here, not to the kernel cache's {path}: it "
        f"would build the module at the engine's start ({done.stderr.strip()[-300:]})"
    )
    return path


def build_record(kernels: KernelCache, module: str = MODULE) -> dict[str, Any] | None:
    path = library_folder(kernels) / module / BUILD_RECORD
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


# --- the provider FlashInfer reads ------------------------------------------------------------


_PROVIDER_SOURCE = '''"""Written by glm5-matrix (glm5_matrix.kernels.flashinfer_aot), not FlashInfer's package: one
provider of FlashInfer AOT modules, the kernel cache's key folder {folder}
({listing}). See that module's doc for what each module leaves out."""

import dataclasses

__version__ = {version!r}


@dataclasses.dataclass(frozen=True)
class Provider:
    provider_id: str
    distribution: str
    version: str
    jit_cache_dir: str
    cuda_architectures: tuple
    modules: tuple


def get_jit_cache_providers():
    return [
        Provider(
            {provider_id!r},
            {provider_id!r},
            __version__,
            {folder!r},
            {architectures!r},
            {modules!r},
        )
    ]


def get_jit_cache_dir():
    return {folder!r}
'''


def provider_source(kernels: KernelCache) -> str | None:
    """The `flashinfer_jit_cache` package that lists the key folder's AOT modules, or None
    when it holds none (or the key names no FlashInfer)."""
    found = modules(kernels)
    version = kernels.key.get("flashinfer-python")
    if not found or not version:
        return None
    listing = ", ".join(
        f"{name}: {(build_record(kernels, name) or {}).get('variant', 'whole')}" for name in found
    )
    return _PROVIDER_SOURCE.format(
        folder=str(library_folder(kernels)),
        listing=listing,
        version=version,
        provider_id=PROVIDER_ID,
        architectures=(TARGET,),
        modules=tuple(found),
    )


def write_provider(kernels: KernelCache, site: Path) -> Path | None:
    """Write the provider package into `site` (a folder the cell's processes have on their
    PYTHONPATH); its path, or None when the key folder holds no AOT module."""
    source = provider_source(kernels)
    if source is None:
        return None
    package = site / PROVIDER_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    write_atomic(package / "__init__.py", source)
    return package


_HAS_OWN = (
    f"import importlib.util, sys; print(importlib.util.find_spec({PROVIDER_PACKAGE!r}) is not None)"
)


def interpreter_has_provider(python: str | Path, environ: Mapping[str, str]) -> bool:
    """Whether `python` already imports a flashinfer_jit_cache of its own (then it is kept)."""
    done = subprocess.run(
        [str(python), "-c", _HAS_OWN],
        capture_output=True,
        text=True,
        env=dict(environ),
        timeout=kernel_cache.PROBE_TIMEOUT_S,
        check=False,
    )
    return done.returncode == 0 and done.stdout.strip().endswith("True")


def activate(
    kernels: KernelCache, python: str | Path, environ: Mapping[str, str], site: Path
) -> str | None:
    """List the key folder's AOT modules to FlashInfer for a cell whose processes have `site` on
    their PYTHONPATH; one line for the cell's log, or None when there is none to list."""
    found = modules(kernels)
    if not found:
        return None
    names = ", ".join(
        f"{name} ({(build_record(kernels, name) or {}).get('variant', 'whole')})" for name in found
    )
    if interpreter_has_provider(python, environ):
        return (
            f"FlashInfer AOT modules in the kernel cache ({names}) not listed: the interpreter has "
            f"a {PROVIDER_PACKAGE} of its own, which FlashInfer reads instead"
        )
    write_provider(kernels, site)
    return f"FlashInfer loads {names} from {library_folder(kernels)} (provider {PROVIDER_ID})"


# --- the build, in the cell's interpreter -----------------------------------------------------


# FlashInfer's generator of each module built here (module, function).
GENERATORS = {
    MODULE: ("flashinfer.jit.fused_moe", "gen_cutlass_fused_moe_sm90_module"),
    UTILS_MODULE: ("flashinfer.jit.tllm_utils", "gen_trtllm_utils_module"),
}


def _driver(request: dict[str, Any]) -> dict[str, Any]:
    """Run in the interpreter whose FlashInfer is compiled: FlashInfer's own generator writes the
    module's build.ninja (the sources narrowed to `request["sources"]` when given) under the build
    folder, the way flashinfer.aot's compile_and_package_modules points its JIT folders
    elsewhere."""
    import importlib
    import importlib.util

    from flashinfer.jit import env as jit_env

    build = Path(request["build_dir"])
    workspace = Path(jit_env.FLASHINFER_WORKSPACE_DIR).relative_to(jit_env.FLASHINFER_BASE_DIR)
    jit_env.FLASHINFER_WORKSPACE_DIR = build
    jit_env.FLASHINFER_JIT_DIR = build / "cached_ops"
    jit_env.FLASHINFER_GEN_SRC_DIR = build / "generated"
    where, function = GENERATORS[request["module"]]
    spec = getattr(importlib.import_module(where), function)()
    if spec.name != request["module"]:
        raise SystemExit(
            f"FlashInfer's {function} names its module {spec.name!r} here, not "
            f"{request['module']!r} (an H20's prebuilt-D variant?)"
        )
    csrc = Path(jit_env.FLASHINFER_CSRC_DIR)
    total = len(spec.sources)
    generated_sources = sum(1 for s in spec.sources if Path(s).name.endswith(".generated.cu"))
    if request.get("sources") is not None:
        wanted = [csrc / source for source in request["sources"]]
        known = {Path(s) for s in spec.sources}
        absent = [str(w) for w in wanted if w not in known]
        if absent:
            raise SystemExit(f"not sources of FlashInfer's {spec.name} here: {', '.join(absent)}")
        spec = dataclasses.replace(spec, sources=wanted)
    spec.write_ninja()
    from flashinfer.version import __version__ as flashinfer_version

    vllm = importlib.util.find_spec("vllm")  # located, not imported
    return {
        "ninja_file": str(spec.ninja_path),
        "build_dir": str(spec.build_dir),
        "library": str(spec.jit_library_path),
        "module_sources": total,
        "generated_sources": generated_sources,
        "flashinfer_version": flashinfer_version,
        "csrc": str(csrc),
        "vllm": str(Path(vllm.origin).parent) if vllm and vllm.origin else None,
        "workspace": str(workspace),  # under FLASHINFER_WORKSPACE_BASE, where it writes at run time
        "generated": str(build / "generated"),
    }


def _driver_main() -> None:
    request = json.loads(sys.argv[1])
    print("GLM5-AOT " + json.dumps(_driver(request)))


_DRIVER = (
    "import sys; sys.path.insert(0, sys.argv[2]); "
    "from glm5_matrix.kernels.flashinfer_aot import _driver_main; _driver_main()"
)


@dataclasses.dataclass
class Built:
    module: Path  # the .so in the kernel cache
    record: dict[str, Any]

    def describe(self) -> str:
        objects = self.record["objects"]
        compiled = sum(1 for o in objects if o["compiled_now"])
        line = (
            f"{self.module} ({self.record['bytes'] / 2**20:.1f} MiB): {len(objects)} of "
            f"{self.record['module_sources']} objects of FlashInfer's {self.record['module']} "
            f"({compiled} compiled now, {self.record['wall_s']:.0f} s), "
            f"{len(self.record['missing_symbols'])} symbols of other paths left undefined"
        )
        kernels = self.record.get("deepgemm_kernels")
        if kernels is None:
            return line
        now = sum(1 for k in kernels if k["compiled_now"])
        return (
            f"{line}; {len(kernels)} DeepGEMM kernels ({now} compiled now) for "
            f"{len(self.record['deepgemm_gemms'])} GEMM shapes"
        )


def _interpreter_environment(environ: Mapping[str, str], build: Path) -> dict[str, str]:
    env = dict(environ)
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH_LIST)
    # FlashInfer makes its default workspace at import and logs into it: keep both in the build.
    env["FLASHINFER_WORKSPACE_BASE"] = str(build / "workspace")
    return env


def _run_driver(python: str, env: Mapping[str, str], request: dict[str, Any]) -> dict[str, Any]:
    source = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [python, "-c", _DRIVER, json.dumps(request), source],
        capture_output=True,
        text=True,
        env=dict(env),
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("GLM5-AOT "):
            return dict(json.loads(line.removeprefix("GLM5-AOT ")))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise UserError(f"{python}: FlashInfer's generator failed: {tail}")


def _ninja_edges(ninja_file: Path) -> dict[str, tuple[str, str]]:
    """{output: (rule, input)} of the build edges of a FlashInfer build.ninja."""
    edges = {}
    for line in ninja_file.read_text().splitlines():
        match = re.match(r"build (\S+): (\w+) (.+)$", line)
        if match:
            edges[match.group(1)] = (match.group(2), match.group(3))
    return edges


def _ninja_log(folder: Path) -> dict[str, float]:
    """{output: seconds} from ninja's .ninja_log (the last record of each output)."""
    seconds = {}
    try:
        lines = (folder / ".ninja_log").read_text().splitlines()
    except OSError:
        return {}
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) >= 4:
            seconds[fields[3]] = (int(fields[1]) - int(fields[0])) / 1000
    return seconds


# The block-scale path's own types: a missing symbol naming the bf16 x fp8 MoE GEMM runner or
# the block-scale GEMM runner would be called by it, and refuses the build.
_PATH_OWN = re.compile(
    r"MoeGemmRunner<__nv_bfloat16, __nv_fp8_e4m3|CutlassFp8BlockScaleGemmRunner|"
    r"CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3|deep_gemm"
)


def path_symbols(demangled: Sequence[str]) -> list[str]:
    """The missing symbols that belong to the fp8 block-scale path (bf16 activations, fp8
    weights): there must be none."""
    return [name for name in demangled if _PATH_OWN.search(name)]


@dataclasses.dataclass
class _Compiled:
    """A module's objects compiled and linked by FlashInfer's build.ninja in the build folder."""

    build: Path
    generated: dict[str, Any]
    ninja_file: Path
    edges: dict[str, tuple[str, str]]
    objects: list[Path]
    before: dict[Path, int]  # mtimes of the objects that existed before the build
    library: Path
    missing: list[str]  # demangled symbols left undefined
    notes: list[str]
    env: dict[str, str]

    def object_records(self) -> list[dict[str, Any]]:
        seconds = _ninja_log(self.ninja_file.parent)
        return [
            {
                "object": obj.name,
                "source": self.edges[str(obj)][1],
                "rule": self.edges[str(obj)][0],
                "seconds": seconds.get(str(obj)),
                "bytes": obj.stat().st_size,
                "sha256": cuda_toolchain.sha256(obj),
                "compiled_now": self.before.get(obj) != obj.stat().st_mtime_ns,
            }
            for obj in self.objects
        ]


def _compile(
    kernels: KernelCache,
    python: str,
    module: str,
    variant: str,
    sources: Sequence[str] | None,
    *,
    jobs: int,
    niceness: int,
    environ: Mapping[str, str],
) -> _Compiled:
    """FlashInfer's generator writes `module`'s build.ninja in the key folder's build folder;
    ninja compiles the objects, then the link, with what this machine's toolkit lacks added."""
    build = kernels.directory / BUILD_FOLDER / f"{module}-{variant}"
    build.mkdir(parents=True, exist_ok=True)
    env = _interpreter_environment(environ, build)
    cuda_home = cuda_toolchain.cuda_home_of(env)
    env.setdefault("CUDA_HOME", str(cuda_home))
    python_lib = cuda_toolchain.site_packages(python, env)
    includes, notes = cuda_toolchain.toolkit_headers(cuda_home, python_lib)
    for variable in ("FLASHINFER_EXTRA_CFLAGS", "FLASHINFER_EXTRA_CUDAFLAGS"):
        env[variable] = " ".join(filter(None, (env.get(variable, ""), *includes)))
    request = {"build_dir": str(build), "module": module, "sources": sources}
    # First the objects (ninja on their targets), then what the link needs, then the link.
    generated = _run_driver(python, env, request)
    ninja_file = Path(generated["ninja_file"])
    edges = _ninja_edges(ninja_file)
    objects = [Path(o) for o, (rule, _) in edges.items() if rule in ("compile", "cuda_compile")]
    ninja = [cuda_toolchain.tool("ninja", env), "-C", str(ninja_file.parent), "-f", str(ninja_file)]
    before = {o: o.stat().st_mtime_ns for o in objects if o.exists()}
    cuda_toolchain.run([*ninja, "-j", str(jobs), *map(str, objects)], env, niceness)
    flags, link_notes = cuda_toolchain.link_libraries(
        cuda_home, python_lib, objects, build / "link"
    )
    notes += link_notes
    if flags:
        env["FLASHINFER_EXTRA_LDFLAGS"] = " ".join(flags)
        _run_driver(python, env, request)  # the same build.ninja, the link's -L added
    cuda_toolchain.run([*ninja, "-j", str(jobs)], env, niceness)
    library = Path(generated["library"])
    missing = cuda_toolchain.missing_symbols(
        library, env, [build / "link", *cuda_toolchain.nvidia_lib_dirs(python_lib)]
    )
    return _Compiled(
        build,
        generated,
        ninja_file,
        edges,
        objects,
        before,
        library,
        cuda_toolchain.demangle(missing),
        notes,
        env,
    )


def _install(kernels: KernelCache, compiled: _Compiled, record: dict[str, Any]) -> Built:
    """The linked module and its build.json into the key folder's flashinfer_aot/<module>/."""
    module = record["module"]
    target = library_folder(kernels) / module
    target.mkdir(parents=True, exist_ok=True)
    staging = target / f".{module}.so.{os.getpid()}.tmp"
    shutil.copy2(compiled.library, staging)
    os.replace(staging, target / f"{module}.so")
    record["bytes"] = (target / f"{module}.so").stat().st_size
    record["sha256"] = cuda_toolchain.sha256(target / f"{module}.so")
    write_json_atomic(target / BUILD_RECORD, record)
    return Built(target / f"{module}.so", record)


def _record(
    compiled: _Compiled, kernels: KernelCache, variant: str, started: float
) -> dict[str, Any]:
    cuda_home = cuda_toolchain.cuda_home_of(compiled.env)
    return {
        "module": Path(compiled.library).stem,
        "variant": variant,
        "target": TARGET,
        "flashinfer_version": compiled.generated["flashinfer_version"],
        "key": kernels.key,
        "module_sources": compiled.generated["module_sources"],
        "generated_sources_left_out": compiled.generated["generated_sources"],
        "objects": compiled.object_records(),
        "build_ninja": compiled.ninja_file.read_text(),
        "toolchain_notes": compiled.notes,
        "tools": cuda_toolchain.tool_versions(compiled.env, cuda_home),
        "missing_symbols": compiled.missing,
        "wall_s": round(time.monotonic() - started, 1),
    }


def build_module(
    kernels: KernelCache,
    python: str,
    *,
    gemms: Sequence[trtllm_deepgemm.Gemm] = (),
    jobs: int,
    niceness: int = 10,
    environ: Mapping[str, str] | None = None,
) -> Built:
    """Compile FlashInfer's fused_moe_90 narrowed to FP8_BLOCK_SCALE_SOURCES with `python`'s
    FlashInfer and put the .so and its build.json into the key folder (module doc), then the
    DeepGEMM kernels FlashInfer compiles at run time for `gemms` (the MoE's and the dense fp8
    linears') into the trtllm_deep_gemm library."""
    environ = dict(os.environ if environ is None else environ)
    start = time.monotonic()
    compiled = _compile(
        kernels,
        python,
        MODULE,
        VARIANT,
        FP8_BLOCK_SCALE_SOURCES,
        jobs=jobs,
        niceness=niceness,
        environ=environ,
    )
    own = path_symbols(compiled.missing)
    if own:
        raise UserError(
            f"{compiled.library}: the fp8 block-scale path's own symbols are undefined ({own[0]}, "
            f"{len(own)} in all): FlashInfer's sources changed; the source list needs them"
        )
    cuda_home = cuda_toolchain.cuda_home_of(compiled.env)
    python_lib = cuda_toolchain.site_packages(python, compiled.env)
    build = compiled.build
    vllm = compiled.generated.get("vllm")
    deepgemm = (
        trtllm_deepgemm.build_deepgemm(
            kernels,
            build,
            gemms,
            csrc=Path(compiled.generated["csrc"]),
            vllm=Path(vllm) if vllm else None,
            objects=compiled.objects,
            env=compiled.env,
            cuda_home=cuda_home,
            library_paths=[
                build / "link",
                cuda_home / "lib64",
                *cuda_toolchain.nvidia_lib_dirs(python_lib),
            ],
            jobs=jobs,
            niceness=niceness,
        )
        if gemms
        else []
    )
    record = _record(compiled, kernels, VARIANT, start)
    record["deepgemm_gemms"] = [dataclasses.asdict(gemm) for gemm in gemms]
    record["deepgemm_sms"] = list(trtllm_deepgemm.DEEPGEMM_SMS)
    record["deepgemm_kernels"] = deepgemm
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["generated_sources"] = place_generated(kernels, compiled.generated)
    return _install(kernels, compiled, record)


def build_utils_module(
    kernels: KernelCache,
    python: str,
    *,
    jobs: int,
    niceness: int = 10,
    environ: Mapping[str, str] | None = None,
) -> Built:
    """Compile FlashInfer's trtllm_utils whole (its 5 sources: the autotuner's delay kernel and
    4 common files) and put it into the key folder beside fused_moe_90. FlashInfer's autotuner
    loads it at each engine start that tunes (flashinfer/autotuner/autotuner.py imports
    delay_kernel; flashinfer/tllm_utils.py: gen_trtllm_utils_module().build_and_load()), which
    the provider turns into a load of this .so instead of a JIT build of 5 objects."""
    environ = dict(os.environ if environ is None else environ)
    start = time.monotonic()
    compiled = _compile(
        kernels, python, UTILS_MODULE, "whole", None, jobs=jobs, niceness=niceness, environ=environ
    )
    if compiled.missing:
        raise UserError(
            f"{compiled.library}: built from all of its sources, it leaves "
            f"{len(compiled.missing)} symbol(s) undefined ({compiled.missing[0]})"
        )
    return _install(kernels, compiled, _record(compiled, kernels, "whole", start))


def exported(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """What build-moe exports (archive names' prefixes): the AOT modules, the DeepGEMM kernels
    compiled for them, and the generated sources FlashInfer looks for at load."""
    prefixes: list[str] = []
    for record in records:
        prefixes.append(f"flashinfer_aot/{record['module']}/")
        prefixes += [
            f"trtllm_deep_gemm/cache/{k['name']}/" for k in record.get("deepgemm_kernels", [])
        ]
        if record.get("generated_sources"):
            prefixes.append(f"{record['generated_sources']}/")
    return prefixes


def place_generated(kernels: KernelCache, generated: Mapping[str, str]) -> str:
    """FlashInfer writes the module's generated CUTLASS sources into its workspace at every load,
    the AOT one too (gen_cutlass_fused_moe_sm90_module), keeping a file whose content is
    unchanged: put them where a runner's FlashInfer will look (the key folder's flashinfer/),
    so that its start writes none. Returns that folder, relative to the key folder."""
    relative = Path("flashinfer") / generated["workspace"] / "generated" / "cutlass_instantiations"
    source = Path(generated["generated"]) / "cutlass_instantiations"
    target = kernels.directory / relative
    for path in sorted(source.rglob("*")):
        if path.is_file():
            placed = target / path.relative_to(source)
            if not placed.exists():
                placed.parent.mkdir(parents=True, exist_ok=True)
                staging = placed.with_name(f".{placed.name}.{os.getpid()}.tmp")
                shutil.copy2(path, staging)
                os.replace(staging, placed)
    return str(relative)
