"""Running one cell: a plan, then a list of short steps (as nox runs its own sessions).

The noxfile calls run_variant() from every cell session; this is the one helper behind them.
Preflight reads and checks, once, everything the run depends on and freezes it in a CellPlan: its
options, profile, environment definition, weights and hardware verdict. That happens before any
environment is built, which matters for GPU minutes and for honest skips: the model source (and a
named drafter) and the hardware are checked first, and a cell whose hardware is missing is
skipped there with a record of why. Then the steps, each reading the plan: lease (a GPU cell
leases its GPUs, glm5_matrix.machine.leases, and holds them until its last process is gone; its
processes see only those), build (its environment and kernel cache, its results folder emptied
first), context (what its processes read), run (its commands or its suites, under
glm5_matrix.machine.supervision, which stops everything they start whatever ends the cell and
records how the run ended) and record (which vLLM files it executed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.kernels import (
    flashinfer_aot,
    gpu_models,
    kernel_archive,
    kernel_cache,
    kernel_guard,
)
from glm5_matrix.machine import hardware, kill_domain, leases, supervision
from glm5_matrix.matrix import context as cell_context
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix
from glm5_matrix.matrix.profiles import Profile, load_profile, profile_names
from glm5_matrix.models import drafters, weights
from glm5_matrix.results import closing, executed, schema
from glm5_matrix.sessions import nox_session
from glm5_matrix.sessions.nox_session import NoxSession

# Suites that load model weights; the others read the profile's config only.
WEIGHTS_SUITES = ("e2e", "offload", "pd")
# The harness's pytest plugins every suite runs with: the results, the known failures, the guard.
PLUGINS = (
    "glm5_matrix.results.recorder",
    "glm5_matrix.matrix.known_failures",
    "glm5_matrix.kernels.kernel_guard",
)


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


def parse_posargs(posargs: list[str], environ: Mapping[str, str]) -> RunOptions:
    parser = argparse.ArgumentParser(prog="nox -s CELL --", add_help=False)
    parser.add_argument("--model", help="checkpoint directory (else GLM5_PRUNED_MODEL)")
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
    variant: Variant, profile: Profile | None, model: str | None, environ: Mapping[str, str]
) -> cell_context.Weights:
    """Which weights the cell uses. A checkpoint that was asked for and is unusable is an error,
    never a silent fallback to dummy weights."""
    if profile is None or variant.cell.suite not in WEIGHTS_SUITES:
        return cell_context.Weights(kind="none", source="the suite reads the config only")
    weights = profile.section("weights")
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


# Variables that other tools set for a model of their own (a bare MODEL is common in CI
# environments): never read as the checkpoint, unless a profile lists one in its [weights]
# checkpoint_variables, the documented opt-in (docs/configuration.md). A run says it left one
# unread, so that nobody takes its random weights for their checkpoint.
FOREIGN_MODEL_VARIABLES = ("MODEL",)


def unread_model_variables(
    variant: Variant, profile: Profile | None, environ: Mapping[str, str]
) -> str:
    """A line naming the set FOREIGN_MODEL_VARIABLES the profile does not read, or an empty one."""
    if profile is None or variant.cell.suite not in WEIGHTS_SUITES:
        return ""
    listed = profile.section("weights").get("checkpoint_variables", [])
    unread = [name for name in FOREIGN_MODEL_VARIABLES if environ.get(name) and name not in listed]
    if not unread:
        return ""
    given = ", ".join(f"{name}={environ[name]}" for name in unread)
    read = " or ".join([*listed, "-- --model"])
    return f"weights: {given} is not read as the checkpoint (it is named by {read})"


def check_drafter(variant: Variant, profile: Profile | None, environ: Mapping[str, str]) -> None:
    """A drafter named by GLM5_DFLASH2_DRAFT for a DFlash cell must be one (one line if not)."""
    named = environ.get(drafters.DRAFT_VARIABLE)
    if variant.cell.suite == "dflash" and named and profile is not None:
        drafters.check_named_drafter(profile, named)


def empty_results_dir(out: Path) -> None:
    """Nothing of an earlier run may be read back as this one's: the folder starts empty."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def results_dir(variant: Variant, environ: Mapping[str, str]) -> Path:
    return schema.results_base(environ) / variant.slug


def venv_dir(variant: Variant, environ: Mapping[str, str]) -> Path:
    return environments.venvs_base(environ) / variant.slug


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


