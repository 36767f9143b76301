"""glm5_matrix.kernels.kernel_cache: the key, the layout, the user's own variables, reading an
interpreter's versions without importing its packages, telling what was compiled (the guard that
refuses it: test_kernel_guard.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from scaffold import KERNEL_KEY

from glm5_matrix.cache import CACHE_VARIABLE
from glm5_matrix.kernels import kernel_cache, kernel_guard

KEY = KERNEL_KEY


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No library variable of the real environment leaks in; the root is a temporary folder."""
    for library in kernel_cache.LIBRARIES:
        monkeypatch.delenv(library.variable, raising=False)
    for name in (kernel_cache.ACTIVE_VARIABLE, kernel_guard.GUARD_VARIABLE, "GLM5_MATRIX_STRICT"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "kernels"
    monkeypatch.setenv(kernel_cache.ROOT_VARIABLE, str(root))
    return root


def test_key_folder_names_the_versions_and_changes_with_each_of_them() -> None:
    name = kernel_cache.key_name(KEY)
    assert name.startswith("vllm-0.33.0_flashinfer-python-0.7.2.post1_torch-2.14.0_cuda-13.0_sm90")
    assert "py3.12" in name and kernel_cache.key_name(dict(KEY)) == name
    names = {name}
    for field, other in [
        ("vllm", "0.33.1"),
        ("flashinfer-python", "0.7.3"),
        ("torch", "2.14.1"),
        ("cuda", "12.9"),
        ("gpu_arch", "sm100"),
        ("python", "3.11"),
        ("triton", "3.8.1"),  # not in the readable part: the hash still tells it apart
        ("tilelang", "0.1.13"),
    ]:
        names.add(kernel_cache.key_name({**KEY, field: other}))
    assert len(names) == 9, "every part of the key gives its own folder"
    assert kernel_cache.key_difference(KEY, {**KEY, "gpu_arch": "sm100"}) == [
        "gpu_arch sm90 != sm100"
    ]


def test_layout_puts_every_library_under_one_key_folder(clean_env: Path) -> None:
    kernels = kernel_cache.layout(KEY)
    assert kernels.directory == clean_env / kernel_cache.key_name(KEY)
    assert set(kernels.variables) == {lib.variable for lib in kernel_cache.LIBRARIES}
    assert kernels.variables["TRITON_CACHE_DIR"] == str(kernels.directory / "triton")
    assert kernels.variables["FLASHINFER_WORKSPACE_BASE"] == str(kernels.directory / "flashinfer")
    assert kernels.user_set == {}
    assert kernels.environment()[kernel_cache.ACTIVE_VARIABLE] == str(kernels.directory)
    kernel_cache.prepare(kernels)
    assert sorted(p.name for p in kernels.directory.iterdir()) == sorted(
        [lib.folder for lib in kernel_cache.LIBRARIES] + [kernel_cache.KEY_FILE]
    )


def test_the_users_own_variable_wins_and_is_reported(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "/my/triton")
    kernels = kernel_cache.layout(KEY)
    assert "TRITON_CACHE_DIR" not in kernels.variables
    assert kernels.user_set == {"TRITON_CACHE_DIR": "/my/triton"}
    assert "TRITON_CACHE_DIR=/my/triton" in kernels.describe()
    assert kernel_cache.watched()["triton"] == Path("/my/triton")


def test_root_defaults_under_the_harness_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(kernel_cache.ROOT_VARIABLE, raising=False)
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    assert kernel_cache.kernel_cache_root() == tmp_path / "kernels"


@pytest.mark.parametrize(
    ("gpus", "arch"), [("9.0", "sm90"), ("9.0,9.0", "sm90"), ("8.0,9.0", "sm80+sm90"), ("", "cpu")]
)
def test_gpu_arch_from_the_visible_gpus(gpus: str, arch: str) -> None:
    assert kernel_cache.gpu_arch({"GLM5_MATRIX_GPUS": gpus}) == arch


def _fake_site(tmp_path: Path) -> Path:
    """A site folder with distributions' metadata and a torch package that must not be imported."""
    site = tmp_path / "site"
    for name, version in [
        ("vllm", "0.33.0"),
        ("flashinfer_python", "0.7.2.post1"),
        ("torch", "9.9"),
    ]:
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n"
        )
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '9.9'\ncuda: Optional[str] = '13.0'\n"
    )
    return site


