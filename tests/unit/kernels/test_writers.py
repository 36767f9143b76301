"""Who wrote a kernel file (glm5_matrix.kernels.writers): real processes write one shared cache
the way the libraries do (an object written in place over seconds, a compiler naming its output
with -o, Triton's put through tmp.pid_<PID>_ and a rename), one of them the cell's (a child of
this process, as engine workers are) and one a stranger (double-forked, in a session of its own:
no descendant of this process). Only the cell's files count, and the guard fails on them alone;
with the stranger alone it fails on nothing; a control that takes every process for the cell's
(what counting every new file did) blames the cell for the stranger's files."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_matrix.kernels import kernel_cache, kernel_guard, writers
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


def start_stranger(command: list[str], env: dict[str, str] | None = None) -> int:
    """Start `command` as no descendant of this process: a launcher starts it in a session of
    its own and exits, so it is re-parented away from us. Returns its pid."""
    launcher = (
        "import subprocess, sys; "
        "print(subprocess.Popen(sys.argv[1:], start_new_session=True, "
        "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    done = subprocess.run(
        [sys.executable, "-c", launcher, *command],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return int(done.stdout.strip())


def run_writers(
    cache: Path, roles: tuple[str, ...], cell: writers.Cell | None = None
) -> tuple[list[FileWrite], dict[str, int]]:
    """Run a writer per role at once, watched; returns attribute() of what they wrote and the
    pid of each role."""
    go = cache.parent / "go"
    script = str(cache.parent / "writer.py")
    pids, own = {}, None
    if "stranger" in roles:  # re-parented away from us before the watch's first look
        pids["stranger"] = start_stranger([sys.executable, script, str(cache), "stranger", str(go)])
    before = kernel_cache.snapshot()
    watch = writers.Watch(cell=cell or writers.Cell(domain={}), poll=0.05).start()
    try:
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
    # The stranger's Triton puts may all end before their folder is scanned on a loaded box
    # (1 of 8 runs at load 13): then they are unseen, and still not counted beside it.
    late = {
        OTHER: {"flashinfer": files_of("stranger")["flashinfer"]},
        UNSEEN: {"triton": files_of("stranger")["triton"]},
    }
    seen = by_writer(writes)
    assert seen == {CELL: files_of("cell"), OTHER: files_of("stranger")} or seen == {
        CELL: files_of("cell"),
        **late,
    }
    assert not writers.Cell(domain={}).member(pids["stranger"])
    assert not any(w.counted for w in writes if w.writer == UNSEEN)
    for write in [w for w in writes if w.writer != UNSEEN]:  # the scripts, or their compilers
        assert write.pids and write.counted == (write.writer == CELL)
        assert pids["cell" if write.writer == OTHER else "stranger"] not in write.pids
        if write.path.endswith(".cuda.o"):  # written in place by the script itself
            assert write.pids == (pids["stranger" if write.writer == OTHER else "cell"],)
    assert writers.counted(writes) == files_of("cell")
    # Under the guard the cell fails on its own files, the stranger's named as not counted.
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    with pytest.raises(kernel_guard.KernelCompiled) as refused:
        kernel_guard.refuse_compiled(
            writers.counted(writes), "the start", writers.describe_not_counted(writes)
        )
    text = str(refused.value)
    assert "flashinfer: 3 file(s)" in text and "triton: 3 file(s)" in text
    assert "sampling" in text and "fused_moe_90" not in text
    outside = "6" if seen == {CELL: files_of("cell"), OTHER: files_of("stranger")} else "3"
    assert f"{outside} written by process(es) outside the cell (" in text
    assert str(pids["stranger"]) in text


def test_a_stranger_alone_never_fails_the_cell(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes, _ = run_writers(cache, ("stranger",))
    assert by_writer(writes) == {OTHER: files_of("stranger")}
    assert writers.counted(writes) == {"flashinfer": [], "triton": []}
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    kernel_guard.refuse_compiled(writers.counted(writes), "the start")  # no raise


def test_the_cell_alone_still_fails(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes, _ = run_writers(cache, ("cell",))
    assert writers.counted(writes) == files_of("cell")
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    with pytest.raises(kernel_guard.KernelCompiled):
        kernel_guard.refuse_compiled(writers.counted(writes), "the start")


def test_control_taking_every_process_for_the_cells_blames_the_stranger(cache: Path) -> None:
    """The planted defect (attribution broken: every writer is the cell's) is caught by the
    assertions above: the stranger's six files count against the cell."""
    writes, _ = run_writers(cache, ("cell", "stranger"), cell=Everyone(domain={}))
    assert writers.counted(writes) != files_of("cell")
    assert writers.counted(writes) == {
        lib: sorted(files_of("cell")[lib] + files_of("stranger")[lib])
        for lib in ("flashinfer", "triton")
    }


# --- a write nobody saw --------------------------------------------------------------------------

# A write too short to be seen (in-process, microseconds: as Inductor's, vLLM's or a Triton
# put that ended before its folder was scanned), by a process that then stays HOLD seconds
# in one way able to write the cache: HOW is "environment" (started pointed at it), "open" (a
# file of it open for reading), "mapped" (a file of it mapped, its descriptor closed), "cwd"
# (its working folder in it) or "none".
UNSEEN_WRITER = r"""
import importlib.util, os, sys, time
how, written, existing, done = sys.argv[1:5]
held = None
if how == "open":
    held = open(existing, "rb")
elif how == "mapped":  # a module loaded from the cache, as FlashInfer loads its JIT modules
    spec = importlib.util.spec_from_file_location("_bisect", existing)
    held = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(held)
elif how == "cwd":
    os.chdir(os.path.dirname(existing))
open(done + ".ready", "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(done + ".go") and time.monotonic() < deadline:
    time.sleep(0.01)
os.makedirs(os.path.dirname(written), exist_ok=True)
with open(written, "wb") as out:
    out.write(b"compiled")
time.sleep(HOLD)
open(done, "w").close()
""".replace("HOLD", "3.0")

ABLE = {
    "environment": ("_started_pointed", "started with the cache in its environment"),
    "open": ("_has_open", "has a file of it open"),
    "mapped": ("_has_mapped", "has a file of it mapped"),
    "cwd": ("_works_in", "works in it"),
}


def run_unseen(
    cache: Path, how: str, stranger: bool, watch_class: type[writers.Watch] = writers.Watch
) -> tuple[list[FileWrite], int]:
    """One unseen write into Triton's folder by a process able to write the cache in the one
    way `how` (a stranger, or a child of this process), watched; (attribute(), its pid)."""
    triton = cache / "triton"
    # A module in the cache before the window (a real one: the stranger may load it).
    existing = triton / "OLD" / "_bisect.so"
    existing.parent.mkdir()
    shutil.copyfile(str(importlib.util.find_spec("_bisect").origin), existing)
    done = cache.parent / f"done.{how}"
    env = dict(os.environ)
    if how != "environment":  # no variable pointing at the cache: `how` alone shows it
        for name in writers._POINTERS:
            env.pop(name, None)
    command = [sys.executable, "-c", UNSEEN_WRITER, how, str(triton / "NEW" / "k.cubin")]
    command += [str(existing), str(done)]
    # The writer is set up (and a stranger re-parented away from us) before the window opens:
    # the watch's first look sees it as it stays.
    own = None
    if stranger:
        pid = start_stranger(command, env)
    else:
        own = subprocess.Popen(command, env=env)
        pid = own.pid
    deadline = time.monotonic() + 30
    while not Path(f"{done}.ready").exists():
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.01)
    before = kernel_cache.snapshot()
    watch = watch_class(cell=writers.Cell(domain={}), poll=0.05).start()
    try:
        Path(f"{done}.go").touch()
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "the writer did not finish"
            time.sleep(0.05)
    finally:
        sightings = watch.stop()
        if own is not None:
            own.wait(timeout=30)
        elif os.path.exists(f"/proc/{pid}"):
            time.sleep(0.5)
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
    changed = kernel_cache.written(before, kernel_cache.snapshot())
    assert changed == {"flashinfer": [], "triton": ["NEW/k.cubin"]}
    return writers.attribute(changed, sightings), pid


