"""GPU leases with real flock in real processes: the pool, holders named while waiting, a holder
that dies, cells contending (one pool through the real noxfile and `nox -j 2`), neighbours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from scaffold import environ_without, nox_installed, run_nox

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.machine import hardware, leases

ROOT = repo_root()
SRC = str(ROOT / "src")
TOPO = Path(__file__).parents[1] / "data" / "nvidia-smi-topo"


def topology(name: str) -> hardware.Topology:
    return hardware.parse_topology((TOPO / name).read_text())


def take(lock_dir: Path, cell: str = "cell", count: int = 1, pool=(0,), timeout_s=0.0, **kw):
    return leases.acquire(
        cell, count, pool, lock_dir=lock_dir, timeout_s=timeout_s, poll_s=0.05, **kw
    )


# --- the pool ----------------------------------------------------------------------------------


def test_the_pool_is_the_override_gpus_that_qualify(matrix):
    found = hardware.detect({"GLM5_MATRIX_GPUS": "9.0,8.0,10.0,9.0"})
    assert leases.pool(matrix.cell("e2e-tp1"), found) == (0, 2, 3)
    assert leases.pool(matrix.cell("pd-nixl"), found) == (0, 2, 3)
    assert leases.pool(matrix.cell("e2e-cpu"), found) == (0, 1, 2, 3)  # needs none, asks none


def test_the_pool_is_what_cuda_visible_devices_left(matrix):
    gpus = hardware.bound_by_visible([(i, f"GPU-{i}", (9, 0)) for i in range(8)], "4,5,6,7")
    found = hardware.Hardware(
        tuple(c for _, _, c in gpus), "nvidia-smi", tuple(i for i, _, _ in gpus)
    )
    assert leases.pool(matrix.cell("e2e-tp2"), found) == (4, 5, 6, 7)


def test_a_cell_without_gpus_gets_an_empty_lease(matrix, tmp_path):
    variant = matrix.variant("e2e-cpu")
    lease = leases.lease_cell(variant, hardware.detect({"GLM5_MATRIX_GPUS": ""}), {})
    assert lease.gpus == () and lease.environment() == {}
    assert not (tmp_path / "leases").exists()


def lease_environ(tmp_path: Path, gpus: str) -> dict[str, str]:
    """GPUs given, a lease folder of the test's own, and no wait."""
    return {
        "GLM5_MATRIX_GPUS": gpus,
        "GLM5_MATRIX_LEASE_DIR": str(tmp_path / "leases"),
        "GLM5_MATRIX_LEASE_TIMEOUT": "0",
    }


def test_lease_cell_reads_pool_folder_and_bound_from_the_environment(matrix, tmp_path):
    environ = lease_environ(tmp_path, "9.0,9.0")
    found = hardware.detect(environ)
    with leases.lease_cell(matrix.variant("pd-nixl"), found, environ) as lease:
        assert lease.gpus == (0, 1)
        assert lease.environment() == {
            "CUDA_VISIBLE_DEVICES": "0,1",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        with pytest.raises(leases.LeaseTimeout, match=r"held by pd-nixl pid \d+"):
            leases.lease_cell(matrix.variant("e2e-tp1(deep_gemm)"), found, environ)


@pytest.mark.parametrize(
    ("value", "expected"), [("", 6 * 3600.0), ("0", 0.0), ("90", 90.0), ("inf", float("inf"))]
)
def test_timeout_variable(value, expected):
    assert leases.timeout({"GLM5_MATRIX_LEASE_TIMEOUT": value}) == expected


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_bad_timeout_is_one_line(value):
    with pytest.raises(UserError, match="GLM5_MATRIX_LEASE_TIMEOUT="):
        leases.timeout({"GLM5_MATRIX_LEASE_TIMEOUT": value})


def test_an_unusable_lock_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"GPU lease folder .*GLM5_MATRIX_LEASE_DIR"):
        take(tmp_path / "file" / "leases")


# --- one process -------------------------------------------------------------------------------


def test_a_lease_names_its_holder_in_the_lock_file_until_released(tmp_path):
    lease = take(tmp_path, "e2e-tp1(deep_gemm)", pool=(0, 1))
    assert lease.gpus == (0,) and lease.waited_for == []
    written = json.loads((tmp_path / "gpu0.lock").read_text())
    assert (written["cell"], written["pid"]) == ("e2e-tp1(deep_gemm)", os.getpid())
    holder = leases.holder_of(tmp_path, 0)
    assert holder is not None and holder.cell == "e2e-tp1(deep_gemm)"
    assert leases.holder_of(tmp_path, 1) is None
    assert (tmp_path / "gpu0.lock").stat().st_mode & 0o666 == 0o666  # other users lock it too
    lease.release()
    assert leases.holder_of(tmp_path, 0) is None
    assert (tmp_path / "gpu0.lock").read_text() == ""


