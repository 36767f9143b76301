"""The checkpoint tests' own readings (tests/unit/checkpoints): what a pruned checkpoint must hold
is derived from the source read back with the `safetensors` library, never from the pruner's own
plan; the prune/verify subcommands run in-process as cli.main runs them."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
from pathlib import Path

from safetensors import deserialize

from glm5_matrix import checkpoints
from glm5_matrix.errors import UserError

LAYER = re.compile(r"^(model\.language_model\.layers|model\.layers)\.(\d+)\.(.+)$")
FULL_LAYERS, MTP_LAYER = 45, 45


def run_cli(*argv: str) -> tuple[int, str]:
    """Run the prune/verify subcommands in-process as cli.main does; (exit code, error line)."""
    parser = argparse.ArgumentParser(prog="glm5-matrix")
    checkpoints.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    try:
        return int(args.func(args) or 0), ""
    except UserError as exc:
        return 2, str(exc)


def read_tensors(directory: Path) -> dict[str, dict]:
    """Every tensor of a checkpoint, read by the safetensors library: name -> dtype/shape/data."""
    out: dict[str, dict] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, info in deserialize(path.read_bytes()):
            assert name not in out, f"{name} in two shards"
            out[name] = {
                "dtype": info["dtype"],
                "shape": list(info["shape"]),
                "data": bytes(info["data"]),
            }
    return out


def file_hashes(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        p.relative_to(directory).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def expected_name(name: str, layers: int) -> str | None:
    """Where a source tensor must end up after keeping `layers` layers (None: dropped)."""
    match = LAYER.match(name)
    if match is None:
        return name
    index = int(match[2])
    if index < layers:
        return name
    if index == MTP_LAYER:
        return f"{match[1]}.{layers}.{match[3]}"
    return None


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def hasher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("glm5-sha256")]


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def first_shard(source: Path) -> Path:
    return sorted(source.glob("model-*.safetensors"))[0]
