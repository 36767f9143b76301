"""Hardware preflight: which GPUs this box has, how they are connected, and whether a cell can
run on them.

Runs before any environment is built. GLM5_MATRIX_GPUS overrides detection with a
comma-separated list of compute capabilities ("9.0,9.0"; empty means no GPU), so a user can
ask what would run on a box they do not have; its GPUs are numbered 0, 1, ... Detected GPUs
carry nvidia-smi's index (PCI bus order), and a CUDA_VISIBLE_DEVICES the user set bounds them
the way CUDA reads it (indices or GPU UUIDs, up to the first entry that names no GPU).
`nvidia-smi topo -m` tells which GPUs are NVLink or NUMA neighbours (read_topology).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.matrix import Capability, Cell, parse_compute_capability

GPUS_VARIABLE = "GLM5_MATRIX_GPUS"
STRICT_VARIABLE = "GLM5_MATRIX_STRICT"


@dataclass(frozen=True)
class Hardware:
    capabilities: tuple[Capability, ...]
    source: str  # how they were found: the override, nvidia-smi, or nothing
    # The device index of each GPU, as nvidia-smi numbers them (0, 1, ... for the override).
    indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.indices:
            object.__setattr__(self, "indices", tuple(range(len(self.capabilities))))
        if len(self.indices) != len(self.capabilities):
            raise ValueError("one index per GPU")

    def describe(self) -> str:
        if not self.capabilities:
            return f"no GPU ({self.source})"
        listed = ",".join(f"{major}.{minor}" for major, minor in self.capabilities)
        return f"{len(self.capabilities)} GPU(s) with compute capability {listed} ({self.source})"


@dataclass(frozen=True)
class Verdict:
    runnable: bool
    reason: str  # one line: what the cell needs and what was found


def parse_override(text: str) -> tuple[Capability, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(parse_compute_capability(part) for part in text.split(","))
    except ValueError as exc:
        raise UserError(f"{GPUS_VARIABLE}={text!r}: {exc}") from None


def check_override(environ: Mapping[str, str]) -> None:
    """GLM5_MATRIX_GPUS, where set, read as detect() reads it: a UserError if it is malformed.
    The noxfile asks when it loads, so that a bad value is one line before any session runs."""
    if GPUS_VARIABLE in environ:
        parse_override(environ[GPUS_VARIABLE])


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
            [smi, "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        gpus = parse_query(out)
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return Hardware((), f"nvidia-smi failed: {exc}")
    source = "nvidia-smi"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = bound_by_visible(gpus, visible)
        source += f", CUDA_VISIBLE_DEVICES={visible!r}"
    return Hardware(
        tuple(capability for _, _, capability in gpus), source, tuple(i for i, _, _ in gpus)
    )


def parse_query(text: str) -> list[tuple[int, str, Capability]]:
    """`nvidia-smi --query-gpu=index,uuid,compute_cap --format=csv,noheader`: one
    (index, uuid, capability) per GPU."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, uuid, capability = (part.strip() for part in line.split(","))
        gpus.append((int(index), uuid, parse_compute_capability(capability)))
    return gpus


def bound_by_visible(
    gpus: list[tuple[int, str, Capability]], visible: str
) -> list[tuple[int, str, Capability]]:
    """The GPUs a CUDA_VISIBLE_DEVICES value leaves, as CUDA reads it: entries are device
    indices or GPU UUIDs (a unique prefix is enough), and the first entry that names no GPU
    ends the list (so "" and "-1" leave none; MIG instances are not whole GPUs and end it too).
    """
    by_index = {gpu[0]: gpu for gpu in gpus}
    kept: dict[int, tuple[int, str, Capability]] = {}
    for entry in (part.strip() for part in visible.split(",")):
        if entry.isdigit() and int(entry) in by_index:
            found = by_index[int(entry)]
        else:
            matches = [gpu for gpu in gpus if entry.startswith("GPU-") and gpu[1].startswith(entry)]
            if len(matches) != 1:
                break
            found = matches[0]
        kept.setdefault(found[0], found)
    return sorted(kept.values())


def check(cell: Cell, hardware: Hardware) -> Verdict:
    if not cell.gpus:
        return Verdict(True, "needs no GPU")
    minimum = cell.min_compute_capability or (0, 0)
    usable = [c for c in hardware.capabilities if c >= minimum]
    need = f"{cell.gpus} GPU(s)"
    if cell.min_compute_capability:
        need += f" with compute capability >= {cell.min_compute_capability}"
    if len(usable) >= cell.gpus:
        return Verdict(True, f"needs {need}; found {hardware.describe()}")
    return Verdict(False, f"{cell.name} needs {need}; found {hardware.describe()}")


