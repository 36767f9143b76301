"""Which processes hold memory on which GPUs: NVML (nvidia-ml-py, where the interpreter has it,
as vLLM's CUDA build does) or, without it, nvidia-smi.

The supervisor (glm5_matrix.machine.supervision) asks on GPU cells: before the test command starts, a GPU
of the cell that another process already holds is named in one line (pid, memory) instead of
failing later with an allocation error; after the cell's processes are stopped, none of them may
still hold memory. Without NVML and nvidia-smi there is nothing to ask and holders() says so
(None), so the check is skipped on a machine without a GPU driver.

A GPU is named as CUDA_VISIBLE_DEVICES names it: an index ("0") or a UUID ("GPU-...").
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

QUERY_GPUS = ["--query-gpu=index,uuid", "--format=csv,noheader"]
QUERY_APPS = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
SMI_TIMEOUT_S = 30


@dataclass(frozen=True)
class Holder:
    """A process holding memory on a GPU."""

    index: str  # the driver's index of the GPU, "0"
    uuid: str
    pid: int
    used_mib: int | None  # None where the driver does not say ([N/A], e.g. in a container)

    def describe(self) -> str:
        used = "memory (amount not reported)" if self.used_mib is None else f"{self.used_mib} MiB"
        return f"pid {self.pid} holds {used} on GPU {self.index}"


def cell_gpus(environ: Mapping[str, str], count: int) -> list[str]:
    """The GPUs a cell of `count` GPUs runs on: the first `count` that CUDA_VISIBLE_DEVICES
    names, or indices 0..count-1 when it is not set."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    return [part.strip() for part in visible.split(",") if part.strip()][:count]


def parse_gpu_list(text: str) -> dict[str, str]:
    """{uuid: index} from `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`."""
    found = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[parts[1]] = parts[0]
    return found


def parse_compute_apps(text: str) -> list[tuple[str, int, int | None]]:
    """(gpu uuid, pid, MiB or None) from `nvidia-smi --query-compute-apps=gpu_uuid,pid,
    used_memory --format=csv,noheader,nounits` (a "MiB" unit, were it there, is dropped)."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[1].isdigit():
            continue  # "No running processes found" and the like
        used = parts[2].removesuffix("MiB").strip()
        found.append((parts[0], int(parts[1]), int(used) if used.isdigit() else None))
    return found


def select(holders: Iterable[Holder], gpus: Iterable[str]) -> list[Holder]:
    """The holders on `gpus` (indices or UUIDs; a UUID prefix such as "GPU-8f3a" counts)."""
    wanted = list(gpus)
    return [
        h
        for h in holders
        if any(
            g == h.index or (g.startswith(("GPU-", "MIG-")) and h.uuid.startswith(g))
            for g in wanted
        )
    ]


def holders(gpus: Iterable[str]) -> list[Holder] | None:
    """Processes holding memory on `gpus`; None when neither NVML nor nvidia-smi can answer."""
    found = _nvml_holders()
    if found is None:
        found = _smi_holders()
    return None if found is None else select(found, gpus)


def _nvml_holders() -> list[Holder] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(proc, "usedGpuMemory", None)
                mib = int(used) // (1024 * 1024) if isinstance(used, int) else None
                found.append(Holder(str(index), uuid, int(proc.pid), mib))
        return found
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _smi_holders() -> list[Holder] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        gpus = _smi(smi, QUERY_GPUS)
        apps = _smi(smi, QUERY_APPS)
    except (subprocess.SubprocessError, OSError):
        return None
    indices = parse_gpu_list(gpus)
    return [
        Holder(indices.get(uuid, "?"), uuid, pid, mib)
        for uuid, pid, mib in parse_compute_apps(apps)
    ]


def _smi(smi: str, arguments: list[str]) -> str:
    return subprocess.run(
        [smi, *arguments], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True
    ).stdout
