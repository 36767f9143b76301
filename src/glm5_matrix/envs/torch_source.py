"""Where an environment's torch comes from when PyPI does not carry the build it pins.

torch's CPU builds (`torch==2.13.0+cpu`) live on PyTorch's own index, not on PyPI. A definition
that needs one names that index (`[torch_index]` in envs/cpu.toml) and pins torch exactly. The
source used is, first match wins:

1. GLM5_MATRIX_TORCH_SOURCE: a folder of wheels, a folder laid out as a simple index
   (torch/index.html), or an index URL (https://, http://, file://);
2. a source pip on this machine is configured with (`pip config list`: find-links, index-url,
   extra-index-url, including PIP_* variables) that holds the pinned torch, so a machine without
   access to PyTorch's index still builds; local folders that do not exist are skipped;
3. the index the definition names.

A source counts only once uv itself has resolved the pinned torch from it (`uv_probe`), so an
unreachable index is one line before any environment is built, never a long uv failure halfway
through one. uv then takes torch, and only torch, from that source: the requirements reach uv as
a pyproject.toml whose [tool.uv.sources] pins torch to one explicit index (uv's documented way
of pinning a package to an index); every other package comes from uv's default index. The pins
in constraints/ are the same whichever source serves the wheel.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from glm5_matrix.errors import UserError

VARIABLE = "GLM5_MATRIX_TORCH_SOURCE"
UV_INDEX_NAME = "glm5-matrix-torch"  # the name of the explicit index in the project uv reads
# pip's settings that name where packages come from, most specific scope first; True: a flat
# folder or page of wheels (find-links), False: a simple index.
_PIP_SCOPES = (":env:", "install", "global")
_PIP_KEYS = (("find-links", True), ("index-url", False), ("extra-index-url", False))
_URL = re.compile(r"^(https?|file)://", re.IGNORECASE)


@dataclass(frozen=True)
class TorchPin:
    """What a definition asks for: one exact torch, and the index that serves it."""

    requirement: str  # "torch==2.13.0+cpu"
    python: str  # the environment's Python, e.g. "3.11"
    index_url: str
    index_name: str  # what messages call the index: "PyTorch's CPU index"
    definition: str  # "envs/cpu.toml"


@dataclass(frozen=True)
class TorchSource:
    """One place uv can take torch from."""

    url: str  # an absolute folder (flat) or an index URL, as uv reads it
    flat: bool  # a folder or page of wheels rather than a simple index
    label: str  # "wheel folder", "index", "PyTorch's CPU index"
    origin: str  # who named it: the variable, a pip setting, or the definition

    def describe(self) -> str:
        return f"{self.label} {self.url} ({self.origin})"

    def uv_tables(self) -> str:
        """The pyproject tables that pin torch to this source and to nothing else."""
        lines = [
            "[tool.uv.sources]",
            f"torch = {{ index = {json.dumps(UV_INDEX_NAME)} }}",
            "",
            "[[tool.uv.index]]",
            f"name = {json.dumps(UV_INDEX_NAME)}",
            f"url = {json.dumps(self.url)}",
            "explicit = true",
        ]
        if self.flat:
            lines.append('format = "flat"')
        return "\n".join(lines) + "\n"


# A probe answers None when uv resolves the pinned torch from a source, else one line saying why
# not.
Probe = Callable[[TorchSource], str | None]


def write_project(
    directory: Path, name: str, requirements: list[str], torch: TorchSource | None
) -> Path:
    """The requirements as a pyproject.toml for `uv pip install -r` / `uv pip compile`, with
    torch pinned to `torch` when given."""
    path = directory / "pyproject.toml"
    text = (
        "[project]\n"
        f"name = {json.dumps(name)}\n"
        'version = "0"\n'
        f"dependencies = {json.dumps(requirements)}\n"
    )
    if torch is not None:
        text += "\n" + torch.uv_tables()
    path.write_text(text)
    return path


def resolve(
    pin: TorchPin,
    environ: Mapping[str, str],
    probe: Probe,
    pip_config: Mapping[str, str] | None = None,
) -> TorchSource:
    """The source to install `pin` from (see the module docstring), or a UserError."""
    given = environ.get(VARIABLE, "").strip()
    if given:
        source = from_variable(given)
        problem = probe(source)
        if problem:
            raise UserError(f"{VARIABLE}={given}: no {pin.requirement} from there ({problem})")
        return source
    config = pip_configuration(environ) if pip_config is None else pip_config
    for candidate in pip_sources(config):
        if probe(candidate) is None:
            return candidate
    default = TorchSource(pin.index_url, False, pin.index_name, pin.definition)
    problem = probe(default)
    if problem:
        raise UserError(
            f"{pin.requirement}: could not get it from {pin.index_name} {pin.index_url} "
            f"({problem}); pip on this machine names no source that holds it; set {VARIABLE} "
            "to a folder of wheels or an index that does"
        )
    return default


def from_variable(value: str) -> TorchSource:
    if _URL.match(value):
        return TorchSource(value.rstrip("/"), False, "index", VARIABLE)
    path = Path(value).expanduser()
    if not path.is_dir():
        raise UserError(
            f"{VARIABLE}={value}: no such folder (expected a folder of wheels, a folder laid "
            "out as a simple index, or an index URL)"
        )
    path = path.resolve()
    if (path / "torch").is_dir():
        return TorchSource(path.as_uri(), False, "index", VARIABLE)
    return TorchSource(str(path), True, "wheel folder", VARIABLE)


def pip_configuration(environ: Mapping[str, str]) -> dict[str, str]:
    """`pip config list` as {"global.find-links": "/a /b", ...}; empty where pip is missing.
    The running interpreter's pip first; where it has none (nox run by `uvx`, whose tool
    environment holds no pip), the pip on PATH, which reads the same configuration files and
    PIP_* variables."""
    listed = None
    path = environ.get("PATH")
    commands = [[sys.executable, "-m", "pip"]] + [
        [found] for name in ("pip3", "pip") if (found := shutil.which(name, path=path))
    ]
    for command in commands:
        try:
            listed = subprocess.run(
                [*command, "config", "list"],
                capture_output=True,
                text=True,
                env=dict(environ),
                timeout=60,
                check=True,
            ).stdout
            break
        except (OSError, subprocess.SubprocessError):
            continue
    if listed is None:
        return {}
    config = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            config[key] = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            continue
    return config


def pip_sources(config: Mapping[str, str]) -> list[TorchSource]:
    """The sources pip's configuration names, in the order they are tried; local folders that
    do not exist are left out, so uv never sees them."""
    found: list[TorchSource] = []
    for scope in _PIP_SCOPES:
        for key, flat in _PIP_KEYS:
            for entry in config.get(f"{scope}.{key}", "").split():
                source = _pip_source(entry, flat, f"pip config {scope}.{key}")
                if source is not None and all(source.url != seen.url for seen in found):
                    found.append(source)
    return found


def _pip_source(entry: str, flat: bool, origin: str) -> TorchSource | None:
    if entry.lower().startswith(("http://", "https://")):
        return TorchSource(entry.rstrip("/"), flat, "find-links page" if flat else "index", origin)
    path = Path(url2pathname(urlparse(entry).path)) if _URL.match(entry) else Path(entry)
    path = path.expanduser()
    if not path.is_dir():
        return None
    path = path.resolve()
    if flat:
        return TorchSource(str(path), True, "wheel folder", origin)
    return TorchSource(path.as_uri(), False, "index", origin)


def uv_probe(pin: TorchPin, uv: str, environ: Mapping[str, str]) -> Probe:
    """A probe that asks uv to resolve the pinned torch alone (no dependencies) from a source,
    through the same project tables the install uses."""

    def probe(source: TorchSource) -> str | None:
        with tempfile.TemporaryDirectory(prefix="glm5-matrix-torch-") as scratch:
            project = write_project(
                Path(scratch), "glm5-matrix-torch-probe", [pin.requirement], source
            )
            command = [uv, "pip", "compile", str(project), "--no-deps", "--quiet", "--no-header"]
            command += ["--python-version", pin.python, "--output-file", os.devnull]
            try:
                done = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    env={**environ, "NO_COLOR": "1"},
                    timeout=600,
                )
            except subprocess.TimeoutExpired:
                return "uv did not answer within 600 s"
        if done.returncode == 0:
            return None
        if "there is no version of" in done.stderr or "not found in the package" in done.stderr:
            return f"it holds no {pin.requirement} for Python {pin.python}"
        return _last_cause(done.stderr) or f"uv exited with status {done.returncode}"

    return probe


def _last_cause(stderr: str) -> str:
    """The innermost cause of a uv error: its last line, without the `error:`/`cause:` tag."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return re.sub(r"^(error|cause|warning):\s*", "", lines[-1]) if lines else ""
