"""ninja_deps against ninja itself: a module built on one machine, whose deps log names a toolchain
header the other machine lacks, is rebuilt there; narrowed to the shared prefixes it is not, and
a shared header that changed still makes it dirty. And a partial build that travels in a kernel
archive resumes where it stopped, which takes the objects' exact mtimes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scaffold import KERNEL_KEY

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import kernel_archive, kernel_cache, ninja_deps

# A compiler stand-in: writes the object and a gcc-style depfile naming the headers it "read".
FAKE_CC = """
import sys
source, out, *headers = sys.argv[1:]
open(out, "w").write("object of " + source)
open(out + ".d", "w").write(out + ": " + " ".join([source, *headers]) + "\\n")
"""


COMMAND = (sys.executable, "-m", "glm5_matrix.cli", "kernel-cache")


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    import ninja  # the harness environment's ninja wheel

    return str(Path(ninja.BIN_DIR) / "ninja")


@pytest.fixture
def built(tmp_path: Path) -> Path:
    """A one-object build: main.c reading the project's a.h and the toolchain's sys.h."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "toolchain").mkdir()
    (tmp_path / "proj/main.c").write_text("int main;")
    (tmp_path / "proj/a.h").write_text("")
    (tmp_path / "toolchain/sys.h").write_text("")
    (tmp_path / "cc.py").write_text(FAKE_CC)
    headers = f"{tmp_path}/proj/a.h {tmp_path}/toolchain/sys.h"
    (tmp_path / "build.ninja").write_text(
        "rule cc\n"
        f"  command = {sys.executable} {tmp_path}/cc.py $in $out {headers}\n"
        "  depfile = $out.d\n"
        "  deps = gcc\n"
        f"build {tmp_path}/out/main.o: cc {tmp_path}/proj/main.c\n"
    )
    old = 1_700_000_000
    for header in ("proj/main.c", "proj/a.h", "toolchain/sys.h"):
        os.utime(tmp_path / header, (old, old))
    _run(tmp_path)
    return tmp_path


def _run(folder: Path, *args: str) -> str:
    done = subprocess.run(
        [_ninja(), "-C", str(folder), *args], capture_output=True, text=True, check=True
    )
    return done.stdout + done.stderr


def _dirty(folder: Path) -> bool:
    return "no work to do" not in _run(folder, "-n")


def test_parse_reads_what_ninja_recorded(built: Path) -> None:
    log = ninja_deps.parse((built / ".ninja_deps").read_bytes())
    assert log.dependencies(f"{built}/out/main.o") == [
        f"{built}/proj/main.c",
        f"{built}/proj/a.h",
        f"{built}/toolchain/sys.h",
    ]
    assert ninja_deps.parse(ninja_deps.serialize(log)) == log


def test_a_missing_toolchain_header_rebuilds_unless_narrowed(built: Path) -> None:
    assert not _dirty(built)
    (built / "toolchain/sys.h").unlink()  # the other machine's toolchain lives elsewhere
    assert _dirty(built)  # the control: ninja as it is rebuilds a valid object
    kept, dropped = ninja_deps.keep_only(built / ".ninja_deps", (f"{built}/proj/",))
    assert (kept, dropped) == (2, 1)
    assert not _dirty(built)
    deps = _run(built, "-t", "deps")
    assert "a.h" in deps and "sys.h" not in deps


def test_a_changed_shared_header_still_rebuilds(built: Path) -> None:
    ninja_deps.keep_only(built / ".ninja_deps", (f"{built}/proj/",))
    assert not _dirty(built)
    os.utime(built / "proj/a.h")  # now: newer than the object
    assert _dirty(built)


def test_keep_only_keeps_the_logs_mtime(built: Path) -> None:
    path = built / ".ninja_deps"
    os.utime(path, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    ninja_deps.keep_only(path, (f"{built}/proj/",))
    assert path.stat().st_mtime_ns == 1_600_000_000_123_456_789
    assert [p.name for p in built.iterdir() if p.name.startswith(".glm5-")] == []


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not a deps log", "not a ninja deps log"),
        (ninja_deps.MAGIC + b"\x03\x00\x00\x00", "version 3"),
        (ninja_deps.MAGIC + b"\x04\x00\x00\x00\x08\x00\x00\x00ab", "truncated"),
    ],
)
def test_malformed_logs_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(UserError, match=message):
        ninja_deps.parse(data)


def test_the_command_narrows_every_log_under_a_folder(built: Path) -> None:
    (built / "toolchain/sys.h").unlink()
    assert _dirty(built)
    done = subprocess.run(
        [*COMMAND, "narrow-deps", str(built), "--keep", f"{built}/proj/"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert "kept 2 dependencies, dropped 1" in done.stdout
    assert not _dirty(built)


def test_the_command_refuses_a_folder_without_logs(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no \.ninja_deps"):
        ninja_deps.keep_only_under(tmp_path, ("/x",))


# The stand-in compiler, then the object stamped with the mtime FlashInfer's fused_moe_90 object
# had on this machine: the tar header's decimal mtime (what Python's tarfile writes,
# 1796249072.1278017) is 25 ns later.
STAMP_NS = 1_796_249_072_127_801_675
STAMPING_CC = FAKE_CC + f"import os\nos.utime(out, ns=({STAMP_NS}, {STAMP_NS}))\n"


def _partial_build(root: Path, sources: Path) -> tuple[kernel_cache.KernelCache, Path]:
    """A two-object module in the kernel cache's FlashInfer folder, stopped after one object."""
    kernels = kernel_cache.prepare(
        kernel_cache.layout(KERNEL_KEY, {kernel_cache.ROOT_VARIABLE: str(root)})
    )
    module = kernels.directory / "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/m"
    module.mkdir(parents=True)
    sources.mkdir()
    (sources / "cc.py").write_text(STAMPING_CC)
    for name in ("one.cu", "two.cu"):
        (sources / name).write_text(name)
        os.utime(sources / name, (1_700_000_000, 1_700_000_000))
    (module / "build.ninja").write_text(
        "rule cc\n"
        f"  command = {sys.executable} {sources}/cc.py $in $out\n"
        "  depfile = $out.d\n"
        "  deps = gcc\n"
        f"build {module}/one.o: cc {sources}/one.cu\n"
        f"build {module}/two.o: cc {sources}/two.cu\n"
    )
    _run(module, f"{module}/one.o")  # the runner went before two.o
    return kernels, module


def _to_run(module: Path) -> int:
    """How many commands ninja would run."""
    return sum(line.startswith("[") for line in _run(module, "-n").splitlines())


def test_a_partial_build_resumes_from_the_archive_and_not_from_plain_tar(tmp_path: Path) -> None:
    kernels, module = _partial_build(tmp_path / "root", tmp_path / "src")
    assert _to_run(module) == 1  # two.o only
    archive = tmp_path / "kernels.tar.gz"
    kernel_archive.export_archive(kernels, archive)
    shutil.rmtree(kernels.directory)
    kernel_archive.import_archive(archive, kernel_cache.prepare(kernels))
    assert (module / "one.o").is_file()
    assert _to_run(module) == 1, _run(module, "-n", "-d", "explain")

    # The control: the same archive unpacked by GNU tar, which restores the header's decimal
    # mtime; ninja's deps log recorded the object's to the nanosecond and finds it newer.
    shutil.rmtree(kernels.directory)
    kernels.directory.mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(kernels.directory)], check=True)
    assert (module / "one.o").stat().st_mtime_ns == STAMP_NS + 25
    assert _to_run(module) == 2
    assert "stored deps info out of date" in _run(module, "-n", "-d", "explain")
