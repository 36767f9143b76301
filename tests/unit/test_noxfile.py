"""The noxfile as users drive it: listing, skips, strict mode and bad input, through real nox."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from scaffold import environ_without, nox_installed, run_nox

from glm5_matrix.files import repo_root

ROOT = repo_root()
pytestmark = nox_installed


_RESULTS: list[Path] = []


@pytest.fixture(autouse=True)
def _results_elsewhere(tmp_path: Path):
    """Cells the tests run write their results (a preflight skip's too) into a temporary folder,
    never into the checkout's results/, which the report of a real run reads."""
    _RESULTS.append(tmp_path / "results")
    yield
    _RESULTS.pop()


def nox(*args: str, root: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    environ = environ_without()
    environ["GLM5_MATRIX_RESULTS"] = str(_RESULTS[-1])
    environ.update(env)
    return run_nox(root, args, environ, timeout=120)


def test_json_listing_has_every_cell_with_tags():
    result = nox("-l", "--json")
    assert result.returncode == 0, result.stderr
    listing = {entry["session"]: entry for entry in json.loads(result.stdout)}
    for name in ("e2e-tp1(deep_gemm)", "e2e-tp4(flashinfer)", "offload-tp1(offloading)"):
        assert "gpu" in listing[name]["tags"]
    assert "gpus-2" in listing["pd-nixl"]["tags"]
    for name in ("e2e-cpu", "pd-nixl-cpu", "layout", "metadata", "unit", "lint", "faults"):
        assert "cpu" in listing[name]["tags"], name
    assert all(entry["description"] for entry in listing.values())


def test_listing_opens_with_what_it_is_and_marks_what_a_bare_nox_runs():
    """`nox -l` prints the noxfile's docstring first: a short description for users (the
    developers' notes are a comment). Its marks say what a bare `nox` runs: `* plan`, every
    other session `-`; `-l --json` still lists every session."""
    result = nox("-l")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("glm5-matrix: the test matrix for GLM-5.3-Flash on vLLM.")
    intro = result.stdout[: result.stdout.index("Sessions defined in")]
    assert len(intro.strip().splitlines()) <= 10
    assert "Thin on purpose" not in result.stdout and "venv_backend" not in result.stdout
    marked = [line for line in lines if line[:2] in ("* ", "- ")]
    assert [line for line in marked if line.startswith("* ")] == [
        next(line for line in marked if line.startswith("* plan "))
    ]
    listing = json.loads(nox("-l", "--json").stdout)
    assert len(marked) == len(listing) >= 31
    # each description is one whole sentence, not a docstring's first line cut mid-way
    assert all(
        entry["description"].rstrip().endswith((".", ")"))
        for entry in listing
        if "meta" in entry["tags"]
    ), [entry["description"] for entry in listing if "meta" in entry["tags"]]


def test_a_tool_sessions_help_and_bad_arguments_build_nothing(tmp_path):
    """`nox -s report -- --help` built the 225 MB harness environment before it printed the
    help. The tool sessions parse their arguments with the CLI's own parser, and check their
    inputs, in nox's process first: help, an unknown option, a missing results folder and a
    binary session list are answered without building anything."""
    venvs = tmp_path / "venvs"
    binary = tmp_path / "sessions.json"
    binary.write_bytes(bytes(range(256)))
    helped = nox("-s", "report", "--", "--help", GLM5_MATRIX_VENVS=str(venvs))
    assert helped.returncode == 0, helped.stderr
    assert "usage: glm5-matrix report" in helped.stdout
    for args, expected in (
        (
            ("report", "--", "--frobnicate"),
            "glm5-matrix: error: unrecognized arguments: --frobnicate",
        ),
        (("report", "--", str(tmp_path / "none")), "results folder not found"),
        (("pipeline", "--", "github-matrix", str(binary)), "not nox's session list"),
        (("pipeline", "--", "gitlab"), "invalid choice: 'gitlab'"),
    ):
        result = nox("-s", *args, GLM5_MATRIX_VENVS=str(venvs))
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if "aborted" in line]
        assert len(errors) == 1 and expected in errors[0], result.stderr
        assert "Traceback" not in result.stderr
    assert not venvs.exists(), "a tool session built its environment before checking its input"


def test_bare_nox_only_prints_the_plan():
    result = nox(GLM5_MATRIX_GPUS="")
    assert result.returncode == 0, result.stderr
    assert "Running session plan" in result.stderr
    assert "skips e2e-tp1(deep_gemm)" in result.stderr
    assert "Running session e2e" not in result.stderr


def test_gpu_cell_without_gpu_skips_with_reason():
    result = nox("-s", "e2e-tp1", GLM5_MATRIX_GPUS="")
    assert result.returncode == 0, result.stderr
    for backend in ("deep_gemm", "flashinfer"):
        assert f"Session e2e-tp1({backend}) skipped: e2e-tp1 needs 1 GPU(s)" in result.stderr
    assert "found no GPU (GLM5_MATRIX_GPUS='')" in result.stderr
    # The skip is recorded, so that a report says why rather than "not run".
    record = json.loads((_RESULTS[-1] / "e2e-tp1-flashinfer" / "results.json").read_text())
    assert record["skipped"].startswith("e2e-tp1 needs 1 GPU(s) with compute capability >= 9.0")
    assert record["cell"]["id"] == "e2e-tp1(flashinfer)" and record["tests"] == {}


def test_strict_mode_fails_without_the_hardware():
    result = nox("-s", "pd-nixl", GLM5_MATRIX_GPUS="9.0", GLM5_MATRIX_STRICT="1")
    assert result.returncode != 0
    assert "pd-nixl needs 2 GPU(s) with compute capability >= 9.0; found 1 GPU(s)" in result.stderr


def test_unknown_cell_fails():
    result = nox("-s", "e2e-tp3")
    assert result.returncode != 0
    assert "e2e-tp3" in result.stderr


def test_missing_checkpoint_is_an_error_not_a_fallback(tmp_path):
    result = nox(
        "-s", "e2e-tp1(deep_gemm)", GLM5_MATRIX_GPUS="", GLM5_PRUNED_MODEL=str(tmp_path / "no")
    )
    assert result.returncode != 0
    assert (
        "GLM5_PRUNED_MODEL=" in result.stderr and "checkpoint directory not found" in result.stderr
    )


def test_a_drafter_that_is_not_one_is_one_line_before_any_build(tmp_path):
    venvs = tmp_path / "venvs"
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for folder, expected in (
        (tmp_path / "missing", "no DFlash2 drafter there (no config.json)"),
        (tmp_path / "llama", "architectures ['LlamaForCausalLM'] is not ['DFlash2DraftModel']"),
    ):
        result = nox(
            "-s",
            "dflash-tp1",
            GLM5_MATRIX_GPUS="",  # refused even where the cell would skip for want of a GPU
            GLM5_DFLASH2_DRAFT=str(folder),
            GLM5_MATRIX_VENVS=str(venvs),
        )
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if "GLM5_DFLASH2_DRAFT=" in line]
        assert len(errors) == 1 and expected in errors[0], result.stderr
        assert "Traceback" not in result.stderr
    assert not venvs.exists()


