"""The `glm5-matrix` command as a user meets it (the real CLI in a child process): --version, an
unknown option, a command without its action, an older Python, and every subcommand given a
missing file, a folder or a binary file where it wants the other: each one line, exit 2, and
nothing created."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scaffold import SRC, environ_without, run_cli

import glm5_matrix


def _cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = environ_without()
    environ.update(env)
    return run_cli(*args, env=environ, timeout=120, cwd=cwd)


def test_version_is_the_package_version():
    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"glm5-matrix {glm5_matrix.__version__}"


def test_an_unknown_option_is_argparses_line_not_a_missing_command():
    done = _cli("--frobnicate")
    assert done.returncode == 2
    assert (
        done.stderr.splitlines()[-1] == "glm5-matrix: error: unrecognized arguments: --frobnicate"
    )
    assert "COMMAND" not in done.stderr.splitlines()[-1]
    bare = _cli()
    assert bare.returncode == 2 and "name a COMMAND" in bare.stderr.splitlines()[-1]


@pytest.mark.parametrize("command", ["kernel-cache", "guards"])
def test_a_command_of_actions_asks_for_one(command):
    done = _cli(command)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"glm5-matrix {command}: error: name an ACTION (glm5-matrix {command} --help lists them)"
    )
    unknown = _cli(command, "--frobnicate")
    assert unknown.returncode == 2 and "unrecognized arguments: --frobnicate" in unknown.stderr


def test_the_python_line_names_the_python_the_need_and_the_uv_command():
    line = glm5_matrix.python_too_old("uvx --python 3.11 ...", (3, 10, 13))
    assert "\n" not in line
    assert "needs Python >= 3.11" in line and "this is Python 3.10.13" in line
    assert line.endswith("uvx --python 3.11 ...")
    assert glm5_matrix.python_too_old("x", (3, 11, 0)) == ""
    assert glm5_matrix.python_too_old("x", (3, 13, 1)) == ""


def _python_310() -> str | None:
    """A Python 3.10 interpreter of this machine (on PATH, pyenv's, or one uv knows), or None."""
    candidates = [shutil.which("python3.10")]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if Path(uv).is_file():
        done = subprocess.run(
            [uv, "python", "find", "--no-python-downloads", "3.10"], capture_output=True, text=True
        )
        candidates.append(done.stdout.strip() if done.returncode == 0 else None)
    for found in filter(None, candidates):
        version = subprocess.run(
            [found, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        )
        if version.stdout.strip() == "(3, 10)":
            return found
    return None


def test_python_310_gets_one_line_from_the_cli_and_from_the_noxfile(tmp_path):
    """Before any import of tomllib: the CLI's entry point, and the noxfile as nox executes it
    (nox itself runs on 3.10; the noxfile is run here the way nox runs it, as a module)."""
    python = _python_310()
    if python is None:
        pytest.skip("no Python 3.10 on this machine (uv python find 3.10 found none)")
    env = {**environ_without(), "PYTHONPATH": str(SRC)}
    cli = subprocess.run(
        [python, "-m", "glm5_matrix.cli", "report", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert cli.returncode == 2
    assert cli.stdout == "" and cli.stderr.count("\n") == 1, cli.stderr
    assert "needs Python >= 3.11" in cli.stderr and "this is Python 3.10" in cli.stderr
    assert "uvx --python 3.11 --from" in cli.stderr and "glm5-matrix report --help" in cli.stderr
    noxfile = SRC.parent / "noxfile.py"
    run = f"import runpy, sys; sys.argv = ['nox', '-l']; runpy.run_path({str(noxfile)!r})"
    nox = subprocess.run(
        [python, "-c", run], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert nox.returncode == 1
    assert nox.stderr.count("\n") == 1 and "Traceback" not in nox.stderr, nox.stderr
    assert "uvx --python 3.11 --from 'nox>=2026.8' nox -l" in nox.stderr


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# Each subcommand given a missing path, a folder or a binary file where it wants another.
BAD_INPUTS = {
    "prune: missing": (["prune", "{missing}", "{out}/dst"], "SRC directory not found"),
    "prune: binary": (["prune", "{binary}", "{out}/dst"], "SRC is a file, not a checkpoint"),
    "prune: folder": (["prune", "{folder}", "{out}/dst"], "no config.json"),
    "verify: missing": (["verify", "{missing}"], "checkpoint directory not found"),
    "verify: binary": (["verify", "{binary}"], "a file, not a checkpoint directory"),
    "verify: folder": (["verify", "{folder}"], "no config.json"),
    "layout: missing": (["layout", "--tp", "1", "--config", "{missing}"], "not found"),
    "layout: folder": (["layout", "--tp", "1", "--config", "{folder}"], "config.json: not found"),
    "layout: binary": (["layout", "--tp", "1", "--config", "{binary}"], "not UTF-8 text"),
    "report: missing": (["report", "{missing}"], "results folder not found"),
    "report: binary": (["report", "{binary}"], "{binary}: not a folder"),
    "report: output is a file": (
        ["report", "{folder}", "--output", "{binary}"],
        "--output names the folder",
    ),
    "pipeline: missing": (["pipeline", "github-matrix", "{missing}"], "not nox's session list"),
    "pipeline: folder": (["pipeline", "github-matrix", "{folder}"], "not nox's session list"),
    "pipeline: binary": (["pipeline", "github-matrix", "{binary}"], "not nox's session list"),
    "pipeline: output is a folder": (
        ["pipeline", "buildkite", "--output", "{folder}"],
        "--output names the file",
    ),
    "kernel-cache import: missing": (
        ["kernel-cache", "import", "{missing}"],
        "kernel cache archive not found",
    ),
    "kernel-cache import: folder": (
        ["kernel-cache", "import", "{folder}"],
        "a folder, not a kernel cache archive",
    ),
    "kernel-cache import: binary": (
        ["kernel-cache", "import", "{binary}"],
        "not a readable kernel cache archive",
    ),
    "kernel-cache export: nothing to export": (
        ["kernel-cache", "export", "{out}/k.tar.gz"],
        "no kernel cache here to export",
    ),
    "kernel-cache narrow-deps: missing": (
        ["kernel-cache", "narrow-deps", "{missing}", "--keep", "/x"],
        "folder not found",
    ),
    "kernel-cache narrow-deps: binary": (
        ["kernel-cache", "narrow-deps", "{binary}", "--keep", "/x"],
        "folder not found",
    ),
    "guards record: missing": (["guards", "record", "{missing}"], "no executed-vllm.json"),
    "guards record: binary": (["guards", "record", "{binary}"], "no executed-vllm.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_line_and_creates_nothing(tmp_path, case):
    args, expected = BAD_INPUTS[case]
    work = tmp_path / "work"
    (work / "a-folder").mkdir(parents=True)
    (work / "binary").write_bytes(bytes(range(256)) * 16)
    places = {
        "missing": str(work / "nonexistent"),
        "folder": str(work / "a-folder"),
        "binary": str(work / "binary"),
        "out": str(work / "out-nonexistent"),
    }
    before = _tree(tmp_path)
    done = _cli(
        *(a.format(**places) for a in args),
        cwd=work,
        GLM5_MATRIX_KERNEL_CACHE=str(tmp_path / "kernel-cache"),
        GLM5_MATRIX_RESULTS=str(tmp_path / "results"),
        GLM5_MATRIX_GPUS="",
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert expected.format(**places) in done.stderr, done.stderr
    assert _tree(tmp_path) == before, "a refused command created something"


def test_the_checkout_is_found_from_the_working_directory(tmp_path):
    """A `glm5-matrix` installed with `pip install .` is not imported from the checkout: it
    finds the checkout's matrix.toml from the working directory up, and says so in one line
    where there is none."""
    from glm5_matrix import files

    copy = tmp_path / "copy"
    shutil.copytree(SRC / "glm5_matrix", copy / "site" / "glm5_matrix")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from glm5_matrix import files; "
        "from glm5_matrix.errors import UserError\n"
        "try:\n    print(files.repo_root())\nexcept UserError as exc:\n    print('error:', exc)"
    )
    checkout = tmp_path / "checkout"
    (checkout / "sub").mkdir(parents=True)
    (checkout / files.MATRIX_FILE).write_text("")
    env = environ_without()
    found = subprocess.run(
        [sys.executable, "-c", code, str(copy / "site")],
        capture_output=True,
        text=True,
        cwd=checkout / "sub",
        env=env,
    )
    assert found.stdout.strip() == str(checkout), found.stderr
    nowhere = subprocess.run(
        [sys.executable, "-c", code, str(copy / "site")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert nowhere.stdout.startswith(
        f"error: no glm5-matrix checkout here: no matrix.toml in {tmp_path}"
    )
    assert "GLM5_MATRIX_ROOT" in nowhere.stdout
    given = subprocess.run(
        [sys.executable, "-c", code, str(copy / "site")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "GLM5_MATRIX_ROOT": str(checkout)},
    )
    assert given.stdout.strip() == str(checkout)
