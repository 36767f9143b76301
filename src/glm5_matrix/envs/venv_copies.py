"""Copies of a built environment that leave the original untouched (the mutants' patched
environments, the upstream reproductions' defect-absent ones).

A copy is the original venv hard-linked file by file (`cp -al`: seconds, no space); a file the
copy changes first becomes a file of its own (never a write through a hard link), its cached
bytecode dropped so that the original's cannot shadow it, and the scripts in bin/ (whose first
line names the original's interpreter) are rewritten to name the copy's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from glm5_matrix.errors import UserError


def site_packages(venv: Path) -> Path:
    """The venv's purelib folder (lib/pythonX.Y/site-packages)."""
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if len(found) != 1:
        raise UserError(f"{venv}: expected one lib/python3.*/site-packages, found {len(found)}")
    return found[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hardlink_copy(source: Path, target: Path) -> None:
    """`target` becomes a copy of the venv `source` sharing its files through hard links; bin/
    scripts naming the source's interpreter are rewritten (new files, not written through)."""
    source, target = source.resolve(), target.resolve()
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(source), str(target)], check=True)
    old, new = str(source).encode(), str(target).encode()
    for script in (target / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        content = script.read_bytes()
        if old in content[:4096]:
            own_file(script, content.replace(old, new))


def own_file(path: Path, data: bytes | None = None) -> None:
    """Replace the hard link `path` by a file of its own holding `data` (its bytes unchanged
    when None), keeping its mode and dropping its cached bytecode."""
    content = path.read_bytes() if data is None else data
    mode = path.stat().st_mode
    path.unlink()  # the original keeps its bytes
    path.write_bytes(content)
    os.chmod(path, mode)
    for compiled in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
        compiled.unlink()
