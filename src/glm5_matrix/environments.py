"""Cell environments: definitions in envs/NAME.toml, pinned by constraints/NAME.txt, built as
isolated uv virtualenvs.

Every cell gets its own venv; cells of one definition share packages through uv's cache
(hard links), so a rebuild from a warm cache takes seconds. A venv whose fingerprint
(definition, constraints, vLLM override, interpreter) is unchanged is reused as it is.

Which vLLM is tested can be overridden per run (GLM5_MATRIX_VLLM or `-- --vllm=...`): a version,
a wheel file, or a local source checkout. GLM5_MATRIX_PYTHON names an interpreter that already
holds the environment (an offline bundle on an air-gapped runner): nothing is built then.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError, load_toml

ENVS_DIR = "envs"
CONSTRAINTS_DIR = "constraints"
VLLM_VARIABLE = "GLM5_MATRIX_VLLM"
PYTHON_VARIABLE = "GLM5_MATRIX_PYTHON"
FINGERPRINT_FILE = ".glm5-matrix-env.json"
_FIELDS = {
    "description": str,
    "python": str,
    "vllm": str,
    "requirements": list,
    "excludes": list,
    "find_links": list,
    "index_urls": list,
    "environment": dict,
}
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class EnvDefinition:
    name: str
    path: Path
    description: str
    python: str | None = None
    vllm: str | None = None  # the requirement of the vLLM under test, e.g. "vllm==0.33.0"
    requirements: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    index_urls: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def constraints_path(self) -> Path:
        return self.path.parent.parent / CONSTRAINTS_DIR / f"{self.name}.txt"

    @property
    def vllm_distribution(self) -> str | None:
        return requirement_name(self.vllm) if self.vllm else None


def requirement_name(requirement: str) -> str:
    match = _REQUIREMENT_NAME.match(requirement)
    if not match:
        raise ValueError(f"{requirement!r} is not a requirement")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def load_env(path: Path) -> EnvDefinition:
    """Read one envs/NAME.toml; a defect is a UserError naming the file and the field."""
    data = load_toml(path, "environment definition")
    for key, value in data.items():
        expected = _FIELDS.get(key)
        if expected is None:
            raise UserError(f"{path}: {key}: unknown field (known: {', '.join(_FIELDS)})")
        if not isinstance(value, expected):
            raise UserError(f"{path}: {key}: expected {expected.__name__}, got {value!r}")
    if "description" not in data:
        raise UserError(f"{path}: description: missing")
    lists = {}
    for key in ("requirements", "excludes", "find_links", "index_urls"):
        values = data.get(key, [])
        if not all(isinstance(v, str) and v.strip() for v in values):
            raise UserError(f"{path}: {key}: expected a list of non-empty strings")
        lists[key] = tuple(values)
    for requirement in (*lists["requirements"], *lists["excludes"], data.get("vllm", "x")):
        try:
            requirement_name(requirement)
        except ValueError as exc:
            raise UserError(f"{path}: {exc}") from None
    environment = data.get("environment", {})
    for key, value in environment.items():
        if not isinstance(value, str):
            raise UserError(f"{path}: environment.{key}: values are strings, got {value!r}")
    return EnvDefinition(
        name=path.stem,
        path=path,
        description=data["description"],
        python=data.get("python"),
        vllm=data.get("vllm"),
        environment=dict(environment),
        **lists,
    )


def load_envs(root: Path) -> dict[str, EnvDefinition]:
    return {path.stem: load_env(path) for path in sorted((root / ENVS_DIR).glob("*.toml"))}


# --- which vLLM -----------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmOverride:
    """A vLLM other than the definition's: `requirement` is what uv installs."""

    spec: str
    requirement: str
    editable: bool = False

    def fingerprint(self) -> str:
        path = Path(self.requirement)
        if path.is_file():
            stat = path.stat()
            return f"{self.requirement}:{stat.st_size}:{stat.st_mtime_ns}"
        return self.requirement


def resolve_vllm_override(spec: str | None, env: EnvDefinition) -> VllmOverride | None:
    """Turn `0.33.1`, `/path/vllm-*.whl` or `/path/to/vllm-checkout` into what uv installs."""
    if not spec:
        return None
    if env.vllm_distribution is None:
        raise UserError(
            f"environment {env.name!r} installs no vLLM; {VLLM_VARIABLE} does not apply"
        )
    if re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", spec):
        return VllmOverride(spec, f"{env.vllm_distribution}=={spec}")
    path = Path(spec).expanduser()
    if spec.endswith(".whl"):
        if not path.is_file():
            raise UserError(f"{VLLM_VARIABLE}={spec}: wheel file not found")
        return VllmOverride(spec, str(path.resolve()))
    if path.is_dir():
        if not any((path / name).is_file() for name in ("pyproject.toml", "setup.py")):
            raise UserError(
                f"{VLLM_VARIABLE}={spec}: not a vLLM source checkout (no pyproject.toml)"
            )
        return VllmOverride(spec, str(path.resolve()), editable=True)
    if "/" in spec or spec.startswith("."):
        raise UserError(f"{VLLM_VARIABLE}={spec}: no such wheel file or source checkout")
    raise UserError(f"{VLLM_VARIABLE}={spec}: expected a version, a .whl file or a source checkout")


# --- building --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltEnv:
    python: Path
    bin_dir: Path | None  # prepended to PATH; None for an interpreter given by the user
    venv: Path | None
    reused: bool
    environment: dict[str, str]

    def describe(self) -> str:
        if self.venv is None:
            return f"interpreter {self.python} (from {PYTHON_VARIABLE}; nothing built)"
        return f"{'reused' if self.reused else 'built'} {self.venv}"