@dataclass(frozen=True)
class CellPlan:
    """One run of a cell as preflight read and checked it, before anything is leased or built.
    The steps after preflight read it; none changes it or reads these again."""

    variant: Variant
    # The results folder (the warm step gives its own): every record of this run goes there, a
    # skip's and a lease timeout's too.
    out: Path
    venv: Path
    environ: Mapping[str, str]  # this process's environment as the cell began
    options: RunOptions
    tests: tuple[str, ...]  # what pytest runs: the cell's tests, or the warm step's
    environment: Mapping[str, str]  # what the caller adds for the cell's processes (warm)
    definition: environments.EnvDefinition
    profile: Profile | None
    weights: cell_context.Weights
    found: hardware.Hardware
    verdict: hardware.Verdict
    kernel_guard: bool  # the kernel guard of this run (glm5_matrix.kernels.kernel_guard)


@dataclass(frozen=True)
class Built:
    """What the build step made for the plan."""

    env: environments.BuiltEnv
    override: environments.VllmOverride | None
    variables: dict[str, str]  # the environment definition's variables, then the cell's
    kernels: kernel_cache.KernelCache | None  # None for a cell that starts no engine


def _run_variant(
    session: NoxSession, variant: Variant, call: Call
) -> kernel_cache.KernelCache | None:
    plan = preflight(session, variant, call)
    if plan is None:
        return None  # --install-only: the environment is built, nothing else
    with take_lease(session, plan) as lease:
        built = build(session, plan)
        log_setup(session, plan, lease, built)
        if plan.kernel_guard and plan.variant.cell.gpus and built.kernels is not None:
            probed = {**plan.environ, **built.variables, **lease.environment()}
            here = gpu_models.probe(built.env.python, probed)
            check_gpu_models(session, built.kernels, here, plan.variant.id)
        context = write_context(plan, lease, built)
        run_env, records = run_environment(session, plan, built, context)
        if variant.cell.commands:
            run_commands(session, plan, built, run_env, context)
        else:
            run_tests(session, plan, built, run_env)
            if records:
                record_executed(session, plan, built.env.python, run_env)
        return built.kernels


def preflight(session: NoxSession, variant: Variant, call: Call) -> CellPlan | None:
    """The plan of this run, or None under `nox --install-only` once the environment is built.
    Bad input is one line here, before anything is built; a cell whose hardware is missing is
    skipped here (an error under GLM5_MATRIX_STRICT). The profile is loaded, and so checked
    (profile_schema), for every suite: a typo in it is one line here, not a pytest error after
    the environment."""
    environ = dict(os.environ)
    out = call.out or results_dir(variant, environ)
    try:
        posargs = session.posargs if call.posargs is None else call.posargs
        options = parse_posargs(list(posargs), environ)
        profile = load_profile(variant.cell.profile) if variant.cell.profile is not None else None
        definition = environments.load_envs(repo_root())[variant.env]
        if nox_session.install_only(session):
            _install_only(session, variant, definition, venv_dir(variant, environ), options)
            return None
        weights = resolve_weights(variant, profile, options.model, environ)
        unread = unread_model_variables(variant, profile, environ)
        if unread:
            session.warn(unread)
        check_drafter(variant, profile, environ)
        found = hardware.detect(environ)
        verdict = hardware.check(variant.cell, found)
    except UserError as exc:
        session.error(str(exc))
    plan = CellPlan(
        variant=variant,
        out=out,
        venv=venv_dir(variant, environ),
        environ=environ,
        options=options,
        tests=variant.cell.tests if call.tests is None else tuple(call.tests),
        environment=dict(call.environment or {}),
        definition=definition,
        profile=profile,
        weights=weights,
        found=found,
        verdict=verdict,
        kernel_guard=kernel_guard.guard_enabled({**environ, **(call.environment or {})}),
    )
    if not verdict.runnable:
        skip(session, plan, verdict.reason)
    return plan


