"""Who wrote a kernel file (glm5_matrix.kernels.writers): real processes write one shared cache
the way the libraries do (an object written in place over seconds, a compiler naming its output
with -o, Triton's put through tmp.pid_<PID>_ and a rename), one of them the cell's (a child of
this process, as engine workers are) and one a stranger (double-forked, in a session of its own:
no descendant of this process). Only the cell's files count, and the guard fails on them alone;
with the stranger alone it fails on nothing; a control that takes every process for the cell's
(what counting every new file did) blames the cell for the stranger's files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_matrix.kernels import kernel_cache, writers
from glm5_matrix.kernels.writers import CELL, OTHER, UNSEEN, FileWrite, Sighting

MODULES = ".cache/flashinfer/0.7.2/90a/cached_ops"

# What a library's JIT does to the cache, as a real process: ROLE is "cell" or "stranger";
# every write waits for GO, so the two processes write at the same time. A compile holds its
# output HOLD seconds (real ones take seconds to minutes): longer than the watch's longest wait
# between looks on a busy machine (writers.MAX_WAIT_S) plus a look.
WRITER = r"""
import os, subprocess, sys, time, uuid
root, role, go = sys.argv[1], sys.argv[2], sys.argv[3]
if role == "compile":  # a compiler: its output named on the command line, written at the end
    time.sleep(HOLD)
    with open(sys.argv[5], "wb") as out:
        out.write(b"object")
    sys.exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
module = "fused_moe_90" if role == "stranger" else "sampling"
folder = os.path.join(root, "flashinfer", "MODULES", module)
os.makedirs(folder, exist_ok=True)
for i in range(2):  # ninja's nvcc writing an object in place
    with open(os.path.join(folder, f"part{i}.cuda.o"), "wb") as out:
        out.write(b"half")
        out.flush()
        time.sleep(HOLD)
        out.write(b"rest")
# A compiler naming its output, in a module folder of its own: each way of seeing a writer is
# the only one for some files.
linked = folder + "_bindings"
os.makedirs(linked, exist_ok=True)
subprocess.run([sys.executable, __file__, root, "compile", go, "-o", os.path.join(linked, "link.so")], check=True)
# Triton's FileCacheManager: makedirs(<hash>) first, then each put through tmp.pid_<pid>_<uuid>.
kernel = os.path.join(root, "triton", role.upper() + "HASH")
os.makedirs(kernel, exist_ok=True)
time.sleep(0.05)  # the first compile stage
for name in ("_kernel.ttir", "_kernel.cubin", "_kernel.json"):
    temp = os.path.join(kernel, f"tmp.pid_{os.getpid()}_{uuid.uuid4()}")
    os.makedirs(temp, exist_ok=True)
    with open(os.path.join(temp, name), "wb") as out:
        out.write(role.encode() + name.encode())
    os.replace(os.path.join(temp, name), os.path.join(kernel, name))
    os.removedirs(temp)
open(os.path.join(go + "." + role), "w").close()
""".replace("MODULES", MODULES).replace("HOLD", "3.0")


def files_of(role: str) -> dict[str, list[str]]:
    module = "fused_moe_90" if role == "stranger" else "sampling"
    return {
        "flashinfer": sorted(
            (
                f"{MODULES}/{module}/part0.cuda.o",
                f"{MODULES}/{module}/part1.cuda.o",
                f"{MODULES}/{module}_bindings/link.so",
            )
        ),
        "triton": sorted(
            f"{role.upper()}HASH/{name}"
            for name in ("_kernel.cubin", "_kernel.json", "_kernel.ttir")
        ),
    }


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for library in kernel_cache.LIBRARIES:
        monkeypatch.delenv(library.variable, raising=False)
    monkeypatch.delenv("GLM5_MATRIX_STRICT", raising=False)
    root = tmp_path / "kernels"
    for name, variable in (
        ("flashinfer", "FLASHINFER_WORKSPACE_BASE"),
        ("triton", "TRITON_CACHE_DIR"),
    ):
        (root / name).mkdir(parents=True)
        monkeypatch.setenv(variable, str(root / name))
    (tmp_path / "writer.py").write_text(WRITER)
    return root


class Everyone(writers.Cell):
    """The planted defect: every process is taken for the cell's."""

    def member(self, pid: int) -> bool:
        return True


