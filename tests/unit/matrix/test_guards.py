"""glm5_matrix.matrix.guards and `glm5-matrix affected`: which cells a vLLM change should run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from scaffold import run_cli

from glm5_matrix.files import repo_root
from glm5_matrix.matrix import guards
from glm5_matrix.matrix.matrix import MATRIX_FILE

ROOT = repo_root()


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
    assert "unit" not in found
    # The layout cell builds GLM's KV specs through vLLM, which runs the GDN builder's module too
    # (executed/layout.txt): it is selected as well now.
    assert "layout" in found


def test_an_axis_value_runs_alone(matrix):
    found = guards.affected(matrix, ["vllm/v1/simple_kv_offload/manager.py"])
    assert [a.variant.id for a in found] == ["offload-tp1(simple)"]
    assert found[0].reasons == (
        ("vllm/v1/simple_kv_offload/manager.py", "vllm/v1/simple_kv_offload/"),
    )
    nixl = guards.affected(matrix, ["vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"])
    assert {a.variant.id for a in nixl} == {
        "pd-nixl",
        "pd-nixl-cpu",
        "pd-nixl-cpu-tp1-tp2",
        "pd-nixl-cpu-tp2-tp1",
        "faults",
    }


def test_nothing_guards_a_doc(matrix):
    assert guards.affected(matrix, ["docs/index.md"]) == []
    assert guards.unguarded(matrix, ["docs/index.md", "vllm/v1/core/x.py"]) == ["docs/index.md"]


# The cells that run vLLM's CPU worker, in matrix order: what a change to it selects.
CPU_WORKER_CELLS = [
    "e2e-cpu",
    "pd-nixl-cpu",
    "e2e-cpu-tp2",
    "e2e-cpu-tp4",
    "pd-nixl-cpu-tp1-tp2",
    "pd-nixl-cpu-tp2-tp1",
    "faults",
]


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return run_cli("affected", *args, env=os.environ, stdin=stdin, timeout=60)


def test_cli_prints_one_cell_per_line():
    result = _cli("vllm/v1/kv_offload/base.py", "vllm/v1/simple_kv_offload/manager.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["offload-tp1(simple)", "offload-tp1(offloading)"]


def test_cli_json_and_stdin():
    result = _cli("--json", "-", stdin="vllm/v1/worker/cpu_worker.py\nREADME.md\n")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [item["session"] for item in listed] == CPU_WORKER_CELLS
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
    # DeepGEMM's vendored package runs in the deep_gemm cells alone; vllm/utils/deep_gemm.py and
    # vllm/utils/flashinfer.py are imported by every engine, the CPU cells' too (executed/).
    package = "vllm/third_party/deep_gemm/__init__.py"
    deep_gemm = {a.variant.id for a in guards.affected(matrix, [package])}
    assert deep_gemm == {v.id for v in moe if _moe(v) == "deep_gemm"}
    for helper in ("vllm/utils/deep_gemm.py", "vllm/utils/flashinfer.py"):
        found = {a.variant.id for a in guards.affected(matrix, [helper])}
        assert {v.id for v in moe} | {"e2e-cpu", "pd-nixl-cpu"} <= found, helper


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
    assert prefixed.stdout == plain.stdout and plain.stdout.split() == CPU_WORKER_CELLS
    folder = _cli("vllm/v1/worker/cpu")
    assert folder.stdout.split() == CPU_WORKER_CELLS
    assert "no cell guards" not in folder.stderr


# --- guards against what the cells execute (executed/, glm5_matrix.results.executed) ----------

# Helpers the CPU cells execute that the hand-written guards missed (issue 35): a change there
# ran no cell.
KV_CONNECTOR_HELPER = "vllm/distributed/kv_transfer/kv_connector/utils.py"
MAMBA_HELPER = "vllm/v1/worker/mamba_utils.py"


# The CPU cells whose lists come from their own runs (never derived).
RECORDED_ON_CPU = ("e2e-cpu", "pd-nixl-cpu", "layout", "metadata")


def _executed(matrix, variant_id: str) -> set[str]:
    variant = matrix.variant(variant_id)
    return {f for rec in guards.recorded(ROOT, matrix, variant) for f in rec.files}


def test_every_cell_guards_every_vllm_file_it_executes(matrix):
    """The check the unit cell runs on every change: the recorded lists against matrix.toml."""
    assert guards.check(ROOT, matrix) == []


def test_every_vllm_cell_has_a_list_of_what_it_executes(matrix):
    """A cell that runs vLLM (its environment has it, or it runs cells that do) has a list; the
    CPU cells' are recorded, a GPU cell's recorded or derived (its header says which)."""
    for variant in matrix.variants:
        if variant.env == "harness" and not variant.cell.runs:
            continue
        lists = guards.recorded(ROOT, matrix, variant)
        assert lists, f"{variant.id}: no list in {guards.EXECUTED_DIR}/"
        if variant.id in RECORDED_ON_CPU:
            assert not any(rec.derived for rec in lists), f"{variant.id}: derived, not recorded"
        assert len({f for rec in lists for f in rec.files}) > 100, variant.id


def test_a_derived_list_holds_its_twins_files_today(matrix):
    """A derived list is its twin's list, less what it drops, plus what it adds: regenerated
    (`glm5-matrix guards derive`) when the twin's recorded list changes."""
    derived = 0
    for path in sorted((ROOT / guards.EXECUTED_DIR).glob("*.txt")):
        rec = guards.read_recorded(path)
        how = guards.derived_from(rec)
        if how is None:
            continue
        twin, drop, add = how
        twin_files = _executed(matrix, twin)
        assert twin_files and list(rec.files) == guards.derive(twin_files, drop, add), path.name
        derived += 1
    assert derived >= 1


