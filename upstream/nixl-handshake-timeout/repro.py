"""NIXL: a prefill instance (P) that takes more than 5 s to answer the decode instance's (D's)
first handshake fails the request with HTTP 500.

Run:  python repro.py --model TINY_MODEL_DIR      (any small model; no tokenizer needed)

Two OpenAI API servers, P and D, with NixlConnector (kv_role kv_both, KV buffer in host memory:
the CPU build runs it), on 127.0.0.1 with ports the kernel picks. One prompt goes through P
(max_tokens=1, do_remote_decode); P's processes are then stopped (SIGSTOP) for --stall s, a
stand-in for a P whose engine core is slow to answer (a loaded host: 0.003-2.1 s measured
beside other work on 2 cores, and one CI failure), while D is asked to decode with P's
kv_transfer_params. D's worker asks P's side channel for its metadata and waits 5 s, hard-coded
(sock.setsockopt(zmq.RCVTIMEO, 5000) in nixl/base_worker.py); with the default
kv_load_failure_policy "fail" the timeout fails the request. Expected: the request succeeds once
P answers (a handshake timeout that is configurable, or retried, or at least as long as the
request's own). Seen (vllm 0.32.0, 0.33.0): HTTP 500, D's log: "NIXL transfer failure:
handshake_failed ... zmq.error.Again".

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made. Every process it starts is stopped (subject.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject

HOST = "127.0.0.1"
MODEL_NAME = "m"


def server(model: str, role_cpu: int, log: Path, rpc: str) -> tuple[subprocess.Popen[bytes], str]:
    port = subject.free_port()
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", MODEL_NAME,
        "--host", HOST, "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--enable-prefix-caching",
        "--max-model-len", "2048", "--max-num-seqs", "2",
        "--kv-cache-memory-bytes", str(256 << 20), "--block-size", "128",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(subject.free_port()),
        "UCX_NET_DEVICES": "lo",
        "VLLM_RPC_BASE_PATH": rpc,
        "VLLM_CPU_OMP_THREADS_BIND": str(role_cpu % max(1, os.cpu_count() or 1)),
        "TORCHDYNAMO_DISABLE": "1",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, f"http://{HOST}:{port}"


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/health", timeout=5) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url}: not healthy within {timeout:.0f} s")


def complete(url: str, prompt: list[int], max_tokens: int, params: dict) -> tuple[int, dict]:
    body = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "kv_transfer_params": params,
    }  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:300]}


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
    deadline = time.monotonic() + 30
    while any(subject.group(p.pid) for p in procs) and time.monotonic() < deadline:
        for proc in procs:
            proc.poll()
        time.sleep(0.2)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_subject(model: str, stall: float, startup: float) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="nixl-handshake-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        (scratch / "rpc-p").mkdir()
        (scratch / "rpc-d").mkdir()
        p, p_url = server(model, 0, scratch / "p.log", str(scratch / "rpc-p"))
        procs.append(p)
        d, d_url = server(model, 1, scratch / "d.log", str(scratch / "rpc-d"))
        procs.append(d)
        wait_healthy(p_url, p, startup)
        wait_healthy(d_url, d, startup)
        prompt = [(7 * i + 3) % 1000 + 1 for i in range(3 * 128 * 2 + 1)]
        status, prefill = complete(p_url, prompt, 1, {"do_remote_decode": True})
        params = (prefill.get("choices") or [{}])[0].get("kv_transfer_params") or prefill.get(
            "kv_transfer_params"
        )
        if status != 200 or not params or not params.get("remote_block_ids"):
            subject.verdict(None, f"P's prefill gave no KV to hand over: {status} {prefill}")
            return 2
        os.killpg(p.pid, signal.SIGSTOP)
        answer: dict[str, object] = {}

        def decode() -> None:
            answer["status"], answer["body"] = complete(d_url, prompt, 2, params)
            answer["after"] = time.monotonic() - stopped

        stopped = time.monotonic()
        thread = threading.Thread(target=decode)
        thread.start()
        time.sleep(stall)
        os.killpg(p.pid, signal.SIGCONT)
        thread.join(300)
        d_log = (scratch / "d.log").read_text(errors="replace")
        timed_out = "handshake" in d_log and "zmq.error.Again" in d_log
        status = answer.get("status")
        detail = (
            f"P stalled {stall:.0f} s on D's first handshake: D answered HTTP {status} after "
            f"{answer.get('after', float('nan')):.1f} s; D's log shows a handshake timeout: "
            f"{timed_out}"
        )
        if status == 200:
            subject.verdict(False, detail)
        elif status == 500 and timed_out:
            subject.verdict(True, detail)
        else:
            subject.verdict(None, detail + f"; {answer.get('body')}")
            return 2
        return 0
    finally:
        stop(procs)
        for name in ("p.log", "d.log"):
            path = scratch / name
            if path.is_file():
                sys.stderr.write(f"--- {name} (last 40 lines)\n")
                sys.stderr.write("\n".join(path.read_text(errors="replace").splitlines()[-40:]))
                sys.stderr.write("\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--stall", type=float, default=8.0, help="s P is stopped (> 5)")
    parser.add_argument("--startup", type=float, default=600.0, help="s to wait for a server")
    parser.add_argument("--timeout", type=float, default=2000.0)
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.stall, args.startup)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--stall", str(args.stall), "--startup", str(args.startup)]
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
