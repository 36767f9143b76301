"""Ninja's dependency log (.ninja_deps), read and narrowed to the headers two machines share.

FlashInfer builds its JIT modules with ninja (`deps = gcc`): after each compile ninja stores the
headers the compiler read, and on every later load it calls an object dirty when one of them is
missing or newer than the object. nvcc lists every header, the host toolchain's too
(/usr/include/c++/12/..., gcc's own include folder), so a module compiled on a machine whose
gcc or glibc headers lie elsewhere (a CPU build box with gcc 12 for a GPU runner with gcc 13 in
/opt/gcc) is rebuilt from scratch on the runner although its objects are valid there.
`keep_only` drops the dependencies outside the given prefixes (kept: the project's sources, the
installed packages' headers, the cache itself), so that the runner's ninja judges the objects by
what the two machines share and nothing else. The objects' own timestamps stay as recorded.

Format 4 (ninja 1.10 and later, src/deps_log.cc): the line "# ninjadeps\\n", a little-endian
uint32 version, then records, each a uint32 whose high bit tells a dependency record from a path
record and whose low 31 bits give the size that follows:
- a path record: the path, NUL-padded to a multiple of 4, then the uint32 one's complement of the
  path's id (ids count path records from 0);
- a dependency record: int32 id of the output, its mtime (uint64 in two uint32 halves, low
  first), then one int32 id per dependency.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from glm5_matrix.errors import UserError

MAGIC = b"# ninjadeps\n"
VERSION = 4
_HEADER = len(MAGIC) + 4
_DEPS_BIT = 0x80000000


@dataclass
class DepsLog:
    """The records of a deps log in order: paths (the index is the id) and, per output id, its
    recorded mtime and dependency ids (a later record for an output replaces an earlier one)."""

    paths: list[str] = field(default_factory=list)
    deps: dict[int, tuple[int, list[int]]] = field(default_factory=dict)

    def dependencies(self, output: str) -> list[str]:
        out_id = self.paths.index(output)
        return [self.paths[i] for i in self.deps[out_id][1]]


def parse(data: bytes, name: str = ".ninja_deps") -> DepsLog:
    if data[: len(MAGIC)] != MAGIC or len(data) < _HEADER:
        raise UserError(f"{name}: not a ninja deps log")
    (version,) = struct.unpack_from("<I", data, len(MAGIC))
    if version != VERSION:
        raise UserError(f"{name}: ninja deps log version {version}, only {VERSION} is read")
    log = DepsLog()
    pos = _HEADER
    while pos < len(data):
        if pos + 4 > len(data):
            raise UserError(f"{name}: truncated at byte {pos}")
        (head,) = struct.unpack_from("<I", data, pos)
        size = head & ~_DEPS_BIT
        body = data[pos + 4 : pos + 4 + size]
        if len(body) != size or size % 4:
            raise UserError(f"{name}: truncated or malformed record at byte {pos}")
        pos += 4 + size
        if head & _DEPS_BIT:
            out_id, low, high = struct.unpack_from("<iII", body)
            ids = list(struct.unpack_from(f"<{(size - 12) // 4}i", body, 12))
            if not 0 <= out_id < len(log.paths) or any(not 0 <= i < len(log.paths) for i in ids):
                raise UserError(f"{name}: a dependency record names an unknown path")
            log.deps[out_id] = ((high << 32) | low, ids)
        else:
            (check,) = struct.unpack_from("<I", body, size - 4)
            if check != ~len(log.paths) & 0xFFFFFFFF:
                raise UserError(f"{name}: path record {len(log.paths)} has a wrong checksum")
            log.paths.append(body[:-4].rstrip(b"\0").decode())
    return log


def serialize(log: DepsLog) -> bytes:
    """The log written the way ninja recompacts it: every path, then one record per output."""
    out = bytearray(MAGIC + struct.pack("<I", VERSION))
    for index, path in enumerate(log.paths):
        raw = path.encode()
        raw += b"\0" * (-len(raw) % 4)
        out += struct.pack("<I", len(raw) + 4) + raw + struct.pack("<I", ~index & 0xFFFFFFFF)
    for out_id, (mtime, ids) in log.deps.items():
        body = struct.pack(f"<iII{len(ids)}i", out_id, mtime & 0xFFFFFFFF, mtime >> 32, *ids)
        out += struct.pack("<I", len(body) | _DEPS_BIT) + body
    return bytes(out)


def keep_only(path: Path, prefixes: tuple[str, ...]) -> tuple[int, int]:
    """Rewrite the deps log at `path` keeping the dependencies under `prefixes` (atomically, its
    mtime kept). Returns (kept, dropped)."""
    if not prefixes:
        raise UserError("name at least one prefix to keep")
    log = parse(path.read_bytes(), str(path))
    kept = dropped = 0
    for out_id, (mtime, ids) in list(log.deps.items()):
        good = [i for i in ids if log.paths[i].startswith(prefixes)]
        kept += len(good)
        dropped += len(ids) - len(good)
        log.deps[out_id] = (mtime, good)
    stat = path.stat()
    temporary = path.with_name(f".glm5-{path.name}.{os.getpid()}")
    try:
        temporary.write_bytes(serialize(log))
        os.utime(temporary, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return kept, dropped


def keep_only_under(folder: Path, prefixes: tuple[str, ...]) -> dict[Path, tuple[int, int]]:
    """keep_only for every .ninja_deps under `folder` (one per FlashInfer module)."""
    if not folder.is_dir():
        raise UserError(f"{folder}: folder not found")
    logs = sorted(folder.rglob(".ninja_deps"))
    if not logs:
        raise UserError(f"{folder}: no .ninja_deps under it")
    return {log: keep_only(log, prefixes) for log in logs}
