"""`nox -s mutants`: plant each catalogued regression in a copy of its cell's environment, run
the cell's selected tests there, and record whether the matrix caught it.

Per cell, a control run of an unpatched copy comes first (the union of its mutants' selections);
only when it is green are that cell's mutants judged. Every run is the cell's own nox session
(`nox -s CELL -- -k SELECT`) with GLM5_MATRIX_VENVS pointing at the copy, so it runs exactly as
the matrix runs it, and writes its results.json under the mutants' results folder, never under
results/. GPU cells this box cannot run are listed with the command that runs them.

    python -m glm5_matrix.mutants.run [--ci] [--jobs N] [--only NAME ...] [--list] [-- CELL ARGS]

What follows a second `--` goes to every cell run (e.g. `-- --kernel-archive FILE`).

A SIGINT, SIGTERM or SIGHUP (Ctrl-C, a CI job cancelled, the driver of a lent GPU runner) stops
the run: the cells running get SIGTERM and are waited for (their own supervision stops them and
records the interruption), no other starts, every mutant or control not judged by then is
recorded as interrupted (results.json, report.md and the printed table; never caught or
survived), and the run exits 128 + the signal's number. A second signal is ignored: the cells'
teardown is under way.
GLM5_MATRIX_MUTANTS_WRAP (e.g. "heavy") is put before every cell command: on a shared box each
cell then takes a machine-wide slot of its own. With GLM5_MATRIX_PYTHON (a box whose vLLM is
installed for that interpreter, nothing to build) the copy is an overlay of the patched packages
put first on the cell's PYTHONPATH (glm5_matrix.mutants.patching).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from glm5_matrix.envs import environments
from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.kernels import kernel_guard
from glm5_matrix.machine import hardware, supervision
from glm5_matrix.matrix.matrix import Matrix, Variant
from glm5_matrix.mutants import catalogue, patching, record, verdicts
from glm5_matrix.mutants.catalogue import Mutant
from glm5_matrix.results import gpu_verdicts, schema
from glm5_matrix.sessions import runner

WRAP_VARIABLE = "GLM5_MATRIX_MUTANTS_WRAP"
OUT_VARIABLE = "GLM5_MATRIX_MUTANTS_RESULTS"
DEFAULT_OUT = "results-mutants"


def out_dir(environ: dict[str, str]) -> Path:
    return Path(environ.get(OUT_VARIABLE) or repo_root() / DEFAULT_OUT)


def gpu_command(mutant: Mutant) -> str:
    return f"nox -s mutants -- --only {mutant.name}"


OVERLAY_PACKAGES = ["vllm"]  # what a control's overlay copies (the catalogue patches vllm/)


def given_python(environ: dict[str, str]) -> str | None:
    """The interpreter GLM5_MATRIX_PYTHON names: the cells run it, nothing is built."""
    return environ.get(environments.PYTHON_VARIABLE) or None


class Stop:
    """The run's stop: the first SIGINT, SIGTERM or SIGHUP sets it (install(), in the main thread);
    the cells running see it within a poll and are stopped, the attempts not started yet see it
    and start nothing."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None

    def set(self, name: str) -> None:
        self.signal = name
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def install(self) -> dict[int, Any]:
        """Handlers for supervision.STOP_SIGNALS; the previous ones, to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            if self.is_set():
                print(f"mutants: {name} again: the cells are being stopped", flush=True)
                return
            print(
                f"mutants: {name}: stopping the cells, then recording them interrupted", flush=True
            )
            self.set(name)

        return {sig: signal.signal(sig, handler) for sig in supervision.STOP_SIGNALS}


class Interrupted(Exception):
    """A cell run stopped because the mutants run was (Stop)."""


# How long a stopped cell gets to end before it is killed: its supervision's teardown (GRACE_S,
# then SIGTERM and SIGKILL) fits, and the record is written before `nox -s mutants`'s own nox,
# which waits WAIT_ALL_S for every descendant, kills what is left, this process among them.
STOP_WAIT_S = supervision.WAIT_ALL_S - 2 * supervision.KILL_AFTER_S


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant | None  # None: the control of `cell`
    cell: str
    verdict: verdicts.Verdict
    seconds: float
    results_dir: str | None
    patched_files: tuple[str, ...] = ()


def source_venv(matrix: Matrix, variant: Variant, say: Callable[[str], None]) -> Path:
    """A built venv of the variant's environment to copy: the cell's own under .nox, or another
    variant's of the same environment whose fingerprint is current; else the cell's is built."""
    env = environments.load_envs(repo_root())[variant.env]
    wanted = environments.fingerprint(env, None)
    base = repo_root() / ".nox"
    for other in [variant, *matrix.variants]:
        if other.env == variant.env and environments.is_current(base / other.slug, wanted):
            return base / other.slug
    say(f"building the {variant.env} environment at {base / variant.slug}")
    built = environments.build(env, base / variant.slug)
    assert built.venv is not None
    return built.venv


def run_cell(
    variant: Variant,
    select: str,
    venvs: Path,
    results: Path,
    log: Path,
    wrap: Sequence[str],
    first_failure: bool = False,
    cell_args: Sequence[str] = (),
    overlay: Path | None = None,
    stop: Stop | None = None,
) -> int:
    """The cell's own nox session on the copy in `venvs`, its results under `results`; with
    `first_failure`, pytest stops at the first failing test (-x: a caught mutant is named by
    its first catcher, and its run is short). `cell_args` go to the cell (its --kernel-archive
    ...); with `overlay`, the cell runs the given interpreter with the overlay first on its
    PYTHONPATH. With `stop` set meanwhile, the cell gets SIGTERM, is waited for (STOP_WAIT_S,
    then killed) and Interrupted is raised."""
    command = [
        *wrap,
        sys.executable,
        "-m",
        "nox",
        "-f",
        str(repo_root() / "noxfile.py"),
        "-s",
        variant.id,
        "--",
        *cell_args,
        "-k",
        select,
        "-p",
        "no:cacheprovider",
        *(["-x"] if first_failure else []),
    ]
    environ = {
        **os.environ,
        environments.VENVS_VARIABLE: str(venvs),
        schema.RESULTS_VARIABLE: str(results),
    }
    # A patch to a Triton kernel's source (the rejection sampler's) compiles that kernel anew by
    # design: the kernel guard (GLM5_MATRIX_STRICT turns it on) would fail the run for that, and
    # a guard failure must not read as a catch.
    environ[kernel_guard.GUARD_VARIABLE] = "0"
    if overlay is None:
        environ.pop(environments.PYTHON_VARIABLE, None)  # the copy is the interpreter
    else:
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(overlay), os.environ.get("PYTHONPATH")) if p
        )
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = variant.cell.timeout_minutes * 60
    started = results / variant.slug  # the runner makes it when the cell starts
    with log.open("w") as sink:
        sink.write(f"$ {shlex.join(command)}\n")
        sink.flush()
        process = subprocess.Popen(command, env=environ, stdout=sink, stderr=subprocess.STDOUT)
        try:
            # The cell's timeout counts from its start, not from while `wrap` waits for a slot.
            deadline = None
            while process.poll() is None:
                if stop is not None and stop.is_set():
                    process.send_signal(signal.SIGTERM)  # nox's supervision stops the cell
                    try:
                        process.wait(timeout=STOP_WAIT_S)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
                    raise Interrupted(stop.signal or "a signal")
                if deadline is None and started.exists():
                    deadline = time.monotonic() + timeout
                if deadline is not None and time.monotonic() > deadline:
                    process.send_signal(signal.SIGTERM)  # nox's supervision stops the cell
                    try:
                        return process.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        return process.wait()
                time.sleep(2)
            return process.returncode
        except Interrupted:
            raise
        except BaseException:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
            raise


def _attempt(
    matrix: Matrix,
    mutant: Mutant | None,
    cell: str,
    select: str,
    out: Path,
    wrap: Sequence[str],
    control: verdicts.Verdict | None,
    say: Callable[[str], None],
    keep: bool,
    cell_args: Sequence[str] = (),
    stop: Stop | None = None,
) -> Outcome:
    variant = matrix.variant(cell)
    label = mutant.name if mutant else f"control-{variant.slug}"
    if stop is not None and stop.is_set():
        # Stopped before this one started: it judges nothing, and says so.
        verdict = verdicts.Verdict(
            verdicts.INTERRUPTED, detail=f"not started: the run was stopped by {stop.signal}"
        )
        say(f"{label}: {verdict.status} ({verdict.detail})")
        return Outcome(mutant, cell, verdict, 0.0, None)
    if mutant is not None and (control is None or control.status != verdicts.SURVIVED):
        # Nothing a run of it could show: not run, and not judged.
        verdict = verdicts.judge(None, mutant.expect, control)
        say(f"{label}: {verdict.status} ({verdict.detail})")
        return Outcome(mutant, cell, verdict, 0.0, None)
    work = out / "work" / label
    venvs = work / "venvs"
    results = out / "runs" / label
    if results.exists():
        shutil.rmtree(results)
    started = time.monotonic()
    files: tuple[str, ...] = ()
    overlay: Path | None = None
    try:
        python = given_python(dict(os.environ))
        if python is not None:
            site = patching.interpreter_site(python, os.environ)
            overlay = work / "overlay"
            if mutant is None:
                patching.control_overlay(site, overlay, OVERLAY_PACKAGES)
            else:
                files = patching.apply_patch_overlay(site, overlay, mutant.patch).files
            patching.check_overlay_imported(python, os.environ, overlay)
        else:
            source = source_venv(matrix, variant, say)
            if mutant is None:
                patching.control_copy(source, venvs / variant.slug)
            else:
                files = patching.apply_patch(source, venvs / variant.slug, mutant.patch).files
        say(f"{label}: running {variant.id} -k {select!r}")
        log = results / "nox.log"
        run_cell(
            variant,
            select,
            venvs,
            results,
            log,
            wrap,
            first_failure=mutant is not None,
            cell_args=cell_args,
            overlay=overlay,
            stop=stop,
        )
    except UserError as exc:
        return Outcome(
            mutant, cell, verdicts.Verdict(verdicts.INVALID, detail=str(exc)), 0.0, None, files
        )
    except Interrupted as exc:
        verdict = verdicts.interrupted(str(exc), schema.load(results / variant.slug))
        seconds = time.monotonic() - started
        say(f"{label}: {verdict.status} ({verdict.detail}) after {seconds:.0f} s")
        return Outcome(mutant, cell, verdict, seconds, str(results / variant.slug), files)
    finally:
        if not keep and work.exists():
            shutil.rmtree(work)  # hard links and the copy's own files only
    data = schema.load(results / variant.slug)
    if mutant is None:
        verdict = verdicts.judge_control(data)
    else:
        verdict = verdicts.judge(data, mutant.expect, control)
    seconds = time.monotonic() - started
    shown = "green" if mutant is None and verdict.status == verdicts.SURVIVED else verdict.status
    say(f"{label}: {shown} ({verdict.detail}) in {seconds:.0f} s")
    return Outcome(mutant, cell, verdict, seconds, str(results / variant.slug), files)


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="nox -s mutants --", description=__doc__.split("\n")[0])
    made.add_argument("--ci", action="store_true", help="only the catalogue's CI subset")
    made.add_argument("--jobs", type=int, default=1, help="runs side by side (default 1)")
    # extend: `--only A --only B` asks for both (with nargs="+" alone the last one won).
    made.add_argument(
        "--only", nargs="+", action="extend", metavar="NAME", help="these mutants only"
    )
    made.add_argument("--list", action="store_true", help="print the catalogue and stop")
    made.add_argument("--keep", action="store_true", help="keep the patched copies")
    return made


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cell_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    def say(line: str) -> None:
        print(f"mutants: {line}", flush=True)

    try:
        matrix = runner.load()
        cells = {v.id: v.env for v in matrix.variants}
        mutants = catalogue.load_catalogue(repo_root() / catalogue.CATALOGUE_FILE, cells)
        order = [m.name for m in mutants]
        if args.only:
            unknown = set(args.only) - {m.name for m in mutants}
            if unknown:
                raise UserError(f"--only: no mutant named {', '.join(sorted(unknown))}")
            # In the order asked for (a long run on a busy box judges the first ones first).
            named = {m.name: m for m in mutants}
            mutants = [named[name] for name in dict.fromkeys(args.only)]
        if args.ci:
            mutants = [m for m in mutants if m.ci]
        if args.jobs < 1:
            raise UserError("--jobs: at least 1")
    except UserError as exc:
        print(f"glm5-matrix: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name:<45} {m.cell:<22} {m.area}")
        return 0

    environ = dict(os.environ)
    out = out_dir(environ)
    wrap = shlex.split(environ.get(WRAP_VARIABLE, ""))
    found = hardware.detect(environ)
    runnable: list[Mutant] = []
    outcomes: list[Outcome] = []
    for m in mutants:
        check = hardware.check(matrix.variant(m.cell).cell, found)
        if check.runnable:
            runnable.append(m)
        else:
            detail = f"{check.reason}; on such a machine: {gpu_command(m)}"
            outcomes.append(
                Outcome(m, m.cell, verdicts.Verdict(verdicts.NOT_RUN, detail=detail), 0.0, None)
            )
    if args.only and not runnable:
        # Nothing asked for runs here: one line, and the record of earlier runs left as it is.
        reasons = sorted({o.verdict.detail.split("; on such")[0] for o in outcomes})
        names = ", ".join(o.mutant.name for o in outcomes if o.mutant)
        print(
            f"glm5-matrix: error: {names}: not runnable here ({'; '.join(reasons)})",
            file=sys.stderr,
        )
        return 2
    by_cell: dict[str, list[Mutant]] = {}
    for m in runnable:
        by_cell.setdefault(m.cell, []).append(m)
    book = _Book(out, args.ci, order, outcomes)
    stop = Stop()
    previous = stop.install()  # kept until the record is written and printed
    try:
        finished, controls_done = _run_all(
            matrix, by_cell, out, wrap, say, args.keep, cell_args, args.jobs, book, stop
        )
        return _record(matrix, book, stop, finished, controls_done, cell_args, args.ci, say)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _record(
    matrix: Matrix,
    book: _Book,
    stop: Stop,
    finished: list[Outcome],
    controls_done: list[Outcome],
    cell_args: Sequence[str],
    ci: bool,
    say: Callable[[str], None],
) -> int:
    """The run's record (results.json, report.md, the kept GPU verdicts), printed; its exit
    status: 128 + the signal when it was stopped, 1 when a control or mutant run was invalid
    (or, in CI, a mutant survived), else 0."""
    environ = dict(os.environ)
    out = book.out
    book.ended = {"how": "finished"}
    if stop.is_set():
        book.ended = {
            "how": "signal",
            "signal": stop.signal,
            "interrupted": [
                o.mutant.name if o.mutant else f"control of {o.cell}"
                for o in [*controls_done, *finished]
                if o.verdict.status == verdicts.INTERRUPTED
            ],
        }
    written = book.write()
    say(f"wrote {written}")
    kept = record.keep(
        repo_root() / gpu_verdicts.KEPT_FILE,
        record.kept_verdicts(
            finished,
            controls_done,
            {v.id for v in matrix.variants if v.cell.gpus},
            hardware.device_model(environ),
            time.strftime("%Y-%m-%d", time.gmtime()),
            "nox -s mutants"
            + (" (GLM5_MATRIX_PYTHON overlay)" if given_python(environ) else "")
            + (f" {shlex.join(cell_args)}" if cell_args else ""),
        ),
    )
    if kept is not None:
        say(f"kept the GPU verdicts in {kept}: commit it (a GPU runner's results go with it)")
        book.write()  # the report shows them
    print((out / record.REPORT_FILE).read_text(), flush=True)
    if stop.is_set():
        # An interrupted run judged less than it was asked to: never a success.
        return 128 + signal.Signals[stop.signal or "SIGTERM"].value
    bad = [o for o in [*controls_done, *finished] if o.verdict.status == verdicts.INVALID]
    # In CI a survivor is a loss of power: the subset holds mutants the matrix catches.
    lost = [o for o in finished if ci and o.verdict.status == verdicts.SURVIVED]
    return 1 if bad or lost else 0


def _run_all(
    matrix: Matrix,
    by_cell: dict[str, list[Mutant]],
    out: Path,
    wrap: Sequence[str],
    say: Callable[[str], None],
    keep: bool,
    cell_args: Sequence[str],
    jobs: int,
    book: _Book,
    stop: Stop,
) -> tuple[list[Outcome], list[Outcome]]:
    """Each cell's control, then its mutants: (the mutants' outcomes, the controls')."""

    def control(cell: str) -> Outcome:
        selection = catalogue.control_selection(by_cell[cell])
        return book.control(
            _attempt(matrix, None, cell, selection, out, wrap, None, say, keep, cell_args, stop)
        )

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # Controls first (nothing waits on a control queued behind it), the mutants after them
        # one cell at a time in turn, so that every cell gets verdicts early in a long run.
        controls = {cell: pool.submit(control, cell) for cell in by_cell}

        def mutant(m: Mutant) -> Outcome:
            verdict = controls[m.cell].result().verdict
            return book.mutant(
                _attempt(
                    matrix, m, m.cell, m.select, out, wrap, verdict, say, keep, cell_args, stop
                )
            )

        judged = [pool.submit(mutant, m) for m in _in_turn(by_cell)]
        return [f.result() for f in judged], [f.result() for f in controls.values()]