def test_the_check_fails_on_a_planted_file_no_guard_covers(matrix, tmp_path):
    """Plant one file no guard covers in e2e-cpu's list: the check names it, for e2e-cpu and
    for faults (which runs e2e-cpu), and `glm5-matrix guards check` exits 1 with that line."""
    planted = "vllm/planted_nowhere/helper.py"
    shutil.copytree(ROOT / guards.EXECUTED_DIR, tmp_path / guards.EXECUTED_DIR)
    shutil.copy(ROOT / MATRIX_FILE, tmp_path / MATRIX_FILE)
    listed = tmp_path / guards.EXECUTED_DIR / "e2e-cpu.txt"
    listed.write_text(listed.read_text() + planted + "\n")
    problems = guards.check(tmp_path, matrix)
    assert len(problems) == 2
    assert problems[0].startswith("e2e-cpu executed 1 vLLM file(s) that none of its guards")
    assert problems[1].startswith("faults executed 1 vLLM file(s)")
    assert all(p.endswith(planted) for p in problems)
    result = run_cli(
        "guards", "check", env={**os.environ, "GLM5_MATRIX_ROOT": str(tmp_path)}, timeout=60
    )
    assert result.returncode == 1 and result.stderr.count("\n") == 2, result.stderr
    assert planted in result.stderr
    clean = run_cli("guards", "check", env=os.environ, timeout=60)
    assert clean.returncode == 0, clean.stderr


def test_uncovered_is_what_no_guard_holds():
    files = ["vllm/v1/core/sched/scheduler.py", "vllm/v1/worker/mamba_utils.py", "vllm/config/"]
    assert guards.uncovered(["vllm/v1/core/", "vllm/config/"], files) == [
        "vllm/v1/worker/mamba_utils.py"
    ]
    # A folder (in a derived list) is covered by a folder guard holding it, never by a file in it.
    assert guards.uncovered(["vllm/config/cache.py"], ["vllm/config/"]) == ["vllm/config/"]


@pytest.mark.parametrize("helper", [KV_CONNECTOR_HELPER, MAMBA_HELPER])
def test_affected_selects_the_cpu_cells_for_the_helpers_they_run(matrix, helper):
    """Both helpers are in the CPU cells' recorded lists (they run them), and `affected` now
    selects those cells; it answered "no cell guards" for both before."""
    for cell in ("e2e-cpu", "pd-nixl-cpu"):
        assert helper in _executed(matrix, cell), cell
    found = {a.variant.id for a in guards.affected(matrix, [helper])}
    assert {"e2e-cpu", "pd-nixl-cpu", "faults"} <= found
    assert guards.unguarded(matrix, [helper]) == []
    result = _cli(helper)
    assert result.returncode == 0 and "no cell guards" not in result.stderr
    assert {"e2e-cpu", "pd-nixl-cpu", "faults"} <= set(result.stdout.split())


def test_both_pipelines_select_a_cell_for_every_file_it_executes(matrix):
    """Buildkite: the step's if_changed globs match each recorded file; GitHub: the matrix job
    keeps the cell for a change to it (the same selection as `affected`)."""
    import fnmatch

    import yaml

    from glm5_matrix.pipelines import generate as pipelines

    steps = {
        s["label"]: s
        for s in yaml.safe_load(pipelines.render("buildkite", matrix))["steps"]
        if "label" in s
    }
    sessions = [{"session": v.id, "tags": v.tags} for v in matrix.variants]
    for variant in matrix.variants:
        files = sorted({f for rec in guards.recorded(ROOT, matrix, variant) for f in rec.files})
        include = steps[variant.id]["if_changed"]["include"]
        missed = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in include)]
        assert not missed, f"{variant.id}: if_changed misses {missed[:5]}"
        for changed in files[:: max(1, len(files) // 20)]:  # a spread of them, each alone
            kept = pipelines.github_matrix(matrix, sessions, [changed])
            assert variant.id in {e["session"] for e in kept}, (variant.id, changed)
