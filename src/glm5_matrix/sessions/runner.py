"""Running one cell: preflight, environment, the cell's suites, results.

The noxfile calls run_variant() from every cell session; this is the one helper behind them.
Order matters for GPU minutes and for honest skips: the model source (and a named drafter) and
the hardware are checked before any environment is built. The cell's results folder is emptied
before it starts, and its commands run under glm5_matrix.machine.supervision, which stops everything they
start whatever ends the cell and records how the run ended. A GPU cell leases its GPUs
(glm5_matrix.machine.leases) before its environment is built and holds them until its last process is
gone; its processes see only those GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.kernels import gpu_models, kernel_archive, kernel_cache
from glm5_matrix.machine import hardware, kill_domain, leases, supervision
from glm5_matrix.matrix import context as cell_context
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix
from glm5_matrix.matrix.profiles import load_profile, profile_names
from glm5_matrix.models import drafters, weights
from glm5_matrix.results import closing, executed, schema
from glm5_matrix.sessions import nox_session
from glm5_matrix.sessions.nox_session import NoxSession

VENVS_VARIABLE = "GLM5_MATRIX_VENVS"
# Suites that load model weights; the others read the profile's config only.
WEIGHTS_SUITES = ("e2e", "offload", "pd")


def load(root: Path | None = None) -> Matrix:
    root = root or repo_root()
    return load_matrix(
        root / MATRIX_FILE,
        known_envs=set(environments.load_envs(root)),
        known_profiles=set(profile_names(root)),
    )


@dataclass(frozen=True)
class RunOptions:
    """Our options taken out of the session's posargs; the rest goes to pytest."""

    model: str | None
    vllm: str | None
    pytest_args: tuple[str, ...]
    kernel_archive: str | None = None


def parse_posargs(posargs: list[str], environ: dict[str, str]) -> RunOptions:
    parser = argparse.ArgumentParser(prog="nox -s CELL --", add_help=False)
    parser.add_argument("--model", help="checkpoint directory (else GLM5_PRUNED_MODEL / MODEL)")
    parser.add_argument("--vllm", help="vLLM version, wheel or source checkout to test")
    parser.add_argument("--kernel-archive", help="import this kernel cache archive first")
    known, rest = parser.parse_known_args(posargs)
    return RunOptions(
        model=known.model,
        vllm=known.vllm or environ.get(environments.VLLM_VARIABLE) or None,
        pytest_args=tuple(rest),
        kernel_archive=known.kernel_archive,
    )


def resolve_weights(
    variant: Variant, model: str | None, environ: dict[str, str]
) -> cell_context.Weights:
    """Which weights the cell uses. A checkpoint that was asked for and is unusable is an error,
    never a silent fallback to dummy weights."""
    cell = variant.cell
    if cell.profile is None or cell.suite not in WEIGHTS_SUITES:
        return cell_context.Weights(kind="none", source="the suite reads the config only")
    weights = load_profile(cell.profile).section("weights")
    default = weights.get("default", "dummy")
    candidates = [("--model", model)] + [
        (name, environ.get(name)) for name in weights.get("checkpoint_variables", [])
    ]
    for source, value in candidates:
        if not value:
            continue
        path = Path(value).expanduser()
        if not path.is_dir():
            raise UserError(f"{source}={value}: checkpoint directory not found")
        from glm5_matrix.checkpoints import load_glm_config

        load_glm_config(path)  # raises with one line when it is not a GLM-5.3-Flash checkpoint
        return cell_context.Weights(kind="checkpoint", path=str(path.resolve()), source=source)
    return cell_context.Weights(kind=default, source="profile")


def check_profile(variant: Variant) -> None:
    """The cell's profile, loaded and so checked (profile_schema) before anything is built, for
    every suite: a typo in it is one line here, not a pytest error after the environment."""
    if variant.cell.profile is not None:
        load_profile(variant.cell.profile)


def check_drafter(variant: Variant, environ: dict[str, str]) -> None:
    """A drafter named by GLM5_DFLASH2_DRAFT for a DFlash cell must be one (one line if not)."""
    named = environ.get(drafters.DRAFT_VARIABLE)
    if variant.cell.suite == "dflash" and named and variant.cell.profile is not None:
        drafters.check_named_drafter(load_profile(variant.cell.profile), named)


