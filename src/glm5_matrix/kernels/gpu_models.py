"""Which GPU models a kernel cache was warmed on, so that strict mode can say before the first
engine start that this GPU's entries are missing.

The key folder says `sm90`, but some caches key their entries by the GPU model too: TorchInductor
and vLLM's compile cache write entries per device name (a fresh H100 runner with an archive
warmed on an H200 wrote 15 inductor files at its first start, and the kernel guard refused it:
issue 48). So the key folder holds gpu-models.json, the models its entries were warmed on:

    {"models": [{"name": "NVIDIA H200", "sm_count": 132, "memory_mib": 143771,
                 "sources": ["warm 2026-12-03", ...]}],
     "unknown": ["archive kernels.tar.gz, exported 2026-12-06T..., made before GPU models
                  were recorded"]}

`nox -s warm` adds the models it warmed on (after its cells passed); an archive's manifest carries
the list (kernel_archive: "gpu_models", "gpu_models_unknown") and import merges it, so warming a
third model on top of an imported archive and exporting again keeps the first two.

An archive made before this existed (the shared sm90-vllm-0.33.0 one, H100 and H200 entries) has
no list: its models are unknown, not absent. Import records it under "unknown", and strict
preflight then says in one line that it cannot tell whether this GPU's entries are there (the
kernel guard still refuses a start that compiles) instead of refusing a cache that may well hold
them. A cache with no list and no files of its own is warmed on nothing: that is an error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_json_atomic
from glm5_matrix.kernels import kernel_cache

RECORD_FILE = "gpu-models.json"
PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class GpuModel:
    """A GPU model as the caches tell them apart: its name (what inductor's keys carry), and, when
    known, its SM count and memory."""

    name: str
    sm_count: int | None = None
    memory_mib: int | None = None

    def same_model(self, other: GpuModel) -> bool:
        """The same name, and the same SM count where both know it."""
        if self.name != other.name:
            return False
        return self.sm_count is None or other.sm_count is None or self.sm_count == other.sm_count

    def describe(self) -> str:
        parts = [f"{self.sm_count} SMs"] if self.sm_count is not None else []
        if self.memory_mib is not None:
            parts.append(f"{self.memory_mib} MiB")
        return self.name + (f" ({', '.join(parts)})" if parts else "")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sm_count": self.sm_count, "memory_mib": self.memory_mib}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuModel:
        if not isinstance(data.get("name"), str) or not data["name"]:
            raise ValueError(f"a GPU model needs a name: {data!r}")
        sm, memory = data.get("sm_count"), data.get("memory_mib")
        return cls(
            data["name"], None if sm is None else int(sm), None if memory is None else int(memory)
        )


@dataclass(frozen=True)
class Record:
    """A key folder's gpu-models.json: each model with where its entries came from, and the
    sources whose models nobody recorded."""

    models: tuple[tuple[GpuModel, tuple[str, ...]], ...] = ()
    unknown: tuple[str, ...] = ()
    exists: bool = False

    def covers(self, model: GpuModel) -> bool:
        return any(known.same_model(model) for known, _ in self.models)

    def added(self, models: Sequence[GpuModel], source: str) -> Record:
        """This record with `models` from `source`: a model already there gains the source (and
        a count or size it lacked), a new one is appended; nothing is dropped."""
        merged: list[tuple[GpuModel, tuple[str, ...]]] = list(self.models)
        for model in models:
            for i, (known, sources) in enumerate(merged):
                if known.same_model(model):
                    filled = GpuModel(
                        known.name,
                        known.sm_count if known.sm_count is not None else model.sm_count,
                        known.memory_mib if known.memory_mib is not None else model.memory_mib,
                    )
                    merged[i] = (filled, sources if source in sources else (*sources, source))
                    break
            else:
                merged.append((model, (source,)))
        return Record(tuple(merged), self.unknown, True)

    def with_unknown(self, source: str) -> Record:
        unknown = self.unknown if source in self.unknown else (*self.unknown, source)
        return Record(self.models, unknown, True)

    def describe(self) -> str:
        named = "; ".join(m.describe() for m, _ in self.models) or "no model recorded"
        if self.unknown:
            named += f" (and entries of unknown models from {len(self.unknown)} source(s))"
        return named

    def to_json(self) -> dict[str, Any]:
        return {
            "models": [{**m.to_json(), "sources": list(s)} for m, s in self.models],
            "unknown": list(self.unknown),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        models = tuple(
            (GpuModel.from_json(entry), tuple(str(s) for s in entry.get("sources", ())))
            for entry in data.get("models", ())
        )
        return cls(models, tuple(str(s) for s in data.get("unknown", ())), True)


def read(kernels: kernel_cache.KernelCache) -> Record:
    """The key folder's record (an empty one that does not exist when there is no file)."""
    path = kernels.directory / RECORD_FILE
    if not path.is_file():
        return Record()
    try:
        return Record.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: not a GPU-model record ({exc})") from None


def write(kernels: kernel_cache.KernelCache, record: Record) -> None:
    write_json_atomic(kernels.directory / RECORD_FILE, record.to_json())


def add_warmed(
    kernels: kernel_cache.KernelCache, models: Sequence[GpuModel], when: str | None = None
) -> Record:
    """Record that `models` were warmed into this key folder (nox -s warm, after its cells
    passed). Under the archive lock, so that an import at the same moment loses nothing."""
    source = f"warm {when or time.strftime('%Y-%m-%d', time.gmtime())}"
    with kernel_cache.locked(kernels.directory.parent):
        record = read(kernels).added(models, source)
        write(kernels, record)
    return record


# --- the GPUs here --------------------------------------------------------------------------------

_PROBE = (
    "import json, torch\n"
    "found = []\n"
    "for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):\n"
    "    p = torch.cuda.get_device_properties(i)\n"
    "    found.append({'name': p.name, 'sm_count': p.multi_processor_count,\n"
    "                  'memory_mib': p.total_memory // 2**20})\n"
    "print(json.dumps(found))\n"
)


def parse_smi(text: str) -> list[GpuModel]:
    """`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    found = []
    for line in text.splitlines():
        if line.strip():
            name, _, memory = line.rpartition(",")
            found.append(GpuModel(name.strip(), None, int(float(memory.strip()))))
    return found


def probe(python: str | Path | None, environ: Mapping[str, str] | None = None) -> list[GpuModel]:
    """The GPU models the cell's interpreter sees (torch: name, SM count, memory), one per
    distinct model; without torch or CUDA there, nvidia-smi's names and memory. Empty without
    a GPU."""
    environ = dict(os.environ if environ is None else environ)
    found: list[GpuModel] = []
    if python is not None:
        try:
            done = subprocess.run(
                [str(python), "-c", _PROBE],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                env=environ,
                check=False,
            )
            if done.returncode == 0:
                lines = done.stdout.strip().splitlines()
                found = [GpuModel.from_json(d) for d in json.loads(lines[-1])] if lines else []
        except (OSError, subprocess.TimeoutExpired, ValueError):
            found = []
    if not found:
        found = _from_smi(environ)
    distinct: list[GpuModel] = []
    for model in found:
        if not any(model == d for d in distinct):
            distinct.append(model)
    return distinct


def _from_smi(environ: Mapping[str, str]) -> list[GpuModel]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = ["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        query.append(f"--id={visible}")
    try:
        out = subprocess.run(
            [smi, *query], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return parse_smi(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


# --- the strict preflight -------------------------------------------------------------------------


@dataclass(frozen=True)
class Coverage:
    """Whether the key folder holds entries warmed on the GPUs here: `error` (a line that fails
    strict mode), `warning` (a line to show), or neither."""

    error: str | None = None
    warning: str | None = None
    missing: tuple[GpuModel, ...] = field(default_factory=tuple)


def check(
    kernels: kernel_cache.KernelCache, here: Sequence[GpuModel], cell: str = "CELL"
) -> Coverage:
    """The preflight's verdict for the GPUs `here` (see the module doc): one line each."""
    record = read(kernels)
    missing = tuple(m for m in here if not record.covers(m))
    if not missing:
        return Coverage()
    shown = "; ".join(m.describe() for m in missing)
    has_files = any(
        kernel_cache.files(kernels.folder(lib))
        for lib in kernel_cache.LIBRARIES
        if kernels.folder(lib).is_dir()
    )
    if record.unknown or (not record.exists and has_files):
        sources = ", ".join(record.unknown) or "entries written before models were recorded"
        return Coverage(
            warning=(
                f"kernel cache {kernels.directory.name}: no entries recorded as warmed on this "
                f"GPU ({shown}), but some are of unknown GPU models ({sources}): whether this "
                "GPU's are there shows only at the first engine start, which the guard refuses "
                f"if it compiles; `nox -s warm -- {cell}` here records this model"
            ),
            missing=missing,
        )
    return Coverage(
        error=(
            f"kernel cache {kernels.directory.name} was warmed on {record.describe()}, not on "
            f"this GPU ({shown}): its first engine start would compile what the cache keys by "
            "GPU model (inductor, Triton autotuning) and measure what FlashInfer's autotuner "
            f"keeps per GPU model; run `nox -s warm -- {cell}` here first "
            "(with --export FILE to add this model to the archive)"
        ),
        missing=missing,
    )
