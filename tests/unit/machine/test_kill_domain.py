"""glm5_matrix.machine.kill_domain with real process trees: a test process that starts sleepers, a
grandchild that double-forks away (its parent exits: it is nobody's descendant but a
subreaper's), and a child in a session of its own; killed through each mechanism this machine
allows (cgroup v2, the v1 freezer, the subreaper fallback), also when the supervisor, or the
runner and the supervisor, are killed outright."""

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

from glm5_matrix.errors import UserError
from glm5_matrix.machine import kill_domain, processes, supervision

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# Starts a sleeper, a child in its own session, and a grandchild that double-forks (the middle
# process exits, so the grandchild is orphaned); writes their pids, one a line, then sleeps.
TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    out = sys.argv[1]
    pids = [os.getpid()]
    pids.append(subprocess.Popen(["sleep", "600"]).pid)
    pids.append(subprocess.Popen(["sleep", "600"], start_new_session=True).pid)
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            os.execvp("sleep", ["sleep", "600"])
        os._exit(0)
    os.waitpid(middle, 0)
    os.close(w)
    pids.append(int(os.read(r, 32)))
    with open(out + ".tmp", "w") as f:
        f.write("\\n".join(map(str, pids)))
    os.rename(out + ".tmp", out)
    time.sleep(600)
    """
)

# The runner's part: a kill domain held around a supervised TREE, as runner.cell_domain does.
RUNNER = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from glm5_matrix.machine import kill_domain
    from glm5_matrix.machine import supervision
    tree, pids, mechanism, report = sys.argv[1:5]
    domain = kill_domain.create("t", {kill_domain.VARIABLE: mechanism})
    with kill_domain.held(domain) as held:
        command = supervision.supervised(
            [sys.executable, "-c", tree, pids], sys.executable,
            domain=held.domain, register=held.register,
        )
        code = subprocess.run(command).returncode
    with open(report, "w") as f:
        json.dump({"code": code, "killed": held.killed, "cgroup": str(domain.path)}, f)
    """
)


def _read_pids(path: Path) -> dict[int, int | None]:
    pids = [int(p) for p in wait_for(lambda: path.is_file() and path.read_text()).split()]
    return {pid: processes.start_time(pid) for pid in pids}


def _alive(pids: dict[int, int | None]) -> list[int]:
    """Those of `pids` ({pid: start time}) still alive."""
    return [pid for pid, started in pids.items() if alive(pid, started)]


def _available(mechanism: str) -> kill_domain.Domain:
    try:
        domain = kill_domain.create("probe", {kill_domain.VARIABLE: mechanism})
    except UserError as exc:
        pytest.skip(str(exc))
    return domain


CGROUPS = [kill_domain.CGROUP_V2, kill_domain.CGROUP_V1]


@pytest.mark.parametrize("mechanism", CGROUPS)
def test_a_cgroup_domain_holds_the_whole_tree_and_kills_it(tmp_path: Path, mechanism: str) -> None:
    domain = _available(mechanism)
    pid_file = tmp_path / "pids"
    # The test process joins the cgroup before exec, as the supervisor starts it.
    command = supervision.die_with_parent(
        [sys.executable, "-c", TREE, str(pid_file)], signal.SIGTERM, join=domain.procs_file()
    )
    proc = subprocess.Popen(command, env=environ_with_src(kill_domain.VARIABLE))
    pids = _read_pids(pid_file)
    assert sorted(domain.members()) == sorted(pids)  # the orphan and the setsid child too
    started = time.monotonic()
    killed = domain.kill()
    proc.wait(timeout=10)
    assert sorted(killed) == sorted(pids)
    assert _alive(pids) == []
    assert not domain.path.exists()  # type: ignore[union-attr]
    assert time.monotonic() - started < 10


def test_the_subreaper_domain_kills_what_came_back_to_it(tmp_path: Path) -> None:
    # In a process of its own: the fallback makes its caller a subreaper for good.
    report = tmp_path / "report.json"
    script = textwrap.dedent(
        """
        import json, subprocess, sys, time
        from glm5_matrix.machine import kill_domain
        domain = kill_domain.create("t", {kill_domain.VARIABLE: "subreaper"})
        proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
        while True:
            try:
                open(sys.argv[2]).read(); break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.5)
        members = domain.members()
        killed = domain.kill()
        proc.wait()
        json.dump({"members": members, "killed": killed}, open(sys.argv[3], "w"))
        """
    )
    pid_file = tmp_path / "pids"
    subprocess.run(
        [sys.executable, "-c", script, TREE, str(pid_file), str(report)],
        env=environ_with_src(kill_domain.VARIABLE),
        check=True,
        timeout=60,
    )
    pids = _read_pids(pid_file)
    data = json.loads(report.read_text())
    assert set(pids) <= set(data["members"])  # the double-forked one came back to the caller
    assert _alive(pids) == []