def empty_results_dir(out: Path) -> None:
    """Nothing of an earlier run may be read back as this one's: the folder starts empty."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def results_dir(variant: Variant, environ: dict[str, str]) -> Path:
    return schema.results_base(environ) / variant.slug


def venv_dir(variant: Variant, environ: dict[str, str]) -> Path:
    base = Path(environ.get(VENVS_VARIABLE) or repo_root() / ".nox")
    return base / variant.slug


def _record_skip(out: Path, variant: Variant, weights: cell_context.Weights, reason: str) -> None:
    """A preflight skip leaves results.json with the reason (before anything is built)."""
    empty_results_dir(out)
    ctx = cell_context.for_variant(variant, weights=weights, results_dir=str(out))
    closing.write_skip(out, asdict(ctx), reason)


def run_variant(
    session: NoxSession,
    variant: Variant,
    *,
    posargs: Sequence[str] | None = None,
    tests: Sequence[str] | None = None,
    out: Path | None = None,
    environment: Mapping[str, str] | None = None,
) -> kernel_cache.KernelCache | None:
    """Everything a cell session does. `session` is a nox.Session. The warm step runs a cell
    with its own `tests` (the warm suite), results folder `out` and extra `environment`.
    Returns the cell's kernel cache (None for a cell that starts no engine)."""
    with supervision.stop_on_signals():
        return _run_variant(session, variant, Call(posargs, tests, out, environment))


@dataclass(frozen=True)
class Call:
    """What the warm step changes of a cell's run (nothing, for a cell session)."""

    posargs: Sequence[str] | None = None
    tests: Sequence[str] | None = None
    out: Path | None = None
    environment: Mapping[str, str] | None = None


def _run_variant(
    session: NoxSession, variant: Variant, call: Call
) -> kernel_cache.KernelCache | None:
    environ = dict(os.environ)
    # The cell's results folder (the warm step gives its own): every record of this run goes
    # there, a skip's and a lease timeout's too.
    out = call.out or results_dir(variant, environ)
    try:
        posargs = session.posargs if call.posargs is None else call.posargs
        options = parse_posargs(list(posargs), environ)
        check_profile(variant)
        if nox_session.install_only(session):
            _install_only(session, variant, environ, options)
            return None
        model_source = resolve_weights(variant, options.model, environ)
        check_drafter(variant, environ)
        found = hardware.detect(environ)
        verdict = hardware.check(variant.cell, found)
        if not verdict.runnable:
            if hardware.strict(environ):
                session.error(f"{verdict.reason} ({hardware.STRICT_VARIABLE} is set)")
            _record_skip(out, variant, model_source, verdict.reason)
            session.skip(verdict.reason)
        lease = take_lease(session, variant, found, environ, out)
    except UserError as exc:
        session.error(str(exc))
    with lease:
        return _run_leased(
            session, variant, environ, out, call, options, model_source, verdict, lease
        )


def check_gpu_models(
    session: NoxSession,
    kernels: kernel_cache.KernelCache,
    here: list[gpu_models.GpuModel],
    cell: str,
) -> None:
    """Before the first engine start, with the kernel guard on: the cache must hold entries
    warmed on the GPU models `here` (gpu_models.check): one line and an error when it records
    others only, a warning when some of its entries' models are unknown."""
    coverage = gpu_models.check(kernels, here, cell)
    if coverage.error:
        session.error(coverage.error)
    if coverage.warning:
        session.warn(coverage.warning)
    session.log(f"kernel cache: GPU models {gpu_models.read(kernels).describe()}")


def _install_only(
    session: NoxSession, variant: Variant, environ: dict[str, str], options: RunOptions
) -> None:
    """`nox --install-only`: the cell's environment built (or found current), and nothing else:
    no lease, no kernel cache, its results folder left as the last run wrote it."""
    env = environments.load_envs(repo_root())[variant.env]
    override = environments.resolve_vllm_override(options.vllm, env)
    built = environments.build(env, venv_dir(variant, environ), override, run=_installer(session))
    session.log(f"environment {variant.env}: {built.describe()} (--install-only: no tests run)")


def _installer(session: NoxSession) -> Callable[[list[str]], object]:
    """How an environment's build commands run: nox's install step, so that --install-only
    runs them (session.run skips every command there)."""
    return lambda cmd: session.run_install(*cmd, external=True)


