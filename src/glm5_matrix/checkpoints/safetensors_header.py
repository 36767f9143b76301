"""safetensors headers, read and written here.

safetensors' Python API cannot write a file incrementally, so the pruner lays out headers
itself and streams the tensor data after them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from glm5_matrix.errors import UserError

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F32": 4, "I32": 4, "U32": 4,
    "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip


class TensorEntry(NamedTuple):
    """One tensor of a shard's header. A NamedTuple: immutable and cheap to make, which counts
    at 76,108 tensors per checkpoint."""

    dtype: str
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]
    data_start: int
    file_size: int


def read_shard_header(path: Path) -> ShardHeader:
    """Parse and check one shard's header (8-byte little-endian length, then JSON)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, 1 << 30):
                raise UserError(f"{path}: not a safetensors file (header length {length})")
            raw = json.loads(f.read(length))
    except OSError as exc:
        raise UserError(f"{path}: cannot read shard ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a safetensors file (header is not an object)")
    metadata = raw.pop("__metadata__", None)
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        try:
            start, end = map(int, info["data_offsets"])
            entry = TensorEntry(str(info["dtype"]), tuple(map(int, info["shape"])), start, end)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: malformed header entry for {name}") from None
        width = _DTYPE_BYTES.get(entry.dtype)
        if width is not None and entry.nbytes != width * math.prod(entry.shape):
            raise UserError(f"{path}: {name}: data_offsets do not match dtype and shape")
        tensors[name] = entry
    data_start = 8 + length
    spans = sorted((e.start, e.end) for e in tensors.values())
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise UserError(f"{path}: tensor data is not contiguous (gap or overlap at {start})")
        position = end
    if data_start + position != size:
        raise UserError(
            f"{path}: file is {size} bytes but its header describes {data_start + position} "
            "(truncated or padded shard)"
        )
    return ShardHeader(path, metadata, tensors, data_start, size)


def encode_header(entries: list[tuple[str, TensorEntry]], metadata: dict[str, str] | None) -> bytes:
    """A safetensors header (length prefix included) for entries already laid out in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    for name, e in entries:
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data section 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(encoded)) + encoded