def device_model(environ: dict[str, str] | None = None) -> str:
    """What the cell's runs are measured on, for figures kept per device: the visible GPUs' model
    names from nvidia-smi (" + "-joined when they differ; no CUDA context is made), else "cpu: "
    and the CPU's model name."""
    environ = dict(os.environ) if environ is None else environ
    smi = shutil.which("nvidia-smi")
    if smi is not None and GPUS_VARIABLE not in environ:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index,uuid,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            names = {}
            for line in out.splitlines():
                if line.strip():
                    index, uuid, name = (p.strip() for p in line.split(",", 2))
                    names[int(index)] = (uuid, name)
            gpus = [(i, uuid, Capability(0, 0)) for i, (uuid, _) in sorted(names.items())]
            visible = environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                gpus = bound_by_visible(gpus, visible)
            models = sorted({names[i][1] for i, _, _ in gpus})
            if models:
                return " + ".join(models)
        except (subprocess.SubprocessError, OSError, ValueError):
            pass
    return f"cpu: {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def strict(environ: dict[str, str] | None = None) -> bool:
    environ = dict(os.environ) if environ is None else environ
    return environ.get(STRICT_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


# --- topology ---------------------------------------------------------------------------------

# How close two GPUs are, from `nvidia-smi topo -m`'s legend: NVLink (NV#, # bonded links) beats
# every PCIe path; PIX (one PCIe bridge) > PXB (several) > PHB (host bridge) > NODE (between host
# bridges of one NUMA node) > SYS (across NUMA nodes).
_PCIE_RANKS = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_LABEL = re.compile(r"GPU(\d+)")


@dataclass(frozen=True)
class Topology:
    """GPU-to-GPU links and each GPU's NUMA node, by nvidia-smi index."""

    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (low, high) -> "NV18"
    numa: dict[int, str] = field(default_factory=dict)  # index -> "0", or absent if unknown

    def link(self, a: int, b: int) -> str | None:
        return self.links.get((min(a, b), max(a, b)))

    def rank(self, a: int, b: int) -> int:
        """Higher is closer: 100 + links for NVLink, 1..5 for PCIe paths, 0 when unknown."""
        kind = self.link(a, b) or ""
        nvlink = re.fullmatch(r"NV(\d+)", kind)
        return 100 + int(nvlink.group(1)) if nvlink else _PCIE_RANKS.get(kind, 0)


def parse_topology(text: str) -> Topology:
    """Read `nvidia-smi topo -m`. Columns are tab-separated (space-aligned in older drivers),
    and the header is underlined with ANSI escapes when nvidia-smi writes to a terminal. Rows
    and columns other than GPUs (NICs, the legend) are ignored. Raises ValueError when there is
    no GPU matrix in the text."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if _GPU_LABEL.search(line)), None)
    if header_at is None:
        raise ValueError("no GPU header in nvidia-smi topo output")
    split = re.compile(r"\t| {2,}")
    header = [cell.strip() for cell in split.split(lines[header_at])]
    if header and not header[0]:
        header = header[1:]  # the (empty) column of row labels
    numa_column = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    links: dict[tuple[int, int], str] = {}
    numa: dict[int, str] = {}
    rows = 0
    for line in lines[header_at + 1 :]:
        cells = [cell.strip() for cell in split.split(line)]
        row = _GPU_LABEL.fullmatch(cells[0]) if cells else None
        if row is None:
            continue
        a = int(row.group(1))
        rows += 1
        for name, value in zip(header, cells[1:], strict=False):
            column = _GPU_LABEL.fullmatch(name)
            if column is not None and int(column.group(1)) != a and value:
                b = int(column.group(1))
                links[(min(a, b), max(a, b))] = value
        if numa_column is not None and numa_column + 1 < len(cells):
            value = cells[numa_column + 1]
            if value and value != "N/A":
                numa[a] = value
    if not rows:
        raise ValueError("no GPU rows in nvidia-smi topo output")
    return Topology(links, numa)


def read_topology(environ: dict[str, str] | None = None) -> Topology | None:
    """The box's topology, or None where it cannot be told (the GLM5_MATRIX_GPUS override, no
    nvidia-smi, or output this parser does not understand): the caller then takes the lowest
    indices."""
    environ = dict(os.environ) if environ is None else environ
    smi = shutil.which("nvidia-smi")
    if GPUS_VARIABLE in environ or smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return parse_topology(out)
    except (subprocess.SubprocessError, OSError, ValueError):
        return None