def start_stranger(command: list[str]) -> int:
    """Start `command` as no descendant of this process: a launcher starts it in a session of
    its own and exits, so it is re-parented away from us. Returns its pid."""
    launcher = (
        "import subprocess, sys; "
        "print(subprocess.Popen(sys.argv[1:], start_new_session=True, "
        "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    done = subprocess.run(
        [sys.executable, "-c", launcher, *command], capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip())


def run_writers(
    cache: Path, roles: tuple[str, ...], cell: writers.Cell | None = None
) -> tuple[list[FileWrite], dict[str, int]]:
    """Run a writer per role at once, watched; returns attribute() of what they wrote and the
    pid of each role."""
    go = cache.parent / "go"
    script = str(cache.parent / "writer.py")
    before = kernel_cache.snapshot()
    watch = writers.Watch(cell=cell or writers.Cell(domain={}), poll=0.05).start()
    pids, own = {}, None
    try:
        if "stranger" in roles:
            pids["stranger"] = start_stranger(
                [sys.executable, script, str(cache), "stranger", str(go)]
            )
        if "cell" in roles:
            own = subprocess.Popen([sys.executable, script, str(cache), "cell", str(go)])
            pids["cell"] = own.pid
        go.touch()
        deadline = time.monotonic() + 60
        while not all(Path(f"{go}.{role}").exists() for role in roles):
            assert time.monotonic() < deadline, "the writers did not finish"
            time.sleep(0.05)
        if own is not None:
            assert own.wait(timeout=30) == 0
    finally:
        sightings = watch.stop()
        if own is not None and own.poll() is None:
            own.kill()
            own.wait()
        if "stranger" in pids:  # it wrote its done file last; give it a moment, then by id
            deadline = time.monotonic() + 5
            while os.path.exists(f"/proc/{pids['stranger']}") and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{pids['stranger']}"):
                os.kill(pids["stranger"], signal.SIGKILL)
    changed = kernel_cache.written(before, kernel_cache.snapshot())
    return writers.attribute(changed, sightings), pids


def by_writer(writes: list[FileWrite]) -> dict[str, dict[str, list[str]]]:
    found: dict[str, dict[str, list[str]]] = {}
    for write in writes:
        found.setdefault(write.writer, {}).setdefault(write.library, []).append(write.path)
    return {w: {lib: sorted(p) for lib, p in libs.items()} for w, libs in found.items()}


def test_two_processes_on_one_cache_only_the_cells_files_count(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes, pids = run_writers(cache, ("cell", "stranger"))
    assert by_writer(writes) == {CELL: files_of("cell"), OTHER: files_of("stranger")}
    assert not writers.Cell(domain={}).member(pids["stranger"])
    for write in writes:  # the writer scripts, or the compilers they started (their children)
        assert write.pids and write.counted == (write.writer == CELL)
        assert pids["cell" if write.writer == OTHER else "stranger"] not in write.pids
        if write.path.endswith(".cuda.o"):  # written in place by the script itself
            assert write.pids == (pids["stranger" if write.writer == OTHER else "cell"],)
    assert writers.counted(writes) == files_of("cell")
    # Under the guard the cell fails on its own files, the stranger's named as not counted.
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "1")
    with pytest.raises(kernel_cache.KernelCompiled) as refused:
        kernel_cache.refuse_compiled(
            writers.counted(writes), "the start", writers.describe_not_counted(writes)
        )
    text = str(refused.value)
    assert "flashinfer: 3 file(s)" in text and "triton: 3 file(s)" in text
    assert "sampling" in text and "fused_moe_90" not in text
    assert "6 written by process(es) outside the cell (" in text and str(pids["stranger"]) in text


def test_a_stranger_alone_never_fails_the_cell(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes, _ = run_writers(cache, ("stranger",))
    assert by_writer(writes) == {OTHER: files_of("stranger")}
    assert writers.counted(writes) == {"flashinfer": [], "triton": []}
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "1")
    kernel_cache.refuse_compiled(writers.counted(writes), "the start")  # no raise


def test_the_cell_alone_still_fails(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes, _ = run_writers(cache, ("cell",))
    assert writers.counted(writes) == files_of("cell")
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "1")
    with pytest.raises(kernel_cache.KernelCompiled):
        kernel_cache.refuse_compiled(writers.counted(writes), "the start")


def test_control_taking_every_process_for_the_cells_blames_the_stranger(cache: Path) -> None:
    """The planted defect (attribution broken: every writer is the cell's) is caught by the
    assertions above: the stranger's six files count against the cell."""
    writes, _ = run_writers(cache, ("cell", "stranger"), cell=Everyone(domain={}))
    assert writers.counted(writes) != files_of("cell")
    assert writers.counted(writes) == {
        lib: sorted(files_of("cell")[lib] + files_of("stranger")[lib])
        for lib in ("flashinfer", "triton")
    }