@pytest.mark.parametrize("how", sorted(ABLE))
def test_an_unseen_write_beside_a_stranger_able_to_write_never_counts(
    cache: Path, how: str
) -> None:
    """Nobody is seen writing NEW/k.cubin; a stranger was in the cache (in the one way `how`):
    not counted, and the stranger is named."""
    writes, pid = run_unseen(cache, how, stranger=True)
    assert [(w.writer, w.counted) for w in writes] == [(UNSEEN, False)]
    assert f"{pid} ({ABLE[how][1]})" in writes[0].why
    assert f"{pid} ({ABLE[how][1]})" in writers.describe_not_counted(writes)


def test_an_unseen_write_with_only_the_cell_in_the_cache_counts(cache: Path) -> None:
    """The cell's own short write, nobody else in the cache: counted (the cell's compile fails)."""
    writes, _ = run_unseen(cache, "environment", stranger=False)
    assert [(w.writer, w.counted) for w in writes] == [(UNSEEN, True)]
    assert writes[0].why == "no process outside the cell was in the cache"
    assert writers.counted(writes) == {"triton": ["NEW/k.cubin"]}


class Blind(writers.Watch):
    """A planted defect: one way of being able to write the cache is not looked at."""

    way = ""

    def _started_pointed(self, pid: int) -> None:
        if self.way != "_started_pointed":
            super()._started_pointed(pid)

    def _has_open(self, pid: int, fds: list[str]) -> None:
        if self.way != "_has_open":
            super()._has_open(pid, fds)

    def _has_mapped(self, pid: int) -> None:
        if self.way != "_has_mapped":
            super()._has_mapped(pid)

    def _works_in(self, pid: int) -> None:
        if self.way != "_works_in":
            super()._works_in(pid)


