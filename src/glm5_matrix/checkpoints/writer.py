"""Writing a prune plan: shards streamed through a fixed buffer, hashed as written, the
result built in a temporary directory next to DST and renamed into place only when complete.

Peak memory is the copy buffer, not a tensor, a shard or the model. SRC is only read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from glm5_matrix.checkpoints.card import model_card, provenance
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME, format_manifest
from glm5_matrix.checkpoints.plan import (
    MODEL_CARD_NAME,
    PROVENANCE_NAME,
    KeptTensor,
    OutputShard,
    PrunePlan,
    config_json,
    format_size,
    index_json,
)
from glm5_matrix.checkpoints.reading import INDEX_NAME
from glm5_matrix.errors import UserError

_COPY_BUFFER_BYTES = 16 << 20


class _HashedStream:
    """Writes one file from byte ranges of source files, hashing what it writes.

    Ranges are read into one reused buffer, many small tensors per buffer; a full buffer is
    hashed and written in one call. Memory: the buffer, whatever the tensor sizes. (Hashing in
    a second thread measured slower on a loaded 2-CPU machine, so it stays inline.)
    """

    def __init__(self, dst: Any, buffer: bytearray, prefix: bytes = b"") -> None:
        self._dst = dst
        self._view = memoryview(buffer)
        self._fill = 0
        self._digest = hashlib.sha256(prefix)
        dst.write(prefix)

    def copy_from(self, src: Any, offset: int, length: int) -> None:
        """Append `length` bytes of the unbuffered file `src`, starting at `offset`."""
        src.seek(offset)
        remaining = length
        while remaining:
            want = min(len(self._view) - self._fill, remaining)
            got = src.readinto(self._view[self._fill : self._fill + want])
            if not got:
                raise UserError(
                    f"{src.name}: unexpected end of file at {offset + length - remaining}"
                )
            self._fill += got
            remaining -= got
            if self._fill == len(self._view):
                self._flush()

    def _flush(self) -> None:
        chunk = self._view[: self._fill]
        self._digest.update(chunk)
        self._dst.write(chunk)
        self._fill = 0

    def finish(self) -> str:
        self._flush()
        return self._digest.hexdigest()


def _write_shard(plan: PrunePlan, shard: OutputShard, target: Path, buffer: bytearray) -> str:
    source = plan.source.shards[shard.source_file]
    # Unbuffered reads straight into the copy buffers; writes are whole buffers.
    with open(source.path, "rb", buffering=0) as src, target.open("wb") as dst:
        stream = _HashedStream(dst, buffer, prefix=shard.header)
        for start, end in _contiguous_runs(shard.tensors):
            stream.copy_from(src, source.data_start + start, end - start)
        digest = stream.finish()
        dst.flush()
        os.fsync(dst.fileno())
    return digest


def _contiguous_runs(tensors: list[KeptTensor]) -> list[tuple[int, int]]:
    """Source byte ranges of tensors in output order, adjacent ones merged into one read."""
    runs: list[tuple[int, int]] = []
    for t in tensors:
        if runs and runs[-1][1] == t.entry.start:
            runs[-1] = (runs[-1][0], t.entry.end)
        else:
            runs.append((t.entry.start, t.entry.end))
    return runs


def _copy_file(src: Path, dst: Path, buffer: bytearray) -> str:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb", buffering=0) as fin, dst.open("wb") as fout:
        stream = _HashedStream(fout, buffer)
        stream.copy_from(fin, 0, os.fstat(fin.fileno()).st_size)
        digest = stream.finish()
    shutil.copymode(src, dst)
    return digest


def _write_text(path: Path, text: str) -> str:
    data = text.encode()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def check_destination(source: Path, dst: Path, force: bool) -> None:
    src_real, dst_real = source.resolve(), dst.resolve()
    if dst_real == src_real or src_real in dst_real.parents or dst_real in src_real.parents:
        raise UserError(f"{dst}: DST must be outside SRC and must not contain it")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise UserError(f"{dst}: already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise UserError(f"{dst.parent}: parent directory of DST does not exist")


def execute_prune(plan: PrunePlan, dst: Path, force: bool, log: Any = print) -> dict[str, str]:
    """Write the pruned checkpoint to dst (atomically); returns the manifest {file: sha256}."""
    check_destination(plan.source.directory, dst, force)
    free, needed = shutil.disk_usage(dst.parent).free, plan.output_bytes()
    if free < needed:
        raise UserError(
            f"{dst.parent}: {format_size(free)} free, the pruned checkpoint needs "
            f"{format_size(needed)}"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        hashes: dict[str, str] = {}
        buffer = bytearray(_COPY_BUFFER_BYTES)
        for shard in plan.shards:
            hashes[shard.file] = _write_shard(plan, shard, staging / shard.file, buffer)
            log(f"wrote {shard.file} ({format_size(shard.size)}, {len(shard.tensors)} tensors)")
        for relative in plan.side_files:
            hashes[relative.as_posix()] = _copy_file(
                plan.source.directory / relative, staging / relative, buffer
            )
        hashes["config.json"] = _write_text(staging / "config.json", config_json(plan.config))
        hashes[INDEX_NAME] = _write_text(staging / INDEX_NAME, index_json(plan))
        hashes[PROVENANCE_NAME] = _write_text(
            staging / PROVENANCE_NAME, json.dumps(provenance(plan), indent=2) + "\n"
        )
        hashes[MODEL_CARD_NAME] = _write_text(staging / MODEL_CARD_NAME, model_card(plan))
        (staging / MANIFEST_NAME).write_text(format_manifest(hashes))
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700; DST is an ordinary directory
        _move_into_place(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return hashes


def _move_into_place(staging: Path, dst: Path) -> None:
    if not (dst.exists() or dst.is_symlink()):
        os.rename(staging, dst)
        return
    # --force: set the old DST aside, move the new one in, then delete the old one, so DST is
    # never missing or half-written.
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.replaced-", dir=dst.parent))
    os.rename(dst, aside / "old")
    try:
        os.rename(staging, dst)
    except BaseException:
        os.rename(aside / "old", dst)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