def skip(session: NoxSession, plan: CellPlan, reason: str) -> NoReturn:
    """A preflight skip leaves results.json with the reason (before anything is built)."""
    if hardware.strict(dict(plan.environ)):
        session.error(f"{reason} ({hardware.STRICT_VARIABLE} is set)")
    empty_results_dir(plan.out)
    context = cell_context.for_variant(
        plan.variant, weights=plan.weights, results_dir=str(plan.out)
    )
    closing.write_skip(plan.out, asdict(context), reason)
    session.skip(reason)


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
    session: NoxSession,
    variant: Variant,
    definition: environments.EnvDefinition,
    venv: Path,
    options: RunOptions,
) -> None:
    """`nox --install-only`: the cell's environment built (or found current), and nothing else:
    no lease, no kernel cache, its results folder left as the last run wrote it."""
    override = environments.resolve_vllm_override(options.vllm, definition)
    built = environments.build(definition, venv, override, run=_installer(session))
    session.log(f"environment {variant.env}: {built.describe()} (--install-only: no tests run)")


def _installer(session: NoxSession) -> Callable[[list[str]], object]:
    """How an environment's build commands run: nox's install step, so that --install-only
    runs them (session.run skips every command there)."""
    return lambda cmd: session.run_install(*cmd, external=True)


# --- the steps ----------------------------------------------------------------------------------


def take_lease(session: NoxSession, plan: CellPlan) -> leases.Lease:
    """The cell's GPUs and the CPU cores its engines are bound to. A lease that does not come
    within the bound skips the cell (with what held them), like missing hardware, and is an
    error under GLM5_MATRIX_STRICT."""
    environ = dict(plan.environ)
    try:
        return leases.lease_cell(plan.variant, plan.found, environ, say=session.warn)
    except leases.LeaseTimeout as exc:
        empty_results_dir(plan.out)
        write_json_atomic(plan.out / leases.RECORD_FILE, exc.record)
        if hardware.strict(environ):
            session.error(f"{exc} ({hardware.STRICT_VARIABLE} is set)")
        session.skip(str(exc))
    except UserError as exc:
        session.error(str(exc))


def build(session: NoxSession, plan: CellPlan) -> Built:
    """The results folder emptied, the cell's environment built (or found current) with the
    vLLM the run asked for, and the kernel cache of a cell that starts engines laid out, an
    archive the run names imported into it."""
    cell = plan.variant.cell
    try:
        empty_results_dir(plan.out)
        override = environments.resolve_vllm_override(plan.options.vllm, plan.definition)
        built = environments.build(plan.definition, plan.venv, override, run=_installer(session))
        variables = {**built.environment, **cell.environment}
        kernels = None
        if cell.tests and cell.profile:
            kernels = kernel_cache.for_interpreter(built.python, {**plan.environ, **variables})
            if plan.options.kernel_archive:
                archive = Path(plan.options.kernel_archive)
                imported = kernel_archive.import_archive(archive, kernels)
                session.log(f"kernel cache: imported {imported.describe()}")
                for warning in imported.warnings:
                    session.warn(f"kernel cache: {warning}")
    except UserError as exc:
        session.error(str(exc))
    return Built(built, override, variables, kernels)


def log_setup(session: NoxSession, plan: CellPlan, lease: leases.Lease, built: Built) -> None:
    session.log(f"hardware: {plan.verdict.reason}")
    session.log(f"lease: {lease.describe()}")
    session.log(f"weights: {plan.weights.describe()}")
    session.log(f"environment {plan.variant.env}: {built.env.describe()}")
    if built.kernels is not None:
        guard = "on" if plan.kernel_guard else "off"
        session.log(f"kernel cache: {built.kernels.describe()} (guard {guard})")


def write_context(plan: CellPlan, lease: leases.Lease, built: Built) -> cell_context.CellContext:
    """The lease record (of a cell that holds GPUs or cores) and the cell's context, which its
    suites and every process they start read (GLM5_MATRIX_CONTEXT), into the results folder."""
    if lease.gpus or lease.cores:
        write_json_atomic(plan.out / leases.RECORD_FILE, lease.record())
    context = cell_context.for_variant(
        plan.variant,
        weights=plan.weights,
        results_dir=str(plan.out),
        vllm=built.override.spec if built.override else None,
        kernel_guard=plan.kernel_guard,
        environment={**built.variables, **lease.environment()},
    )
    write_json_atomic(plan.out / schema.CONTEXT_FILE, asdict(context))
    return context


