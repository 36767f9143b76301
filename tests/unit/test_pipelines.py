"""glm5_matrix.pipelines: the Buildkite pipeline and the GitHub Actions workflow generated from
the matrix, validated against the vendors' published schemas (check-jsonschema's vendored
copies, no network), every cell variant exactly once with its needs, tags and timeout; and the
validation shown rejecting a pipeline broken on purpose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from glm5_matrix import pipelines
from glm5_matrix.matrix import MATRIX_FILE, load_matrix
from glm5_matrix.profiles import repo_root

ROOT = repo_root()
SCHEMAS = {"buildkite": "vendor.buildkite", "github": "vendor.github-workflows"}


@pytest.fixture(scope="module")
def matrix():
    return load_matrix(ROOT / MATRIX_FILE)


def check_jsonschema(kind: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", SCHEMAS[kind], str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "glm5_matrix.cli", "pipeline", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.parametrize("kind", ["buildkite", "github"])
def test_generated_pipeline_passes_the_published_schema(tmp_path, kind):
    path = tmp_path / f"{kind}.yml"
    result = _cli(kind, "--output", str(path))
    assert result.returncode == 0, result.stderr
    checked = check_jsonschema(kind, path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "validation done" in checked.stdout


BROKEN = {
    # a step that is a list, not a mapping, and a misspelt command key
    "buildkite": lambda d: {**d, "steps": [["e2e-cpu"], {"label": "x", "comand": "nox"}]},
    # a job without runs-on or uses, and steps that are a mapping
    "github": lambda d: {**d, "jobs": {"cell": {"steps": {"run": "nox"}}}},
}


@pytest.mark.parametrize("kind", ["buildkite", "github"])
def test_the_schema_check_rejects_a_broken_pipeline(tmp_path, matrix, kind):
    good = yaml.safe_load(pipelines.render(kind, matrix))
    path = tmp_path / f"{kind}.yml"
    path.write_text(yaml.safe_dump(BROKEN[kind](good)))
    checked = check_jsonschema(kind, path)
    assert checked.returncode != 0, checked.stdout
    assert "Schema validation errors" in checked.stdout + checked.stderr


def test_buildkite_has_every_variant_once_with_its_needs(matrix):
    data = yaml.safe_load(pipelines.render("buildkite", matrix))
    cells = [s for s in data["steps"] if str(s.get("key", "")).startswith("cell-")]
    assert [s["label"] for s in cells] == [v.id for v in matrix.variants]  # each exactly once
    for step, variant in zip(cells, matrix.variants, strict=True):
        assert step["env"]["GLM5_MATRIX_TAGS"].split() == variant.tags
        assert step["timeout_in_minutes"] == variant.cell.timeout_minutes
        assert step["artifact_paths"] == [f"results/{variant.slug}/**/*"]
        assert (
            f"nox -s '{variant.id}'" in step["command"] or f"nox -s {variant.id}" in step["command"]
        )
        if variant.cell.gpus:
            assert step["agents"] == {
                "queue": "gpu",
                "gpus": str(variant.cell.gpus),
                "sm90": "true",
            }
            assert step["env"]["GLM5_MATRIX_STRICT"] == "1"
        else:
            assert step["agents"] == {"queue": "cpu"}
            assert "GLM5_MATRIX_STRICT" not in step["env"]
        include = step["if_changed"]["include"]
        for guard in variant.guards:
            assert (f"{guard}**" if guard.endswith("/") else guard) in include
        assert "src/**" in include and f"envs/{variant.env}.toml" in include
    steps = data["steps"]
    wait = steps.index({"wait": None, "continue_on_failure": True})
    assert wait == len(cells) and steps[-1]["key"] == "report"
    assert any("nox -s report" in c for c in steps[-1]["commands"])
    assert any("buildkite-agent annotate" in c for c in steps[-1]["commands"])


def test_the_pruned_model_steps_run_on_the_59536_paths(matrix):
    """The seed's lesson reaches the pipeline: a change to gdn_attn.py alone selects them."""
    data = yaml.safe_load(pipelines.render("buildkite", matrix))
    step = next(s for s in data["steps"] if s.get("label") == "e2e-tp1(deep_gemm)")
    include = step["if_changed"]["include"]
    for path in (
        "vllm/v1/attention/backends/gdn_attn.py",
        "vllm/model_executor/layers/mamba/**",
        "vllm/v1/worker/gpu/**",
        "vllm/v1/core/**",
        "vllm/models/glm5next/**",
    ):
        assert path in include