def test_probe_reads_an_interpreters_versions_without_importing_them(tmp_path: Path) -> None:
    site = _fake_site(tmp_path)
    environ = {**os.environ, "PYTHONPATH": str(site)}
    found = kernel_cache.probe(sys.executable, environ)
    assert found["vllm"] == "0.33.0" and found["flashinfer-python"] == "0.7.2.post1"
    assert found["torch"] == "9.9" and found["cuda"] == "13.0"
    assert found["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    # The control: importing that torch fails, so the probe really did not import it.
    imported = subprocess.run(
        [sys.executable, "-c", "import torch"], env=environ, capture_output=True, text=True
    )
    assert "torch was imported" in imported.stderr


def test_probe_of_a_broken_interpreter_is_one_line(tmp_path: Path) -> None:
    from glm5_matrix.errors import UserError

    with pytest.raises(UserError, match="cannot read its package versions"):
        kernel_cache.probe(tmp_path / "no-python")


def test_ensure_active_sets_what_is_unset_and_keeps_the_rest(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/mine")
    monkeypatch.setenv("GLM5_MATRIX_GPUS", "9.0")
    saved = dict(os.environ)
    try:
        kernel_cache.ensure_active()
        active = Path(os.environ[kernel_cache.ACTIVE_VARIABLE])
        key = {**kernel_cache.interpreter_versions(), "gpu_arch": "sm90"}
        assert active == clean_env / kernel_cache.key_name(key)
        assert os.environ["VLLM_CACHE_ROOT"] == "/mine"
        assert os.environ["TRITON_CACHE_DIR"] == str(active / "triton")
        before = dict(os.environ)
        kernel_cache.ensure_active()  # once active, nothing changes
        assert dict(os.environ) == before
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_written_counts_new_and_rewritten_files_only(clean_env: Path, monkeypatch) -> None:
    kernels = kernel_cache.prepare(kernel_cache.layout(KEY))
    for name, value in kernels.variables.items():
        monkeypatch.setenv(name, value)
    triton = kernels.directory / "triton"
    flashinfer = kernels.directory / "flashinfer" / ".cache" / "flashinfer" / "0.7.2.post1" / "90a"
    old = _touch(triton / "AAA" / "old_kernel.cubin")
    rewritten = _touch(flashinfer / "cached_ops" / "sampling" / "sampling.so")
    _touch(kernels.directory / "vllm" / "modelinfos" / "Old.json")  # bookkeeping: not a kernel
    before = kernel_cache.snapshot()

    _touch(triton / "BBB" / "_fwd_kernel.cubin")  # a new kernel
    rewritten.write_text("rebuilt")  # ninja rebuilt it in place
    os.utime(rewritten, ns=(1, 1))
    # Not kernels: locks, temporary files, a staging folder, ninja's and vLLM's bookkeeping.
    _touch(triton / "tmp.pid_12_abc" / "x.cubin")
    _touch(flashinfer / "cached_ops" / "tmp" / "sampling.lock")
    _touch(kernels.directory / "tilelang" / ".staging" / "k" / "kernel.cu")
    _touch(flashinfer / "cached_ops" / "sampling" / ".ninja_log")
    _touch(kernels.directory / "vllm" / "modelinfos" / "Glm.json")
    _touch(kernels.directory / "inductor" / "locks" / "x.lock")
    _touch(kernels.directory / "inductor" / "fx" / ".123.456.tmp")

    changed = kernel_cache.written(before, kernel_cache.snapshot())
    assert changed["triton"] == ["BBB/_fwd_kernel.cubin"]
    assert changed["flashinfer"] == [
        ".cache/flashinfer/0.7.2.post1/90a/cached_ops/sampling/sampling.so"
    ]
    assert all(not paths for name, paths in changed.items() if name not in ("triton", "flashinfer"))
    assert set(changed) == {lib.name for lib in kernel_cache.LIBRARIES}
    assert old.is_file()
    record = kernel_cache.compile_record(changed, 12.345, before, guard=False)
    assert record["seconds"] == 12.35
    assert record["entries_added"]["triton"] == 1 and record["entries_added"]["vllm"] == 0
    assert record["files_before"] == 2  # old_kernel.cubin and sampling.so, not Old.json
    assert record["guard"] is False
    # the report marks such a start
    assert kernel_cache.compile_record(changed, None, before, guard=True)["guard"] is True
    # A start on an empty cache is the cold start engine_start.py compares against.
    empty = {name: {} for name in before}
    assert kernel_cache.compile_record(changed, None, empty, guard=False)["files_before"] == 0


def _bump_mtime(path: Path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_a_cache_hit_that_touches_files_is_no_compile_a_new_kernel_is(
    clean_env: Path, monkeypatch
) -> None:
    """What every engine start wrote on the H200 after the warm step (issue 26): DeepGEMM bumps
    the mtime of each loaded kernel's .committed marker, FlashInfer appends to its JIT log. Not
    a compile; a kernel DeepGEMM builds (new files) and a marker rewritten with other bytes are."""
    kernels = kernel_cache.prepare(kernel_cache.layout(KEY))
    for name, value in kernels.variables.items():
        monkeypatch.setenv(name, value)
    cache = kernels.directory / "deep_gemm" / "cache"
    loaded = cache / "sm90_fp8_gemm_1d2d.00f95db06c7064c1ad2c0b049bb2ce77"
    for name, text in (("kernel.cu", "src"), ("kernel.cubin", "bin"), ("meta.json", "{}")):
        _touch(loaded / name, text)
    marker = _touch(loaded / ".committed", "")
    other = _touch(cache / "transpose_fp32.eaf551a8d3e91643eaae74a2f689c12c" / ".committed", "")
    small = _touch(kernels.directory / "vllm" / "autotune" / "fp8_gemm.json", '{"tactic": 3}')
    triton = kernels.directory / "triton" / "K"
    big = _touch(triton / "big.cubin", "b" * (kernel_cache.DIGEST_LIMIT + 1))
    ptx = _touch(triton / "k.ptx", "version 1")
    workspace = kernels.directory / "flashinfer" / ".cache" / "flashinfer" / "0.7.2.post1" / "90a"
    log = _touch(workspace / "flashinfer_jit.log", "a\n")
    before = kernel_cache.snapshot()

    _bump_mtime(marker)  # a hit: try_update_mtime
    small.write_text('{"tactic": 3}')  # rewritten with the same bytes (os.replace of a copy)
    _bump_mtime(small)
    with log.open("a") as handle:  # the autotuner's lines
        handle.write("[Autotuner]: Autotuning process starts ...\n")
    _bump_mtime(log)
    unchanged = kernel_cache.written(before, kernel_cache.snapshot())
    assert unchanged == {name: [] for name in kernel_cache.LIBRARY_NAMES}

    built = cache / "sm90_fp8_gemm_1d2d.3efe06605fcfffd8867099179573a8dc"  # a miss: compiled
    for name in ("kernel.cu", "kernel.cubin", "meta.json", ".committed"):
        _touch(built / name, "" if name == ".committed" else name)
    other.write_text("x")  # same name, other bytes: counts
    _bump_mtime(big)  # too large to compare: a new mtime counts
    ptx.write_text("version 2")  # same size, other bytes: counts
    changed = kernel_cache.written(before, kernel_cache.snapshot())
    assert changed["deep_gemm"] == [
        "cache/sm90_fp8_gemm_1d2d.3efe06605fcfffd8867099179573a8dc/.committed",
        "cache/sm90_fp8_gemm_1d2d.3efe06605fcfffd8867099179573a8dc/kernel.cu",
        "cache/sm90_fp8_gemm_1d2d.3efe06605fcfffd8867099179573a8dc/kernel.cubin",
        "cache/sm90_fp8_gemm_1d2d.3efe06605fcfffd8867099179573a8dc/meta.json",
        "cache/transpose_fp32.eaf551a8d3e91643eaae74a2f689c12c/.committed",
    ]
    assert changed["triton"] == ["K/big.cubin", "K/k.ptx"]
    assert changed["vllm"] == [] and changed["flashinfer"] == []
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    with pytest.raises(kernel_guard.KernelCompiled, match=r"deep_gemm: 5 file\(s\)"):
        kernel_guard.refuse_compiled(changed, "the start of engine e")


def test_the_record_lists_the_counted_files_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's own compile beside a busy stranger: the files that count are listed whatever
    the stranger wrote before them (the H200's control wrote 619 files, 225 of them counted),
    and the record says how many there were."""
    monkeypatch.setattr(kernel_cache, "FILES_LISTED", 3)
    writes: list[dict[str, object]] = [
        {"library": "triton", "path": f"S{i}/k.cubin", "writer": "other", "counted": False}
        for i in range(4)
    ] + [
        {"library": "triton", "path": f"C{i}/k.cubin", "writer": "cell", "counted": True}
        for i in range(2)
    ]
    empty: kernel_cache.Snapshot = {}
    record = kernel_cache.compile_record(
        {"triton": ["C0/k.cubin", "C1/k.cubin"]}, None, empty, writes, guard=True
    )
    listed = record["written"]
    assert isinstance(listed, list)
    assert [w["path"] for w in listed] == ["C0/k.cubin", "C1/k.cubin", "S0/k.cubin"]
    assert record["written_total"] == 6
    assert record["not_counted"] == {"triton": 4}
