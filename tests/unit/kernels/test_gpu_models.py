"""glm5_matrix.kernels.gpu_models: the GPU models a key folder records, carried by archives (an
archive from before the list imports as of unknown models), added by warm without losing the
others, and the strict preflight's one line when this GPU is not among them."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from scaffold import KERNEL_KEY

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import gpu_models, kernel_archive, kernel_cache
from glm5_matrix.sessions import runner

H200 = gpu_models.GpuModel("NVIDIA H200", 132, 143771)
H100 = gpu_models.GpuModel("NVIDIA H100 80GB HBM3", 132, 81559)
B200 = gpu_models.GpuModel("NVIDIA B200", 148, 183359)


def _cache(root: Path) -> kernel_cache.KernelCache:
    return kernel_cache.prepare(
        kernel_cache.layout(KERNEL_KEY, {kernel_cache.ROOT_VARIABLE: str(root)})
    )


def _kernel(kernels: kernel_cache.KernelCache, name: str) -> None:
    path = kernels.directory / "inductor" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(name.encode())


def test_a_record_merges_and_loses_nothing() -> None:
    record = gpu_models.Record().added([H200], "warm 2026-12-03")
    record = record.added([gpu_models.GpuModel("NVIDIA H200", None, None), H100], "warm 2026-12-06")
    assert [m for m, _ in record.models] == [H200, H100]  # the H200 kept its count and size
    assert record.models[0][1] == ("warm 2026-12-03", "warm 2026-12-06")
    assert record.covers(gpu_models.GpuModel("NVIDIA H100 80GB HBM3"))
    assert not record.covers(gpu_models.GpuModel("NVIDIA H100 80GB HBM3", 114))
    assert gpu_models.Record.from_json(record.to_json()) == record


def test_warm_adds_a_model_and_export_import_carry_every_one(tmp_path: Path) -> None:
    """An archive warmed on the H200, imported on an H100 box, warmed there and exported: the new
    archive lists both, and a third box that imports it knows both."""
    first = _cache(tmp_path / "h200")
    _kernel(first, "h200.py")
    gpu_models.add_warmed(first, [H200], "2026-12-03")
    kernel_archive.export_archive(first, tmp_path / "h200.tar.gz")

    second = _cache(tmp_path / "h100")
    imported = kernel_archive.import_archive(tmp_path / "h200.tar.gz", second)
    assert "warmed on NVIDIA H200 (132 SMs, 143771 MiB)" in imported.describe()
    _kernel(second, "h100.py")
    gpu_models.add_warmed(second, [H100], "2026-12-06")
    kernel_archive.export_archive(second, tmp_path / "both.tar.gz")

    third = _cache(tmp_path / "third")
    kernel_archive.import_archive(tmp_path / "both.tar.gz", third)
    record = gpu_models.read(third)
    assert [m for m, _ in record.models] == [H200, H100]
    assert "warm 2026-12-03" in record.models[0][1]
    assert any(s.startswith("archive both.tar.gz") for s in record.models[1][1])
    assert not record.unknown
    assert gpu_models.check(third, [H100], "e2e-tp1").error is None


def _legacy_archive(tmp_path: Path) -> Path:
    """An archive as the harness wrote them before GPU models were recorded (the shared
    sm90-vllm-0.33.0 one): its manifest has no gpu_models."""
    source = _cache(tmp_path / "old")
    _kernel(source, "old.py")
    archive = tmp_path / "old.tar.gz"
    kernel_archive.export_archive(source, archive)
    # Rewrite the manifest without the new fields, as an older harness wrote it.
    import io
    import tarfile

    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar]  # type: ignore[union-attr]
    manifest = json.loads(members[0][1])
    manifest.pop("gpu_models")
    members[0] = (members[0][0], json.dumps(manifest).encode())
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    (tmp_path / "old.tar.gz.sha256").unlink()
    return archive


def test_an_archive_from_before_the_list_imports_as_of_unknown_models(tmp_path: Path) -> None:
    archive = _legacy_archive(tmp_path)
    kernels = _cache(tmp_path / "here")
    kernel_archive.import_archive(archive, kernels)
    record = gpu_models.read(kernels)
    assert record.models == () and len(record.unknown) == 1
    assert "made before GPU models were recorded" in record.unknown[0]
    coverage = gpu_models.check(kernels, [H100], "e2e-tp1(deep_gemm)")
    assert coverage.error is None and coverage.warning is not None
    assert "\n" not in coverage.warning and "nox -s warm -- e2e-tp1(deep_gemm)" in coverage.warning
    # Warmed here afterwards: the H100 is known, the unknown entries stay unknown, and an export
    # says so, so the next box sees both.
    gpu_models.add_warmed(kernels, [H100])
    assert gpu_models.check(kernels, [H100]).warning is None
    kernel_archive.export_archive(kernels, tmp_path / "new.tar.gz")
    after = _cache(tmp_path / "after")
    kernel_archive.import_archive(tmp_path / "new.tar.gz", after)
    record = gpu_models.read(after)
    assert record.covers(H100) and record.unknown and "via archive new.tar.gz" in record.unknown[0]


def test_strict_preflight_fails_in_one_line_on_a_model_the_cache_lacks(tmp_path: Path) -> None:
    kernels = _cache(tmp_path / "here")
    _kernel(kernels, "h200.py")
    gpu_models.add_warmed(kernels, [H200, H100])
    coverage = gpu_models.check(kernels, [B200], "e2e-tp1(deep_gemm)")
    assert coverage.error is not None and "\n" not in coverage.error
    assert "NVIDIA B200 (148 SMs, 183359 MiB)" in coverage.error
    assert "warmed on NVIDIA H200" in coverage.error
    assert "run `nox -s warm -- e2e-tp1(deep_gemm)` here first" in coverage.error
    assert gpu_models.check(kernels, [H100]) == gpu_models.Coverage()
    # An empty cache (never warmed, no archive) is warmed on nothing: an error too.
    empty = _cache(tmp_path / "empty")
    assert gpu_models.check(empty, [H100]).error is not None


class _Session:
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def error(self, text: str) -> None:
        self.said.append(("error", text))
        raise SystemExit(1)

    def warn(self, text: str) -> None:
        self.said.append(("warn", text))

    def log(self, text: str) -> None:
        self.said.append(("log", text))


def test_the_runner_stops_the_cell_before_any_engine(tmp_path: Path) -> None:
    kernels = _cache(tmp_path / "here")
    _kernel(kernels, "h200.py")
    gpu_models.add_warmed(kernels, [H200])
    session: Any = _Session()
    with pytest.raises(SystemExit):
        runner.check_gpu_models(session, kernels, [H100], "offload-tp1(simple)")
    assert [kind for kind, _ in session.said] == ["error"]
    session = _Session()
    runner.check_gpu_models(session, kernels, [H200], "offload-tp1(simple)")
    assert [kind for kind, _ in session.said] == ["log"]


def test_the_probe_reads_the_cell_interpreter(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'torch says'\necho '"
        + json.dumps([H100.to_json(), H100.to_json()])
        + "'\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert gpu_models.probe(fake, {"PATH": ""}) == [H100]
    assert (
        gpu_models.parse_smi("NVIDIA H200, 143771\nNVIDIA H200, 143771\n")
        == [gpu_models.GpuModel("NVIDIA H200", None, 143771)] * 2
    )


def test_a_damaged_record_is_one_line(tmp_path: Path) -> None:
    kernels = _cache(tmp_path / "here")
    (kernels.directory / gpu_models.RECORD_FILE).write_text('{"models": [{"sm_count": 1}]}')
    with pytest.raises(UserError, match="not a GPU-model record"):
        gpu_models.read(kernels)
