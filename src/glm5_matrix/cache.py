"""The harness's cache: folders it generates once and reuses (the tiny hybrid model, synthesized
drafters). The compiled kernels of the engines it starts live under it too, in their own
module (glm5_matrix.kernels.kernel_cache).

Root: $GLM5_MATRIX_CACHE, else ~/.cache/glm5-matrix. A generated folder is written into a staging
folder beside its final name and renamed into place, so a reader sees a whole folder or none, and
processes that race to write it (P and D servers, engine workers) all end with the same one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_VARIABLE = "GLM5_MATRIX_CACHE"


def cache_root() -> Path:
    root = os.environ.get(CACHE_VARIABLE)
    return Path(root) if root else Path.home() / ".cache" / "glm5-matrix"


def models_dir() -> Path:
    """Where generated models (and drafters) live."""
    return cache_root() / "models"


def ensure_folder(target: Path, write: Callable[[Path], None], complete: str) -> Path:
    """`target`, generated on first use: `write(staging)` fills a fresh folder, which is renamed
    to `target`. `complete` names the file whose presence marks a finished folder (written last).
    The content must depend only on the name, so that two racing writers are interchangeable."""
    if (target / complete).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process renamed its copy first
            if not (target / complete).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