# --- the rules, on sightings given ------------------------------------------------------------


def sighting(pid: int, member: bool, library: str, entry: str | None) -> Sighting:
    return Sighting(pid, member, f"proc {pid}", library, entry, "open for writing")


CHANGED = {"triton": ["A/k.cubin", "B/k.cubin"], "deep_gemm": ["cache/k1/kernel.cubin"]}


def test_a_sighting_in_the_kernels_folder_decides() -> None:
    writes = writers.attribute(
        CHANGED,
        [sighting(10, True, "triton", "A"), sighting(20, False, "triton", "B")],
    )
    got = {(w.library, w.path): (w.writer, w.counted, w.pids) for w in writes}
    assert got[("triton", "A/k.cubin")] == (CELL, True, (10,))
    assert got[("triton", "B/k.cubin")] == (OTHER, False, (20,))
    # Nothing seen for deep_gemm, but a stranger wrote the cache: not counted, said so.
    assert got[("deep_gemm", "cache/k1/kernel.cubin")] == (UNSEEN, False, ())
    assert "whose writer was not seen while another process wrote" in writers.describe_not_counted(
        writes
    )


def test_unseen_counts_when_no_stranger_wrote() -> None:
    writes = writers.attribute(CHANGED, [sighting(10, True, "triton", "A")])
    assert [(w.writer, w.counted) for w in writes if w.library == "deep_gemm"] == [(UNSEEN, True)]
    assert writers.counted(writes) == {
        "deep_gemm": ["cache/k1/kernel.cubin"],
        "triton": ["A/k.cubin", "B/k.cubin"],
    }
    assert writers.counted(writers.attribute(CHANGED, [])) == CHANGED  # nothing seen: all count


def test_the_librarys_temporary_files_decide_only_when_one_side_wrote_them() -> None:
    ours = writers.attribute(CHANGED, [sighting(10, True, "deep_gemm", None)])
    assert [(w.writer, w.counted) for w in ours if w.library == "deep_gemm"] == [(CELL, True)]
    theirs = writers.attribute(CHANGED, [sighting(20, False, "deep_gemm", None)])
    assert [(w.writer, w.counted) for w in theirs if w.library == "deep_gemm"] == [(OTHER, False)]
    both = writers.attribute(
        CHANGED, [sighting(10, True, "deep_gemm", None), sighting(20, False, "deep_gemm", None)]
    )
    assert [(w.writer, w.counted) for w in both if w.library == "deep_gemm"] == [(UNSEEN, False)]


def test_a_kernels_folder_per_library() -> None:
    assert writers.entry("triton", "abc/x.cubin") == "abc"
    assert writers.entry("triton", "abc/tmp.pid_12_u/x.cubin") == "abc"
    assert (
        writers.entry("flashinfer", f"{MODULES}/fused_moe_90/a.cuda.o") == f"{MODULES}/fused_moe_90"
    )
    assert writers.entry("flashinfer", f"{MODULES}/tmp/fused_moe_90.lock") is None
    assert writers.entry("deep_gemm", "cache/kernel.abc/kernel.cubin") == "cache/kernel.abc"
    assert writers.entry("deep_gemm", "tmp/0f3a/kernel.cubin") is None
    assert (
        writers.entry("tilelang", "0.1.12/linux/kernels/key/lib.so") == "0.1.12/linux/kernels/key"
    )


def test_a_process_in_the_cells_cgroup_is_the_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """An orphan re-parented away from the cell is still the cell's through its cgroup."""
    domain = {"0:": "/user.slice/glm5-matrix-e2e-1-2"}
    groups = {
        111: {"0:": "/user.slice/glm5-matrix-e2e-1-2"},
        112: {"0:": "/user.slice/glm5-matrix-e2e-1-2/sub"},
        113: {"0:": "/user.slice/glm5-matrix-other-3-4"},
    }
    monkeypatch.setattr(writers, "_cgroups", lambda pid: groups.get(pid, {}))
    monkeypatch.setattr(writers.processes, "proc_stat", lambda pid: ("S", 1, pid))
    monkeypatch.setattr(writers.processes, "start_time", lambda pid: 5)
    cell = writers.Cell(root=99, domain=domain)
    assert [cell.member(pid) for pid in (111, 112, 113, 114)] == [True, True, False, False]
