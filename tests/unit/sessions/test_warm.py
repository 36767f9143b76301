"""glm5_matrix.sessions.warm without nox: what `nox -s warm -- ...` selects, what it leaves out and why,
and the per-configuration lines it prints from the warm suite's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.machine import hardware
from glm5_matrix.sessions import warm
from glm5_matrix.sessions.runner import load


def _ids(variants: list) -> list[str]:
    return [v.id for v in variants]


def test_selection_by_cells_and_tags_in_matrix_order() -> None:
    matrix = load()
    options = warm.parse(["offload-tp1", "e2e-tp1(deep_gemm)", "--model", "/ckpt", "-k", "x"])
    assert options.cell_args == ("--model", "/ckpt", "-k", "x")
    assert _ids(warm.select(matrix, options)) == [
        "e2e-tp1(deep_gemm)",
        "offload-tp1(simple)",
        "offload-tp1(offloading)",
    ]
    gpu = warm.select(matrix, warm.parse(["-t", "gpu"]))
    assert "e2e-tp1-graphs" in _ids(gpu) and "e2e-cpu" not in _ids(gpu)
    with pytest.raises(UserError, match="no cell has tag 'gpus-3'"):
        warm.select(matrix, warm.parse(["-t", "gpus-3"]))
    with pytest.raises(UserError, match="unknown cell 'e2e-tp3'"):
        warm.select(matrix, warm.parse(["e2e-tp3"]))
    export = warm.parse(["-t", "gpu", "--export", "k.tar.gz", "--part-size", "60"])
    assert export.export == "k.tar.gz" and export.part_size == 60.0


def test_what_is_left_out_and_why() -> None:
    matrix = load()
    chosen = warm.select(matrix, warm.parse(["-t", "sm90", "layout", "e2e-cpu"]))
    one_h200 = hardware.Hardware(((9, 0),), "test")
    keep, left_out = warm.runnable(chosen, one_h200)
    assert "e2e-tp1(deep_gemm)" in _ids(keep) and "e2e-cpu" in _ids(keep)
    assert "pd-nixl" not in _ids(keep) and "e2e-tp2(deep_gemm)" not in _ids(keep)
    assert "layout: starts no engine, nothing to warm" in left_out
    assert any(line.startswith("pd-nixl needs 2 GPU(s)") for line in left_out)


def test_summary_lines_per_configuration(tmp_path: Path) -> None:
    variant = load().variant("e2e-tp1(deep_gemm)")
    label = "glm-5.3-flash-4l:e2e-tp1(deep_gemm)"
    (tmp_path / "results.json").write_text(
        json.dumps(
            {
                "exit_status": 0,
                "engine_starts": [
                    {
                        "label": label,
                        "seconds": 246.7,
                        "test": "t",
                        "compile": {
                            "seconds": 0.0,
                            "entries_added": {"flashinfer": 6, "tilelang": 30, "triton": 0},
                        },
                    },
                    {"label": "server:old", "seconds": 3.0, "test": "t"},
                ],
                "figures": [
                    {"name": f"warm.requests_s[{label}]", "value": 35.25},
                    {"name": f"warm.requests_compiled[{label}]", "value": {"inductor": 6}},
                    {"name": "warm.deduplicated", "value": "x:dflash-tp1 (warmed by e2e)"},
                ],
            }
        )
    )
    lines = warm.summary_lines(variant, tmp_path)
    assert lines[0] == (
        f"e2e-tp1(deep_gemm): {label} ready in 246.7 s; compiled: flashinfer 6, tilelang 30; "
        "warm requests 35.2 s, compiled: inductor 6"
    )
    assert lines[1] == "e2e-tp1(deep_gemm): server:old ready in 3.0 s; compiled: not measured"
    assert lines[2] == "e2e-tp1(deep_gemm): x:dflash-tp1 (warmed by e2e): not started again"
    assert warm.summary_lines(variant, tmp_path / "none") == [
        "e2e-tp1(deep_gemm): no results.json (the warm suite did not finish)"
    ]