def test_a_cell_takes_all_its_gpus_or_none(tmp_path):
    """A 2-GPU cell waiting on a pool of two with one held never sits on the other one."""
    held = take(tmp_path, "holder", pool=(0,))
    outcome: list[BaseException] = []

    def wait_for_two() -> None:
        try:
            take(tmp_path, "pd-nixl", count=2, pool=(0, 1), timeout_s=2.0)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_two)
    waiter.start()
    time.sleep(0.5)
    other = take(tmp_path, "e2e-tp1(flashinfer)", pool=(1,))  # free all along
    assert other.gpus == (1,)
    waiter.join()
    assert isinstance(outcome[0], leases.LeaseTimeout)
    assert "waiting for 2 of GPUs 0,1" in str(outcome[0])
    held.release()
    other.release()


def test_a_multi_gpu_lease_takes_numa_neighbours(tmp_path):
    """8x H100 on NVSwitch with GPUs 0-2 busy: all links equal, so the pair that shares a NUMA
    node (4,5) is taken, not the lowest free indices (3,4)."""
    busy = [take(tmp_path, "other", pool=(gpu,)) for gpu in (0, 1, 2)]
    topo = topology("h100-sxm-8gpu.txt")
    lease = take(tmp_path, "e2e-tp2", count=2, pool=range(8), topology=topo)
    assert lease.gpus == (4, 5)
    lease.release()
    assert take(tmp_path, "e2e-tp2", count=2, pool=range(8)).gpus == (3, 4)  # no topology
    for other in busy:
        other.release()


# --- choosing neighbours -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "free", "count", "chosen"),
    [
        ("dgx1-v100-8gpu.txt", range(8), 2, (0, 3)),  # NV2, not GPU0-GPU1's NV1
        ("dgx1-v100-8gpu.txt", (1, 2, 3, 4), 2, (1, 2)),
        ("dgx1-v100-8gpu.txt", (3, 4, 5, 7), 2, (4, 7)),  # NV2 over 3-7's NV1 and 3-4's SYS
        ("dgx1-v100-8gpu.txt", range(8), 4, (0, 1, 2, 3)),  # NVLinked throughout
        ("dgx1-v100-8gpu.txt", (0, 3, 4, 5, 6, 7), 4, (4, 5, 6, 7)),
        ("rtx4090-8gpu.txt", (3, 4, 5, 6, 7), 2, (4, 5)),  # SYS alike: one NUMA node
        ("rtx4090-8gpu.txt", (2, 3, 4, 5), 4, (2, 3, 4, 5)),
        ("rtx-a6000-3gpu.txt", (0, 1, 2), 2, (0, 1)),  # the NVLink bridge
        ("rtx-a6000-3gpu.txt", (1, 2), 2, (1, 2)),
        ("h100-sxm-8gpu.txt", (1, 2, 3, 4, 5, 6), 4, (1, 2, 3, 4)),  # can't avoid 2 nodes
        ("h100-sxm-8gpu.txt", (6, 0, 5), 1, (0,)),
    ],
)
def test_choose(name, free, count, chosen):
    assert leases.choose(list(free), count, topology(name)) == chosen


def test_choose_without_topology_takes_the_lowest():
    assert leases.choose([7, 2, 5, 3], 2, None) == (2, 3)


