"""glm5_matrix.kernels.kernel_archive: export and import of a key folder, for real (tar, gzip, zstd,
parts), the refusal of an archive built for another machine, the merge and the lock."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scaffold import KERNEL_KEY, environ_without, run_cli

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.kernels import kernel_archive, kernel_cache

KEY = KERNEL_KEY
FILES = {
    "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/fused_moe_90/a.cuda.o": b"o" * 5000,
    "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/fused_moe_90/.ninja_log": b"# log\n",
    "deep_gemm/cache/kernel.fp8_gemm.abc/kernel.cubin": os.urandom(3000),
    "triton/HASH/_fwd_kernel.cubin": b"cubin",
    "vllm/modelinfos/Glm5.json": b"{}",
}
TRANSIENT = (
    "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/tmp/fused_moe_90.lock",
    "triton/tmp.pid_1_x/k.cubin",
)


def _cache(root: Path, key: dict[str, str] = KEY) -> kernel_cache.KernelCache:
    return kernel_cache.prepare(kernel_cache.layout(key, {kernel_cache.ROOT_VARIABLE: str(root)}))


def _fill(kernels: kernel_cache.KernelCache) -> dict[str, int]:
    """Write FILES (and transient files) with distinct sub-second mtimes; {name: mtime_ns}."""
    mtimes = {}
    for i, (name, data) in enumerate(FILES.items()):
        path = kernels.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        mtimes[name] = 1_700_000_000_123_456_789 + i * 1_001
        os.utime(path, ns=(mtimes[name], mtimes[name]))
    for name in TRANSIENT:
        (kernels.directory / name).parent.mkdir(parents=True, exist_ok=True)
        (kernels.directory / name).write_text("")
    return mtimes


def _contents(kernels: kernel_cache.KernelCache) -> dict[str, bytes]:
    found = {}
    for library in kernel_cache.LIBRARIES:
        folder = kernels.folder(library)
        for relative in kernel_cache.files(folder):
            found[f"{library.folder}/{relative}"] = (folder / relative).read_bytes()
    return found


@pytest.mark.parametrize("compression", ["gz", "xz", "none", "zst"])
def test_round_trip_keeps_every_file_and_its_exact_mtime(tmp_path: Path, compression: str) -> None:
    if compression == "zst" and shutil.which("zstd") is None:
        pytest.skip("zstd is not installed")
    source = _cache(tmp_path / "here")
    mtimes = _fill(source)
    archive = tmp_path / "kernels.tar"
    done = kernel_archive.export_archive(source, archive, compression=compression)
    assert done.files == {"flashinfer": 2, "deep_gemm": 1, "triton": 1, "vllm": 1}
    assert [p.name for p in done.written] == ["kernels.tar", "kernels.tar.sha256"]
    # Another machine, same versions, same root path: the root is moved here in between.
    shutil.rmtree(tmp_path / "here")
    target = _cache(tmp_path / "here")
    imported = kernel_archive.import_archive(archive, target)
    assert imported.files == done.files and not imported.warnings
    assert _contents(target) == FILES
    for name, mtime in mtimes.items():
        assert (target.directory / name).stat().st_mtime_ns == mtime, name
    for name in TRANSIENT:
        assert not (target.directory / name).exists(), f"{name} travelled"
    assert not list(target.directory.glob(".glm5-import-*")), "staging left behind"


def test_parts_with_sums_and_damaged_or_missing_parts(tmp_path: Path) -> None:
    source = _cache(tmp_path / "a")
    _fill(source)
    archive = tmp_path / "out" / "kernels.tar.gz"
    archive.parent.mkdir()
    done = kernel_archive.export_archive(
        source, archive, compression="none", part_size_mib=2048 / 2**20
    )
    parts = sorted(archive.parent.glob("kernels.tar.gz.[0-9][0-9][0-9]"))
    assert len(parts) > 3 and all(p.stat().st_size <= 2048 for p in parts)
    assert done.written == [*parts, archive.with_name("kernels.tar.gz.sha256")]
    target = _cache(tmp_path / "b")
    kernel_archive.import_archive(archive, target)
    assert _contents(target) == FILES

    damaged = bytearray(parts[1].read_bytes())
    damaged[10] ^= 0xFF
    parts[1].write_bytes(bytes(damaged))
    with pytest.raises(UserError, match=r"kernels.tar.gz.001: sha256 differs"):
        kernel_archive.import_archive(archive, _cache(tmp_path / "c"))
    parts[-1].unlink()
    with pytest.raises(UserError, match="lists"):
        kernel_archive.import_archive(archive, _cache(tmp_path / "c"))
    parts[0].unlink()
    with pytest.raises(UserError, match=r"part kernels.tar.gz.000 is missing|not found"):
        kernel_archive.import_archive(archive, _cache(tmp_path / "c"))


@pytest.mark.parametrize(
    ("field", "value"), [("gpu_arch", "sm100"), ("vllm", "0.33.1"), ("cuda", "12.9")]
)
def test_an_archive_for_another_machine_is_refused_in_one_line(
    tmp_path: Path, field: str, value: str
) -> None:
    source = _cache(tmp_path / "a")
    _fill(source)
    archive = tmp_path / "k.tar.gz"
    kernel_archive.export_archive(source, archive)
    other = _cache(tmp_path / "b", {**KEY, field: value})
    with pytest.raises(UserError) as refused:
        kernel_archive.import_archive(archive, other)
    message = str(refused.value)
    assert f"{field} {KEY[field]} != {value}" in message and "refused" in message
    assert "\n" not in message
    assert _contents(other) == {}, "a refused archive wrote something"


def test_import_merges_and_keeps_what_the_machine_has(tmp_path: Path) -> None:
    source = _cache(tmp_path / "a")
    _fill(source)
    archive = tmp_path / "k.tar.gz"
    kernel_archive.export_archive(source, archive, libraries=["triton", "deep_gemm"])
    target = _cache(tmp_path / "b")
    mine = target.directory / "triton" / "HASH" / "_fwd_kernel.cubin"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"mine")
    done = kernel_archive.import_archive(archive, target)
    assert done.kept == 1 and mine.read_bytes() == b"mine"
    assert (target.directory / "deep_gemm/cache/kernel.fp8_gemm.abc/kernel.cubin").is_file()
    assert not (target.directory / "flashinfer" / ".cache").exists()  # not exported
    assert any("built under" in w for w in done.warnings), "another root goes unnoticed"


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    kernels = _cache(tmp_path / "a")
    with pytest.raises(UserError, match="not found"):
        kernel_archive.import_archive(tmp_path / "none.tar.gz", kernels)
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(200))
    with pytest.raises(UserError, match="not a readable kernel cache archive"):
        kernel_archive.import_archive(junk, kernels)
    with pytest.raises(UserError, match="compression"):
        kernel_archive.export_archive(kernels, tmp_path / "x", compression="lz4")
    with pytest.raises(UserError, match="unknown library"):
        kernel_archive.export_archive(kernels, tmp_path / "x", libraries=["cutedsl"])


def test_zst_without_zstd_is_one_line(tmp_path: Path, monkeypatch) -> None:
    kernels = _cache(tmp_path / "a")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="zstd is not installed"):
        kernel_archive.export_archive(kernels, tmp_path / "k.tar.zst", compression="zst")
    assert not list(tmp_path.glob("k.tar.zst*"))


_HOLD_LOCK = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from glm5_matrix.kernels.kernel_archive import locked
with locked(Path(sys.argv[2])):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def test_import_waits_for_the_lock_another_process_holds(tmp_path: Path) -> None:
    source = _cache(tmp_path / "a")
    _fill(source)
    archive = tmp_path / "k.tar.gz"
    kernel_archive.export_archive(source, archive)
    target = _cache(tmp_path / "b")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _HOLD_LOCK,
            str(repo_root() / "src"),
            str(target.directory.parent),
            "1.5",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        kernel_archive.import_archive(archive, target)
        waited = time.monotonic() - started
    finally:
        holder.wait(timeout=30)
    assert waited > 1.0, f"import did not wait for the lock ({waited:.2f} s)"
    assert _contents(target) == FILES


def test_two_imports_at_once_both_end_complete(tmp_path: Path) -> None:
    source = _cache(tmp_path / "a")
    _fill(source)
    archive = tmp_path / "k.tar.gz"
    kernel_archive.export_archive(source, archive)
    root = tmp_path / "b"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from glm5_matrix.kernels import kernel_archive, kernel_cache; import json; "
        "k = kernel_cache.prepare(kernel_cache.layout(json.loads(sys.argv[3]), "
        "{'GLM5_MATRIX_KERNEL_CACHE': sys.argv[2]})); "
        "kernel_archive.import_archive(Path(sys.argv[4]), k)"
    )
    import json

    args = [str(repo_root() / "src"), str(root), json.dumps(KEY), str(archive)]
    runs = [subprocess.Popen([sys.executable, "-c", code, *args]) for _ in range(2)]
    assert [r.wait(timeout=60) for r in runs] == [0, 0]
    assert _contents(_cache(root)) == FILES


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = environ_without()
    environ.update(env)
    return run_cli("kernel-cache", *args, env=environ, timeout=120)


def test_the_command_exports_imports_and_refuses_another_gpu(tmp_path: Path) -> None:
    here = {"GLM5_MATRIX_KERNEL_CACHE": str(tmp_path / "root"), "GLM5_MATRIX_GPUS": "9.0"}
    shown = _cli("show", "--python", sys.executable, **here)
    assert shown.returncode == 0, shown.stderr
    assert "_sm90_" in shown.stdout and "triton" in shown.stdout
    # show creates nothing: it names the key folder a cell would fill
    assert "(not created yet: nothing compiled here)" in shown.stdout
    assert not (tmp_path / "root").exists()
    key_dir = Path(shown.stdout.split()[2])
    assert key_dir.parent == tmp_path / "root"
    (key_dir / "triton" / "H").mkdir(parents=True)
    (key_dir / "triton" / "H" / "k.cubin").write_bytes(b"k")
    exported = _cli("export", str(tmp_path / "k.tar.gz"), "--python", sys.executable, **here)
    assert exported.returncode == 0, exported.stderr
    assert "triton 1" in exported.stdout
    other = {**here, "GLM5_MATRIX_KERNEL_CACHE": str(tmp_path / "other")}
    imported = _cli("import", str(tmp_path / "k.tar.gz"), "--python", sys.executable, **other)
    assert imported.returncode == 0, imported.stderr
    assert "warning: built under" in imported.stderr  # another root
    elsewhere = {**here, "GLM5_MATRIX_GPUS": "10.0"}
    refused = _cli("import", str(tmp_path / "k.tar.gz"), "--python", sys.executable, **elsewhere)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "gpu_arch sm90 != sm100" in refused.stderr
    # the refused archive left no key folder for sm100 behind
    assert [p.name for p in (tmp_path / "root").iterdir() if p.is_dir()] == [key_dir.name]


def test_a_refused_import_through_the_command_creates_nothing(tmp_path: Path) -> None:
    """Issue 49: `kernel-cache import /nonexistent` failed, but only after creating the key
    folder and its nine library folders. A missing archive, a folder and a binary file are each
    one line, exit 2, and the kernel cache's root is never created."""
    root = tmp_path / "root"
    here = {"GLM5_MATRIX_KERNEL_CACHE": str(root), "GLM5_MATRIX_GPUS": ""}
    folder = tmp_path / "a-folder"
    folder.mkdir()
    binary = tmp_path / "binary.tar.gz"
    binary.write_bytes(os.urandom(3000))
    for given, expected in (
        (tmp_path / "nonexistent", "kernel cache archive not found"),
        (folder, "a folder, not a kernel cache archive"),
        (binary, "not a readable kernel cache archive"),
    ):
        done = _cli("import", str(given), "--python", sys.executable, **here)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
        assert not root.exists(), f"importing {given.name} created {root}"
    # export creates nothing either: there is no cache here to export
    done = _cli("export", str(folder), "--python", sys.executable, **here)
    assert done.returncode == 2 and "no kernel cache here to export" in done.stderr
    assert not root.exists()


def test_an_export_onto_a_folder_is_one_line(tmp_path: Path) -> None:
    kernels = _cache(tmp_path / "a")
    _fill(kernels)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="a folder \\(name the archive file to write\\)"):
        kernel_archive.export_archive(kernels, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
