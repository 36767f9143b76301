"""Hardware preflight: which GPUs this box has, and whether a cell can run on them.

Runs before any environment is built. GLM5_MATRIX_GPUS overrides detection with a
comma-separated list of compute capabilities ("9.0,9.0"; empty means no GPU), so a user can
ask what would run on a box they do not have.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from glm5_matrix.errors import UserError
from glm5_matrix.matrix import Cell, parse_compute_capability

GPUS_VARIABLE = "GLM5_MATRIX_GPUS"
STRICT_VARIABLE = "GLM5_MATRIX_STRICT"


@dataclass(frozen=True)
class Hardware:
    capabilities: tuple[tuple[int, int], ...]
    source: str  # how they were found: the override, nvidia-smi, or nothing

    def describe(self) -> str:
        if not self.capabilities:
            return f"no GPU ({self.source})"
        listed = ",".join(f"{major}.{minor}" for major, minor in self.capabilities)
        return f"{len(self.capabilities)} GPU(s) with compute capability {listed} ({self.source})"


@dataclass(frozen=True)
class Verdict:
    runnable: bool
    reason: str  # one line: what the cell needs and what was found


def parse_override(text: str) -> tuple[tuple[int, int], ...]:
    if not text.strip():
        return ()
    try:
        return tuple(parse_compute_capability(part) for part in text.split(","))
    except ValueError as exc:
        raise UserError(f"{GPUS_VARIABLE}={text!r}: {exc}") from None


def detect(environ: dict[str, str] | None = None) -> Hardware:
    environ = dict(os.environ) if environ is None else environ
    if GPUS_VARIABLE in environ:
        override = environ[GPUS_VARIABLE]
        return Hardware(parse_override(override), f"{GPUS_VARIABLE}={override!r}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Hardware((), "nvidia-smi not found")
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        return Hardware((), f"nvidia-smi failed: {exc}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    capabilities = [parse_compute_capability(line) for line in out.split() if line.strip()]
    if visible is not None:
        indices = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        capabilities = [c for i, c in enumerate(capabilities) if i in indices]
    return Hardware(tuple(capabilities), "nvidia-smi")


def check(cell: Cell, hardware: Hardware) -> Verdict:
    if not cell.gpus:
        return Verdict(True, "needs no GPU")
    minimum = (
        parse_compute_capability(cell.min_compute_capability)
        if cell.min_compute_capability
        else (0, 0)
    )
    usable = [c for c in hardware.capabilities if c >= minimum]
    need = f"{cell.gpus} GPU(s)"
    if cell.min_compute_capability:
        need += f" with compute capability >= {cell.min_compute_capability}"
    if len(usable) >= cell.gpus:
        return Verdict(True, f"needs {need}; found {hardware.describe()}")
    return Verdict(False, f"{cell.name} needs {need}; found {hardware.describe()}")


def strict(environ: dict[str, str] | None = None) -> bool:
    environ = dict(os.environ) if environ is None else environ
    return environ.get(STRICT_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")
