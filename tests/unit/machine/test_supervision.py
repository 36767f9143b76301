"""glm5_matrix.machine.supervision with real processes: sleepers, a child that orphans a grandchild, a
process that ignores SIGINT and SIGTERM, a supervisor whose parent is killed outright.

Where the GPU check is driven (test_gpu_*), nvidia-smi is a stand-in script first on PATH that
prints recorded-format output: the only way to show the refusal without a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from polling import alive, wait_for
from scaffold import environ_with_src

from glm5_matrix.machine import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _supervise(
    command: list[str], tmp_path: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "glm5_matrix.machine.supervision",
            "--results",
            str(tmp_path / "r"),
            *options,
            "--",
            *command,
        ],
        env=env or environ_with_src(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _results(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "r" / "results.json").read_text())


# A command that starts a grandchild ignoring SIGTERM, writes its pid, then waits `argv[2]`
# seconds (or forever) and exits 0; on SIGINT it writes "SIGINT" to argv[3] first.
_ORPHANING = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(sys.argv[1], "w").write(str(grandchild.pid))
    try:
        time.sleep(float(sys.argv[2]))
    except KeyboardInterrupt:
        open(sys.argv[3], "w").write("SIGINT")
    """
)


@pytest.mark.parametrize(
    ("script", "code"),
    [
        # Ignores SIGTERM, so it has to be killed: the cell fails.
        (_ORPHANING, 1),
        # Stops on SIGTERM, as what vLLM's import leaves on a CPU box does (humming-kernels'
        # nvrtc build helpers): named and recorded, and the passing command stays passing.
        (_ORPHANING.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN); ", ""), 0),
    ],
    ids=["needs-sigkill", "stops-on-sigterm"],
)
def test_what_a_finished_command_left_is_stopped_and_named(
    tmp_path: Path, script: str, code: int
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    proc = _supervise(
        [sys.executable, "-c", script, str(pid_file), "0.5", str(tmp_path / "int")],
        tmp_path,
        "--linger",
        "0.5",
        "--kill-after",
        "1",
    )
    _, stderr = proc.communicate(timeout=60)
    grandchild = int(pid_file.read_text())
    # The grandchild was orphaned when the command exited and came back to the supervisor
    # (child subreaper), which stopped it: nothing is left.
    assert processes.proc_stat(grandchild) is None
    assert proc.returncode == code, stderr
    assert "left behind" in stderr and f"pid {grandchild}" in stderr
    data = _results(tmp_path)
    assert data["left_behind"][0].startswith(f"pid {grandchild}: ")
    assert time.monotonic() - started < 20


def test_sigterm_stops_the_command_with_sigint_first(tmp_path: Path) -> None:
    pid_file, marker = tmp_path / "grandchild.pid", tmp_path / "int"
    proc = _supervise(
        [sys.executable, "-c", _ORPHANING, str(pid_file), "600", str(marker)],
        tmp_path,
        "--kill-after",
        "1",
    )
    grandchild = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text()))
    started = processes.start_time(grandchild)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert marker.read_text() == "SIGINT"  # the command's own teardown ran
    assert not alive(grandchild, started)
    data = _results(tmp_path)
    assert data["complete"] is False
    assert data["ended"]["how"] == "signal" and data["ended"]["signal"] == "SIGTERM"
    assert "ran its teardown" in data["ended"]["detail"]
    assert data["exit_status"] == 143
    assert "glm5-matrix.complete" in (tmp_path / "r" / "junit.xml").read_text()


