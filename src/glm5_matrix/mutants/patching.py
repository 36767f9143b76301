"""A patched copy of a cell's environment, the original left untouched.

The copy is the original venv hard-linked file by file (`cp -al`: seconds, no space), then made
the copy's own where it would otherwise share bytes with the original: the files the patch
changes are replaced by real copies before `patch` touches them (never a write through a hard
link), their cached bytecode is dropped, and the scripts in bin/ (whose first line names the
original's interpreter) are rewritten to name the copy's. The patch is applied with
`patch -p1` inside the copy's site-packages and checked applied: a reverse dry run must succeed,
and each patched file must differ from the original, whose digest must not have moved.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from glm5_matrix.errors import UserError


def patched_files(patch_text: str) -> list[str]:
    """The files a unified diff changes, relative to site-packages (its `+++ b/PATH` lines,
    with the first path component stripped as `patch -p1` does)."""
    files = []
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            path = line[4:].split("\t")[0].strip()
            if path == "/dev/null":
                raise ValueError("a mutant patch must change existing files, not delete them")
            parts = Path(path).parts
            if len(parts) < 2 or ".." in parts or Path(path).is_absolute():
                raise ValueError(
                    f"patch path {path!r} is not a/b-relative (made with diff -u a/ b/)"
                )
            files.append(str(Path(*parts[1:])))
    if not files:
        raise ValueError("no +++ lines: not a unified diff")
    return files


def site_packages(venv: Path) -> Path:
    """The venv's purelib folder (lib/pythonX.Y/site-packages)."""
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if len(found) != 1:
        raise UserError(f"{venv}: expected one lib/python3.*/site-packages, found {len(found)}")
    return found[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Applied:
    """A patched copy: where it is and what the patch changed, with the original's digests."""

    venv: Path
    files: tuple[str, ...]
    original_digests: dict[str, str]
    patched_digests: dict[str, str]


def copy_venv(source: Path, target: Path) -> None:
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
        if old not in content[:4096]:
            continue
        mode = script.stat().st_mode
        script.unlink()  # the original's link is left as it was
        script.write_bytes(content.replace(old, new))
        os.chmod(script, mode)


def _own_copy(path: Path) -> None:
    """Replace a hard link by a file of its own with the same bytes."""
    data = path.read_bytes()
    mode = path.stat().st_mode
    path.unlink()
    path.write_bytes(data)
    os.chmod(path, mode)
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        for compiled in cache.glob(f"{path.stem}.*.pyc"):
            compiled.unlink()


def apply_patch(source: Path, target: Path, patch: Path) -> Applied:
    """Copy the venv `source` to `target` and apply `patch` there; a patch that does not apply
    cleanly (or is already applied) is a UserError, and the original is checked unchanged."""
    files = tuple(patched_files(patch.read_text()))
    source_site = site_packages(source)
    missing = [f for f in files if not (source_site / f).is_file()]
    if missing:
        raise UserError(f"{patch.name}: {', '.join(missing)} not in {source_site}")
    before = {f: digest(source_site / f) for f in files}
    copy_venv(source, target)
    site = site_packages(target)
    for name in files:
        _own_copy(site / name)
    _patch(site, patch, ["--dry-run"], "does not apply")
    _patch(site, patch, [], "failed to apply")
    _patch(site, patch, ["--dry-run", "--reverse"], "is not applied after patch ran")
    after = {f: digest(source_site / f) for f in files}
    if after != before:
        raise UserError(f"{patch.name}: the original environment's files changed: {source_site}")
    patched = {f: digest(site / f) for f in files}
    same = [f for f in files if patched[f] == before[f]]
    if same:
        raise UserError(f"{patch.name}: {', '.join(same)} unchanged by the patch")
    return Applied(target, files, before, patched)


def control_copy(source: Path, target: Path) -> Applied:
    """The unpatched copy a control run uses (the same copying, no patch)."""
    copy_venv(source, target)
    return Applied(target, (), {}, {})


def _patch(site: Path, patch: Path, options: list[str], failure: str) -> None:
    command = [
        "patch",
        "-p1",
        "--batch",
        *([] if "--reverse" in options else ["--forward"]),
        "--no-backup-if-mismatch",
        "--reject-file=-",
        "-d",
        str(site),
        "-i",
        str(patch),
        *options,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        detail = (done.stdout + done.stderr).strip().splitlines()
        raise UserError(f"{patch.name}: {failure} ({detail[-1] if detail else 'no output'})")