def test_override_to_a_missing_wheel_fails_before_building(tmp_path):
    venvs = tmp_path / "venvs"
    result = nox(
        "-s",
        "e2e-cpu",
        GLM5_MATRIX_VLLM=str(tmp_path / "vllm-9.9.9.whl"),
        GLM5_MATRIX_VENVS=str(venvs),
    )
    assert result.returncode != 0
    assert "wheel file not found" in result.stderr
    assert not venvs.exists()


def test_malformed_matrix_is_one_line(tmp_path):
    for name in ("noxfile.py", "envs", "constraints", "profiles", "src"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    text = (ROOT / "matrix.toml").read_text().replace("gpus = 2\n", 'gpus = "two"\n', 1)
    (tmp_path / "matrix.toml").write_text(text)
    result = nox("-l", root=tmp_path, GLM5_MATRIX_ROOT=str(tmp_path))
    assert result.returncode != 0
    assert (
        "glm5-matrix: error: "
        f"{tmp_path / 'matrix.toml'}: cells.e2e-tp2.gpus: must be an integer, not a string ('two')"
    ) in result.stderr.splitlines()


def test_a_malformed_gpus_variable_is_one_line_before_any_session():
    """GLM5_MATRIX_GPUS=abc was a traceback out of the plan session (issue 49)."""
    result = nox(GLM5_MATRIX_GPUS="abc")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "glm5-matrix: error: GLM5_MATRIX_GPUS='abc': 'abc' is not a compute capability like 9.0"
    ]
    assert "Traceback" not in result.stdout + result.stderr