def uv_executable() -> str:
    found = shutil.which("uv")
    if found is None:
        raise UserError("uv is not on PATH (pip install uv)")
    return found


def install_command(
    env: EnvDefinition, python: Path, constraints: Path | None, override: VllmOverride | None
) -> tuple[list[str], list[Path]]:
    """The `uv pip install` command for a venv, and the temporary files it reads."""
    command = [uv_executable(), "pip", "install", "--python", str(python)]
    if constraints is not None:
        command += ["--constraints", str(constraints)]
    sources, temporary = _resolution_options(env)
    command += sources
    command += list(env.requirements)
    if override is not None:
        command += (
            ["--editable", override.requirement] if override.editable else [override.requirement]
        )
    elif env.vllm:
        command.append(env.vllm)
    return command, temporary


def constraints_for(env: EnvDefinition, override: VllmOverride | None, venv: Path) -> Path | None:
    """The pins to install with; with a vLLM override, the vLLM pin itself is dropped."""
    path = env.constraints_path
    if not path.is_file():
        return None
    if override is None:
        return path
    name = env.vllm_distribution
    kept = [
        line
        for line in path.read_text().splitlines()
        if not (line.strip() and not line.lstrip().startswith("#") and _line_name(line) == name)
    ]
    filtered = venv.parent / f".{venv.name}.constraints.txt"
    filtered.parent.mkdir(parents=True, exist_ok=True)
    filtered.write_text("\n".join(kept) + "\n")
    return filtered


def _line_name(line: str) -> str | None:
    try:
        return requirement_name(line)
    except ValueError:
        return None


def fingerprint(env: EnvDefinition, override: VllmOverride | None) -> dict[str, Any]:
    constraints = env.constraints_path.read_text() if env.constraints_path.is_file() else ""
    return {
        "definition": hashlib.sha256(env.path.read_bytes()).hexdigest(),
        "constraints": hashlib.sha256(constraints.encode()).hexdigest(),
        "vllm": override.fingerprint() if override else env.vllm,
        "excludes_applied": list(env.excludes),
    }


def build(
    env: EnvDefinition,
    venv: Path,
    override: VllmOverride | None = None,
    run: Any = None,
    environ: dict[str, str] | None = None,
) -> BuiltEnv:
    """Build (or reuse) the venv for `env` at `venv`. `run(cmd)` runs a command (nox's
    session.run in sessions, subprocess in scripts)."""
    environ = dict(os.environ) if environ is None else environ
    run = run or _run
    variables = dict(env.environment)
    given = environ.get(PYTHON_VARIABLE)
    if given:
        python = Path(given)
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise UserError(f"{PYTHON_VARIABLE}={given}: not an executable interpreter")
        return BuiltEnv(python, None, None, True, variables)
    python = venv / "bin" / "python"
    wanted = fingerprint(env, override)
    marker = venv / FINGERPRINT_FILE
    if python.is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == wanted:
                return BuiltEnv(python, venv / "bin", venv, True, variables)
        except json.JSONDecodeError:
            pass
    marker.unlink(missing_ok=True)
    create = [uv_executable(), "venv", "--clear", "--quiet", str(venv)]
    if env.python:
        create += ["--python", env.python]
    run(create)
    command, temporary = install_command(
        env, python, constraints_for(env, override, venv), override
    )
    try:
        run(command)
    finally:
        for path in temporary:
            path.unlink(missing_ok=True)
    _write_atomic(marker, json.dumps(wanted, indent=2, sort_keys=True))
    return BuiltEnv(python, venv / "bin", venv, False, variables)


def lock_command(env: EnvDefinition, output: Path) -> tuple[list[str], list[Path]]:
    """`uv pip compile` of the definition into `output` (the caller renames it into place)."""
    requirements = [*env.requirements, *([env.vllm] if env.vllm else [])]
    inputs = _write_lines(requirements, suffix=".in")
    command = [
        uv_executable(),
        "pip",
        "compile",
        "--quiet",
        "--no-header",
        "--python-platform",
        "x86_64-manylinux_2_28",
        "--python-version",
        env.python or "3.11",
        "--output-file",
        str(output),
        str(inputs),
    ]
    sources, temporary = _resolution_options(env)
    return command + sources, [inputs, *temporary]


def lock(env: EnvDefinition, run: Any = None) -> Path:
    """Refresh constraints/NAME.txt; written next to the target and renamed into place."""
    run = run or _run
    target = env.constraints_path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    command, temporary = lock_command(env, tmp)
    try:
        run(command)
        header = (
            f"# Pins for envs/{env.name}.toml, compiled by `nox -s lock` (uv pip compile).\n"
            "# Do not edit by hand: change the definition and re-lock.\n"
        )
        tmp.write_text(header + tmp.read_text())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        for path in temporary:
            path.unlink(missing_ok=True)
    return target


def _resolution_options(env: EnvDefinition) -> tuple[list[str], list[Path]]:
    """What install and compile share: excluded packages and where packages come from; the
    excludes go through a temporary file, returned for the caller to remove."""
    options: list[str] = []
    temporary: list[Path] = []
    if env.excludes:
        temporary.append(_write_lines(env.excludes))
        options += ["--excludes", str(temporary[-1])]
    for link in env.find_links:
        options += ["--find-links", link]
    for url in env.index_urls:
        options += ["--extra-index-url", url]
    return options, temporary


def _write_lines(lines: tuple[str, ...] | list[str], suffix: str = ".txt") -> Path:
    with tempfile.NamedTemporaryFile(
        "w", suffix=suffix, prefix="glm5-matrix-", delete=False
    ) as handle:
        handle.write("\n".join(lines) + "\n")
    return Path(handle.name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True)
