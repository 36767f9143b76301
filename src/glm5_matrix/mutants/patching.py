"""A patched copy of a cell's environment, the original left untouched.

The copy is glm5_matrix.envs.venv_copies': hard links, and the files the patch changes made the
copy's own before `patch` touches them (never a write through a hard link). The patch is applied with
`patch -p1` inside the copy's site-packages and checked applied: a reverse dry run must succeed,
and each patched file must differ from the original, whose digest must not have moved.

Where the cell runs a given interpreter (GLM5_MATRIX_PYTHON: a box with vLLM installed and no
venv to build, no network), the copy is an overlay instead: the top-level packages the patch
touches (vllm/), copied out of the folder that interpreter imports them from, into a folder put
first on the cell's PYTHONPATH; the interpreter is checked to import them from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
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

    def copy() -> Path:
        hardlink_copy(source, target)
        return site_packages(target)

    return _apply(site_packages(source), copy, target, patch)


def apply_patch_overlay(source_site: Path, overlay: Path, patch: Path) -> Applied:
    """The overlay of `patch`: its top-level packages copied from `source_site` (the folder the
    given interpreter imports them from) to `overlay`, and patched there."""
    tops = sorted({Path(f).parts[0] for f in patched_files(patch.read_text())})
    return _apply(source_site, lambda: overlay_copy(source_site, overlay, tops), overlay, patch)


def _apply(source_site: Path, copy: Callable[[], Path], target: Path, patch: Path) -> Applied:
    files = tuple(patched_files(patch.read_text()))
    missing = [f for f in files if not (source_site / f).is_file()]
    if missing:
        raise UserError(f"{patch.name}: {', '.join(missing)} not in {source_site}")
    before = {f: digest(source_site / f) for f in files}
    site = copy()
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


def overlay_copy(source_site: Path, overlay: Path, tops: list[str]) -> Path:
    """`overlay` holds a copy of each package `tops` of `source_site`: hard links where both
    are on one filesystem, else a plain copy (the original is never written either way)."""
    if overlay.exists():
        shutil.rmtree(overlay)
    overlay.mkdir(parents=True)
    for top in tops:
        src = source_site / top
        if not src.is_dir():
            raise UserError(f"{src}: not a package folder to copy")
        linked = subprocess.run(["cp", "-al", str(src), str(overlay / top)], capture_output=True)
        if linked.returncode != 0:  # another filesystem (e.g. /tmp/site and the checkout)
            shutil.rmtree(overlay / top, ignore_errors=True)
            subprocess.run(["cp", "-a", str(src), str(overlay / top)], check=True)
    return overlay


def interpreter_site(python: str, environ: Mapping[str, str], package: str = "vllm") -> Path:
    """The folder the interpreter `python` imports `package` from (site-packages, a bundle on
    its PYTHONPATH)."""
    origin = _origin(python, environ, package)
    if origin is None:
        raise UserError(f"{python}: cannot import {package} (nothing to patch)")
    return origin.parent.parent  # .../SITE/vllm/__init__.py -> .../SITE


def check_overlay_imported(
    python: str, environ: Mapping[str, str], overlay: Path, package: str = "vllm"
) -> None:
    """`python` with `overlay` first on its PYTHONPATH imports `package` from the overlay."""
    path = os.pathsep.join(p for p in (str(overlay), environ.get("PYTHONPATH")) if p)
    origin = _origin(python, {**environ, "PYTHONPATH": path}, package)
    if origin is None or overlay.resolve() not in origin.resolve().parents:
        raise UserError(f"{python} imports {package} from {origin}, not from the overlay {overlay}")


def _origin(python: str, environ: Mapping[str, str], package: str) -> Path | None:
    code = (
        "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
        "print(s.origin if s and s.origin else '')"
    )
    done = subprocess.run(
        [python or sys.executable, "-c", code, package],
        capture_output=True,
        text=True,
        env=dict(environ),
    )
    found = done.stdout.strip()
    return Path(found) if done.returncode == 0 and found else None


def control_copy(source: Path, target: Path) -> Applied:
    """The unpatched copy a control run uses (the same copying, no patch)."""
    hardlink_copy(source, target)
    return Applied(target, (), {}, {})


def control_overlay(source_site: Path, overlay: Path, tops: list[str]) -> Applied:
    """The unpatched overlay a control run uses (the same copying, no patch)."""
    overlay_copy(source_site, overlay, tops)
    return Applied(overlay, (), {}, {})


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