_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{grandchild.pid}")
    time.sleep(600)
    """
)


def test_a_command_ignoring_sigint_and_sigterm_is_killed_in_bounded_time(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    proc = _supervise(
        [sys.executable, "-c", _STUBBORN, str(pid_file)],
        tmp_path,
        "--grace",
        "1",
        "--kill-after",
        "1",
    )
    grandchild = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text()))
    command = processes.live_children(proc.pid)[0]
    starts = {pid: processes.start_time(pid) for pid in (command, grandchild)}
    signalled = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    proc.communicate(timeout=60)
    # grace (1 s) for SIGINT, then SIGTERM for 1 s, then SIGKILL
    assert time.monotonic() - signalled < 10
    assert proc.returncode == 128 + signal.SIGHUP
    assert not any(alive(pid, started) for pid, started in starts.items())
    ended = _results(tmp_path)["ended"]
    assert ended["signal"] == "SIGHUP" and "did not end within 1 s" in ended["detail"]


def test_a_killed_command_is_recorded_with_the_test_it_was_in(tmp_path: Path) -> None:
    out = tmp_path / "r"
    out.mkdir()
    # What the results plugin leaves while a test runs.
    partial = {
        "cell": {"id": "c"},
        "exit_status": None,
        "complete": False,
        "ended": {"how": "unfinished", "signal": None, "detail": "", "test": "t.py::test_b"},
        "wall_seconds": 1.0,
        "outcomes": {"passed": 1, "running": 1},
        "tests": {
            "t.py::test_a": {"outcome": "passed", "seconds": 0.1, "phases": {}},
            "t.py::test_b": {"outcome": "running", "seconds": 0.0, "phases": {}},
        },
        "engine_starts": [],
        "figures": [],
    }
    (out / "results.json").write_text(json.dumps(partial))
    proc = _supervise([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path)
    command = wait_for(lambda: processes.live_children(proc.pid))[0]
    os.kill(command, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    data = _results(tmp_path)
    assert data["complete"] is False
    assert data["ended"]["how"] == "killed" and data["ended"]["signal"] == "SIGKILL"
    assert data["ended"]["test"] == "t.py::test_b"
    assert f"pid {command}" in data["ended"]["detail"]
    assert data["outcomes"] == {"passed": 1, "interrupted": 1}
    junit = (out / "junit.xml").read_text()  # pytest wrote none: built from results.json
    assert 'name="test_a"' in junit and 'name="test_b"' in junit
    assert 'name="glm5-matrix.complete" value="false"' in junit


_MIDDLE = textwrap.dedent(
    """
    import subprocess, sys, time
    from glm5_matrix.machine import supervision
    command = [sys.executable, "-c", sys.argv[2], *sys.argv[3:]]
    subprocess.Popen(supervision.supervised(command, sys.executable, results_dir=sys.argv[1]))
    time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["runner", "runner's process group"])
def test_the_supervisor_stops_the_cell_when_the_runner_is_killed_outright(
    tmp_path: Path, how: str
) -> None:
    pid_file, marker = tmp_path / "grandchild.pid", tmp_path / "int"
    middle = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _MIDDLE,
            str(tmp_path / "r"),
            _ORPHANING,
            str(pid_file),
            "600",
            str(marker),
        ],
        env=environ_with_src(),
        start_new_session=True,  # the runner leads a process group, as nox -j's sessions do
    )
    grandchild = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text()))
    grandchild_started = processes.start_time(grandchild)
    supervisor = processes.live_children(middle.pid)[0]
    started = processes.start_time(supervisor)
    if how == "runner":
        middle.kill()  # SIGKILL: nothing of the runner runs any more
    else:
        os.killpg(middle.pid, signal.SIGKILL)  # and everything still in its group
    middle.wait()
    wait_for(lambda: not alive(supervisor, started), 60)
    assert not alive(grandchild, grandchild_started)
    assert marker.read_text() == "SIGINT"
    ended = _results(tmp_path)["ended"]
    assert ended["how"] == "process-died" and f"runner (pid {middle.pid}) died" in ended["detail"]


def test_die_with_parent_takes_the_command_down_with_its_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    parent_code = textwrap.dedent(
        """
        import subprocess, sys, time
        from glm5_matrix.machine import supervision
        command = [sys.executable, "-c", "import time; time.sleep(600)"]
        sleeper = subprocess.Popen(supervision.die_with_parent(command), start_new_session=True)
        open(sys.argv[1], "w").write(str(sleeper.pid))
        time.sleep(600)
        """
    )
    command = [b"-c", b"import time; time.sleep(600)"]
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, str(pid_file)], env=environ_with_src()
    )
    sleeper = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text()))
    # The small step before the command has exec'd it: the process is the command now.
    wait_for(lambda: Path(f"/proc/{sleeper}/cmdline").read_bytes().split(b"\0")[1:3] == command)
    assert processes.proc_stat(sleeper)[2] == sleeper  # exec kept the pid: it leads its group
    started = processes.start_time(sleeper)
    parent.kill()
    parent.wait()
    wait_for(lambda: not alive(sleeper, started), 10)


_FORWARDING = textwrap.dedent(
    """
    import subprocess, sys
    from glm5_matrix.machine import supervision
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    try:
        with supervision.stop_on_signals():
            child.wait()
    except KeyboardInterrupt as exc:
        child.wait()
        print(f"interrupted by {exc}; child exited {child.returncode}", flush=True)
        sys.exit(130)
    """
)
_SIGNAL_WRITER = textwrap.dedent(
    """
    import signal, sys, time
    def on(signum, frame):
        open(sys.argv[1], "a").write(signal.Signals(signum).name + "\\n")
        if signum == signal.SIGTERM:
            time.sleep(1.0)  # a teardown that takes a moment: a second signal must not cut it
            sys.exit(3)
    signal.signal(signal.SIGTERM, on)
    open(sys.argv[1], "a").write("ready\\n")
    time.sleep(600)
    """
)


