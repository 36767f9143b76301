"""Cell environments: definitions in envs/NAME.toml, pinned by constraints/NAME.txt, built as
isolated uv virtualenvs.

Every cell gets its own venv; cells of one definition share packages through uv's cache
(hard links), so a rebuild from a warm cache takes seconds. A venv whose fingerprint
(definition, constraints, vLLM override, interpreter) is unchanged is reused as it is.

Which vLLM is tested can be overridden per run (GLM5_MATRIX_VLLM or `-- --vllm=...`): a version,
a wheel file, or a local source checkout. GLM5_MATRIX_PYTHON names an interpreter that already
holds the environment (an offline bundle on an air-gapped runner): nothing is built then.

uv reads a definition's requirements as a generated pyproject.toml, so that a torch PyPI does not
carry (`[torch_index]`) is pinned to the one source glm5_matrix.envs.torch_source chooses; that choice
is made, and checked with uv, before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.envs import torch_source
from glm5_matrix.envs.torch_source import TorchPin, TorchSource
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root, write_atomic

ENVS_DIR = "envs"
CONSTRAINTS_DIR = "constraints"
VLLM_VARIABLE = "GLM5_MATRIX_VLLM"
PYTHON_VARIABLE = "GLM5_MATRIX_PYTHON"
FINGERPRINT_FILE = ".glm5-matrix-env.json"
# Where the cells' (and the harness tools') venvs are built: this folder, else .nox/ of the checkout.
VENVS_VARIABLE = "GLM5_MATRIX_VENVS"
DEFAULT_PYTHON = "3.11"
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
    torch: TorchPin | None = None  # the exact torch and the index serving it ([torch_index])
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


def _requirement(text: str) -> str | None:
    try:
        requirement_name(text)
    except ValueError as exc:
        return str(exc)
    return None


def _torch_pinned(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if "torch_index" in data and not _exact_torch(data.get("requirements", [])):
        yield "torch_index", "needs an exact torch requirement (torch==VERSION)"


_REQUIREMENT = Spec("str", nonempty=True, check=_requirement, check_says="a requirement")
ENV = contracts.table(
    {
        "description": Spec("str", "what the environment is for", required=True),
        "python": Spec(
            "str", f"the interpreter version uv installs ({DEFAULT_PYTHON} where unset)"
        ),
        "vllm": Spec("str", "the vLLM under test, e.g. vllm==0.33.0", check=_requirement),
        "requirements": contracts.strings("what else it installs", item=_REQUIREMENT),
        "excludes": contracts.strings("requirements uv leaves out", item=_REQUIREMENT),
        "find_links": contracts.strings("uv --find-links folders (those present)"),
        "index_urls": contracts.strings("extra package indexes"),
        "torch_index": contracts.table(
            {
                "url": Spec("str", "the index", required=True, nonempty=True),
                "name": Spec("str", "its name for uv", required=True, nonempty=True),
            },
            "where the exact torch comes from (glm5_matrix.envs.torch_source)",
        ),
        "environment": contracts.entries(Spec("str"), "variables set in the environment"),
    },
    "envs/NAME.toml: a cell environment",
    rules=(_torch_pinned,),
    rules_say=("torch_index needs an exact torch requirement (torch==VERSION).",),
)


def _exact_torch(requirements: list[str]) -> list[str]:
    return [r for r in requirements if requirement_name(r) == "torch" and "==" in r]


def load_env(path: Path) -> EnvDefinition:
    """Read one envs/NAME.toml (ENV); a defect is a UserError naming the file and the key."""
    data = contracts.read(path, ENV, "environment definition")
    lists = {
        key: tuple(data.get(key, ()))
        for key in ("requirements", "excludes", "find_links", "index_urls")
    }
    return EnvDefinition(
        name=path.stem,
        path=path,
        description=data["description"],
        python=data.get("python"),
        vllm=data.get("vllm"),
        torch=_torch_pin(path, data),
        environment=dict(data.get("environment", {})),
        **lists,
    )


def _torch_pin(path: Path, data: dict[str, Any]) -> TorchPin | None:
    """[torch_index] url = ..., name = ...: where the definition's exact torch comes from."""
    table = data.get("torch_index")
    if table is None:
        return None
    return TorchPin(
        requirement=_exact_torch(data["requirements"])[0].replace(" ", ""),
        python=data.get("python") or DEFAULT_PYTHON,
        index_url=table["url"].rstrip("/"),
        index_name=table["name"],
        definition=f"{ENVS_DIR}/{path.name}",
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
    torch: TorchSource | None = None  # where torch came from, for a build that pinned it

    def describe(self) -> str:
        if self.venv is None:
            return f"interpreter {self.python} (from {PYTHON_VARIABLE}; nothing built)"
        built = f"{'reused' if self.reused else 'built'} {self.venv}"
        return f"{built}, torch from {self.torch.describe()}" if self.torch else built


def uv_executable() -> str:
    found = shutil.which("uv")
    if found is None:
        raise UserError("uv is not on PATH (pip install uv)")
    return found


def torch_source_for(env: EnvDefinition, environ: dict[str, str]) -> TorchSource | None:
    """Where this build takes torch from (None: wherever uv's indexes have it); a source that
    cannot serve the pinned torch is a UserError here, before anything is built."""
    if env.torch is None:
        return None
    probe = torch_source.uv_probe(env.torch, uv_executable(), environ)
    return torch_source.resolve(env.torch, environ, probe)


def install_command(
    env: EnvDefinition,
    python: Path,
    constraints: Path | None,
    override: VllmOverride | None,
    scratch: Path,
    torch: TorchSource | None = None,
) -> list[str]:
    """The `uv pip install` command for a venv; the files it reads are written to `scratch`,
    which must outlive the command."""
    command = [uv_executable(), "pip", "install", "--python", str(python)]
    if constraints is not None:
        command += ["--constraints", str(constraints)]
    command += _resolution_options(env, scratch)
    vllm = [env.vllm] if env.vllm and override is None else []
    command += ["--requirements", str(_project(env, scratch, [*env.requirements, *vllm], torch))]
    if override is not None:
        command += (
            ["--editable", override.requirement] if override.editable else [override.requirement]
        )
    return command


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


def venvs_base(environ: Mapping[str, str]) -> Path:
    """The folder the venvs are built in, one folder each (GLM5_MATRIX_VENVS, else .nox/)."""
    return Path(environ.get(VENVS_VARIABLE) or repo_root() / ".nox")


def is_current(venv: Path, wanted: dict[str, Any]) -> bool:
    """Whether the venv at `venv` was built to the fingerprint `wanted` (fingerprint()) and
    still has its interpreter: then it is reused as it is."""
    try:
        built = json.loads((venv / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return built == wanted and (venv / "bin" / "python").is_file()


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
    if is_current(venv, wanted):
        return BuiltEnv(python, venv / "bin", venv, True, variables)
    marker = venv / FINGERPRINT_FILE
    torch = torch_source_for(env, environ)
    marker.unlink(missing_ok=True)
    create = [uv_executable(), "venv", "--clear", "--quiet", str(venv)]
    if env.python:
        create += ["--python", env.python]
    run(create)
    constraints = constraints_for(env, override, venv)
    with tempfile.TemporaryDirectory(prefix="glm5-matrix-") as scratch:
        run(install_command(env, python, constraints, override, Path(scratch), torch))
    write_atomic(marker, json.dumps(wanted, indent=2, sort_keys=True))
    return BuiltEnv(python, venv / "bin", venv, False, variables, torch)


def lock_command(
    env: EnvDefinition, output: Path, scratch: Path, torch: TorchSource | None = None
) -> list[str]:
    """`uv pip compile` of the definition into `output` (the caller renames it into place); the
    files it reads are written to `scratch`."""
    requirements = [*env.requirements, *([env.vllm] if env.vllm else [])]
    command = [
        uv_executable(),
        "pip",
        "compile",
        "--quiet",
        "--no-header",
        "--python-platform",
        "x86_64-manylinux_2_28",
        "--python-version",
        env.python or DEFAULT_PYTHON,
        "--output-file",
        str(output),
        str(_project(env, scratch, requirements, torch)),
    ]
    return command + _resolution_options(env, scratch)


def lock(env: EnvDefinition, run: Any = None, environ: dict[str, str] | None = None) -> Path:
    """Refresh constraints/NAME.txt, written next to it and renamed into place. Pins that still
    fit the definition are kept (uv prefers the versions of the file it writes); delete the file
    to resolve afresh. The pins name no source: they are the same whichever folder or index
    served torch."""
    environ = dict(os.environ) if environ is None else environ
    run = run or _run
    torch = torch_source_for(env, environ)
    with tempfile.TemporaryDirectory(prefix="glm5-matrix-") as scratch:
        output = Path(scratch) / "constraints.txt"
        if env.constraints_path.is_file():  # uv keeps the pins of the file it writes where they fit
            shutil.copyfile(env.constraints_path, output)
        run(lock_command(env, output, Path(scratch), torch))
        # uv names the generated project's path in its `# via` lines; name the definition.
        pins = output.read_text().replace(str(Path(scratch) / "pyproject.toml"), _definition(env))
    header = (
        f"# Pins for {_definition(env)}, compiled by `nox -s lock` (uv pip compile).\n"
        "# Do not edit by hand: change the definition and re-lock.\n"
    )
    target = env.constraints_path
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, header + pins)
    return target


def _definition(env: EnvDefinition) -> str:
    return f"{ENVS_DIR}/{env.name}.toml"


def _project(
    env: EnvDefinition, scratch: Path, requirements: list[str], torch: TorchSource | None
) -> Path:
    """The requirements as the pyproject.toml uv reads (its name shows in uv's `# via` lines)."""
    return torch_source.write_project(scratch, f"glm5-matrix-{env.name}", requirements, torch)


def _resolution_options(env: EnvDefinition, scratch: Path) -> list[str]:
    """What install and compile share: excluded packages (through a file in `scratch`) and the
    definition's extra sources; a local find-links folder that does not exist is left out."""
    options: list[str] = []
    if env.excludes:
        excludes = scratch / "excludes.txt"
        excludes.write_text("\n".join(env.excludes) + "\n")
        options += ["--excludes", str(excludes)]
    for link in env.find_links:
        if "://" in link or Path(link).expanduser().is_dir():
            options += ["--find-links", link]
    for url in env.index_urls:
        options += ["--extra-index-url", url]
    return options


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True)