def take_lease(
    session: NoxSession,
    variant: Variant,
    found: hardware.Hardware,
    environ: dict[str, str],
    out: Path,
) -> leases.Lease:
    """The cell's GPUs and the CPU cores its engines are bound to. A lease that does not come
    within the bound skips the cell (with what held them), like missing hardware, and is an
    error under GLM5_MATRIX_STRICT."""
    try:
        return leases.lease_cell(variant, found, environ, say=session.warn)
    except leases.LeaseTimeout as exc:
        empty_results_dir(out)
        write_json_atomic(out / leases.RECORD_FILE, exc.record)
        if hardware.strict(environ):
            session.error(f"{exc} ({hardware.STRICT_VARIABLE} is set)")
        session.skip(str(exc))
        raise  # not reached: skip() raises


def _run_leased(
    session: NoxSession,
    variant: Variant,
    environ: dict[str, str],
    out: Path,
    call: Call,
    options: RunOptions,
    model_source: cell_context.Weights,
    verdict: hardware.Verdict,
    lease: leases.Lease,
) -> kernel_cache.KernelCache | None:
    environment = call.environment or {}
    try:
        empty_results_dir(out)
        env = environments.load_envs(repo_root())[variant.env]
        override = environments.resolve_vllm_override(options.vllm, env)
        built = environments.build(
            env,
            venv_dir(variant, environ),
            override,
            run=_installer(session),
        )
        cell_environment = {**built.environment, **variant.cell.environment}
        kernels = None
        if variant.cell.tests and variant.cell.profile:
            kernels = kernel_cache.for_interpreter(built.python, {**environ, **cell_environment})
            if options.kernel_archive:
                imported = kernel_archive.import_archive(Path(options.kernel_archive), kernels)
                session.log(f"kernel cache: imported {imported.describe()}")
                for warning in imported.warnings:
                    session.warn(f"kernel cache: {warning}")
    except UserError as exc:
        session.error(str(exc))
    session.log(f"hardware: {verdict.reason}")
    session.log(f"lease: {lease.describe()}")
    session.log(f"weights: {model_source.describe()}")
    session.log(f"environment {variant.env}: {built.describe()}")
    guarded = kernel_cache.guard_enabled({**environ, **environment})
    if kernels is not None:
        session.log(f"kernel cache: {kernels.describe()} (guard {'on' if guarded else 'off'})")
        if guarded and variant.cell.gpus:
            probed = {**environ, **cell_environment, **lease.environment()}
            check_gpu_models(session, kernels, gpu_models.probe(built.python, probed), variant.id)

    if lease.gpus or lease.cores:
        write_json_atomic(out / leases.RECORD_FILE, lease.record())
    ctx = cell_context.for_variant(
        variant,
        weights=model_source,
        results_dir=str(out),
        vllm=override.spec if override else None,
        kernel_guard=guarded,
    )
    ctx = replace(ctx, environment={**cell_environment, **lease.environment()})
    context_file = out / "context.json"
    write_json_atomic(context_file, asdict(ctx))

    run_env = dict(ctx.environment)
    run_env.update(kernels.environment() if kernels is not None else {})
    run_env.update(environment)
    run_env[cell_context.CONTEXT_VARIABLE] = str(context_file)
    run_env["GLM5_MATRIX_ROOT"] = str(repo_root())
    # The suites import the harness from the checkout and vLLM finds our plugin (the random
    # weights load format) through its metadata: nothing of ours is installed in the venv.
    src = str(repo_root() / "src")
    plugin_site = str(weights.write_plugin_site(out / "site"))
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (src, plugin_site, environ.get("PYTHONPATH")) if p
    )
    if built.bin_dir is not None:
        run_env["VIRTUAL_ENV"] = str(built.venv)
        run_env["PATH"] = os.pathsep.join((str(built.bin_dir), environ.get("PATH", "")))
    # Which vLLM files the cell executes (glm5_matrix.results.executed), in every process it starts;
    # a cell without vLLM (the harness's) turns it off for the cells it runs itself (faults).
    records = bool(env.vllm or override) and bool(variant.cell.tests)
    try:
        records = records and executed.enabled(environ, variant.cell.gpus)
    except UserError as exc:
        session.error(str(exc))
    if records:
        run_env.update(executed.configure(out))
    elif not env.vllm and not override:
        run_env[executed.COVERAGE_VARIABLE] = "0"

    cell = variant.cell
    if cell.commands:
        recorded = closing.CommandResults(out, asdict(ctx))
        for program, *arguments in cell.commands:
            # The cell's own tools: looked up on the cell's PATH, not on nox's.
            executable = shutil.which(program, path=run_env.get("PATH"))
            if executable is None:
                session.error(f"{program} is not installed in the {variant.env} environment")
            assert executable is not None  # session.error raised
            with recorded.command([program, *arguments]), cell_domain(session, variant) as held:
                command = supervision.supervised(
                    [executable, *arguments],
                    built.python,
                    domain=held.domain,
                    register=held.register,
                )
                session.run(*command, env=run_env, external=True, **supervision.NOX_TIMEOUTS)
        recorded.write()
        session.log(f"{variant.id}: {closing.summarize(out)}")
        return kernels
    pytest = [
        str(built.python),
        "-m",
        "pytest",
        *(cell.tests if call.tests is None else call.tests),
        "-p",
        "glm5_matrix.results.recorder",
        "-p",
        "glm5_matrix.matrix.known_failures",
        "-p",
        "glm5_matrix.kernels.kernel_guard",
        f"--junitxml={out / schema.JUNIT_FILE}",
        *options.pytest_args,
    ]
    session.log(f"cell context: {context_file}")
    try:
        with cell_domain(session, variant, out) as held:
            command = supervision.supervised(
                pytest,
                built.python,
                results_dir=out,
                gpus=cell.gpus,
                domain=held.domain,
                register=held.register,
            )
            session.run(*command, env=run_env, external=True, **supervision.NOX_TIMEOUTS)
    finally:
        session.log(f"{variant.id}: {closing.summarize(out)}")
    if records:
        record_executed(session, variant, built.python, out, run_env)
    return kernels


