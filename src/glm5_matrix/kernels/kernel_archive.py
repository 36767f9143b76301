"""Kernel cache archives: one key folder exported as a tar stream, imported on another machine.

An archive is what a CI system saves and restores between ephemeral runners (or what crosses
to a machine that holds no network): `glm5-matrix kernel-cache export FILE` (or
`nox -s warm -- ... --export FILE`), `glm5-matrix kernel-cache import FILE`, or
`nox -s CELL -- --kernel-archive FILE` before a cell. Its first member is manifest.json: the key
(versions and GPU arch) it was built for, the root it was built under, what it holds. Import
refuses, with one line, an archive whose key differs from the importing interpreter's.

- Tar from the standard library, gzip by default (`--compression xz|none`, or `zst` through the
  `zstd` program when it is installed); `--part-size MiB` splits the stream into FILE.000,
  FILE.001, ... for transports with a size limit; FILE.sha256 lists every file written
  (sha256sum format) and import checks it.
- Exact mtimes travel in a pax header per file: FlashInfer's ninja compares them with what
  .ninja_log and .ninja_deps recorded, so a partial FlashInfer build resumes where it stopped
  (at the same absolute root: FlashInfer and Triton record absolute paths, and import warns
  when the root differs).
- Export and import hold an exclusive lock of ours (<root>/.glm5-lock, flock); export writes
  beside its target and renames into place; import extracts into a staging folder inside the
  key folder and moves each subtree in with one rename where it is absent (the libraries' own
  entries, written by atomic renames too, appear whole), keeping files the machine has.
  Locks and temporary files of the libraries are never exported.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import gpu_models, kernel_cache
from glm5_matrix.kernels.kernel_cache import LIBRARIES, KernelCache

FORMAT = 1
MANIFEST = "manifest.json"
# The kernel cache's lock of ours, held by export, import and gpu_models.add_warmed.
LOCK_FILE = kernel_cache.LOCK_FILE
locked = kernel_cache.locked
MTIME_HEADER = "GLM5.mtime_ns"
COMPRESSIONS = ("gz", "xz", "zst", "none")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class Transfer:
    """What an export or import did, for one line per library."""

    archive: Path
    files: dict[str, int] = field(default_factory=dict)  # per library
    bytes: int = 0
    written: list[Path] = field(default_factory=list)  # export: the files written
    kept: int = 0  # import: files the machine already had
    models: str = ""  # import: the GPU models the key folder now records (gpu_models)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        per = ", ".join(f"{name} {n}" for name, n in sorted(self.files.items()) if n) or "nothing"
        text = f"{self.archive}: {sum(self.files.values())} files ({per}), {self.bytes / 2**20:.1f} MiB"
        if self.kept:
            text += f"; {self.kept} already here, kept"
        if self.models:
            text += f"; warmed on {self.models}"
        return text


# --- export ---------------------------------------------------------------------------------------


class _Sink(io.RawIOBase):
    """Writes a byte stream to `target`, or to target.000, .001, ... of at most `part_size`
    bytes; every file is written under a staging name and renamed into place on commit()."""

    def __init__(self, target: Path, part_size: int | None) -> None:
        super().__init__()
        self.target, self.part_size = target, part_size
        self.parts: list[tuple[Path, Path]] = []  # (staging, final)
        self._handle: IO[bytes] | None = None
        self._in_part = 0
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def _next_part(self) -> None:
        if self._handle is not None:
            self._handle.close()
        final = (
            self.target
            if self.part_size is None
            else self.target.with_name(f"{self.target.name}.{len(self.parts):03d}")
        )
        staging = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        self.parts.append((staging, final))
        self._handle = open(staging, "wb")  # noqa: SIM115 (closed at the next part or commit)
        self._in_part = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._handle is None or (self.part_size and self._in_part >= self.part_size):
                self._next_part()
            assert self._handle is not None
            room = len(view) - done
            if self.part_size:
                room = min(room, self.part_size - self._in_part)
            self._handle.write(view[done : done + room])
            self._in_part += room
            done += room
        self.bytes += done
        return done

    def commit(self) -> list[Path]:
        if self._handle is None:
            self._next_part()
        assert self._handle is not None
        self._handle.close()
        sums = []
        for staging, final in self.parts:
            sums.append(f"{_sha256(staging)}  {final.name}\n")
        sidecar = self.target.with_name(f"{self.target.name}.sha256")
        sidecar_staging = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
        sidecar_staging.write_text("".join(sums))
        for staging, final in self.parts:
            os.replace(staging, final)
        os.replace(sidecar_staging, sidecar)
        return [final for _, final in self.parts] + [sidecar]

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
        for staging, _ in self.parts:
            staging.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _zstd() -> str:
    program = shutil.which("zstd")
    if program is None:
        raise UserError("zstd is not installed: use --compression gz (the default), xz or none")
    return program


def _library_files(kernels: KernelCache, names: Sequence[str]) -> Iterator[tuple[str, Path, str]]:
    """(library, absolute path, archive name) of every file to export: locks and temporary
    files aside, bookkeeping (ninja's logs, vLLM's model inspection) kept."""
    for library in LIBRARIES:
        if library.name not in names:
            continue
        folder = kernels.folder(library)
        for relative in sorted(kernel_cache.files(folder)) if folder.is_dir() else ():
            yield library.name, folder / relative, f"{library.folder}/{relative}"


def export_archive(
    kernels: KernelCache,
    target: Path,
    *,
    compression: str = "gz",
    part_size_mib: float | None = None,
    libraries: Sequence[str] | None = None,
    prefixes: Sequence[str] | None = None,
) -> Transfer:
    """Write the key folder of `kernels` to `target` (see the module doc); with `prefixes`,
    only the files whose name in the archive (LIBRARY_FOLDER/...) starts with one of them."""
    if compression not in COMPRESSIONS:
        raise UserError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    names = list(libraries or kernel_cache.LIBRARY_NAMES)
    unknown = sorted(set(names) - set(kernel_cache.LIBRARY_NAMES))
    if unknown:
        known = ", ".join(kernel_cache.LIBRARY_NAMES)
        raise UserError(f"unknown library {unknown[0]!r} (libraries: {known})")
    if part_size_mib is not None and part_size_mib <= 0:
        raise UserError(f"--part-size {part_size_mib}: must be more than 0 MiB")
    if not kernels.directory.is_dir():
        raise UserError(f"{kernels.directory}: no kernel cache here to export")
    target = target.expanduser().absolute()
    if not target.parent.is_dir():
        raise UserError(f"{target.parent}: folder not found")
    if target.is_dir():
        raise UserError(f"{target}: a folder (name the archive file to write)")
    part_size = None if part_size_mib is None else max(1, int(part_size_mib * 2**20))
    transfer = Transfer(target)
    with locked(kernels.directory.parent):
        members = [
            m
            for m in _library_files(kernels, names)
            if prefixes is None or m[2].startswith(tuple(prefixes))
        ]
        manifest = {
            "format": FORMAT,
            "key": kernels.key,
            "key_folder": kernels.directory.name,
            "root": str(kernels.directory.parent),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "compression": compression,
            "libraries": {name: sum(1 for m in members if m[0] == name) for name in names},
            **_models_manifest(gpu_models.read(kernels), bool(members)),
        }
        sink = _Sink(target, part_size)
        try:
            _write_tar(sink, compression, manifest, members, transfer)
            transfer.written = sink.commit()
        except BaseException:
            sink.discard()
            raise
    transfer.bytes = sink.bytes
    return transfer


def _models_manifest(record: gpu_models.Record, has_files: bool) -> dict[str, Any]:
    """The manifest's GPU models (gpu_models): those the key folder records, and the sources of
    entries whose models nobody recorded (a folder with files and no record has such entries)."""
    found: dict[str, Any] = {"gpu_models": record.to_json()["models"]}
    unknown = list(record.unknown)
    if not record.exists and has_files:
        unknown.append("entries written before GPU models were recorded")
    if unknown:
        found["gpu_models_unknown"] = unknown
    return found


def merge_models(
    manifest: dict[str, Any], record: gpu_models.Record, archive: Path
) -> gpu_models.Record:
    """The key folder's record with the archive's models merged in (each keeps its sources, and
    gains the archive). An archive without the list (made before it existed) adds its entries
    as of unknown models: the preflight cannot say they lack this GPU's."""
    via = f"archive {archive.name} ({manifest.get('created', 'date unknown')})"
    if "gpu_models" not in manifest:
        return record.with_unknown(f"{via}, made before GPU models were recorded")
    try:
        for entry in manifest["gpu_models"]:
            model = gpu_models.GpuModel.from_json(entry)
            for source in [*entry.get("sources", []), via]:
                record = record.added([model], str(source))
        for source in manifest.get("gpu_models_unknown", []):
            record = record.with_unknown(f"{source} (via {via})")
    except (ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"{archive}: {MANIFEST}: gpu_models is malformed ({exc})") from None
    return record


