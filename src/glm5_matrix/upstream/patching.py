"""A defect-absent copy of an environment: the venv hard-link-copied (`cp -al`, seconds and no
space), then only the patched files replaced by real files of their own. The original's files
are never written through a link: a patched file is unlinked in the copy and written anew, and
the original's bytes are checked unchanged afterwards."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic


def apply(text: str, old: str, new: str, where: str) -> str:
    """`text` with `old` replaced by `new`; `old` must occur exactly once (a patch that no
    longer matches its vLLM says so instead of patching nothing)."""
    count = text.count(old)
    if count != 1:
        raise UserError(f"{where}: the patch's old text occurs {count} times (expected once)")
    return text.replace(old, new)


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if len(found) != 1:
        raise UserError(f"{venv}: expected one lib/python3.*/site-packages, found {len(found)}")
    return found[0]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patched_copy(venv: Path, dest: Path, patches: Sequence[tuple[str, str, str]]) -> Path:
    """`dest`: a hard-link copy of `venv` with each (file under site-packages, old, new) patched
    in a real copy of that file. Returns the copy's python."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(venv), str(dest)], check=True)
    original_site, site = site_packages(venv), site_packages(dest)
    for file, old, new in patches:
        source, target = original_site / file, site / file
        if not source.is_file():
            raise UserError(f"{source}: the file to patch does not exist")
        before = _digest(source)
        text = apply(source.read_text(), old, new, str(source))
        target.unlink()  # the hard link goes; the original keeps its bytes
        write_atomic(target, text)
        for cache in target.parent.glob(f"__pycache__/{target.stem}.*.pyc"):
            cache.unlink()  # a link to the original's bytecode would shadow the patch
        if _digest(source) != before or os.path.samefile(source, target):
            raise UserError(f"{source}: changed while patching its copy")
    # The copy's scripts name the original venv in their shebangs; its python is a link to the
    # same interpreter, and site-packages is found from the copy's pyvenv.cfg.
    return dest / "bin" / "python"