def run_environment(
    session: NoxSession, plan: CellPlan, built: Built, context: cell_context.CellContext
) -> tuple[dict[str, str], bool]:
    """The environment of the cell's processes, and whether they record which vLLM files they
    execute (glm5_matrix.results.executed): a cell without vLLM (the harness's) turns that off
    for the cells it runs itself (faults)."""
    run_env = dict(context.environment)
    run_env.update(built.kernels.environment() if built.kernels is not None else {})
    run_env.update(plan.environment)
    run_env[cell_context.CONTEXT_VARIABLE] = str(plan.out / schema.CONTEXT_FILE)
    run_env["GLM5_MATRIX_ROOT"] = str(repo_root())
    # The suites import the harness from the checkout and vLLM finds our plugin (the random
    # weights load format) through its metadata: nothing of ours is installed in the venv.
    src = str(repo_root() / "src")
    plugin_site = str(weights.write_plugin_site(plan.out / "site"))
    if built.kernels is not None:
        # FlashInfer modules built ahead of time in the key folder, listed to FlashInfer.
        listed = flashinfer_aot.activate(
            built.kernels, built.env.python, {**plan.environ, **built.variables}, plan.out / "site"
        )
        if listed:
            session.log(f"kernel cache: {listed}")
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (src, plugin_site, plan.environ.get("PYTHONPATH")) if p
    )
    if built.env.bin_dir is not None:
        run_env["VIRTUAL_ENV"] = str(built.env.venv)
        run_env["PATH"] = os.pathsep.join((str(built.env.bin_dir), plan.environ.get("PATH", "")))
    has_vllm = bool(plan.definition.vllm or built.override)
    records = has_vllm and bool(plan.variant.cell.tests)
    try:
        records = records and executed.enabled(plan.environ, plan.variant.cell.gpus)
    except UserError as exc:
        session.error(str(exc))
    if records:
        run_env.update(executed.configure(plan.out))
    elif not has_vllm:
        run_env[executed.COVERAGE_VARIABLE] = "0"
    return run_env, records


def run_commands(
    session: NoxSession,
    plan: CellPlan,
    built: Built,
    run_env: Mapping[str, str],
    context: cell_context.CellContext,
) -> None:
    """A cell of commands (lint): each under the supervisor, results.json one entry each."""
    recorded = closing.CommandResults(plan.out, asdict(context))
    for program, *arguments in plan.variant.cell.commands:
        # The cell's own tools: looked up on the cell's PATH, not on nox's.
        executable = shutil.which(program, path=run_env.get("PATH"))
        if executable is None:
            session.error(f"{program} is not installed in the {plan.variant.env} environment")
        with recorded.command([program, *arguments]), cell_domain(session, plan.variant) as held:
            command = supervision.supervised(
                [executable, *arguments],
                built.env.python,
                domain=held.domain,
                register=held.register,
            )
            session.run(*command, env=run_env, external=True, **supervision.NOX_TIMEOUTS)
    recorded.write()
    session.log(f"{plan.variant.id}: {closing.summarize(plan.out)}")


def run_tests(
    session: NoxSession, plan: CellPlan, built: Built, run_env: Mapping[str, str]
) -> None:
    """The cell's suites: pytest with the harness's plugins, under the supervisor."""
    pytest = [
        str(built.env.python),
        "-m",
        "pytest",
        *plan.tests,
        *(option for plugin in PLUGINS for option in ("-p", plugin)),
        f"--junitxml={plan.out / schema.JUNIT_FILE}",
        *plan.options.pytest_args,
    ]
    session.log(f"cell context: {plan.out / schema.CONTEXT_FILE}")
    try:
        with cell_domain(session, plan.variant, plan.out) as held:
            command = supervision.supervised(
                pytest,
                built.env.python,
                results_dir=plan.out,
                gpus=plan.variant.cell.gpus,
                domain=held.domain,
                register=held.register,
            )
            session.run(*command, env=run_env, external=True, **supervision.NOX_TIMEOUTS)
    finally:
        session.log(f"{plan.variant.id}: {closing.summarize(plan.out)}")


def record_executed(
    session: NoxSession, plan: CellPlan, python: Path, run_env: Mapping[str, str]
) -> None:
    """After the tests passed: combine the coverage data of every process, write the executed
    vLLM files into the results folder and fail the cell when its guards miss one. Run with the
    cell's interpreter (coverage is installed there), which itself is not measured."""
    env = {k: v for k, v in run_env.items() if k != "COVERAGE_PROCESS_START"}
    session.run(
        *executed.collect_command(python, plan.out, plan.variant.id, repo_root() / MATRIX_FILE),
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
            closing.record_kill_domain(
                out, held.domain.record(), held.killed, time.monotonic() - started
            )
