"""Writing a prune plan: each output shard is its header followed by the plan's copy runs,
copied by the kernel and hashed from the written file (copying.HashingCopier); the result is
built in a temporary directory next to DST and renamed into place only when complete.

Peak memory is a fixed buffer, not a tensor, a shard or the model. SRC is only read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from glm5_matrix.checkpoints.card import model_card, provenance
from glm5_matrix.checkpoints.copying import HashingCopier
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME, format_manifest
from glm5_matrix.checkpoints.plan import (
    MODEL_CARD_NAME,
    PROVENANCE_NAME,
    OutputShard,
    PrunePlan,
    config_json,
    format_size,
)
from glm5_matrix.checkpoints.reading import INDEX_NAME
from glm5_matrix.errors import UserError


def _write_shard(
    copier: HashingCopier, plan: PrunePlan, shard: OutputShard, target: Path
) -> Future[str]:
    source = plan.source.shards[shard.source_file]
    runs = [(source.data_start + run.source_offset, run.length) for run in shard.runs]
    return copier.write(target, shard.header, source.path, runs, fsync=True)


def _copy_file(copier: HashingCopier, src: Path, dst: Path) -> Future[str]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest = copier.write(dst, b"", src, [(0, src.stat().st_size)])
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
        copied: dict[str, Future[str]] = {}
        with HashingCopier() as copier:
            for shard in plan.shards:
                copied[shard.file] = _write_shard(copier, plan, shard, staging / shard.file)
                log(
                    f"wrote {shard.file} ({format_size(shard.size)}, {len(shard.tensors)} "
                    f"tensors in {len(shard.runs)} run(s))"
                )
            for relative in plan.side_files:
                copied[relative.as_posix()] = _copy_file(
                    copier, plan.source.directory / relative, staging / relative
                )
        hashes = {name: digest.result() for name, digest in copied.items()}
        hashes["config.json"] = _write_text(staging / "config.json", config_json(plan.config))
        hashes[INDEX_NAME] = _write_text(staging / INDEX_NAME, plan.index_json)
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
