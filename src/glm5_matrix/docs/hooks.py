"""The mkdocs hook of the docs site (mkdocs.yml `hooks:`): a page line `<!-- table: NAME -->`
is replaced by the table glm5_matrix.docs.tables renders from the repository's data, so the
site shows the matrix and the mutants' verdicts as they are when it is built."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

# mkdocs loads this file by its path: the package it belongs to is importable from src/ (which
# `nox -s docs` puts on PYTHONPATH; a bare `mkdocs build` in the harness environment does not).
_SRC = str(Path(__file__).resolve().parents[2])
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

from glm5_matrix.docs import tables  # noqa: E402
from glm5_matrix.files import repo_root  # noqa: E402
from glm5_matrix.mutants import run  # noqa: E402

MARKER = re.compile(r"^<!-- table: ([a-z-]+) -->$", re.MULTILINE)


def expand(markdown: str) -> str:
    """`markdown` with every table marker replaced by its table."""
    root = repo_root()
    results = run.out_dir(dict(os.environ))
    return MARKER.sub(lambda m: tables.render(m.group(1), root, results), markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
