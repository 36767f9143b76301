"""GPU only (an H200, vLLM 0.33.0): under `jit_monitor_mode="error"` the first prompt longer
than one block of a Mamba-style hybrid with prefix caching stops the engine, because vLLM's
warm-up never runs store_cache_checkpoints_kernel (vllm/model_executor/layers/mamba/
checkpoint.py:206) and the jit monitor counts its first launch after the warm-up as a JIT
compilation during inference (vllm/utils/jit_monitor.py:134).

Run (one H200, vllm==0.33.0):
    python repro.py --model ../../profiles/glm-5.3-flash-4l     # GLM-5.3-Flash-4L config, dummy weights
    python repro.py --model DIR --monitor warn                  # the control: the same run passes

The model folder needs a config.json only (load_format "dummy", no tokenizer: token-id
prompts). The engine runs vLLM's default mode (torch.compile and CUDA graphs: the monitor is
armed only after vLLM's own JIT warm-up, which enforce_eager turns off). Two requests: a short
prompt within one block (no checkpoint stored: must pass), then one of 1.5 blocks (vLLM's block
size, read back from the engine; prefix caching in align mode stores a Mamba checkpoint at the
block boundary). Expected: both complete. Seen (H200, vLLM 0.33.0, twice): the second stops the
engine with "Triton kernel JIT compilation during inference: store_cache_checkpoints_kernel";
the kernel was in Triton's disk cache, so no kernel cache can cover it.

Last line of stdout: {"reproduced": true|false, "vllm": VERSION, "detail": ...} (exit 0), or
exit 2 when the check could not be made. Every process it starts is stopped (subject.py).
Not run by `nox -s upstream` (CPU only); written for the GPU box, not run in the project's CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import subject

STOPPED = "store_cache_checkpoints_kernel"


def run_subject(model: str, monitor: str, moe_backend: str | None) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"moe_backend": moe_backend} if moe_backend else {}
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=16384,
        max_num_seqs=4,
        gpu_memory_utilization=0.6,
        language_model_only=True,
        jit_monitor_mode=monitor,
        seed=0,
        **extra,
    )
    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def prompt(length: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[(7 * i + 3) % 1000 + 1 for i in range(length)])

    try:
        llm.generate([prompt(block // 2)], params, use_tqdm=False)
    except Exception as exc:
        subject.verdict(None, f"the prompt within one block failed already: {exc!r}"[:500])
        return 2
    try:
        llm.generate([prompt(block + block // 2)], params, use_tqdm=False)
    except Exception as exc:
        text = f"{exc!r} {exc.__cause__!r}"
        if STOPPED in text or "EngineDead" in type(exc).__name__:
            subject.verdict(
                True,
                f"a prompt of {block + block // 2} tokens (block {block}) stopped the engine "
                f"under jit_monitor_mode={monitor}: {text[:300]}",
            )
            return 0
        subject.verdict(None, f"the long prompt failed otherwise: {text[:500]}")
        return 2
    subject.verdict(False, f"both prompts completed (block {block}, jit_monitor_mode={monitor})")
    llm.llm_engine.engine_core.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a folder with a hybrid config.json")
    parser.add_argument("--monitor", default="error", choices=("error", "warn"))
    parser.add_argument("--moe-backend", default="deep_gemm", help="'' for vLLM's choice")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--subject", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subject:
        return run_subject(args.model, args.monitor, args.moe_backend or None)
    command = [sys.executable, __file__, "--subject", "--model", args.model]
    command += ["--monitor", args.monitor, "--moe-backend", args.moe_backend]
    return subject.run(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