def _write_tar(
    sink: _Sink,
    compression: str,
    manifest: dict[str, Any],
    members: list[tuple[str, Path, str]],
    transfer: Transfer,
) -> None:
    zstd: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    stream: IO[bytes] = sink  # type: ignore[assignment]
    mode = "w|" if compression in ("none", "zst") else f"w|{compression}"
    if compression == "zst":
        zstd = subprocess.Popen(
            [_zstd(), "-q", "-c", "-T0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert zstd.stdin is not None and zstd.stdout is not None
        pump = threading.Thread(target=shutil.copyfileobj, args=(zstd.stdout, sink), daemon=True)
        pump.start()
        stream = zstd.stdin
    with tarfile.open(fileobj=stream, mode=mode, format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(data))
        for library, path, name in members:
            try:
                stat = os.stat(path, follow_symlinks=False)
                info = tar.gettarinfo(str(path), arcname=name)
            except FileNotFoundError:  # removed by its library since the listing
                continue
            if not info.isfile():
                continue
            info.pax_headers = {MTIME_HEADER: str(stat.st_mtime_ns)}
            info.uname = info.gname = ""
            with open(path, "rb") as handle:
                tar.addfile(info, handle)
            transfer.files[library] = transfer.files.get(library, 0) + 1
    if zstd is not None and pump is not None:
        assert zstd.stdin is not None
        zstd.stdin.close()
        pump.join()
        if zstd.wait() != 0:
            raise UserError(f"zstd failed with status {zstd.returncode}")


# --- import ---------------------------------------------------------------------------------------


class _Chain(io.RawIOBase):
    """The parts of an archive read as one stream."""

    def __init__(self, paths: Sequence[Path]) -> None:
        super().__init__()
        self._paths = list(paths)
        self._handle: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._handle is None:
                if not self._paths:
                    return 0
                self._handle = open(self._paths.pop(0), "rb")  # noqa: SIM115 (closed when read)
            count = self._handle.readinto(buffer)
            if count:
                return count
            self._handle.close()
            self._handle = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        super().close()


def archive_parts(archive: Path) -> list[Path]:
    """The file(s) holding the archive: `archive` itself, or archive.000, archive.001, ..."""
    if archive.is_dir():
        raise UserError(f"{archive}: a folder, not a kernel cache archive")
    if archive.is_file():
        return [archive]
    parts = sorted(archive.parent.glob(f"{archive.name}.[0-9][0-9][0-9]"))
    if not parts:
        raise UserError(f"{archive}: kernel cache archive not found (nor {archive.name}.000)")
    expected = [archive.with_name(f"{archive.name}.{i:03d}") for i in range(len(parts))]
    if parts != expected:
        missing = sorted(set(expected) - set(parts))
        raise UserError(f"{archive}: part {missing[0].name} is missing")
    return parts


def verify_parts(archive: Path, parts: Sequence[Path]) -> None:
    """Check the parts against archive.sha256 when it is there."""
    sidecar = archive.with_name(f"{archive.name}.sha256")
    if not sidecar.is_file():
        return
    listed = {}
    for line in sidecar.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name:
            listed[name.strip()] = digest.strip()
    names = [p.name for p in parts]
    if sorted(listed) != sorted(names):
        raise UserError(f"{sidecar}: lists {sorted(listed)}, found {names}")
    for part in parts:
        if _sha256(part) != listed[part.name]:
            raise UserError(f"{part}: sha256 differs from {sidecar.name} (a damaged copy)")


@contextlib.contextmanager
def _open_stream(parts: Sequence[Path]) -> Iterator[tarfile.TarFile]:
    with open(parts[0], "rb") as head:
        magic = head.read(4)
    chain = _Chain(parts)
    zstd: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    stream: IO[bytes] = chain  # type: ignore[assignment]
    if magic == _ZSTD_MAGIC:
        zstd = subprocess.Popen(
            [_zstd(), "-q", "-d", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert zstd.stdin is not None and zstd.stdout is not None
        feed = zstd.stdin

        def pump_in() -> None:
            with contextlib.suppress(BrokenPipeError):
                shutil.copyfileobj(chain, feed)
            with contextlib.suppress(BrokenPipeError):
                feed.close()

        pump = threading.Thread(target=pump_in, daemon=True)
        pump.start()
        stream = zstd.stdout
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise UserError(f"{parts[0]}: not a readable kernel cache archive ({exc})") from None
    finally:
        if zstd is not None:
            zstd.kill()
            zstd.wait()
        chain.close()


def read_manifest(tar: tarfile.TarFile, archive: Path) -> dict[str, Any]:
    first = tar.next()
    if first is None or first.name != MANIFEST:
        raise UserError(f"{archive}: not a kernel cache archive (no {MANIFEST} first)")
    handle = tar.extractfile(first)
    assert handle is not None
    try:
        manifest = json.loads(handle.read())
    except ValueError:
        raise UserError(f"{archive}: {MANIFEST} is not valid JSON") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("key"), dict):
        raise UserError(f"{archive}: archive format {manifest.get('format')!r}, expected {FORMAT}")
    return dict(manifest)


def check_fits(manifest: dict[str, Any], kernels: KernelCache, archive: Path) -> None:
    """UserError, one line, when the archive was built for other versions or another GPU."""
    differences = kernel_cache.key_difference(manifest["key"], kernels.key)
    if differences:
        raise UserError(
            f"{archive}: built for other versions or another GPU than this interpreter here "
            f"({'; '.join(differences)}, archive != here): refused"
        )


def import_archive(archive: Path, kernels: KernelCache) -> Transfer:
    """Merge `archive` into the key folder of `kernels` (see the module doc). Nothing is
    created until the archive is found, whole (its .sha256), readable and built for this
    interpreter and GPU: a refused archive leaves the machine as it was."""
    archive = archive.expanduser().absolute()
    parts = archive_parts(archive)
    verify_parts(archive, parts)
    transfer = Transfer(archive)
    folders = {library.folder: library.name for library in LIBRARIES}
    with _open_stream(parts) as tar:
        manifest = read_manifest(tar, archive)
        check_fits(manifest, kernels, archive)
        models = merge_models(manifest, gpu_models.read(kernels), archive)
        kernel_cache.prepare(kernels)
        with locked(kernels.directory.parent):
            _import_members(tar, archive, manifest, kernels, folders, transfer)
            gpu_models.write(kernels, models)
            transfer.models = models.describe()
    return transfer


def _import_members(
    tar: tarfile.TarFile,
    archive: Path,
    manifest: dict[str, Any],
    kernels: KernelCache,
    folders: dict[str, str],
    transfer: Transfer,
) -> None:
    """The archive's members after its manifest, staged and merged into the key folder."""
    root = str(kernels.directory.parent)
    if manifest.get("root") != root:
        transfer.warnings.append(
            f"built under {manifest.get('root')}, imported under {root}: FlashInfer and "
            "Triton record absolute paths and will rebuild what they find moved"
        )
    staging = Path(tempfile.mkdtemp(prefix=".glm5-import-", dir=kernels.directory))
    try:
        while (member := tar.next()) is not None:  # on from the manifest
            top = member.name.split("/", 1)[0]
            if top not in folders or not member.isfile():
                raise UserError(f"{archive}: unexpected member {member.name!r}")
            _extract(tar, member, staging)
            transfer.files[folders[top]] = transfer.files.get(folders[top], 0) + 1
            transfer.bytes += member.size
        for folder in folders:
            if (staging / folder).is_dir():
                transfer.kept += _merge(staging / folder, kernels.directory / folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, staging: Path) -> None:
    if hasattr(tarfile, "data_filter"):  # refuses absolute names, '..', links out, devices
        tar.extract(member, staging, filter="data")
    else:  # Python before 3.11.4: names were checked above (regular files under a library)
        if member.name.startswith("/") or ".." in member.name.split("/"):
            raise UserError(f"unsafe member name {member.name!r}")
        tar.extract(member, staging)
    mtime_ns = member.pax_headers.get(MTIME_HEADER)
    if mtime_ns is not None:
        ns = int(mtime_ns)
        os.utime(staging / member.name, ns=(ns, ns))


def _merge(source: Path, target: Path) -> int:
    """Move `source` into `target`: a subtree absent there moves with one rename; files the
    target has are kept. Returns how many were kept."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(source, target)
            return 0
        except OSError:  # another writer created it meanwhile: merge into theirs
            if not target.exists():
                raise
    if target.is_dir() and source.is_dir():
        return sum(_merge(child, target / child.name) for child in sorted(source.iterdir()))
    return 1


# --- the command ----------------------------------------------------------------------------------


def _interpreter(args: argparse.Namespace) -> str:
    from glm5_matrix.envs.environments import PYTHON_VARIABLE

    return str(args.python or os.environ.get(PYTHON_VARIABLE) or sys.executable)


# The commands create nothing in the cache: show and export read it, import creates the key
# folder only once the archive is accepted (import_archive).
def _show(args: argparse.Namespace) -> int:
    kernels = kernel_cache.for_interpreter(_interpreter(args), create=False, arch=args.gpu_arch)
    absent = "" if kernels.directory.is_dir() else " (not created yet: nothing compiled here)"
    print(f"kernel cache {kernels.describe()}{absent}")
    print(f"key: {kernel_cache.describe_key(kernels.key)}")
    for library in LIBRARIES:
        own_folder = kernels.user_set.get(library.variable or "")
        folder = Path(own_folder) if own_folder else kernels.folder(library)
        found = kernel_cache.files(folder) if folder.is_dir() else {}
        size = sum(s for s, _ in found.values())
        own = " (the user's own)" if own_folder else ""
        print(f"  {library.name:<17} {len(found):>6} files {size / 2**20:>9.1f} MiB  {folder}{own}")
    return 0


def _export(args: argparse.Namespace) -> int:
    kernels = kernel_cache.for_interpreter(_interpreter(args), create=False, arch=args.gpu_arch)
    done = export_archive(
        kernels,
        Path(args.file),
        compression=args.compression,
        part_size_mib=args.part_size,
        libraries=args.library,
    )
    print(f"exported {kernels.directory.name}: {done.describe()}")
    print("written: " + " ".join(str(p) for p in done.written))
    return 0


def _import(args: argparse.Namespace) -> int:
    kernels = kernel_cache.for_interpreter(_interpreter(args), create=False, arch=args.gpu_arch)
    done = import_archive(Path(args.file), kernels)
    print(f"imported into {kernels.directory}: {done.describe()}")
    for warning in done.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _build_moe(args: argparse.Namespace) -> int:
    from glm5_matrix.kernels import flashinfer_aot, trtllm_deepgemm

    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be at least 1")
    if args.export is not None and not Path(args.export).expanduser().absolute().parent.is_dir():
        raise UserError(f"{Path(args.export).parent}: folder not found")
    from glm5_matrix.matrix.profiles import load_profile

    config = load_profile(args.profile).config()
    tps = args.tp or [1, 2, 4]
    gemms = [*trtllm_deepgemm.moe_gemms(config, tps), *trtllm_deepgemm.dense_gemms(config, tps)]
    kernels = kernel_cache.for_interpreter(_interpreter(args), arch=args.gpu_arch)
    print(f"kernel cache {kernels.describe()}")
    built = [
        flashinfer_aot.build_module(
            kernels, _interpreter(args), gemms=gemms, jobs=args.jobs, niceness=args.nice
        ),
        flashinfer_aot.build_utils_module(
            kernels, _interpreter(args), jobs=args.jobs, niceness=args.nice
        ),
    ]
    for module in built:
        print(f"built {module.describe()}")
        for note in module.record["toolchain_notes"]:
            print(f"  toolchain: {note}")
    if args.export:
        done = export_archive(
            kernels,
            Path(args.export),
            compression=args.compression,
            libraries=["flashinfer_aot", "trtllm_deep_gemm", "flashinfer"],
            prefixes=flashinfer_aot.exported([b.record for b in built]),
        )
        print(f"exported {kernels.directory.name}: {done.describe()}")
        print("written: " + " ".join(str(p) for p in done.written))
    return 0


def _check_moe(args: argparse.Namespace) -> int:
    from glm5_matrix.kernels import aot_check, flashinfer_aot, trtllm_deepgemm

    kernels = kernel_cache.for_interpreter(_interpreter(args), create=False, arch=args.gpu_arch)
    failed = False
    results, written, notes = aot_check.check_module(kernels, _interpreter(args))
    for note in notes:
        print(f"loader: {note}")
    utils = flashinfer_aot.library_folder(kernels) / flashinfer_aot.UTILS_MODULE
    for checked in results:
        loaded = checked.loaded or {}
        print(f"{checked.path}: FlashInfer's AOT artifacts {loaded.get('artifacts')}")
        print(f"  mapped {loaded.get('mapped')}")
        if checked.result is not None:
            print(f"  runner: {checked.result.get('init')} (exit {checked.returncode})")
        else:
            print(f"  the process ended with status {checked.returncode}: {checked.error}")
        module = str(flashinfer_aot.library_folder(kernels) / flashinfer_aot.MODULE)
        loaded_ours = bool(loaded.get("mapped")) and all(
            m.startswith(module) for m in loaded["mapped"]
        )
        if not loaded_ours:  # FlashInfer built instead (its build raises here) or loaded another
            failed = True
        if checked.path == "fp8-block-scale" and checked.loaded is not None:
            mapped = loaded.get("utils_mapped") or []
            print(f"  {flashinfer_aot.UTILS_MODULE}: mapped {mapped}")
            if not mapped or not all(m.startswith(str(utils)) for m in mapped):
                print(f"  expected: the autotuner's entry loads the kernel cache's {utils.name}")
                failed = True
        if checked.path == "fp8-block-scale" and (checked.result is None or checked.returncode):
            print("  expected: the block-scale runner made (or stopped at its first CUDA call)")
            failed = True
        if checked.path == "fp16":
            if checked.symbol_error() is None:
                print("  expected: the process ends naming the undefined symbol")
                failed = True
            else:
                print(f"  {checked.symbol_error()}")
    record = flashinfer_aot.build_record(kernels) or {}
    gemms = trtllm_deepgemm.gemms_of_record(record)
    asked, absent = trtllm_deepgemm.absent_kernels(kernels, gemms)
    tps = sorted({g.tp for g in gemms})
    print(
        f"DeepGEMM kernels a start asks for ({len(gemms)} GEMM shapes of the build's model at TP "
        f"{tps}, on {list(trtllm_deepgemm.DEEPGEMM_SMS)} SMs): {len(asked)}, "
        + (f"{len(absent)} not in the cache: {', '.join(absent[:4])}" if absent else "all cached")
    )
    failed = failed or bool(absent) or not gemms
    counted = {name: paths for name, paths in written.items() if paths}
    print(f"kernel files written into {kernels.directory}: {counted or 'none'}")
    return 1 if failed or counted else 0


def _narrow_deps(args: argparse.Namespace) -> int:
    from glm5_matrix.kernels import ninja_deps

    for log, (kept, dropped) in ninja_deps.keep_only_under(
        Path(args.folder), tuple(args.keep)
    ).items():
        print(f"{log}: kept {kept} dependencies, dropped {dropped}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "kernel-cache", help="show, export or import the kernel cache of an interpreter"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    show = actions.add_parser("show", help="the key folder, its variables and what it holds")
    export = actions.add_parser("export", help="write the key folder to an archive")
    export.add_argument("file", help="the archive to write (FILE.000, ... with --part-size)")
    export.add_argument("--compression", choices=COMPRESSIONS, default="gz")
    export.add_argument("--part-size", type=float, metavar="MIB", help="split into parts")
    export.add_argument(
        "--library", action="append", choices=kernel_cache.LIBRARY_NAMES, help="only these"
    )
    imported = actions.add_parser("import", help="merge an archive built for this machine")
    imported.add_argument("file", help="the archive (or the name before .000 of its parts)")
    narrow = actions.add_parser(
        "narrow-deps",
        help="keep in every .ninja_deps under FOLDER only the headers under --keep prefixes "
        "(a FlashInfer module built on another machine: see kernels/ninja_deps.py)",
    )
    narrow.add_argument("folder")
    narrow.add_argument("--keep", action="append", required=True, metavar="PREFIX")
    narrow.set_defaults(func=_narrow_deps)
    moe = actions.add_parser(
        "build-moe",
        help="compile, off the GPU, what a start of the profile's engine would compile of "
        "FlashInfer: its SM90 CUTLASS MoE module for the fp8 block-scale path, trtllm_utils, and "
        "the DeepGEMM kernels of the MoE and the dense fp8 linears, into the kernel cache (see "
        "docs/flashinfer-moe.md)",
    )
    moe.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ninja's -j")
    moe.add_argument("--nice", type=int, default=10, help="niceness of the compile (0: none)")
    moe.add_argument(
        "--profile",
        default="glm-5.3-flash-4l",
        help="the model whose GEMM shapes get DeepGEMM kernels (default glm-5.3-flash-4l)",
    )
    moe.add_argument(
        "--tp", type=int, action="append", help="a TP size of those shapes (default 1, 2, 4)"
    )
    moe.add_argument("--export", metavar="FILE", help="then export the module to this archive")
    moe.add_argument("--compression", choices=COMPRESSIONS, default="gz")
    check = actions.add_parser(
        "check-moe",
        help="prove, without a GPU, that FlashInfer loads the kernel cache's fused_moe_90 and "
        "trtllm_utils and builds nothing, that a path it leaves out ends naming the symbol, and "
        "that every DeepGEMM kernel the build's GEMMs ask for is cached",
    )
    for sub, func in (
        (show, _show),
        (export, _export),
        (imported, _import),
        (moe, _build_moe),
        (check, _check_moe),
    ):
        sub.add_argument(
            "--python", help="the cell interpreter (default: $GLM5_MATRIX_PYTHON, else this one)"
        )
        sub.add_argument(
            "--gpu-arch",
            default="sm90" if sub in (moe, check) else None,
            help="the GPU arch of the key folder, for a machine that is not the GPU's (default: "
            + ("sm90" if sub in (moe, check) else "this machine's")
            + ")",
        )
        sub.set_defaults(func=func)
