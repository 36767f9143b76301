"""Scaffolding several unit-test files share: nox and the `glm5-matrix` CLI run in a child
process, the kernel-cache key the kernel tests build caches for, and a threaded HTTP server
on a free loopback port, and this process's environment less the harness's own variables or
with the checkout's src/ on PYTHONPATH."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from glm5_matrix.files import repo_root

ROOT = repo_root()
SRC = ROOT / "src"

# A kernel cache's key: the versions of everything that compiles kernels, and the GPU arch.
KERNEL_KEY = {
    "python": "3.12",
    "vllm": "0.33.0",
    "flashinfer-python": "0.7.2.post1",
    "torch": "2.14.0",
    "triton": "3.8.0",
    "tilelang": "0.1.12",
    "cuda": "13.0",
    "gpu_arch": "sm90",
}

nox_installed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "nox", "--version"], capture_output=True).returncode,
    reason="nox is not installed in this interpreter",
)


def environ_without(*prefixes: str) -> dict[str, str]:
    """os.environ less every variable named with one of `prefixes` (GLM5_ when none given):
    a child that must see none of this run's GLM5_MATRIX_* settings."""
    drop = prefixes or ("GLM5_",)
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def environ_with_src(*drop: str, **extra: str) -> dict[str, str]:
    """os.environ with the checkout's src/ first on PYTHONPATH, less the variables named in
    `drop`, plus `extra`: a child Python that imports glm5_matrix from this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_nox(
    root: Path, args: tuple[str, ...], env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`nox -f ROOT/noxfile.py ARGS...` in this interpreter, with exactly `env`."""
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(root / "noxfile.py"), *args],
        capture_output=True,
        text=True,
        env=dict(env),
        timeout=timeout,
    )


def run_cli(
    *args: str,
    env: Mapping[str, str],
    timeout: float,
    stdin: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m glm5_matrix.cli ARGS...` with `env`, the checkout's src/ as its PYTHONPATH."""
    return subprocess.run(
        [sys.executable, "-m", "glm5_matrix.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**env, "PYTHONPATH": str(SRC)},
        cwd=cwd,
        timeout=timeout,
    )


@contextlib.contextmanager
def serve_http(handler: Any) -> Iterator[http.server.ThreadingHTTPServer]:
    """`handler` served on 127.0.0.1 (a port the OS picks) by a daemon thread, stopped after."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