def test_github_workflow_lists_sessions_the_cookbook_way(matrix):
    data = yaml.safe_load(pipelines.render("github", matrix))
    jobs = data["jobs"]
    assert "nox -l --json" in jobs["sessions"]["steps"][-1]["run"]
    cell = jobs["cell"]
    assert cell["strategy"]["matrix"] == "${{ fromJSON(needs.sessions.outputs.matrix) }}"
    assert cell["runs-on"] == "${{ matrix.runs-on }}"
    assert cell["timeout-minutes"] == "${{ matrix.timeout }}"
    assert jobs["report"]["if"] == "${{ always() }}"
    assert any("GITHUB_STEP_SUMMARY" in s.get("run", "") for s in jobs["report"]["steps"])
    # no cell is written into the workflow: adding one to matrix.toml needs no regeneration
    assert "e2e-cpu" not in pipelines.render("github", matrix)


def _sessions(tmp_path: Path) -> Path:
    listed = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-l", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("GLM5_")},
    )
    if listed.returncode:
        pytest.skip(f"nox is not usable here: {listed.stderr.strip()[-200:]}")
    path = tmp_path / "sessions.json"
    path.write_text(listed.stdout)
    return path


def test_github_matrix_from_nox_has_every_variant_once_with_its_tags(tmp_path, matrix):
    sessions = _sessions(tmp_path)
    output = tmp_path / "github_output"
    result = _cli("github-matrix", str(sessions), "--github-output", str(output))
    assert result.returncode == 0, result.stderr
    entries = json.loads(result.stdout)["include"]
    assert [e["session"] for e in entries] == [v.id for v in matrix.variants]
    for entry, variant in zip(entries, matrix.variants, strict=True):
        assert entry["tags"] == variant.tags
        assert entry["timeout"] == variant.cell.timeout_minutes
        assert entry["strict"] == ("1" if variant.cell.gpus else "")
        if variant.cell.gpus:
            assert entry["runs-on"] == [
                "self-hosted",
                "linux",
                "gpu",
                f"gpus-{variant.cell.gpus}",
                "sm90",
            ]
        else:
            assert entry["runs-on"] == "ubuntu-latest"
    lines = output.read_text().splitlines()
    assert lines[0] == f"matrix={result.stdout.strip()}" and lines[1] == "any=true"


def test_github_matrix_keeps_only_the_cells_a_vllm_change_affects(tmp_path):
    sessions = _sessions(tmp_path)
    output = tmp_path / "github_output"
    changed = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py docs/x.md"
    result = _cli(
        "github-matrix", str(sessions), "--changed", changed, "--github-output", str(output)
    )
    assert result.returncode == 0, result.stderr
    assert [e["session"] for e in json.loads(result.stdout)["include"]] == [
        "pd-nixl",
        "pd-nixl-cpu",
    ]
    nothing = _cli(
        "github-matrix", str(sessions), "--changed", "docs/x.md", "--github-output", str(output)
    )
    assert json.loads(nothing.stdout) == {"include": []}
    assert output.read_text().splitlines()[-1] == "any=false"  # the cell job is skipped, not broken


def test_nox_session_writes_the_pipeline(tmp_path):
    """`nox -s pipeline -- github --output FILE` for real: the tool runs in the harness env."""
    path = tmp_path / "workflow.yml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nox",
            "-f",
            str(ROOT / "noxfile.py"),
            "-s",
            "pipeline",
            "--",
            "github",
            "--output",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("GLM5_")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert check_jsonschema("github", path).returncode == 0
    refused = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "pipeline"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "say which" in refused.stderr