# --- processes ---------------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from glm5_matrix.machine import leases
    lock_dir, cell, out = sys.argv[1], sys.argv[2], sys.argv[3]
    said = []
    def say(line):
        said.append(line)
        print("said", line, flush=True)
    lease = leases.acquire(cell, 1, (0,), lock_dir=Path(lock_dir), timeout_s=60, poll_s=0.05,
                           say=say)
    start = time.time()
    print("held", flush=True)
    sys.stdin.readline()  # hold until told (or killed)
    end = time.time()
    lease.release()
    Path(out).write_text(json.dumps({"start": start, "end": end, "said": said,
                                     "waited_for": lease.waited_for}))
    """
)


def holder(lock_dir: Path, cell: str, out: Path) -> subprocess.Popen[str]:
    """A process that leases GPU 0 of `lock_dir`, says "held", and keeps it until told."""
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_dir), cell, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def wait_held(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"


def let_go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()


def test_waiting_names_the_holder_and_is_bounded(tmp_path):
    proc = holder(tmp_path / "leases", "e2e-tp1(deep_gemm)", tmp_path / "out.json")
    try:
        wait_held(proc)
        said: list[str] = []
        started = time.monotonic()
        with pytest.raises(leases.LeaseTimeout) as raised:
            take(tmp_path / "leases", "offload-tp1(simple)", timeout_s=1.0, say=said.append)
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait()
    wait_line = f"waiting for GPU 0: held by e2e-tp1(deep_gemm) pid {proc.pid} since "
    assert said and said[0].startswith(wait_line)  # said once: the holder did not change
    assert len(said) == 1 and "up to 1 s, GLM5_MATRIX_LEASE_TIMEOUT" in said[0]
    assert str(raised.value).startswith("no GPU lease after 1 s (GLM5_MATRIX_LEASE_TIMEOUT): ")
    assert wait_line in str(raised.value)
    record = raised.value.record
    assert record["timed_out"] is True and record["gpus"] == []
    assert record["waited_for"][0]["pid"] == proc.pid


def test_a_holder_that_dies_leaves_no_lease(tmp_path):
    proc = holder(tmp_path, "e2e-tp1(deep_gemm)", tmp_path / "out.json")
    wait_held(proc)
    with pytest.raises(leases.LeaseTimeout):  # the control: while it lives, GPU 0 is taken
        take(tmp_path, "offload-tp1(simple)")
    proc.kill()  # SIGKILL: no cleanup ran, the lock file still names the dead holder
    proc.wait()
    assert json.loads((tmp_path / "gpu0.lock").read_text())["pid"] == proc.pid
    lease = take(tmp_path, "offload-tp1(simple)")
    assert lease.gpus == (0,) and lease.waited_for == []
    lease.release()


def run_two(lock_a: Path, lock_b: Path, tmp_path: Path) -> tuple[dict, dict]:
    """cell-a leases GPU 0; then cell-b asks for it while cell-a holds it (sharing the folder,
    it says it waits), and cell-a lets go."""
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    a = holder(lock_a, "cell-a", out_a)
    wait_held(a)
    b = holder(lock_b, "cell-b", out_b)
    assert b.stdout is not None
    if lock_a == lock_b:
        assert b.stdout.readline().startswith("said waiting for GPU 0")
        let_go(a)
        wait_held(b)
    else:
        wait_held(b)
        let_go(a)
    let_go(b)
    return json.loads(out_a.read_text()), json.loads(out_b.read_text())


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_two_cells_on_one_gpu_take_turns(tmp_path):
    a, b = run_two(tmp_path / "leases", tmp_path / "leases", tmp_path)
    assert not overlap(a, b)
    assert a["said"] == [] and a["waited_for"] == []
    (line,) = b["said"]
    assert line.startswith("waiting for GPU 0: held by cell-a pid ")
    assert b["waited_for"][0]["cell"] == "cell-a"


def test_two_cells_with_separate_lock_folders_overlap(tmp_path):
    """The control: without the shared folder both hold "GPU 0" at once, which the check above
    would see."""
    a, b = run_two(tmp_path / "leases-a", tmp_path / "leases-b", tmp_path)
    assert overlap(a, b)


# --- through nox -j ----------------------------------------------------------------------------

CELL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    out, name = Path(os.environ["LEASE_TEST_OUT"]), sys.argv[1]
    start = time.time()
    (out / f"{name}.started").write_text("")
    if os.environ.get("LEASE_TEST_RENDEZVOUS"):  # both must run at once, or this one fails
        other = name[:-1] + ("b" if name.endswith("a") else "a")  # gpu-a <-> gpu-b
        deadline = time.time() + float(os.environ["LEASE_TEST_RENDEZVOUS"])
        while not (out / f"{other}.started").exists():
            if time.time() > deadline:
                sys.exit(f"{other} never ran beside {name}")
            time.sleep(0.05)
    else:
        time.sleep(5)  # long enough for the other cell to be waiting meanwhile
    (out / f"{name}.json").write_text(json.dumps({
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
        "start": start, "end": time.time()}))
    """
)


