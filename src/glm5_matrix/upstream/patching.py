"""A defect-absent copy of an environment (glm5_matrix.envs.venv_copies: hard links, the patched
files made the copy's own), the original's bytes checked unchanged afterwards."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from glm5_matrix.envs.venv_copies import digest, hardlink_copy, own_file, site_packages
from glm5_matrix.errors import UserError


def apply(text: str, old: str, new: str, where: str) -> str:
    """`text` with `old` replaced by `new`; `old` must occur exactly once (a patch that no
    longer matches its vLLM says so instead of patching nothing)."""
    count = text.count(old)
    if count != 1:
        raise UserError(f"{where}: the patch's old text occurs {count} times (expected once)")
    return text.replace(old, new)


def patched_copy(venv: Path, dest: Path, patches: Sequence[tuple[str, str, str]]) -> Path:
    """`dest`: a hard-link copy of `venv` with each (file under site-packages, old, new) patched
    in a real copy of that file. Returns the copy's python."""
    hardlink_copy(venv, dest)
    original_site, site = site_packages(venv), site_packages(dest)
    for file, old, new in patches:
        source, target = original_site / file, site / file
        if not source.is_file():
            raise UserError(f"{source}: the file to patch does not exist")
        before = digest(source)
        text = apply(source.read_text(), old, new, str(source))
        own_file(target, text.encode())  # never written through the hard link
        if digest(source) != before or os.path.samefile(source, target):
            raise UserError(f"{source}: changed while patching its copy")
    return dest / "bin" / "python"