def test_unreachable_torch_index_is_one_line_before_building(tmp_path):
    """A fresh machine: pip configured with nothing, PyTorch's index out of reach (here a
    loopback port that refuses connections stands in for it)."""
    for name in ("noxfile.py", "matrix.toml", "constraints", "profiles", "src"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    with socket.socket() as closed:  # bound, never listening
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/whl/cpu"
        shutil.copytree(ROOT / "envs", tmp_path / "envs")
        cpu = tmp_path / "envs" / "cpu.toml"
        cpu.write_text(cpu.read_text().replace("https://download.pytorch.org/whl/cpu", url))
        environ = environ_without("GLM5_", "PIP_")
        environ.update(
            PIP_CONFIG_FILE=os.devnull,
            HOME=str(tmp_path / "home"),
            UV_HTTP_RETRIES="0",
            GLM5_MATRIX_ROOT=str(tmp_path),
            GLM5_MATRIX_VENVS=str(tmp_path / "venvs"),
            GLM5_MATRIX_RESULTS=str(tmp_path / "results"),
        )
        result = run_nox(tmp_path, ("-s", "e2e-cpu"), environ, timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "PyTorch's CPU index" in line]
    assert len(lines) == 1, result.stderr
    assert f"could not get it from PyTorch's CPU index {url}" in lines[0]
    assert "GLM5_MATRIX_TORCH_SOURCE" in lines[0]
    assert "Failed to read" not in result.stderr and "uv venv" not in result.stderr
    assert not (tmp_path / "venvs").exists()


def test_warm_without_cells_or_tags_is_one_line():
    result = nox("-s", "warm")
    assert result.returncode != 0
    assert "name the cells to warm, or tags: nox -s warm -- -t gpu" in result.stderr


def test_warm_skips_what_this_box_cannot_run(tmp_path):
    result = nox(
        "-s", "warm", "--", "-t", "gpu", GLM5_MATRIX_GPUS="", GLM5_MATRIX_RESULTS=str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert "warm: skips e2e-tp1 needs 1 GPU(s)" in result.stderr
    assert "Session warm skipped: nothing to warm on this machine" in result.stderr
    strict = nox("-s", "warm", "--", "offload-tp1", GLM5_MATRIX_GPUS="", GLM5_MATRIX_STRICT="1")
    assert strict.returncode != 0
    assert "offload-tp1 needs 1 GPU(s)" in strict.stderr and "GLM5_MATRIX_STRICT" in strict.stderr


def test_a_kernel_archive_for_another_gpu_is_refused_before_the_suites(tmp_path):
    """The layout cell in an interpreter given as is (nothing built): its kernel cache key is
    this interpreter's with no GPU, so an archive built for sm90 is refused in one line."""
    sys.path.insert(0, str(ROOT / "src"))
    from glm5_matrix.kernels import kernel_archive, kernel_cache

    key = {**kernel_cache.interpreter_versions(), "gpu_arch": "sm90"}
    source = kernel_cache.prepare(
        kernel_cache.layout(key, {kernel_cache.ROOT_VARIABLE: str(tmp_path / "k")})
    )
    archive = tmp_path / "sm90.tar.gz"
    kernel_archive.export_archive(source, archive)
    result = nox(
        "-s",
        "layout",
        "--",
        "--kernel-archive",
        str(archive),
        GLM5_MATRIX_PYTHON=sys.executable,
        GLM5_MATRIX_GPUS="",
        GLM5_MATRIX_KERNEL_CACHE=str(tmp_path / "k"),
        GLM5_MATRIX_RESULTS=str(tmp_path / "results"),
    )
    assert result.returncode != 0
    assert "gpu_arch sm90 != cpu" in result.stderr and "refused" in result.stderr
    assert "-m pytest" not in result.stderr  # refused before the suites
    # The control: an archive for this very interpreter and box is imported, and the cell goes on.
    fitting = tmp_path / "cpu.tar.gz"
    kernel_archive.export_archive(
        kernel_cache.prepare(
            kernel_cache.layout(
                {**key, "gpu_arch": "cpu"}, {kernel_cache.ROOT_VARIABLE: str(tmp_path / "k")}
            )
        ),
        fitting,
    )
    result = nox(
        "-s",
        "layout",
        "--",
        "--kernel-archive",
        str(fitting),
        "--co",
        GLM5_MATRIX_PYTHON=sys.executable,
        GLM5_MATRIX_GPUS="",
        GLM5_MATRIX_KERNEL_CACHE=str(tmp_path / "k"),
        GLM5_MATRIX_RESULTS=str(tmp_path / "results"),
    )
    assert "kernel cache: imported" in result.stderr and "-m pytest" in result.stderr


def test_noxfile_needs_the_nox_the_readme_installs():
    """nox.needs_version makes an older nox refuse the file in one line; it must ask for the nox
    the README's commands install (`nox -j` needs 2026.08)."""
    import re

    declared = re.search(
        r'^nox\.needs_version = "(.+)"$', (repo_root() / "noxfile.py").read_text(), re.M
    )
    assert declared, "noxfile.py declares no nox.needs_version"
    readme = (repo_root() / "README.md").read_text()
    installed = set(re.findall(r'(?:pip install|uvx .*--from) "nox(>=[0-9.]+)"', readme))
    assert installed, "the README installs no nox"
    assert installed == {declared.group(1)}, (installed, declared.group(1))


@pytest.mark.parametrize("cell", ["layout", "metadata"])
def test_a_profile_typo_is_one_line_before_anything_is_built(tmp_path, cell):
    """Cells whose suite reads no weights (layout, metadata, noise, dflash) had their profile
    loaded only inside pytest, after their environment was built. A vLLM wheel that is not
    there stands in for the build: it is refused only after the profile, never before."""
    for name in ("noxfile.py", "matrix.toml", "envs", "constraints", "profiles", "src"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    profile = tmp_path / "profiles" / "glm-5.3-flash-4l" / "profile.toml"
    profile.write_text(profile.read_text() + "\n[prompt]\nmax_tokens = 3\n")
    venvs = tmp_path / "venvs"
    result = nox(
        "-s",
        cell,
        root=tmp_path,
        GLM5_MATRIX_ROOT=str(tmp_path),
        GLM5_MATRIX_VENVS=str(venvs),
        GLM5_MATRIX_VLLM=str(tmp_path / "vllm-9.9.9.whl"),
    )
    assert result.returncode != 0
    lines = [
        line
        for line in result.stderr.splitlines()
        if "prompt: unknown key; did you mean 'prompts'?" in line
    ]
    assert len(lines) == 1, result.stderr
    assert str(profile) in lines[0]
    assert "wheel file not found" not in result.stderr
    assert not venvs.exists()


def test_install_only_builds_the_environment_and_runs_nothing(tmp_path):
    """`nox --install-only` (how a pipeline builds environments ahead of the runs): the cell's
    environment is built through nox's install step and nothing else happens, no command run
    and no results folder touched. Before, the build ran through session.run, which nox skips
    under --install-only, and the runner then wrote its fingerprint into a venv never made."""
    venvs, results = tmp_path / "venvs", Path(_RESULTS[-1])
    result = nox("--install-only", "-s", "lint", GLM5_MATRIX_VENVS=str(venvs))
    assert result.returncode == 0, result.stderr
    assert "(--install-only: no tests run)" in result.stderr
    assert (venvs / "lint" / "bin" / "python").is_file()
    assert (venvs / "lint" / ".glm5-matrix-env.json").is_file()
    assert "ruff check" not in result.stderr
    assert not results.exists()
