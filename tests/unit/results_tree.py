"""A results folder like a real matrix run leaves, made by the real writers: pytest with the
results plugin and --junitxml for cells that ran tests, the runner's skip record, the lint
cell's command record, and the ways a run ends early. Shared by the report and browser tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from glm5_matrix.files import repo_root
from glm5_matrix.matrix import context
from glm5_matrix.matrix.matrix import Matrix, Variant
from glm5_matrix.results import closing

ROOT = repo_root()

SUITE = """
import pytest
from glm5_matrix.results.recorder import record_engine_start, record_figure

def test_kv_layout():
    record_engine_start("engine:tiny", 21.5)
    record_figure("layout.block_size", 544, limit=544, relation="==", unit="tokens")
    record_figure("layout.kv_groups", ["MambaSpec", "FullAttentionSpec"], unit="groups")

def test_greedy_repeat():
    record_figure("repeat.logprob_delta", 0.25, limit=0.094, relation="<=", unit="nats")
    assert 0.25 <= 0.094, "cold vs repeat: |logprob delta| 0.25 > 0.094 | at step 3 <b>"

@pytest.mark.parametrize("backend", ["a/b", "c"])
def test_param(backend):
    pass

def test_needs_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.xfail(reason="vllm#56973 until 0.32.0", strict=True)
def test_known_upstream():
    assert False
"""
PASSING = """
def test_one():
    pass

def test_two():
    pass
"""


def _run_suite(base: Path, variant: Variant, source: str, work: Path) -> None:
    out = base / variant.slug
    out.mkdir(parents=True)
    ctx = context.for_variant(
        variant,
        weights=context.Weights("generated"),
        results_dir=str(out),
        environment={"VLLM_NO_USAGE_STATS": "1"},
    )
    (out / "context.json").write_text(ctx.to_json())
    suite = work / variant.slug / "tests" / "suites"
    suite.mkdir(parents=True)
    (suite / "test_demo.py").write_text(source)
    env = {
        **os.environ,
        context.CONTEXT_VARIABLE: str(out / "context.json"),
        "PYTHONPATH": str(ROOT / "src"),
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "glm5_matrix.results.recorder",
            f"--junitxml={out / 'junit.xml'}",
            "tests/suites/test_demo.py",
        ],
        cwd=work / variant.slug,
        env=env,
        capture_output=True,
        timeout=120,
    )


def build(base: Path, work: Path, matrix: Matrix) -> Path:
    """results/ for `matrix` (the checkout's, the `matrix` fixture) with: e2e-cpu (pass, fail, skip, xfail, figures, an engine start), unit (all
    pass), lint (a failing command), e2e-tp1(deep_gemm) (skipped in preflight), pd-nixl-cpu
    (no results.json: killed), offload-tp1(simple) (complete: false), and old-cell (a cell
    no longer in the matrix). The other cells have no folder: not run."""
    _run_suite(base, matrix.variant("e2e-cpu"), SUITE, work)
    _run_suite(base, matrix.variant("unit"), PASSING, work)
    lint = base / "lint"
    lint.mkdir()
    recorded = closing.CommandResults(lint, asdict(context.for_variant(matrix.variant("lint"))))
    with recorded.command(["ruff", "check", "."]):
        pass
    try:
        with recorded.command(["mypy"]):
            raise RuntimeError("Returned code 1")
    except RuntimeError:
        pass
    skipped = base / "e2e-tp1-deep_gemm"
    skipped.mkdir()
    closing.write_skip(
        skipped,
        asdict(context.for_variant(matrix.variant("e2e-tp1(deep_gemm)"))),
        "e2e-tp1 needs 1 GPU(s) with compute capability >= 9.0; found no GPU",
    )
    killed = base / "pd-nixl-cpu"
    killed.mkdir()
    (killed / "context.json").write_text(
        context.for_variant(matrix.variant("pd-nixl-cpu")).to_json()
    )
    ended = base / "offload-tp1-simple"
    ended.mkdir()
    (ended / "results.json").write_text(
        json.dumps(
            {
                "cell": asdict(context.for_variant(matrix.variant("offload-tp1(simple)"))),
                "exit_status": 1,
                "wall_seconds": 40.0,
                "outcomes": {"passed": 1, "interrupted": 1},
                "tests": {
                    "tests/suites/test_offload.py::test_a": {"outcome": "passed", "seconds": 1},
                    # the test that was running when SIGTERM came
                    "tests/suites/test_offload.py::test_b": {
                        "outcome": "interrupted",
                        "seconds": 2,
                    },
                },
                "engine_starts": [
                    # issue 13's record: torch.compile seconds only
                    {
                        "label": "engine:x",
                        "seconds": 30.0,
                        "test": None,
                        "compile": {"seconds": 12.0},
                    },
                    # issue 26's: kernel files per library, and whether the guard was on
                    {
                        "label": "engine:y",
                        "seconds": 46.1,
                        "test": "tests/suites/test_offload.py::test_a",
                        "compile": {
                            "seconds": 0.0,
                            "entries_added": {"deep_gemm": 8, "flashinfer": 1, "triton": 0},
                            "guard": True,
                        },
                    },
                    {
                        "label": "engine:z",
                        "seconds": 37.7,
                        "test": "tests/suites/test_offload.py::test_b",
                        "compile": {
                            "seconds": 0.0,
                            "entries_added": {"deep_gemm": 0, "triton": 2},
                            "guard": False,
                        },
                    },
                ],
                "figures": [],
                "complete": False,
                "ended": {"how": "signal", "signal": "SIGTERM", "detail": "", "test": None},
            }
        )
    )
    old = base / "old-cell"
    old.mkdir()
    (old / "results.json").write_text(
        json.dumps({"cell": {"id": "old-cell"}, "exit_status": 0, "outcomes": {}, "tests": {}})
    )
    return base
