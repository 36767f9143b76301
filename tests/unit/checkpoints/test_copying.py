"""glm5_matrix.checkpoints.copying: files from byte ranges, copied by the kernel, hashed behind.

Expectations are computed here with plain reads and hashlib, never by the copier.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
from checkpoint_readback import hasher_threads

from glm5_matrix.checkpoints import copying
from glm5_matrix.checkpoints.copying import HashingCopier
from glm5_matrix.errors import UserError


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "source.bin"
    path.write_bytes(os.urandom(300_000))
    return path


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def expected(source: Path, prefix: bytes, runs: list[tuple[int, int]]) -> bytes:
    data = source.read_bytes()
    return prefix + b"".join(data[offset : offset + length] for offset, length in runs)


@pytest.fixture(params=["kernel", "cross-device", "copies-nothing"])
def copy_path(request, monkeypatch) -> str:
    """The kernel's copy, or copy_file_range refusing (EXDEV) or answering 0 bytes."""
    if request.param == "cross-device":

        def cross_device(*args, **kwargs):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", cross_device)
    elif request.param == "copies-nothing":
        monkeypatch.setattr(os, "copy_file_range", lambda *args, **kwargs: 0)
    return str(request.param)


@pytest.mark.parametrize("piece_bytes", [None, 4099])
def test_files_are_the_prefix_and_runs_and_hashes_are_of_the_files(
    source, tmp_path, monkeypatch, copy_path, piece_bytes
):
    if piece_bytes:  # many pieces per file: the hasher works while the copy goes on
        monkeypatch.setattr(copying, "_PIECE_BYTES", piece_bytes)
        monkeypatch.setattr(copying, "_BUFFER_BYTES", 1021)
    fds = open_fds()
    layouts = {
        f"out-{i}.bin": (os.urandom(i * 7), [(i, 1000 * i + 1), (200_000 - i, 50_000)])
        for i in range(40)  # more files than the hasher can keep up with: all must finish
    }
    layouts["empty.bin"] = (b"", [])
    layouts["whole.bin"] = (b"", [(0, 300_000)])
    with HashingCopier() as copier:
        digests = {
            name: copier.write(tmp_path / name, prefix, source, runs, fsync=i % 2 == 0)
            for i, (name, (prefix, runs)) in enumerate(layouts.items())
        }
        assert copier.kernel_copy == (copy_path == "kernel")
    for name, (prefix, runs) in layouts.items():
        data = (tmp_path / name).read_bytes()
        assert data == expected(source, prefix, runs), name
        assert digests[name].result() == hashlib.sha256(data).hexdigest(), name
    assert open_fds() == fds
    assert hasher_threads() == []


def test_a_source_shorter_than_its_runs_is_an_error(source, tmp_path, copy_path):
    with pytest.raises(UserError, match="unexpected end of file at 300000"), HashingCopier() as c:
        c.write(tmp_path / "out.bin", b"head", source, [(250_000, 60_000)])
    assert hasher_threads() == []


def test_other_copy_errors_are_not_swallowed(source, tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "copy_file_range", failing)
    with pytest.raises(OSError, match="Input/output error"), HashingCopier() as copier:
        copier.write(tmp_path / "out.bin", b"", source, [(0, 1000)])


def test_an_interrupted_copy_stops_the_hasher_and_closes_everything(source, tmp_path, monkeypatch):
    monkeypatch.setattr(copying, "_PIECE_BYTES", 4099)
    fds = open_fds()
    digests = []
    with pytest.raises(KeyboardInterrupt), HashingCopier() as copier:
        for i in range(10):
            digests.append(copier.write(tmp_path / f"{i}.bin", b"", source, [(0, 300_000)]))
        raise KeyboardInterrupt
    assert open_fds() == fds
    assert hasher_threads() == []
    assert digests  # written before the interruption; the caller discards them


def test_a_hasher_error_reaches_the_caller(source, tmp_path, monkeypatch):
    # Planted: the destination reads back short, as if truncated behind the copier's back.
    monkeypatch.setattr(copying, "_BUFFER_BYTES", 4099)
    real_preadv = os.preadv

    def short_read(fd, buffers, offset, *args):
        got = real_preadv(fd, buffers, offset, *args)
        return 0 if offset >= 100_000 and os.readlink(f"/proc/self/fd/{fd}").endswith("b") else got

    monkeypatch.setattr(os, "preadv", short_read)
    with pytest.raises(UserError, match="shorter than written"), HashingCopier() as copier:
        copier.write(tmp_path / "a", b"", source, [(0, 300_000)])
        copier.write(tmp_path / "b", b"", source, [(0, 300_000)])
    assert hasher_threads() == []
