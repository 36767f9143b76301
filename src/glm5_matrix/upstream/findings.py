"""The findings: upstream/NAME/finding.toml, one folder per vLLM defect (data, read here).

A finding names its reproduction script, the platform it runs on (`cpu`: `nox -s upstream` runs
it; `gpu`: written for an H200, run by hand), the matrix test that found it, the vLLM sources
that cause it, the harness's workaround, and its defect-absent controls: runs in which the
reproduction must report "not reproduced", so that its check is shown able to fail. A control
either patches one file of vLLM in a copy of the environment (`file`, `old`, `new`: `old` must
occur exactly once) or passes the script arguments that apply the workaround (`args`), or both.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError

FOLDER = "upstream"
FINDING_FILE = "finding.toml"
PLATFORMS = ("cpu", "gpu")
_FIELDS = {
    "title",
    "platform",
    "script",
    "args",
    "timeout_s",
    "found_by",
    "vllm",
    "sources",
    "workaround",
    "upstream",
    "control",
}
_CONTROL_FIELDS = {"name", "description", "file", "old", "new", "args"}


@dataclass(frozen=True)
class Control:
    name: str
    description: str
    file: str | None = None  # a path under site-packages, e.g. vllm/utils/network_utils.py
    old: str | None = None
    new: str | None = None
    args: tuple[str, ...] = ()

    @property
    def patches(self) -> bool:
        return self.file is not None


@dataclass(frozen=True)
class Finding:
    name: str  # the folder's name
    folder: Path
    title: str
    platform: str
    script: str
    args: tuple[str, ...]
    timeout_s: float
    found_by: str
    vllm: tuple[str, ...]
    sources: tuple[str, ...]
    workaround: str | None
    upstream: str | None
    controls: tuple[Control, ...]

    @property
    def script_path(self) -> Path:
        return self.folder / self.script


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: must be a list of strings")
    return tuple(value)


def _text(raw: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: {key} must be a non-empty string")
    return value


def parse_control(raw: Any, where: str) -> Control:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: a [[control]] must be a table")
    unknown = set(raw) - _CONTROL_FIELDS
    if unknown:
        raise UserError(f"{where}: unknown field(s) {sorted(unknown)}")
    patch = [raw.get(k) for k in ("file", "old", "new")]
    if any(p is not None for p in patch) and not all(isinstance(p, str) and p for p in patch):
        raise UserError(f"{where}: a patch needs file, old and new, all non-empty strings")
    args = _strings(raw.get("args", []), f"{where}: args")
    if patch[0] is None and not args:
        raise UserError(f"{where}: a control patches a file (file, old, new) or passes args")
    if patch[1] is not None and patch[1] == patch[2]:
        raise UserError(f"{where}: old and new are the same text")
    return Control(
        name=_text(raw, "name", where),
        description=_text(raw, "description", where),
        file=patch[0],
        old=patch[1],
        new=patch[2],
        args=args,
    )


def parse_finding(name: str, folder: Path, raw: dict[str, Any], where: str) -> Finding:
    unknown = set(raw) - _FIELDS
    if unknown:
        raise UserError(f"{where}: unknown field(s) {sorted(unknown)}")
    platform = _text(raw, "platform", where)
    if platform not in PLATFORMS:
        raise UserError(f"{where}: platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    timeout = raw.get("timeout_s", 600)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise UserError(f"{where}: timeout_s must be a positive number")
    controls_raw = raw.get("control", [])
    if not isinstance(controls_raw, list):
        raise UserError(f"{where}: control must be an array of tables ([[control]])")
    controls = tuple(
        parse_control(c, f"{where} [[control]] #{i + 1}") for i, c in enumerate(controls_raw)
    )
    if platform == "cpu" and not controls:
        raise UserError(f"{where}: a CPU reproduction needs a defect-absent [[control]]")
    if len({c.name for c in controls}) != len(controls):
        raise UserError(f"{where}: two controls share a name")
    workaround = raw.get("workaround")
    upstream = raw.get("upstream")
    for key, value in (("workaround", workaround), ("upstream", upstream)):
        if value is not None and not (isinstance(value, str) and value):
            raise UserError(f"{where}: {key} must be a non-empty string")
    return Finding(
        name=name,
        folder=folder,
        title=_text(raw, "title", where),
        platform=platform,
        script=_text(raw, "script", where, "repro.py"),
        args=_strings(raw.get("args", []), f"{where}: args"),
        timeout_s=float(timeout),
        found_by=_text(raw, "found_by", where),
        vllm=_strings(raw.get("vllm", []), f"{where}: vllm"),
        sources=_strings(raw.get("sources", []), f"{where}: sources"),
        workaround=workaround,
        upstream=upstream,
        controls=controls,
    )


def load_findings(root: Path) -> list[Finding]:
    """Every root/upstream/NAME/finding.toml, by name; a malformed one is a UserError."""
    base = root / FOLDER
    found = []
    for path in sorted(base.glob(f"*/{FINDING_FILE}")):
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"{path}: {exc}") from None
        finding = parse_finding(path.parent.name, path.parent, raw, str(path))
        if not finding.script_path.is_file():
            raise UserError(f"{path}: script {finding.script} not found")
        found.append(finding)
    return found


def reproduction_name(reference: str) -> str:
    """`upstream/NAME` (as the harness's workarounds name their reproduction) -> NAME."""
    prefix = FOLDER + "/"
    if not reference.startswith(prefix) or "/" in reference[len(prefix) :].strip("/"):
        raise UserError(f"{reference!r}: not {prefix}NAME")
    return reference[len(prefix) :].strip("/")
