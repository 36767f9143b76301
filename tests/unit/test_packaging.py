"""The project as `pip install .` (here uv's pip) gives it to a user: a fresh venv holding only
the project and what pyproject declares, its `glm5-matrix` command run from inside a checkout
(the installed package is not the checkout's src/) for every subcommand and its --help; and
the [test] extra, which must be enough to collect the unit tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import results_tree
import synthetic_checkpoint
from scaffold import ROOT, environ_without

INSTALL_TIMEOUT_S = 600


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(found).is_file() and shutil.which(found) is None:
        pytest.fail("uv is not installed (the [test] extra and the harness environment hold it)")
    return found


def _environ() -> dict[str, str]:
    """This process's environment without the harness's variables or a PYTHONPATH: the venv's
    own packages only."""
    return {k: v for k, v in environ_without().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _venv(folder: Path, requirement: str) -> Path:
    """A fresh venv at `folder` (this interpreter's Python) with `requirement` installed."""
    uv, env = _uv(), _environ()
    for command in (
        [uv, "venv", "--quiet", "--python", sys.executable, str(folder)],
        [uv, "pip", "install", "--quiet", "--python", str(folder / "bin" / "python"), requirement],
    ):
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S
        )
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr[-2000:]}"
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the project installed from the checkout, as a wheel (not editable)."""
    return _venv(tmp_path_factory.mktemp("installed") / "venv", str(ROOT))


def _run(venv: Path, *args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "glm5-matrix"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**_environ(), **env},
        timeout=300,
    )


def _commands(venv: Path) -> list[list[str]]:
    """Every command and action the installed `glm5-matrix --help` lists."""
    code = (
        "import argparse, json; from glm5_matrix.cli import build_parser\n"
        "def subs(p):\n"
        "    return [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]\n"
        "out = []\n"
        "for name, sub in subs(build_parser())[0].choices.items():\n"
        "    out.append([name])\n"
        "    for action in subs(sub):\n"
        "        out += [[name, a] for a in action.choices]\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=_environ()
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_installed_package_is_not_the_checkouts(installed):
    done = subprocess.run(
        [
            str(installed / "bin" / "python"),
            "-c",
            "import glm5_matrix; print(glm5_matrix.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_environ(),
    )
    assert "site-packages" in done.stdout and str(ROOT / "src") not in done.stdout


def test_every_command_answers_help_and_version(installed):
    commands = _commands(installed)
    assert ["report"] in commands and ["kernel-cache", "import"] in commands
    assert len(commands) >= 14
    for command in commands:
        done = _run(installed, *command, "--help")
        assert done.returncode == 0, (command, done.stderr)
        assert done.stdout.startswith(f"usage: glm5-matrix {' '.join(command)}"), command
    version = _run(installed, "--version")
    assert version.returncode == 0 and version.stdout.startswith("glm5-matrix 0.")


def test_every_command_works_from_inside_a_checkout(installed, tmp_path, matrix):
    """What each command imports is installed: the report (junitparser), the pipelines (PyYAML,
    check-jsonschema), the layout, the guards, the kernel cache, the pruner and verifier."""
    results = results_tree.build(tmp_path / "results", tmp_path / "work", matrix)
    runs = {
        "report": ["report", str(results), "--output", str(tmp_path / "report")],
        "pipeline buildkite": ["pipeline", "buildkite", "--output", str(tmp_path / "bk.yml")],
        "pipeline github": ["pipeline", "github", "--output", str(tmp_path / "gh.yml")],
        "pipeline check": ["pipeline", "check"],
        "affected": ["affected", "vllm/v1/core/kv_cache_utils.py"],
        "guards check": ["guards", "check"],
        "layout": ["layout", "--profile", "glm-5.3-flash-4l", "--tp", "1"],
        "kernel-cache show": ["kernel-cache", "show", "--python", str(installed / "bin/python")],
    }
    source = tmp_path / "full"
    synthetic_checkpoint.write_checkpoint(source, synthetic_checkpoint.full_config("text"))
    runs["prune"] = ["prune", str(source), str(tmp_path / "pruned"), "--layers", "4"]
    runs["verify"] = ["verify", str(tmp_path / "pruned")]
    for name, args in runs.items():
        done = _run(installed, *args, GLM5_MATRIX_KERNEL_CACHE=str(tmp_path / "kernels"))
        assert "ModuleNotFoundError" not in done.stderr, (name, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (name, done.stderr[-2000:])
        assert done.returncode == 0, (name, done.stderr[-2000:])
    assert (tmp_path / "report" / "report.html").is_file()


def test_outside_a_checkout_the_command_says_so_in_one_line(installed, tmp_path):
    done = _run(installed, "affected", "vllm/x.py", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no glm5-matrix checkout here" in done.stderr


def test_the_test_extra_collects_the_unit_tests(tmp_path):
    """pip install '.[test]' and pytest collect every unit test (two modules errored before:
    junitparser and PyYAML were in no extra)."""
    venv = _venv(tmp_path / "venv", f"{ROOT}[test]")
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "--collect-only", "-q", "tests/unit"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_environ(),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-3000:]
    assert "could not import" not in done.stdout