@pytest.mark.parametrize("mechanism", [*CGROUPS, kill_domain.SUBREAPER])
def test_sigkill_of_the_supervisor_still_kills_the_whole_tree(
    tmp_path: Path, mechanism: str
) -> None:
    if mechanism != kill_domain.SUBREAPER:
        _available(mechanism).kill()
    pid_file, report = tmp_path / "pids", tmp_path / "report.json"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, TREE, str(pid_file), mechanism, str(report)],
        env=environ_with_src(kill_domain.VARIABLE),
    )
    pids = _read_pids(pid_file)
    supervisor = [
        pid
        for pid in processes.live_children(runner.pid)
        if "glm5_matrix.machine.supervision" in processes.cmdline(pid)
    ]
    assert len(supervisor) == 1, supervisor
    os.kill(supervisor[0], signal.SIGKILL)
    runner.wait(timeout=60)
    data = json.loads(report.read_text())
    assert data["code"] == -signal.SIGKILL
    assert _alive(pids) == []
    # The test process itself may have gone on its SIGINT (PR_SET_PDEATHSIG), never the rest.
    assert set(list(pids)[1:]) <= set(data["killed"])
    if mechanism != kill_domain.SUBREAPER:
        assert not Path(data["cgroup"]).exists()


@pytest.mark.parametrize("mechanism", CGROUPS)
def test_the_watchdog_kills_the_tree_when_runner_and_supervisor_are_killed(
    tmp_path: Path, mechanism: str
) -> None:
    _available(mechanism).kill()
    pid_file, report = tmp_path / "pids", tmp_path / "report.json"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, TREE, str(pid_file), mechanism, str(report)],
        env=environ_with_src(kill_domain.VARIABLE),
        start_new_session=True,
    )
    pids = _read_pids(pid_file)
    children = processes.live_children(runner.pid)
    supervisor = [
        pid for pid in children if "glm5_matrix.machine.supervision" in processes.cmdline(pid)
    ]
    watchdog = [
        pid for pid in children if "glm5_matrix.machine.kill_domain" in processes.cmdline(pid)
    ]
    assert len(supervisor) == 1 and len(watchdog) == 1, children
    watchdog_started = processes.start_time(watchdog[0])
    for pid in (runner.pid, supervisor[0]):  # both at once: neither can stop the cell
        os.kill(pid, signal.SIGSTOP)
    for pid in (runner.pid, supervisor[0]):
        os.kill(pid, signal.SIGKILL)
    runner.wait(timeout=10)
    wait_for(lambda: not _alive(pids), 20)
    wait_for(lambda: not _alive({watchdog[0]: watchdog_started}), 20)  # and it is gone
    assert not report.exists()  # the runner never got to its own kill


def test_auto_falls_back_to_the_subreaper_where_no_cgroup_is_writable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kill_domain, "_mounts", lambda: [])
    monkeypatch.setattr(kill_domain, "become_subreaper", lambda: True)
    said: list[str] = []
    domain = kill_domain.create("t", {}, say=said.append)
    assert domain.mechanism == kill_domain.SUBREAPER and domain.path is None
    assert len(said) == 1 and "no writable cgroup" in said[0]
    with pytest.raises(UserError, match="cgroup-v2: no cgroup-v2 hierarchy"):
        kill_domain.create("t", {kill_domain.VARIABLE: "cgroup-v2"})


def test_a_mechanism_not_known_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="not one of auto, cgroup-v2"):
        kill_domain.create("t", {kill_domain.VARIABLE: "cgroup"})
    with pytest.raises(UserError, match="not MECHANISM"):
        kill_domain.Domain.from_argument("cgroup-v2")


def test_the_argument_names_the_domain_to_another_process() -> None:
    domain = kill_domain.Domain(kill_domain.CGROUP_V1, Path("/sys/fs/cgroup/freezer/x"))
    assert kill_domain.Domain.from_argument(domain.argument()) == domain
    subreaper = kill_domain.Domain(kill_domain.SUBREAPER)
    assert kill_domain.Domain.from_argument(subreaper.argument()) == subreaper
