"""A patched copy of a cell's environment, the original left untouched.

The copy is glm5_matrix.envs.venv_copies': hard links, and the files the patch changes made the
copy's own before `patch` touches them (never a write through a hard link). The patch is applied with
`patch -p1` inside the copy's site-packages and checked applied: a reverse dry run must succeed,
and each patched file must differ from the original, whose digest must not have moved.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from glm5_matrix.envs.venv_copies import digest, hardlink_copy, own_file, site_packages
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


@dataclass(frozen=True)
class Applied:
    """A patched copy: where it is and what the patch changed, with the original's digests."""

    venv: Path
    files: tuple[str, ...]
    original_digests: dict[str, str]
    patched_digests: dict[str, str]


def apply_patch(source: Path, target: Path, patch: Path) -> Applied:
    """Copy the venv `source` to `target` and apply `patch` there; a patch that does not apply
    cleanly (or is already applied) is a UserError, and the original is checked unchanged."""
    files = tuple(patched_files(patch.read_text()))
    source_site = site_packages(source)
    missing = [f for f in files if not (source_site / f).is_file()]
    if missing:
        raise UserError(f"{patch.name}: {', '.join(missing)} not in {source_site}")
    before = {f: digest(source_site / f) for f in files}
    hardlink_copy(source, target)
    site = site_packages(target)
    for name in files:
        own_file(site / name)
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
    hardlink_copy(source, target)
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