def record_executed(
    session: NoxSession, variant: Variant, python: Path, out: Path, run_env: Mapping[str, str]
) -> None:
    """After the tests passed: combine the coverage data of every process, write the executed
    vLLM files into the results folder and fail the cell when its guards miss one. Run with the
    cell's interpreter (coverage is installed there), which itself is not measured."""
    env = {k: v for k, v in run_env.items() if k != "COVERAGE_PROCESS_START"}
    session.run(
        *executed.collect_command(python, out, variant.id, repo_root() / MATRIX_FILE),
        env=env,
        external=True,
    )


@contextlib.contextmanager
def cell_domain(
    session: NoxSession, variant: Variant, out: Path | None = None
) -> Iterator[kill_domain.Held]:
    """The kill domain of one supervised command (glm5_matrix.machine.kill_domain). When the command
    line returns, however it ended, whatever is left in the domain is killed; when that is
    because the supervisor itself died (no record of how the run ended), the record says so."""
    started = time.monotonic()
    try:
        domain = kill_domain.create(variant.slug, os.environ, say=session.warn)
    except UserError as exc:
        session.error(str(exc))
    session.log(f"kill domain: {domain.describe()}")
    held = kill_domain.Held(domain, None)
    try:
        with kill_domain.held(domain) as held:
            yield held
    finally:
        if held.killed:
            session.warn(
                f"kill domain: killed {len(held.killed)} process(es) left when the supervisor ended"
            )
        if out is not None:
            record_domain(out, held, time.monotonic() - started)


def record_domain(out: Path, state: kill_domain.Held, seconds: float) -> None:
    """results.json after the runner stopped the domain: where the supervisor recorded how the
    run ended, what the runner killed after it; where it did not (it was killed, or died), an
    ending that says so."""
    data = schema.load(out)
    recorded = data is not None and data.get("exit_status") is not None
    stopped = {
        **state.domain.record(),
        "stopped_by": "supervisor" if recorded else "runner",
        "killed": len(state.killed),
    }
    if recorded:
        assert data is not None
        if not state.killed:
            return
        stopped["killed_by_runner"] = len(state.killed)
        stopped["killed"] = (data.get("kill_domain") or {}).get("killed", 0)
        data["kill_domain"] = stopped
        write_json_atomic(out / schema.RESULTS_FILE, data)
        return
    detail = (
        "the supervisor ended without recording how the run ended (it was killed or died); "
        f"the cell's kill domain ({state.domain.mechanism}) killed {len(state.killed)} "
        "process(es) left"
    )
    closing.record_ending(
        out,
        schema.ending("process-died", detail),
        1,
        seconds,
        [f"pid {pid} killed with the cell's kill domain" for pid in state.killed],
        junit=out / schema.JUNIT_FILE,
        kill_domain=stopped,
    )