def test_stop_on_signals_forwards_the_first_signal_and_waits(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORWARDING, _SIGNAL_WRITER, str(seen)],
        env=environ_with_src(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: seen.is_file() and "ready" in seen.read_text())
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM" in seen.read_text())
    proc.send_signal(signal.SIGTERM)  # ignored: the child's teardown is under way
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "interrupted by SIGTERM; child exited 3" in out
    assert seen.read_text().split() == ["ready", "SIGTERM"]
    assert "SIGTERM again" in err


# --- GPUs --------------------------------------------------------------------------------------

DATA = Path(__file__).parents[1] / "data"


def _stub_smi(tmp_path: Path, apps: str) -> dict[str, str]:
    """A stand-in nvidia-smi first on PATH: the GPU list and the compute apps in `apps`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gpus = (DATA / "nvidia-smi-gpus.txt").read_text()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=*) cat <<'EOF'\n{gpus}EOF\n;;\n"
        f"  --query-compute-apps=*) cat {apps};;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return environ_with_src(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="1"
    )


def test_gpu_cell_refuses_to_start_on_a_held_gpu_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("glm5_matrix.machine.gpu_memory")
    marker = tmp_path / "ran"
    proc = _supervise(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        tmp_path,
        "--gpus",
        "1",
        env=_stub_smi(tmp_path, str(DATA / "nvidia-smi-apps-held.txt")),
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert not marker.exists()  # the command never started
    lines = [line for line in err.splitlines() if line.startswith("glm5-matrix:")]
    assert len(lines) == 1, err
    assert "pid 48213 holds 91204 MiB on GPU 1" in lines[0]
    assert "GPU 0" not in lines[0]  # another GPU's holder is not this cell's business
    ended = _results(tmp_path)["ended"]
    assert ended["how"] == "gpu-held" and "pid 48213" in ended["detail"]


def test_gpu_cell_starts_when_its_gpu_is_free(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = _supervise(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        tmp_path,
        "--gpus",
        "1",
        env=_stub_smi(tmp_path, str(DATA / "nvidia-smi-apps-none.txt")),
    )
    proc.communicate(timeout=60)
    assert marker.exists()


# --- the nox processes (glm5_matrix.machine.supervision.guard_nox_process) ---------------------------

# The main nox of `nox -j 2`, in small: two workers in sessions of their own, each with a child
# in a session of its own too; a worker takes 1 s to stop on SIGTERM, its child one more. None
# holds the main process's stdout or stderr: the test's wait for it does not wait for them.
_WORKER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time\\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))\\n"
        "time.sleep(600)"], start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def stop(signum, frame):
        time.sleep(1)
        child.terminate()  # and does not wait for it
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print(child.pid, flush=True)
    time.sleep(600)
    """
)
_MAIN_NOX = textwrap.dedent(
    """
    import subprocess, sys
    from glm5_matrix.machine import supervision
    supervision.guard_nox_process(["nox", "-j", "2"])
    workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for _ in range(2)]
    pids = [str(w.pid) for w in workers] + [w.stdout.readline().strip() for w in workers]
    try:
        print(" ".join(pids), flush=True)
        for worker in workers:
            worker.wait()
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_main_nox_exits_only_when_every_cell_is_gone(sig: int) -> None:
    main = subprocess.Popen(
        [sys.executable, "-c", _MAIN_NOX, _WORKER],
        env=environ_with_src(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert main.stdout is not None
    pids = [int(p) for p in main.stdout.readline().split()]
    assert len(pids) == 4
    starts = {pid: processes.start_time(pid) for pid in pids}
    signalled = time.monotonic()
    main.send_signal(sig)
    _, err = main.communicate(timeout=60)
    # At the moment the main process is gone, none of its workers or their children is left.
    assert [pid for pid, started in starts.items() if alive(pid, started)] == []
    assert main.returncode == 130, err
    assert time.monotonic() - signalled >= 1.0  # it waited for the workers' own teardown
    assert "stopping every cell" in err


def test_a_nox_worker_is_stopped_when_the_main_nox_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    worker = textwrap.dedent(
        """
        import signal, sys, time
        from glm5_matrix.machine import supervision
        signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write("SIGTERM"),
                                                  sys.exit(143)))
        supervision.guard_nox_process(["nox", "--parallel-worker"])
        open(sys.argv[1] + ".ready", "w")
        time.sleep(600)
        """
    )
    main = textwrap.dedent(
        """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", main, worker, str(marker)], env=environ_with_src()
    )
    wait_for(lambda: Path(f"{marker}.ready").exists())
    proc.kill()
    proc.wait()
    assert wait_for(lambda: marker.is_file() and marker.read_text()) == "SIGTERM"


