"""Files written whole or not at all: the content goes to a temp file beside the target (named
for this process, so writers that race never share one), which os.replace then puts in place. A
reader, in this process or another, sees the old file or the new one, never part of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace `path` with `content` (text or bytes) in one rename. Its folder must exist."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(content, bytes):
        tmp.write_bytes(content)
    else:
        tmp.write_text(content)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any, compact: bool = False) -> None:
    """`data` as JSON (indented with sorted keys, or `compact`), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data) if compact else json.dumps(data, indent=2, sort_keys=True)
    write_atomic(path, text + "\n")


def repo_root() -> Path:
    """The checkout holding matrix.toml, envs/ and profiles/ (GLM5_MATRIX_ROOT overrides)."""
    override = os.environ.get("GLM5_MATRIX_ROOT")
    return Path(override) if override else Path(__file__).resolve().parents[2]
