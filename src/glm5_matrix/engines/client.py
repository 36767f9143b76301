"""Managed in-process vLLM engines for the suites.

An Engine is built from an engine spec (glm5_matrix.engines.specs: the cell's profile, model and
settings). It is a context manager that always shuts vLLM down
(vLLM's own shutdown API, then a bounded wait for the child processes it started; any left are
killed by id and reported).

Every start runs against the kernel cache (glm5_matrix.kernels.kernel_cache) and records, beside its
seconds to ready, what it compiled: the cache files each library added, and the torch.compile
seconds vLLM reports. With the kernel guard on, a start that compiled fails naming the files,
and an engine in compiled mode runs vLLM's jit monitor in error mode (vLLM activates it only
when it warms up JIT kernels itself, i.e. not with enforce_eager).

Worker-side reads (KV layout, block tables, cache pages) go through `LLM.collective_rpc` with
the module-level functions of glm5_matrix.engines.workers, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1: the
Engine sets it in its own process environment for its lifetime only (the workers inherit it at
spawn), never globally.

The layout readers (spec_classes, groups_of, layer_specs) turn worker_kv_layout's plain data
back into vLLM's classes in the test process.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_matrix.engines.prompts import random_prompt
from glm5_matrix.engines.specs import EngineSpec, jit_monitor_args
from glm5_matrix.engines.starts import account_start
from glm5_matrix.engines.startup_interrupts import reaching_the_caller
from glm5_matrix.engines.workers import (
    worker_compilation_seconds,
    worker_kv_layout,
    worker_mapped_files,
    worker_moe_backends,
    worker_page_digests,
    worker_read_pages,
    worker_recorded_block_tables,
    worker_recorded_chunks,
    worker_scheduler_limits,
    worker_served_states,
    worker_start_block_recorder,
    worker_start_served_state_recorder,
)
from glm5_matrix.kernels import kernel_cache, kernel_guard, writers
from glm5_matrix.machine import processes
from glm5_matrix.verdicts.compare import GreedyOutput

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
SHUTDOWN_TIMEOUT_S = 30.0
# LLM.__repr__ waits forever on an engine core that died (Engine.start sets vLLM's cached repr
# up front): the vLLM defect, reproduced for its maintainers (upstream/NAME/repro.py).
REPR_REPRODUCTION = "upstream/llm-repr-after-engine-death"


class Engine:
    """A running vLLM `LLM`, shut down on exit whatever happened."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._llm: Any = None
        self._saved_environment: dict[str, str | None] = {}
        self._scratch: Path | None = None
        self._children_before: set[int] = set()
        self.start_seconds: float | None = None
        self.leftover_processes: list[str] = []
        self._watch: EngineCoreWatch | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        self._children_before = set(processes.live_descendants())
        self._scratch = Path(tempfile.mkdtemp(prefix="glm5-matrix-engine-"))
        rpc_dir = self._scratch / "rpc"
        rpc_dir.mkdir()
        environment = {
            **self.spec.environment,
            INSECURE_SERIALIZATION: "1",
            # ZMQ socket files go to a scratch folder.
            "VLLM_RPC_BASE_PATH": str(rpc_dir),
        }
        for name, value in environment.items():
            self._saved_environment[name] = os.environ.get(name)
            os.environ[name] = value
        watch: writers.Watch | None = None
        try:
            # The library caches (vLLM's own included: model-class inspection, compiled
            # graphs) point into the kernel cache, unless the runner did that already.
            kernel_cache.ensure_active()
            # Imported before the clock starts: a once-per-process cost, not the engine's.
            from vllm import LLM

            before = kernel_cache.snapshot()
            # Who writes the kernel cache during the start: only the engine's processes count.
            # Watched only under the guard, which alone judges a start (a watch costs CPU).
            watch = writers.Watch().start() if kernel_guard.guard_enabled() else None
            started = time.monotonic()
            # A Ctrl-C during the start must reach this process's teardown: vLLM swallows one
            # that lands while it waits for the engine core (startup_interrupts).
            with reaching_the_caller():
                self._llm = LLM(
                    model=self.spec.model, **self.spec.args, **jit_monitor_args(self.spec)
                )
            self.start_seconds = time.monotonic() - started
            # vLLM's LLM.__repr__ asks the workers for the model's structure (collective_rpc,
            # no timeout) unless its cache is set. pytest reprs a traceback's arguments, so a
            # failure or Ctrl-C with an LLM frame in it waited forever on an engine core that
            # had stopped (the faults cell's SIGTERM to e2e-cpu while generating, in
            # pytest_keyboard_interrupt). vLLM's own fallback text, set up front. Reproduced for
            # vLLM's maintainers: REPR_REPRODUCTION (remove this when it no longer reproduces).
            if hasattr(self._llm, "_cached_repr"):
                self._llm._cached_repr = f"LLM(model={self.spec.model!r})"
            account_start(
                self.spec.label,
                self.start_seconds,
                before,
                self._compile_seconds,
                f"the start of engine {self.spec.label}",
                watch,
            )
        except BaseException:
            if watch is not None:
                watch.stop()
            self.shutdown()
            raise
        # The engine core: the children this process gained (the workers are below it).
        cores = (
            set(processes.live_children()) - self._children_before - processes.stdlib_helper_pids()
        )
        self._watch = EngineCoreWatch(self._llm, cores)

    def _compile_seconds(self) -> float | None:
        """vLLM's own report of the start's torch.compile seconds (the slowest worker's), or
        None when it cannot be read."""
        try:
            return max(float(s) for s in self.rpc(worker_compilation_seconds))
        except Exception:  # accounting only: never fail a start over it
            return None

    def shutdown(self) -> None:
        """Stop the engine (vLLM's API), wait for its processes, kill and report leftovers."""
        llm, self._llm = self._llm, None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        try:
            if llm is not None:
                engine_core = getattr(llm.llm_engine, "engine_core", None)
                if engine_core is not None:
                    engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
                del llm
        finally:
            self.leftover_processes = processes.reap_descendants(
                self._children_before, SHUTDOWN_TIMEOUT_S
            )
            for name, value in self._saved_environment.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self._saved_environment.clear()
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None

    @property
    def llm(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"engine {self.spec.label} is not running")
        return self._llm

    # --- requests ----------------------------------------------------------------------------

    def generate_greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy tokens for one token-id prompt."""
        return list(self._generate(prompt, max_tokens, logprobs=None).outputs[0].token_ids)

    def generate_scored(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        top: int,
        logit_bias: dict[int, float] | None = None,
    ) -> GreedyOutput:
        """Greedy tokens with the chosen token's logprob and the `top` best candidates per step
        (what compare's noise-floor rule needs to tell rounding from a real difference). A
        `logit_bias` steers the choice only: the logprobs are vLLM's raw ones, computed before
        any logits processor."""
        return _scored(self._generate(prompt, max_tokens, logprobs=top, logit_bias=logit_bias))

    def generate_many_scored(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, top: int
    ) -> list[tuple[str, GreedyOutput]]:
        """generate_scored for several prompts submitted together: vLLM schedules them side by
        side (batched steps, each looking up the prefix cache as it is admitted). In the
        prompts' order, each with vLLM's request id (the recorders key by the engine's own id,
        which vLLM derives from it: recorded_id)."""
        requests = self._generate_all(prompts, max_tokens, logprobs=top)
        return [(str(request.request_id), _scored(request)) for request in requests]

    def _generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        logprobs: int | None,
        logit_bias: dict[int, float] | None = None,
    ) -> Any:
        """vLLM's RequestOutput of one greedy request (no EOS stop: a fixed number of tokens)."""
        return self._generate_all([prompt], max_tokens, logprobs, logit_bias)[0]

    def _generate_all(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        logprobs: int | None,
        logit_bias: dict[int, float] | None = None,
    ) -> list[Any]:
        """vLLM's RequestOutputs of greedy requests submitted in one call, in order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=logprobs,
            logit_bias=logit_bias,
        )
        return list(
            self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
            )
        )

    def counters(self) -> dict[str, float]:
        """vLLM's counters and vectors (summed) by name, e.g. vllm:spec_decode_num_drafts.
        Needs the engine built with disable_log_stats=False."""
        totals: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            value = getattr(metric, "value", None)
            if value is None and hasattr(metric, "values"):
                value = sum(metric.values)
            if isinstance(value, (int, float)):
                totals[metric.name] = totals.get(metric.name, 0.0) + float(value)
        return totals

    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def random_prompt(self, length: int, seed: int) -> list[int]:
        """`length` token ids drawn uniformly from this model's vocabulary with `seed`."""
        return random_prompt(self.vocab_size(), length, seed)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Drop the GPU prefix cache (and, with `reset_connector`, the KV connector's, e.g. the
        CPU offload store); False while blocks are still in flight."""
        if reset_connector:
            return bool(self.llm.reset_prefix_cache(reset_connector=True))
        return bool(self.llm.reset_prefix_cache())

    def reset_prefix_cache_when_stored(
        self, bound_s: float, reset_connector: bool = False
    ) -> float:
        """reset_prefix_cache() once vLLM accepts it: with an offload connector the stores
        complete asynchronously and the reset is refused while blocks are in flight. Polls
        (bounded; an empty step lets the engine collect finished stores) and returns how long it
        took; TimeoutError after `bound_s`."""
        started = time.monotonic()
        while not self.reset_prefix_cache(reset_connector=reset_connector):
            if time.monotonic() - started > bound_s:
                raise TimeoutError(f"reset_prefix_cache() still refused after {bound_s:.0f} s")
            self.generate_greedy([1], 1)
            time.sleep(0.5)
        return time.monotonic() - started

    def rpc(self, function: Any, *args: Any) -> list[Any]:
        """Run `function(worker, *args)` on every worker; one result per worker."""
        return list(self.llm.collective_rpc(function, args=args))

    # --- what the engine decided -------------------------------------------------------------

    def kv_layout(self) -> dict[str, Any]:
        """The KV cache layout of rank 0 as plain data (see worker_kv_layout)."""
        return self.rpc(worker_kv_layout)[0]

    def kv_layouts(self) -> list[dict[str, Any]]:
        """worker_kv_layout of every tensor-parallel rank, in rank order."""
        return self.rpc(worker_kv_layout)

    def moe_backends(self) -> dict[str, list[str]]:
        return self.rpc(worker_moe_backends)[0]

    def mapped_files(self, needle: str) -> list[list[str]]:
        """worker_mapped_files of every rank, in rank order."""
        return self.rpc(worker_mapped_files, needle)

    def scheduler_limits(self) -> dict[str, Any]:
        return self.rpc(worker_scheduler_limits)[0]

    def record_block_tables(self) -> None:
        """From now on, remember every request's block table per KV cache group (rank 0)."""
        self.rpc(worker_start_block_recorder)

    def recorded_block_tables(self, clear: bool = True) -> dict[str, list[list[list[int]]]]:
        """{request id: [block ids per group, one entry per step where they changed]} for the
        requests seen since the recorder started or was last cleared."""
        return self.rpc(worker_recorded_block_tables, clear)[0]

    def recorded_chunks(self, clear: bool = True) -> dict[str, list[list[int]]]:
        """{request id: [[first position, tokens] per step]} for the requests seen since the
        recorder (record_block_tables) started or was last cleared: how each prefill was
        chunked, as the worker was told to compute it."""
        return self.rpc(worker_recorded_chunks, clear)[0]

    def record_served_states(self, groups: dict[int, list[str]]) -> None:
        """From now on, at the first step of every request that starts after a prefix hit,
        read the state its Mamba layers (`groups`: group index -> layers) start from, in the
        worker, as the model is about to run (rank 0; see
        worker_start_served_state_recorder)."""
        self.rpc(
            worker_start_served_state_recorder,
            {str(group): list(layers) for group, layers in groups.items()},
        )

    def served_states(self, clear: bool = True) -> dict[str, dict[str, Any]]:
        """{request id: what its first post-hit step started from: start, tokens, batch,
        columns per group, blocks and digests per layer, and kernel_blocks where the metadata
        names them} since the recorder started or was last cleared."""
        return self.rpc(worker_served_states, clear)[0]

    def read_pages(self, layer_blocks: Sequence[tuple[str, int]]) -> list[list[Any]]:
        """For each (layer, block id): that block's page of each of the layer's state tensors,
        as float32 numpy arrays, from rank 0."""
        return self.rpc(worker_read_pages, list(layer_blocks))[0]

    def read_pages_per_rank(self, layer_blocks: Sequence[tuple[str, int]]) -> list[list[list[Any]]]:
        """read_pages on every tensor-parallel rank: one list per rank (rank order), each rank
        holding its own split of the heads."""
        return self.rpc(worker_read_pages, list(layer_blocks))

    def page_digests(self, layer_blocks: Sequence[tuple[str, int]]) -> list[list[str]]:
        """For each (layer, block id): the sha256 of that block's bytes per state tensor, from
        rank 0 (glm5_matrix.engines.workers)."""
        return self.rpc(worker_page_digests, list(layer_blocks))[0]


def recorded_id(records: Mapping[str, Any], request_id: str) -> str:
    """The key of the request `request_id` (a RequestOutput's, the id the caller sees) among a
    worker recorder's `records`, which key by the engine's id: vLLM 0.32 and 0.33 append a
    random suffix ("4" -> "4-1a2b3c4d", v1/engine/input_processor.py). Exactly one must match."""
    found = [key for key in records if key == request_id or key.startswith(f"{request_id}-")]
    if len(found) != 1:
        raise KeyError(
            f"request {request_id!r}: {len(found)} recorded ids match ({sorted(records)})"
        )
    return found[0]


def _scored(request: Any) -> GreedyOutput:
    """A RequestOutput with logprobs as a GreedyOutput: tokens, the chosen tokens' logprobs, the
    candidates per step, and the tokens vLLM reports it served from the prefix cache."""
    output = request.outputs[0]
    tokens = list(output.token_ids)
    steps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in output.logprobs]
    chosen = [step[token] for token, step in zip(tokens, steps, strict=True)]
    return GreedyOutput(tokens, chosen, steps, int(request.num_cached_tokens or 0))