def test_the_cell_is_killed_at_once_when_the_main_nox_dies(tmp_path: Path) -> None:
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pid_file, marker = tmp_path / "grandchild.pid", tmp_path / "int"
    proc = _supervise(
        [sys.executable, "-c", _ORPHANING, str(pid_file), "600", str(marker)],
        tmp_path,
        "--main-nox",
        f"{main.pid}:{processes.start_time(main.pid)}",
    )
    grandchild = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text()))
    started = processes.start_time(grandchild)
    main.kill()
    main.wait()
    killed_at = time.monotonic()
    proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 5  # no 60 s grace: nobody waits for the cell
    assert not alive(grandchild, started)
    assert not marker.exists()  # killed, not interrupted
    ended = _results(tmp_path)["ended"]
    assert ended["how"] == "process-died" and f"main nox (pid {main.pid})" in ended["detail"]
    assert proc.returncode == 128 + signal.SIGTERM


def test_the_main_nox_death_is_named_when_its_worker_stops_the_cell_first(tmp_path: Path) -> None:
    """`nox -j` whose main nox is killed: the worker nox gets SIGTERM from the kernel and passes
    it on, and a command that ends on SIGINT at once would end before the supervisor's
    once-a-second look at the main nox. The signal itself must tell the main nox died: the cell
    is killed at once, as nobody waits for it, and the record says so, not that someone sent
    SIGTERM (seen in CI: the faults cell's j2-sigkill case, now and then)."""
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ready = tmp_path / "ready"
    quick = (
        "import sys, time; open(sys.argv[1], 'w').write('1')\n"
        "try:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n    sys.exit(130)\n"
    )
    proc = _supervise(
        [sys.executable, "-c", quick, str(ready)],
        tmp_path,
        "--main-nox",
        f"{main.pid}:{processes.start_time(main.pid)}",
    )
    wait_for(ready.is_file)
    time.sleep(0.3)  # past the supervisor's first look, well inside the next second
    main.kill()
    main.wait()
    proc.send_signal(signal.SIGTERM)  # what the worker nox passes on
    proc.communicate(timeout=60)
    ended = _results(tmp_path)["ended"]
    assert ended["how"] == "process-died", ended
    assert ended["signal"] is None and f"main nox (pid {main.pid})" in ended["detail"], ended
    assert "killed at once" in ended["detail"], ended


# A nox that runs one session's command itself (`nox -s mutants`): the command is its child, and
# nox's Popen waits on it. SIGTERM is held back until the child has ended unreaped, as when a
# SIGTERM to the whole group ends a child without a handler before nox's own handler runs.
_NOX_WITH_A_DEAD_CHILD = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from glm5_matrix.machine import processes, supervision
    supervision.guard_nox_process(["nox", "-s", "mutants"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print(child.pid, flush=True)
    while child.pid not in processes.zombie_children():
        time.sleep(0.05)
    print("ended", flush=True)
    while signal.SIGTERM not in signal.sigpending():
        time.sleep(0.05)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # the handler runs here
        time.sleep(30)
    except KeyboardInterrupt:
        pass
    print("status", child.wait(), flush=True)
    """
)


def test_the_main_nox_leaves_its_own_ended_child_to_its_popen() -> None:
    """nox's handler waits for every descendant and reaps orphans, but not nox's own children,
    even one that ended before the handler ran: reaped there, its Popen would read exit status 0
    (Python's waitpid sees ECHILD) and nox would call an interrupted session successful (the
    H100's `nox -s mutants`, 2026-12-06). Its Popen reads how it ended."""
    main = subprocess.Popen(
        [sys.executable, "-c", _NOX_WITH_A_DEAD_CHILD],
        env=environ_with_src(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert main.stdout is not None
    child = int(main.stdout.readline())
    os.kill(child, signal.SIGKILL)
    assert main.stdout.readline().strip() == "ended"
    main.send_signal(signal.SIGTERM)
    out, err = main.communicate(timeout=60)
    assert out.split() == ["status", str(-signal.SIGKILL)], err