def checkout(tmp_path: Path, cells: dict[str, str]) -> Path:
    """A copy of the checkout whose matrix holds the given cells (name: their own fields), each
    running a script, not a suite."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("noxfile.py", "envs", "constraints", "profiles", "src"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, root / name)
    script = tmp_path / "cell.py"
    script.write_text(CELL_SCRIPT)
    matrix = "".join(
        f"""
[cells.{name}]
description = "a cell of the lease test"
suite = "lint"
env = "harness"
{fields}
commands = [[{json.dumps(sys.executable)}, {json.dumps(str(script))}, "{name}"]]
"""
        for name, fields in cells.items()
    )
    (root / "matrix.toml").write_text(matrix)
    (tmp_path / "out").mkdir()
    return root


@pytest.fixture
def gpu_checkout(tmp_path):
    """Two 1-GPU cells."""
    gpu = 'gpus = 1\nmin_compute_capability = "9.0"'
    return checkout(tmp_path, {"gpu-a": gpu, "gpu-b": gpu})


def nox(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = environ_without()
    environ.update(
        GLM5_MATRIX_ROOT=str(root),
        GLM5_MATRIX_PYTHON=sys.executable,  # nothing is built
        GLM5_MATRIX_RESULTS=str(root / "results"),
        GLM5_MATRIX_LEASE_DIR=str(root / "leases"),
        LEASE_TEST_OUT=str(root.parent / "out"),
        **env,
    )
    return run_nox(root, args, environ, timeout=300)


def ran(root: Path, name: str) -> dict:
    return json.loads((root.parent / "out" / f"{name}.json").read_text())


@nox_installed
def test_nox_parallel_on_one_gpu_runs_the_cells_in_turn(gpu_checkout):
    result = nox(gpu_checkout, "-s", "gpu-a", "gpu-b", "-j", "2", GLM5_MATRIX_GPUS="9.0")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    a, b = ran(gpu_checkout, "gpu-a"), ran(gpu_checkout, "gpu-b")
    assert not overlap(a, b)
    assert a["CUDA_VISIBLE_DEVICES"] == b["CUDA_VISIBLE_DEVICES"] == "0"
    assert a["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    first, second = ("gpu-a", "gpu-b") if a["start"] < b["start"] else ("gpu-b", "gpu-a")
    assert f"waiting for GPU 0: held by {first} pid " in output  # in the second's block
    record = json.loads((gpu_checkout / "results" / second / "lease.json").read_text())
    assert record["gpus"] == [0] and record["waited_for"][0]["cell"] == first
    assert record["waited_seconds"] > 0
    context = json.loads((gpu_checkout / "results" / second / "context.json").read_text())
    assert context["environment"]["CUDA_VISIBLE_DEVICES"] == "0"


@nox_installed
def test_nox_parallel_on_two_gpus_runs_the_cells_side_by_side(gpu_checkout):
    result = nox(
        gpu_checkout,
        "-s",
        "gpu-a",
        "gpu-b",
        "-j",
        "2",
        GLM5_MATRIX_GPUS="9.0,9.0",
        LEASE_TEST_RENDEZVOUS="120",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    a, b = ran(gpu_checkout, "gpu-a"), ran(gpu_checkout, "gpu-b")
    assert {a["CUDA_VISIBLE_DEVICES"], b["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}
    assert "waiting for" not in output


@nox_installed
def test_nox_serial_rendezvous_fails(gpu_checkout):
    """The control for the test above: run one after the other, the rendezvous fails."""
    result = nox(gpu_checkout, "-s", "gpu-a", GLM5_MATRIX_GPUS="9.0,9.0", LEASE_TEST_RENDEZVOUS="3")
    assert result.returncode != 0
    assert "gpu-b never ran beside gpu-a" in result.stdout + result.stderr


@nox_installed
@pytest.mark.parametrize("strict", [False, True])
def test_a_lease_timeout_skips_or_fails_under_strict(gpu_checkout, strict):
    proc = holder(gpu_checkout / "leases", "e2e-tp1(deep_gemm)", gpu_checkout / "h.json")
    try:
        wait_held(proc)
        extra = {"GLM5_MATRIX_STRICT": "1"} if strict else {}
        result = nox(
            gpu_checkout,
            "-s",
            "gpu-a",
            GLM5_MATRIX_GPUS="9.0",
            GLM5_MATRIX_LEASE_TIMEOUT="0",
            **extra,
        )
    finally:
        proc.kill()
        proc.wait()
    output = result.stdout + result.stderr
    assert (
        f"no GPU lease after 0 s (GLM5_MATRIX_LEASE_TIMEOUT): waiting for GPU 0: held by e2e-tp1(deep_gemm) pid {proc.pid}"
        in output
    )
    if strict:
        assert result.returncode != 0 and "GLM5_MATRIX_STRICT is set" in output
    else:
        assert result.returncode == 0 and "Session gpu-a skipped: no GPU lease" in output
    record = json.loads((gpu_checkout / "results" / "gpu-a" / "lease.json").read_text())
    assert record["timed_out"] is True
    assert not (gpu_checkout.parent / "out" / "gpu-a.started").exists()  # nothing ran


# --- CPU cores ---------------------------------------------------------------------------------


def test_cores_are_leased_apart_from_gpus(tmp_path):
    """core<N>.lock, not gpu<N>.lock: a cell bound to core 0 does not wait for GPU 0's holder."""
    folder = tmp_path / "leases"
    gpu = take(folder, "gpu-cell", pool=(0,))
    with (
        gpu,
        leases.acquire(
            "core-cell", 2, (0, 1), lock_dir=folder, timeout_s=0, kind=leases.CORE
        ) as cores,
    ):
        assert cores.cores == (0, 1) and cores.gpus == () and cores.environment() == {}
        assert cores.describe() == "CPU cores 0,1"
        with pytest.raises(
            leases.LeaseTimeout,
            match=r"no CPU core lease .*waiting for CPU core 1: held by core-cell",
        ) as waited:
            leases.acquire("other", 1, (1,), lock_dir=folder, timeout_s=0, kind=leases.CORE)
        assert waited.value.record["waited_for"][0]["core"] == 1
    locks = sorted(p.name for p in folder.glob("*.lock") if not p.name.startswith("."))
    assert locks == ["core0.lock", "core1.lock", "gpu0.lock"]