@pytest.mark.parametrize("how", sorted(ABLE))
def test_control_a_watch_blind_to_one_way_blames_the_cell(cache: Path, how: str) -> None:
    """Each way broken on purpose turns the test above red: the stranger's file counts."""
    blind = type("Blind", (Blind,), {"way": ABLE[how][0]})
    writes, _ = run_unseen(cache, how, stranger=True, watch_class=blind)
    assert [(w.writer, w.counted) for w in writes] == [(UNSEEN, True)]


def test_control_a_stranger_in_no_way_in_the_cache_is_not_seen(cache: Path) -> None:
    """The limit, measured: a stranger that writes unseen and is in the cache in none of the
    ways is taken for nobody; the only processes that write the cache are started pointed at
    it (the runner's variables) or use it."""
    writes, _ = run_unseen(cache, "none", stranger=True)
    assert [(w.writer, w.counted) for w in writes] == [(UNSEEN, True)]


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
    assert (
        "1 whose writer was not seen (processes outside the cell were in the cache: 20 (wrote it))"
        in writers.describe_not_counted(writes)
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


def test_the_cells_temporary_files_beside_a_stranger_in_the_cache_name_no_writer() -> None:
    """The cell seen in a library's temporary files (a lock, a tmp/ file) says nothing of which
    kernel it wrote: with a process outside the cell able to write the cache, a file with no
    sighting in its own folder may be that process's, and is not counted."""
    able = Sighting(20, False, "proc 20", "deep_gemm", None, "has a file of it open", False)
    writes = writers.attribute(CHANGED, [sighting(10, True, "deep_gemm", None), able])
    assert [(w.writer, w.counted) for w in writes if w.library == "deep_gemm"] == [(UNSEEN, False)]
    assert "20 (has a file of it open)" in writers.describe_not_counted(writes)


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


# --- Triton's puts made before their folder was watched ------------------------------------------

# Triton's put (triton/runtime/cache.py), stopped after the rename: its temporary folder
# tmp.pid_<PID>_<uuid> is still there, the kernel file already in <hash>/, until GO exists.
PUT = r"""
import os, sys, time, uuid
kernel, ready, go = sys.argv[1:4]
os.makedirs(kernel, exist_ok=True)
temp = os.path.join(kernel, f"tmp.pid_{os.getpid()}_{uuid.uuid4()}")
os.makedirs(temp)
with open(os.path.join(temp, "_kernel.cubin"), "wb") as out:
    out.write(b"cubin")
os.replace(os.path.join(temp, "_kernel.cubin"), os.path.join(kernel, "_kernel.cubin"))
open(ready, "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
os.removedirs(temp)
"""


def start_put(
    tmp_path: Path, kernel: Path, tag: str = "put"
) -> tuple[subprocess.Popen[bytes], Path]:
    """A process that makes `kernel` and a put in it, and holds the put's temporary folder."""
    ready, go = tmp_path / f"{tag}.ready", tmp_path / f"{tag}.go"
    put = subprocess.Popen([sys.executable, "-c", PUT, str(kernel), str(ready), str(go)])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert put.poll() is None and time.monotonic() < deadline, "the put did not happen"
        time.sleep(0.01)
    return put, go


def finish(put: subprocess.Popen[bytes], go: Path) -> None:
    go.touch()
    assert put.wait(timeout=30) == 0


@pytest.fixture
def triton(tmp_path: Path) -> Path:
    folder = tmp_path / "triton"
    folder.mkdir()
    return folder


def test_a_put_under_way_when_the_watch_starts_names_its_writer(
    tmp_path: Path, triton: Path
) -> None:
    """<hash>/ and its put exist before the watch: the watch's first scan finds the put's
    temporary folder (a watch that only listens for what comes next misses it)."""
    put, go = start_put(tmp_path, triton / "HASH")
    inotify = writers._Inotify({"triton": triton})
    try:
        assert inotify.fd >= 0
        assert inotify.writers() == [(put.pid, "HASH")]
        assert inotify.writers() == []  # said once
    finally:
        inotify.close()
        finish(put, go)


def test_a_put_made_before_its_new_folder_was_watched_names_its_writer(
    tmp_path: Path, triton: Path
) -> None:
    """The race of a watch added on an event: <hash>/ and its put are made after the watch on
    Triton's folder started but before its event was read (a listener that was not scheduled in
    time). Reading the event watches <hash>/ and scans it: the put is found."""
    inotify = writers._Inotify({"triton": triton})
    try:
        put, go = start_put(tmp_path, triton / "LATE")  # the listener has read nothing yet
        try:
            assert inotify.writers() == [(put.pid, "LATE")]
        finally:
            finish(put, go)
        # From here on <hash>/ is watched: a later put in it is an event.
        again, go_again = start_put(tmp_path, triton / "LATE", "again")
        try:
            assert inotify.writers() == [(again.pid, "LATE")]
        finally:
            finish(again, go_again)
    finally:
        inotify.close()


def test_an_unwatched_window_says_so_and_never_that_no_stranger_was_there() -> None:
    # The guard off, no Watch ran: a file written then counts (as before writers were told
    # apart) but its record must not claim what only a watch can tell (seen on the H200: a
    # stranger's fused_moe_90 objects reported "no process outside the cell was in the cache").
    changed = {"flashinfer": [".cache/flashinfer/x/90a/cached_ops/fused_moe_90/a.cuda.o"]}
    (write,) = writers.unwatched(changed)
    assert write.counted and write.writer == writers.UNSEEN
    assert write.why == writers.UNWATCHED_WHY
    (watched,) = writers.attribute(changed, ())
    assert watched.why != write.why  # the control: a watch that saw nobody says otherwise


# --- a file every process keeps open -------------------------------------------------------------

# FlashInfer's JIT logger: a FileHandler on flashinfer_jit.log, open for appending in every process
# that logs (an engine core from its start to its end).
LOGGER = r"""
import os, sys, time
path, done = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "a") as log:
    log.write("flashinfer.jit: Loading JIT ops\n")
    log.flush()
    deadline = time.monotonic() + 30
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.01)
"""
# A stranger's tiny module build (1.4 s each on the H200): every file written at once, too fast to
# be seen open; it stays alive a moment after, started pointed at the cache as any build by hand.
QUICK = r"""
import os, sys, time
folder, go, done = sys.argv[1], sys.argv[2], sys.argv[3]
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
os.makedirs(folder, exist_ok=True)
for name in ("build.ninja", "tiny.cuda.o", "tiny.so"):
    with open(os.path.join(folder, name), "wb") as out:
        out.write(b"x")
open(done, "w").close()
time.sleep(1.5)
"""


def test_a_log_every_process_keeps_open_does_not_make_the_cell_a_modules_writer(
    cache: Path, tmp_path: Path
) -> None:
    """Seen on the H200 (offload-tp1(offloading), GLM5_MATRIX_STRICT=1, a stranger building a
    tiny FlashInfer module every 1.4 s into the same cache): the start failed on 80 of the
    stranger's module files, each counted as written by the cell's VLLM::EngineCore, which had
    flashinfer_jit.log open for appending; that log's folder holds every module's folder, so the
    sighting covered them all. A bookkeeping file open for writing names no kernel's writer."""
    log = cache / "flashinfer/.cache/flashinfer/0.7.2/90a/flashinfer_jit.log"
    module = f"{MODULES}/stranger_tiny_1"
    go, done = tmp_path / "go", tmp_path / "done"
    (tmp_path / "logger.py").write_text(LOGGER)
    (tmp_path / "quick.py").write_text(QUICK)
    stranger = start_stranger(
        [
            sys.executable,
            str(tmp_path / "quick.py"),
            str(cache / "flashinfer" / module),
            str(go),
            str(done),
        ]
    )
    before = kernel_cache.snapshot()
    watch = writers.Watch(cell=writers.Cell(domain={}), poll=0.05).start()
    own = subprocess.Popen([sys.executable, str(tmp_path / "logger.py"), str(log), str(done)])
    try:
        deadline = time.monotonic() + 30
        while not log.exists():
            assert time.monotonic() < deadline, "the logger did not open its log"
            time.sleep(0.01)
        time.sleep(writers.MAX_WAIT_S + 0.2)  # the watch has seen the cell's log open
        go.touch()
        assert own.wait(timeout=30) == 0
        time.sleep(writers.MAX_WAIT_S + 0.2)  # and the stranger, still alive
    finally:
        sightings = watch.stop()
        if own.poll() is None:
            own.kill()
            own.wait()
        if os.path.exists(f"/proc/{stranger}"):
            os.kill(stranger, signal.SIGKILL)
    writes = writers.attribute(kernel_cache.written(before, kernel_cache.snapshot()), sightings)
    theirs = sorted(f"{module}/{name}" for name in ("build.ninja", "tiny.cuda.o", "tiny.so"))
    assert sorted(w.path for w in writes) == theirs
    assert [w.writer for w in writes] != [CELL] * 3
    assert writers.counted(writes) == {"flashinfer": []}
