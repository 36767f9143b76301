"""glm5-matrix: the test matrix for GLM-5.3-Flash on vLLM.

Data flows one way: matrix.toml -> noxfile (one session per cell) -> an isolated uv
environment (envs/ + constraints/) -> the pytest suites in tests/suites, which read the
cell's context -> per-cell results -> reports.

This file is read by Python 3.10 too (the noxfile and the CLI import it first, to say in one
line that they need 3.11): nothing here may need a newer Python.
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"

# tomllib (the reader of matrix.toml, envs/, profiles/) came with Python 3.11.
REQUIRES_PYTHON = (3, 11)


def python_too_old(how: str, version: tuple[int, ...] | None = None) -> str:
    """The one line to exit with where this Python is older than REQUIRES_PYTHON, else "".
    `how` is the command that gets a fitting Python with uv (uv downloads it)."""
    version = tuple(sys.version_info[:3] if version is None else version)
    if version[:2] >= REQUIRES_PYTHON:
        return ""
    need = ".".join(map(str, REQUIRES_PYTHON))
    found = ".".join(map(str, version))
    return (
        f"glm5-matrix needs Python >= {need} (it reads its TOML files with tomllib); "
        f"this is Python {found} ({sys.executable}). With uv, which fetches Python {need} "
        f"for you: {how}"
    )