def _in_turn(by_cell: dict[str, list[Mutant]]) -> list[Mutant]:
    """The cells' mutants taken one from each cell in turn."""
    queues = [list(ms) for ms in by_cell.values()]
    ordered: list[Mutant] = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


class _Book:
    """The outcomes so far; results.json and report.md are rewritten after each one, so a long
    run that is stopped keeps what it judged."""

    def __init__(self, out: Path, ci: bool, order: list[str], outcomes: list[Outcome]) -> None:
        self.out, self.ci, self.order = out, ci, order
        self.controls: list[Outcome] = []
        self.outcomes = list(outcomes)
        self.ended: dict[str, Any] = {"how": "running"}  # "finished" or "signal" at the end
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.write()

    def control(self, outcome: Outcome) -> Outcome:
        with self.lock:
            self.controls.append(outcome)
            self.write()
        return outcome

    def mutant(self, outcome: Outcome) -> Outcome:
        with self.lock:
            self.outcomes.append(outcome)
            self.write()
        return outcome

    def write(self) -> Path:
        return record.write(
            self.out,
            self.controls,
            self.outcomes,
            time.monotonic() - self.started,
            ci=self.ci,
            order=self.order,
            ended=self.ended,
        )


if __name__ == "__main__":
    sys.exit(main())
