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


ROOT_VARIABLE = "GLM5_MATRIX_ROOT"
MATRIX_FILE = "matrix.toml"


def repo_root() -> Path:
    """The checkout holding matrix.toml, envs/ and profiles/: GLM5_MATRIX_ROOT where set, else
    the checkout this package is imported from (src/ on the path, an editable install), else
    the nearest folder from the working directory up that holds a matrix.toml (a `glm5-matrix`
    installed with `pip install .` or `uv tool install .`, run inside a checkout); a UserError,
    one line, where there is none."""
    override = os.environ.get(ROOT_VARIABLE)
    if override:
        return Path(override)
    source = Path(__file__).resolve().parents[2]
    if (source / MATRIX_FILE).is_file():
        return source
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / MATRIX_FILE).is_file():
            return folder
    from glm5_matrix.errors import UserError

    raise UserError(
        f"no glm5-matrix checkout here: no {MATRIX_FILE} in {here} or a folder above it "
        f"(run inside a checkout, or set {ROOT_VARIABLE})"
    )