def test_lease_cell_takes_the_cores_a_cell_binds(matrix, tmp_path):
    environ = lease_environ(tmp_path, "")
    found = hardware.detect(environ)
    with leases.lease_cell(matrix.variant("pd-nixl-cpu-tp2-tp1"), found, environ) as lease:
        assert lease.cores == (0, 1) and lease.gpus == ()
        assert lease.record()["cores"] == [0, 1]
        with pytest.raises(leases.LeaseTimeout, match=r"held by pd-nixl-cpu-tp2-tp1 pid \d+"):
            leases.lease_cell(matrix.variant("pd-nixl-cpu-tp1-tp2"), found, environ)
        # A cell that binds no core runs beside it.
        assert leases.lease_cell(matrix.variant("e2e-cpu"), found, environ).cores == ()
    with leases.lease_cell(matrix.variant("pd-nixl-cpu-tp1-tp2"), found, environ) as lease:
        assert lease.cores == (0, 1)


@pytest.fixture
def core_checkout(tmp_path, request):
    """Two CPU cells bound to the cores given (the parameter: each cell's `cores`)."""
    a, b = request.param
    return checkout(tmp_path, {"core-a": f"cores = {a}", "core-b": f"cores = {b}"})


@nox_installed
@pytest.mark.parametrize("core_checkout", [([0, 1], [1])], indirect=True)
def test_nox_parallel_cells_binding_one_core_run_in_turn(core_checkout):
    """What pd-nixl-cpu-tp1-tp2 and -tp2-tp1 (both bound to cores 0 and 1) do under nox -t cpu
    -j 2: one waits for the other."""
    result = nox(core_checkout, "-s", "core-a", "core-b", "-j", "2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    a, b = ran(core_checkout, "core-a"), ran(core_checkout, "core-b")
    assert not overlap(a, b)
    first, second = ("core-a", "core-b") if a["start"] < b["start"] else ("core-b", "core-a")
    assert f"held by {first} pid " in output
    record = json.loads((core_checkout / "results" / second / "lease.json").read_text())
    assert record["cores"] == ([0, 1] if second == "core-a" else [1])
    assert record["gpus"] == [] and record["waited_for"][0]["cell"] == first


@nox_installed
@pytest.mark.parametrize("core_checkout", [([0], [1])], indirect=True)
def test_nox_parallel_cells_on_other_cores_run_side_by_side(core_checkout):
    """The control: bound to other cores, the two meet (each waits for the other to start)."""
    result = nox(core_checkout, "-s", "core-a", "core-b", "-j", "2", LEASE_TEST_RENDEZVOUS="120")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "waiting for" not in output
