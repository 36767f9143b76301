"""Files written from byte ranges of other files by the kernel, each hashed behind its copy.

The tensor data never passes through Python: os.copy_file_range moves it from the source's
page cache to the destination's (or, on a filesystem that shares extents, not at all), as a
plain file copy does. The sha256 is that of the file as written: a second thread reads back
each finished piece of the destination, from the page cache the copy just filled, and hashes
it while the next piece copies, so on two cores hashing costs almost no wall time. Memory is
a fixed buffer (two where the kernel cannot copy), whatever the tensor, run or shard sizes.

Where the kernel refuses to copy between the two files (another filesystem on some kernels, a
filesystem without copy_file_range) or copies nothing before the end of the range, pieces go
through a buffer with pread/pwrite instead, hashed the same way.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from glm5_matrix.errors import UserError

# One copy_file_range call moves at most a piece; the hasher is handed whole pieces (or what
# is left of a file). Small enough that the last piece's hash is a short tail, large enough
# that the handoffs cost nothing.
_PIECE_BYTES = 64 << 20
# The hasher's read buffer, and the copy buffer where the kernel does not copy.
_BUFFER_BYTES = 1 << 20
# Pieces copied but not yet hashed, at most: the copy waits rather than run ahead of the hash
# by more than this (they are still in the page cache when the hasher reads them).
_BACKLOG = 2
# copy_file_range errors that mean "not between these files", not "the copy failed".
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


@dataclass
class _Hashing:
    """One destination file as the hasher sees it: a reader, a digest, what was handed over."""

    path: Path
    reader: int  # a read-only descriptor of the destination
    digest: Any = field(default_factory=hashlib.sha256)
    handed: int = 0  # bytes [0, handed) are copied and queued for hashing
    error: BaseException | None = None


class HashingCopier:
    """Writes files from a header and byte ranges of a source; returns each file's sha256.

    Use as a context manager: leaving it waits for every hash (and re-raises a hasher's error);
    leaving it by an exception stops the hasher at its next buffer and waits for that only.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm5-sha256")
        self._backlog: deque[Future[None]] = deque()
        self._stop = threading.Event()
        self._hash_buffer = bytearray(_BUFFER_BYTES)  # the hasher thread's only
        self._copy_buffer: bytearray | None = None  # allocated when the kernel will not copy
        self._kernel_copy = hasattr(os, "copy_file_range")
        self._files: list[_Hashing] = []

    def __enter__(self) -> HashingCopier:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        failed = kind is not None
        if failed:
            self._stop.set()
        try:
            while self._backlog and not failed:
                self._backlog.popleft().result()
        except BaseException:
            failed = True
            self._stop.set()
            raise
        finally:
            # On success every queued hash (and each file's digest) still runs; on failure
            # what has not started is dropped and the running one stops at its next buffer.
            self._executor.shutdown(wait=True, cancel_futures=failed)
            for file in self._files:
                os.close(file.reader)
            self._files.clear()

    @property
    def kernel_copy(self) -> bool:
        """Whether copies go through copy_file_range (False once it refused or copied nothing)."""
        return self._kernel_copy

    def write(
        self,
        target: Path,
        prefix: bytes,
        source: Path | None = None,
        runs: Sequence[tuple[int, int]] = (),
        fsync: bool = False,
    ) -> Future[str]:
        """Create `target`: `prefix`, then each (offset, length) range of `source` in order.

        Returns the sha256 (hex) of `target` as a future; it is hashed from the file itself,
        piece by piece as the copy proceeds.
        """
        with open(target, "wb") as out:
            out.write(prefix)
            out.flush()
            file = _Hashing(target, os.open(target, os.O_RDONLY))
            self._files.append(file)
            position = len(prefix)
            if runs:
                assert source is not None
                with open(source, "rb", buffering=0) as src:
                    for offset, length in runs:
                        position = self._copy_run(src, out.fileno(), offset, length, position, file)
            self._hand_over(file, position)
            if fsync:
                os.fsync(out.fileno())
        return self._executor.submit(self._finish, file)

    # --- the copy (caller's thread) ---------------------------------------------------------

    def _copy_run(
        self, src: Any, out: int, offset: int, length: int, position: int, file: _Hashing
    ) -> int:
        end = offset + length
        while offset < end:
            copied = self._copy(
                src.fileno(), out, offset, position, min(end - offset, _PIECE_BYTES)
            )
            if copied == 0:
                raise UserError(f"{src.name}: unexpected end of file at {offset}")
            offset += copied
            position += copied
            if position - file.handed >= _PIECE_BYTES:
                self._hand_over(file, position)
        return position

    def _copy(self, src: int, out: int, offset: int, position: int, length: int) -> int:
        """Copy up to `length` bytes of src at `offset` to out at `position`; bytes copied."""
        if self._kernel_copy:
            try:
                copied = os.copy_file_range(src, out, length, offset, position)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                copied = 0
            if copied:
                return copied
            # Refused, or 0 bytes, which some filesystems answer for data they do hold; a read
            # tells a real end of file from that. No more kernel copies from this copier.
            self._kernel_copy = False
        if self._copy_buffer is None:
            self._copy_buffer = bytearray(_BUFFER_BYTES)
        view = memoryview(self._copy_buffer)[: min(length, _BUFFER_BYTES)]
        got = os.preadv(src, [view], offset)
        written = 0
        while written < got:
            written += os.pwrite(out, view[written:got], position + written)
        return got

    def _hand_over(self, file: _Hashing, position: int) -> None:
        """Queue bytes [file.handed, position) for hashing; wait if the hasher is behind."""
        if position > file.handed:
            self._backlog.append(
                self._executor.submit(self._hash, file, file.handed, position - file.handed)
            )
            file.handed = position
        while len(self._backlog) > _BACKLOG:
            self._backlog.popleft().result()

    # --- the hash (the hasher thread) -------------------------------------------------------

    def _hash(self, file: _Hashing, offset: int, length: int) -> None:
        if file.error is not None:
            return
        try:
            view = memoryview(self._hash_buffer)
            end = offset + length
            while offset < end:
                if self._stop.is_set():
                    raise InterruptedError("stopped")
                got = os.preadv(file.reader, [view[: min(end - offset, len(view))]], offset)
                if got == 0:
                    raise UserError(f"{file.path}: shorter than written ({offset} bytes)")
                file.digest.update(view[:got])
                offset += got
        except BaseException as exc:
            file.error = exc
            raise

    def _finish(self, file: _Hashing) -> str:
        if file.error is not None:
            raise file.error
        os.close(file.reader)
        self._files.remove(file)
        return str(file.digest.hexdigest())
