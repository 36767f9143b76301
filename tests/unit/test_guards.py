"""glm5_matrix.matrix.guards and `glm5-matrix affected`: which cells a vLLM change should run."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from scaffold import run_cli

from glm5_matrix.matrix import guards
from glm5_matrix.matrix.matrix import MATRIX_FILE, load_matrix
from glm5_matrix.matrix.profiles import repo_root

ROOT = repo_root()


@pytest.fixture(scope="module")
def matrix():
    return load_matrix(ROOT / MATRIX_FILE)


@pytest.mark.parametrize(
    ("changed", "guard", "expected"),
    [
        ("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/", True),
        ("./vllm/v1/core/block_pool.py", "vllm/v1/core/", True),
        ("vllm/v1/core_extra.py", "vllm/v1/core/", False),  # a prefix of a name is not a folder
        ("vllm/v1/attention/backends/gdn_attn.py", "vllm/v1/attention/backends/gdn_attn.py", True),
        (
            "vllm/v1/attention/backends/gdn_attn.pyi",
            "vllm/v1/attention/backends/gdn_attn.py",
            False,
        ),
        ("vllm/v1/", "vllm/v1/core/", True),  # a changed folder holds the guarded one
        ("vllm/v1/", "vllm/v1/kv_cache_interface.py", True),
        ("vllm/v1", "vllm/v1/core/", True),  # a folder without its trailing slash
        ("vllm/v1/core", "vllm/v1/core/", True),
        ("vllm/v1/cor", "vllm/v1/core/", False),  # a prefix of a name is not a folder
        ("a/vllm/v1/core/block_pool.py", "vllm/v1/core/", True),  # git diff's a/ and b/
        ("b/vllm/utils/deep_gemm.py", "vllm/utils/deep_gemm.py", True),
        ("docs/index.md", "vllm/v1/core/", False),
    ],
)
def test_matches(changed, guard, expected):
    assert guards.matches(changed, guard) is expected


def test_the_59536_lesson_runs_the_pruned_model_cells(matrix):
    """A change to the GDN metadata builder (where #59536 came from) runs every GLM engine
    cell, not only a change to vllm/models/glm5next/."""
    found = {
        a.variant.id for a in guards.affected(matrix, ["vllm/v1/attention/backends/gdn_attn.py"])
    }
    assert {"e2e-tp1(deep_gemm)", "e2e-tp1(flashinfer)", "dflash-tp1", "metadata"} <= found
    assert "layout" not in found and "unit" not in found


def test_an_axis_value_runs_alone(matrix):
    found = guards.affected(matrix, ["vllm/v1/simple_kv_offload/manager.py"])
    assert [a.variant.id for a in found] == ["offload-tp1(simple)"]
    assert found[0].reasons == (
        ("vllm/v1/simple_kv_offload/manager.py", "vllm/v1/simple_kv_offload/"),
    )
    nixl = guards.affected(matrix, ["vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"])
    assert {a.variant.id for a in nixl} == {"pd-nixl", "pd-nixl-cpu", "faults"}


def test_nothing_guards_a_doc(matrix):
    assert guards.affected(matrix, ["docs/index.md"]) == []
    assert guards.unguarded(matrix, ["docs/index.md", "vllm/v1/core/x.py"]) == ["docs/index.md"]


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return run_cli("affected", *args, env=os.environ, stdin=stdin, timeout=60)


def test_cli_prints_one_cell_per_line():
    result = _cli("vllm/v1/kv_offload/base.py", "vllm/utils/flashinfer.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "e2e-tp1(flashinfer)",
        "e2e-tp2(flashinfer)",
        "e2e-tp4(flashinfer)",
        "offload-tp1(offloading)",
    ]


def test_cli_json_and_stdin():
    result = _cli("--json", "-", stdin="vllm/v1/worker/cpu_worker.py\nREADME.md\n")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [item["session"] for item in listed] == ["e2e-cpu", "pd-nixl-cpu", "faults"]
    assert listed[0]["matched"] == [
        {"path": "vllm/v1/worker/cpu_worker.py", "guard": "vllm/v1/worker/cpu_worker.py"}
    ]
    assert "cpu" in listed[0]["tags"]
    assert "no cell guards README.md" in result.stderr


def test_cli_without_paths_is_a_usage_error():
    result = _cli()
    assert result.returncode == 2
    assert "PATH" in result.stderr


def _moe(variant) -> str | None:
    return variant.settings.get("moe_backend")


def test_every_cell_running_the_fp8_moe_guards_it(matrix):
    """A cell whose moe_backend is set (a setting or an axis value) runs the fused MoE layer and
    that backend: a change to either selects it. e2e-tp1-graphs and dflash-tp1 run deep_gemm."""
    moe = [v for v in matrix.variants if _moe(v)]
    assert {"e2e-tp1-graphs", "dflash-tp1"} <= {v.id for v in moe}
    for changed in (
        "vllm/model_executor/layers/fused_moe/fused_moe.py",
        "vllm/v1/attention/backends/gdn_attn.py",
        "vllm/v1/core/kv_cache_utils.py",
    ):
        found = {a.variant.id for a in guards.affected(matrix, [changed])}
        assert {v.id for v in moe} <= found, (
            f"{changed}: misses {[v.id for v in moe if v.id not in found]}"
        )
    deep_gemm = {a.variant.id for a in guards.affected(matrix, ["vllm/utils/deep_gemm.py"])}
    assert deep_gemm == {v.id for v in moe if _moe(v) == "deep_gemm"}
    flashinfer = {a.variant.id for a in guards.affected(matrix, ["vllm/utils/flashinfer.py"])}
    assert flashinfer == {v.id for v in moe if _moe(v) == "flashinfer"}


def test_every_gpu_engine_cell_is_selected_by_a_vllm_folder_change(matrix):
    """`affected vllm/` lists every cell that starts vLLM on the GLM profile."""
    found = {a.variant.id for a in guards.affected(matrix, ["vllm/"])}
    engine = {v.id for v in matrix.variants if v.cell.gpus}
    assert engine <= found


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["-"], "", "no paths on standard input"),
        (["-"], "\n  \n", "no paths on standard input"),
        (["/vllm/v1/core/block_pool.py"], "", "an absolute path"),
        ([""], "", "no paths given"),
    ],
    # Readable ids: the report's page shows test names, and HTML collapses a newline.
    ids=["empty-stdin", "blank-stdin", "absolute-path", "empty-argument"],
)
def test_cli_refuses_what_it_cannot_answer(args, stdin, message):
    result = _cli(*args, stdin=stdin)
    assert result.returncode == 2, result.stdout
    assert result.stdout == ""
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_cli_reads_git_diff_output_as_git_prints_it():
    """`git diff` prefixes a/ and b/; a folder may come without its slash."""
    plain = _cli("vllm/v1/worker/cpu_worker.py")
    prefixed = _cli("-", stdin="a/vllm/v1/worker/cpu_worker.py\nb/vllm/v1/worker/cpu_worker.py\n")
    assert plain.returncode == prefixed.returncode == 0, prefixed.stderr
    assert prefixed.stdout == plain.stdout and plain.stdout.split() == [
        "e2e-cpu",
        "pd-nixl-cpu",
        "faults",
    ]
    folder = _cli("vllm/v1/worker/cpu")
    assert folder.stdout.split() == ["e2e-cpu", "pd-nixl-cpu", "faults"]
    assert "no cell guards" not in folder.stderr