class EngineCoreWatch:
    """Fails the request in flight when a process of the engine dies.

    vLLM's in-process client (SyncMPClient, v1/engine/core_client.py, 0.32 and 0.33) waits on
    its output queue for ever when the engine core process dies mid-generate: its monitor marks
    the engine dead and shuts the client down, but nothing reaches the queue, so the test (and
    the cell) would hang until an outer timeout. This thread watches the engine core processes,
    by pid; when one is gone it puts vLLM's EngineDeadError in that queue, so the generate raises
    at once (later requests raise EngineDeadError from vLLM itself)."""

    POLL_S = 0.5

    def __init__(self, llm: Any, pids: set[int]) -> None:
        self.queue = getattr(getattr(llm.llm_engine, "engine_core", None), "outputs_queue", None)
        self.pids = {pid: processes.start_time(pid) for pid in pids}
        self._stop = threading.Event()
        self.dead: str | None = None
        if self.queue is not None and self.pids:
            threading.Thread(target=self._run, name="glm5-engine-core-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            for pid, started in self.pids.items():
                stat = processes.proc_stat(pid)
                if stat is None or stat[0] == "Z" or processes.start_time(pid) != started:
                    self.dead = f"engine core process {pid} died"
                    from vllm.v1.engine.exceptions import EngineDeadError

                    queue = self.queue
                    assert queue is not None
                    queue.put_nowait(EngineDeadError())
                    return

    def stop(self) -> None:
        self._stop.set()


def resolve_class(qualified_name: str) -> type:
    """The class object named `module.Class`, imported in this process."""
    module, _, name = qualified_name.rpartition(".")
    found = getattr(importlib.import_module(module), name)
    if not isinstance(found, type):
        raise TypeError(f"{qualified_name} is not a class")
    return found


# --- reading the layout worker_kv_layout returns -----------------------------------------------


def spec_classes(group: dict[str, Any]) -> set[type]:
    """The KV spec classes of a group's layers. vLLM 0.33 wraps every group's specs in
    UniformTypeKVCacheSpecs, so the members, where there are any, tell the kinds apart."""
    members = group.get("member_specs") or {"": group}
    return {resolve_class(m["spec_class"]) for m in members.values()}


def spec_names(group: dict[str, Any]) -> str:
    """A group's spec classes by name, its members' where vLLM wraps them ("MambaSpec";
    "MLAAttentionSpec" for GLM's latent and indexer keys), joined by "+": what tells groups apart
    in a figure or a message, where the wrapper's name (UniformTypeKVCacheSpecs) is the same for
    every group."""
    return "+".join(sorted(cls.__name__ for cls in spec_classes(group)))


def block_size_of(layout: dict[str, Any]) -> int:
    """The block size of the prefix-cacheable groups (GLM's tail ring has its own, per
    request); an AssertionError when they disagree."""
    sizes = {g["block_size"] for g in layout["groups"] if g["prefix_cacheable"]}
    if len(sizes) != 1:
        raise AssertionError(f"KV groups disagree on the block size: {sorted(sizes)}")
    return sizes.pop()


def groups_of(layout: dict[str, Any], cls: type) -> list[dict[str, Any]]:
    """The groups whose layers' spec class IS `cls` (identity: a subclass does not count)."""
    return [g for g in layout["groups"] if spec_classes(g) == {cls}]


def layer_specs(layout: dict[str, Any]) -> dict[str, tuple[type, int, int]]:
    """{layer: (its spec class, page bytes, the group's block size)} over every group."""
    found = {}
    for group in layout["groups"]:
        members = group.get("member_specs") or dict.fromkeys(group["layer_names"], group)
        for name, member in members.items():
            found[name] = (
                resolve_class(member["spec_class"]),
                int(member["page_size_bytes"]),
                int(group["block_size"]),
            )
    return found
