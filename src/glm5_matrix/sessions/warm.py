"""`nox -s warm`: compile on this machine what the selected cells need, before they run.

    nox -s warm -- -t gpu                          # every GPU cell this machine can run
    nox -s warm -- "e2e-tp1(deep_gemm)" offload-tp1 --export kernels.tar.gz [--part-size 60]
    nox -s warm -- e2e-cpu                         # a CPU cell (vLLM's CPU build uses Inductor)

Each selected cell runs the warm suite (tests/suites/test_warm.py) in its own environment with
its own context, results under results/warm/CELL/, the kernel guard off; a configuration equal to
one an earlier cell of this run warmed is not started again (engine_configs.WarmLedger). Then:
seconds per configuration (to ready, and the files each library compiled), what the kernel cache
cannot hold, and with --export the archive of the cells' kernel cache. Cells whose hardware is
missing are skipped with a line (an error with GLM5_MATRIX_STRICT=1), cells that start no
engine with another. Arguments the cells take (--model, --vllm) pass through.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import gpu_models, kernel_archive, kernel_cache, kernel_guard
from glm5_matrix.machine import hardware
from glm5_matrix.matrix.context import LEDGER_VARIABLE
from glm5_matrix.matrix.matrix import ENGINE_SUITES, Matrix, Variant
from glm5_matrix.results import schema
from glm5_matrix.results.schema import RESULTS_FILE
from glm5_matrix.sessions import runner
from glm5_matrix.sessions.nox_session import NoxSession

WARM_SUITE = "tests/suites/test_warm.py"
NOT_CACHED = (
    "not held by the kernel cache, so paid at every engine start: CuTeDSL kernels (cute.compile "
    "keeps them in memory), CUDA graph capture and vLLM's in-process JIT warm-up (compiled "
    "mode), model loading; and kernels compiled per request shape for shapes other than the "
    "profile's [warm] requests (with the guard on, a cell names them and fails)"
)


@dataclass(frozen=True)
class WarmOptions:
    cells: tuple[str, ...]
    tags: tuple[str, ...]
    export: str | None
    compression: str
    part_size: float | None
    cell_args: tuple[str, ...]  # for every cell: --model, --vllm, pytest's own


def parse(posargs: list[str]) -> WarmOptions:
    parser = argparse.ArgumentParser(prog="nox -s warm --", add_help=False)
    parser.add_argument("cells", nargs="*")
    parser.add_argument("-t", "--tag", action="append", default=[])
    parser.add_argument("--export")
    parser.add_argument("--compression", default="gz", choices=kernel_archive.COMPRESSIONS)
    parser.add_argument("--part-size", type=float)
    known, rest = parser.parse_known_args(posargs)
    if not known.cells and not known.tag:
        raise UserError("name the cells to warm, or tags: nox -s warm -- -t gpu")
    return WarmOptions(
        tuple(known.cells),
        tuple(known.tag),
        known.export,
        known.compression,
        known.part_size,
        tuple(rest),
    )


def select(matrix: Matrix, options: WarmOptions) -> list[Variant]:
    """The variants named (a cell's name means all its variants, as for nox -s) or tagged, in
    matrix order, each once."""
    wanted: set[str] = set()
    for name in options.cells:
        try:
            wanted.add(matrix.variant(name).id)
        except UserError:
            wanted |= {v.id for v in matrix.cell(name).variants}
    for tag in options.tags:
        tagged = matrix.select(tag)
        if not tagged:
            raise UserError(f"no cell has tag {tag!r}")
        wanted |= {v.id for v in tagged}
    return [variant for variant in matrix.variants if variant.id in wanted]


def runnable(variants: list[Variant], found: hardware.Hardware) -> tuple[list[Variant], list[str]]:
    """(the variants to warm here, one line per variant left out and why)."""
    keep, left_out = [], []
    for variant in variants:
        verdict = hardware.check(variant.cell, found)
        if variant.cell.suite not in ENGINE_SUITES or not variant.cell.profile:
            left_out.append(f"{variant.id}: starts no engine, nothing to warm")
        elif not verdict.runnable:
            left_out.append(verdict.reason)
        else:
            keep.append(variant)
    return keep, left_out


def _by_label(data: dict[str, Any], name: str) -> dict[str, Any]:
    """{label: value} of the figures named `name[label]`."""
    prefix = name + "["
    return {
        f["name"][len(prefix) : -1]: f["value"]
        for f in data.get("figures", [])
        if f["name"].startswith(prefix) and f["name"].endswith("]")
    }


def summary_lines(variant: Variant, out: Path) -> list[str]:
    """What the warm suite recorded for a cell: per configuration, seconds to ready and the
    files compiled, the warm requests' seconds, or which earlier cell warmed it."""
    path = out / RESULTS_FILE
    if not path.is_file():
        return [f"{variant.id}: no {RESULTS_FILE} (the warm suite did not finish)"]
    data = json.loads(path.read_text())
    requests = _by_label(data, "warm.requests_s")
    request_compiles = _by_label(data, "warm.requests_compiled")
    lines = []
    for start in data.get("engine_starts", []):
        compiled = start.get("compile") or {}
        added = ", ".join(
            f"{name} {n}" for name, n in sorted((compiled.get("entries_added") or {}).items()) if n
        )
        torch_compile = compiled.get("seconds")
        line = f"{variant.id}: {start['label']} ready in {start['seconds']:.1f} s"
        line += f"; compiled: {added or 'nothing'}" if compiled else "; compiled: not measured"
        if torch_compile:
            line += f" (torch.compile {torch_compile:.1f} s)"
        if start["label"] in requests:
            line += f"; warm requests {requests[start['label']]:.1f} s"
        if start["label"] in request_compiles:
            counts = request_compiles[start["label"]] or {}
            done = ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "nothing"
            line += f", compiled: {done}"
        lines.append(line)
    for figure in data.get("figures", []):
        if figure["name"] == "warm.deduplicated":
            lines.append(f"{variant.id}: {figure['value']}: not started again")
    if data.get("exit_status"):
        lines.append(f"{variant.id}: the warm suite failed (exit {data['exit_status']}): {path}")
    return lines


def warmed(out: Path) -> bool:
    """The warm suite ran to the end and passed in `out` (its results.json says so)."""
    path = out / RESULTS_FILE
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    return bool(data.get("complete")) and data.get("exit_status") == 0


def run(session: NoxSession, matrix: Matrix) -> None:
    """The `warm` session. `session` is a nox.Session."""
    try:
        options = parse(list(session.posargs))
        variants = select(matrix, options)
    except UserError as exc:
        session.error(str(exc))
    found = hardware.detect()
    variants, left_out = runnable(variants, found)
    for line in left_out:
        session.log(f"warm: skips {line}")
    missing = [line for line in left_out if "nothing to warm" not in line]
    if missing and hardware.strict():
        session.error(f"{missing[0]} ({hardware.STRICT_VARIABLE} is set)")
    if not variants:
        session.skip(f"nothing to warm on this machine ({found.describe()})")
    base = schema.results_base(os.environ) / "warm"
    ledger = base / "ledger.json"
    ledger.unlink(missing_ok=True)
    caches: dict[Path, kernel_cache.KernelCache] = {}
    failed: set[Path] = set()  # caches a cell did not warm to the end
    lines: list[str] = []
    try:
        for variant in variants:
            out = base / variant.slug
            shutil.rmtree(out, ignore_errors=True)  # nothing of an earlier run read as this one's
            try:
                kernels = runner.run_variant(
                    session,
                    variant,
                    posargs=list(options.cell_args),
                    tests=(WARM_SUITE,),
                    out=out,
                    environment={kernel_guard.GUARD_VARIABLE: "0", LEDGER_VARIABLE: str(ledger)},
                )
            finally:
                lines += summary_lines(variant, out)
            if kernels is not None:
                caches[kernels.directory] = kernels
                if not warmed(out):
                    failed.add(kernels.directory)
    finally:
        for line in lines:
            session.log(f"warm: {line}")
    session.log(f"warm: {NOT_CACHED}")
    for directory, kernels in caches.items():
        session.log(f"warm: kernel cache {directory}")
        if directory in failed:
            session.log("warm: GPU models not recorded there (a cell did not warm to the end)")
            continue
        models = gpu_models.probe(kernels.python)
        if models:
            record = gpu_models.add_warmed(kernels, models)
            session.log(f"warm: the kernel cache records GPU models {record.describe()}")
    if options.export:
        export(session, options, caches)


def export(
    session: NoxSession, options: WarmOptions, caches: dict[Path, kernel_cache.KernelCache]
) -> None:
    """--export: the archive of the one kernel cache the cells used."""
    assert options.export is not None
    if len(caches) != 1:
        session.error(
            f"--export: the cells used {len(caches)} kernel caches "
            f"({', '.join(d.name for d in caches)}); export one with glm5-matrix kernel-cache"
        )
    try:
        done = kernel_archive.export_archive(
            next(iter(caches.values())),
            Path(options.export),
            compression=options.compression,
            part_size_mib=options.part_size,
        )
    except UserError as exc:
        session.error(str(exc))
    session.log(f"warm: exported {done.describe()}")
    session.log("warm: written " + " ".join(str(p) for p in done.written))
