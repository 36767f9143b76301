"""Managed in-process vLLM engines for the suites.

An Engine is built from the cell's profile: the model (the tiny hybrid, a checkpoint, or the
profile's config with glm5-random weights), the profile's [engine] arguments, and the cell's
settings (`cell_engine_args`: tensor parallelism, the MoE backend of the matrix axis, the mode:
eager, or compiled with CUDA graphs). It is a context manager that always shuts vLLM down
(vLLM's own shutdown API, then a bounded wait for the child processes it started; any left are
killed by id and reported).

Every start runs against the kernel cache (glm5_matrix.kernels.kernel_cache) and records, beside its
seconds to ready, what it compiled: the cache files each library added, and the torch.compile
seconds vLLM reports. With the kernel guard on, a start that compiled fails naming the files,
and an engine in compiled mode runs vLLM's jit monitor in error mode (vLLM activates it only
when it warms up JIT kernels itself, i.e. not with enforce_eager).

Worker-side reads (KV layout, block tables, cache pages) go through `LLM.collective_rpc` with
module-level functions of this module, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1: the
Engine sets it in its own process environment for its lifetime only (the workers inherit it at
spawn), never globally.

The layout readers (spec_classes, groups_of, layer_specs) turn worker_kv_layout's plain data
back into vLLM's classes in the test process.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.kernels import kernel_cache
from glm5_matrix.machine import processes
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile, load_profile
from glm5_matrix.results.recorder import record_engine_start
from glm5_matrix.verdicts.compare import GreedyOutput
from glm5_matrix.worker_pages import layer_caches

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
SHUTDOWN_TIMEOUT_S = 30.0
# Engine args the harness decides itself; a profile that sets them is refused.
_HARNESS_ARGS = {"model", "tensor_parallel_size", "load_format"}
# The cell setting `mode`: what vLLM's enforce_eager is in each.
MODES = {"eager": True, "compiled": False}


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from; equal specs can share one engine."""

    label: str
    model: str
    args: dict[str, Any]
    environment: dict[str, str] = field(default_factory=dict)


def engine_spec(cell: CellContext, profile: Profile | None = None, **overrides: Any) -> EngineSpec:
    """The engine of a cell: model + profile [engine] args + the cell's parallelism + overrides."""
    if profile is None:
        if cell.profile is None:
            raise UserError(f"cell {cell.id}: no profile, so no engine to build")
        profile = load_profile(cell.profile)
    engine = dict(profile.section("engine"))
    environment = {str(k): str(v) for k, v in engine.pop("environment", {}).items()}
    clash = _HARNESS_ARGS & set(engine)
    if clash:
        raise UserError(
            f"{profile.directory / 'profile.toml'} [engine]: {sorted(clash)[0]!r} is set by the "
            "harness (from the cell and the weights), not by the profile"
        )
    model, model_args = resolve_model(cell, profile)
    args = {**engine, **model_args, **cell_engine_args(cell, profile), **overrides}
    # The cell's environment (e.g. the conv-state layout) applies to its engines too.
    environment = {**cell.environment, **environment}
    label = f"{profile.name}:{cell.id}"
    if overrides:
        label += "[" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) + "]"
    return EngineSpec(label=label, model=model, args=args, environment=environment)


def resolve_model(cell: CellContext, profile: Profile) -> tuple[str, dict[str, Any]]:
    """The model path and the load arguments it needs."""
    if cell.weights.kind == "checkpoint":
        assert cell.weights.path is not None
        return cell.weights.path, {}
    if "model" in profile.data:  # a generated model (the tiny hybrid)
        from glm5_matrix.models.tiny_hybrid import ensure_model

        return str(ensure_model(profile=profile.name)), {}
    # The profile's config.json with random weights: glm5-random (glm5_matrix.models.weights) unless
    # vLLM's plain dummy weights were asked for.
    if not profile.config_path.is_file():
        raise UserError(f"profile {profile.name}: no [model] table and no {profile.config_path}")
    from glm5_matrix.models.weights import LOAD_FORMAT

    load_format = "dummy" if cell.weights.kind == "dummy" else LOAD_FORMAT
    return str(profile.directory), {"load_format": load_format}


def cell_engine_args(cell: CellContext, profile: Profile | None = None) -> dict[str, Any]:
    """Engine args that come from the cell rather than the profile: TP, the MoE backend, and
    the mode (`eager`: enforce_eager; `compiled`: vLLM's default torch.compile and CUDA
    graphs, the mode users serve)."""
    args: dict[str, Any] = {}
    if cell.tp is not None and cell.tp > 1:
        args["tensor_parallel_size"] = cell.tp
    mode = cell.setting("mode")
    if mode is not None:
        if mode not in MODES:
            raise UserError(f"cell {cell.id}: mode {mode!r} is not one of {', '.join(MODES)}")
        args["enforce_eager"] = MODES[mode]
    backend = cell.setting("moe_backend")
    if backend is not None:
        if profile is None:
            raise UserError(f"cell {cell.id}: a MoE backend needs the profile's [moe_backends]")
        args["moe_backend"] = moe_backend_for(profile, backend, gpu_family())
    return args


def gpu_family() -> str:
    """`sm90`, `sm100`, ... of GPU 0 (the MoE backend and the KV dtype depend on it)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    major, _ = torch.cuda.get_device_capability(0)
    return f"sm{major}0"


def moe_backend_for(profile: Profile, axis_value: str, family: str) -> str:
    """The vLLM `moe_backend` that the matrix's backend axis value means on this GPU family."""
    table = profile.section("moe_backends").get(axis_value)
    if not isinstance(table, dict):
        raise UserError(f"profile {profile.name}: [moe_backends] has no {axis_value!r}")
    if family not in table:
        raise UserError(
            f"profile {profile.name}: [moe_backends].{axis_value} names no backend for {family} "
            f"(known: {', '.join(sorted(table))})"
        )
    return str(table[family])


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
        try:
            # The library caches (vLLM's own included: model-class inspection, compiled
            # graphs) point into the kernel cache, unless the runner did that already.
            kernel_cache.ensure_active()
            # Imported before the clock starts: a once-per-process cost, not the engine's.
            from vllm import LLM

            before = kernel_cache.snapshot()
            started = time.monotonic()
            self._llm = LLM(model=self.spec.model, **self.spec.args, **jit_monitor_args(self.spec))
            self.start_seconds = time.monotonic() - started
            compiled = kernel_cache.written(before, kernel_cache.snapshot())
            record_engine_start(
                self.spec.label,
                self.start_seconds,
                compile=kernel_cache.compile_record(compiled, self._compile_seconds()),
            )
            kernel_cache.refuse_compiled(compiled, f"the start of engine {self.spec.label}")
        except BaseException:
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
        request = self._generate(prompt, max_tokens, logprobs=top, logit_bias=logit_bias)
        output = request.outputs[0]
        tokens = list(output.token_ids)
        steps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in output.logprobs]
        chosen = [step[token] for token, step in zip(tokens, steps, strict=True)]
        return GreedyOutput(tokens, chosen, steps, int(request.num_cached_tokens or 0))

    def _generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        logprobs: int | None,
        logit_bias: dict[int, float] | None = None,
    ) -> Any:
        """vLLM's RequestOutput of one greedy request (no EOS stop: a fixed number of tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=logprobs,
            logit_bias=logit_bias,
        )
        return self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
        )[0]

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

    def moe_backends(self) -> dict[str, list[str]]:
        return self.rpc(worker_moe_backends)[0]

    def scheduler_limits(self) -> dict[str, Any]:
        return self.rpc(worker_scheduler_limits)[0]

    def record_block_tables(self) -> None:
        """From now on, remember every request's block table per KV cache group (rank 0)."""
        self.rpc(worker_start_block_recorder)

    def recorded_block_tables(self, clear: bool = True) -> dict[str, list[list[list[int]]]]:
        """{request id: [block ids per group, one entry per step where they changed]} for the
        requests seen since the recorder started or was last cleared."""
        return self.rpc(worker_recorded_block_tables, clear)[0]

    def read_pages(self, layer_blocks: Sequence[tuple[str, int]]) -> list[list[Any]]:
        """For each (layer, block id): that block's page of each of the layer's state tensors,
        as float32 numpy arrays, from rank 0."""
        return self.rpc(worker_read_pages, list(layer_blocks))[0]

    def page_digests(self, layer_blocks: Sequence[tuple[str, int]]) -> list[list[str]]:
        """For each (layer, block id): the sha256 of that block's bytes per state tensor, from
        rank 0 (glm5_matrix.worker_pages)."""
        from glm5_matrix.worker_pages import worker_page_digests

        return self.rpc(worker_page_digests, list(layer_blocks))[0]


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


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """Token ids drawn uniformly from [0, vocab_size) with `seed`: prompts without a tokenizer,
    the same on every run and in every process."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def with_other_tokens(
    prompt: Sequence[int], start: int, end: int, vocab_size: int, seed: int
) -> list[int]:
    """`prompt` with its tokens [start, end) drawn anew with `seed`: the prompt a stale or wrong
    cached state of that span amounts to (a negative control for comparisons across a cached
    block). Every redrawn token differs from the one it replaces."""
    if not 0 <= start < end <= len(prompt):
        raise ValueError(f"span [{start}, {end}) is not inside a {len(prompt)}-token prompt")
    rng = random.Random(seed)
    out = list(prompt)
    for i in range(start, end):
        token = rng.randrange(vocab_size - 1)
        out[i] = token if token < out[i] else token + 1
    return out


def jit_monitor_args(spec: EngineSpec) -> dict[str, Any]:
    """vLLM's jit monitor in error mode when the kernel guard asks for it (see
    kernel_cache.jit_monitor_mode), unless the spec sets the mode itself."""
    if "jit_monitor_mode" in spec.args:
        return {}
    mode = kernel_cache.jit_monitor_mode(bool(spec.args.get("enforce_eager")))
    return {} if mode is None else {"jit_monitor_mode": mode}


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


# --- worker-side functions (run inside vLLM's worker processes via collective_rpc) -------------


def _runner(worker: Any) -> Any:
    return worker.model_runner


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def worker_kv_layout(worker: Any) -> dict[str, Any]:
    """The KV cache config as plain data.

    groups: per KV cache group, the spec's qualified class name, block size, page bytes (padded,
    as allocated), the unpadded state page for Mamba specs, and layer names.
    tensors: per KVCacheTensor, its layers and byte placement in the shared allocation.
    storage: per layer, (storage address, first byte, last byte) of its allocated views, so the
    caller can see which layers share memory.
    """
    config = _runner(worker).kv_cache_config
    context = _runner(worker).compilation_config.static_forward_context
    groups = []
    cacheable = set(config.prefix_cacheable_group_ids)
    for index, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        members = dict(getattr(spec, "kv_cache_specs", None) or {})
        entry: dict[str, Any] = {
            "spec_class": _qualified(type(spec)),
            "block_size": int(spec.block_size),
            "page_size_bytes": int(spec.page_size_bytes),
            "layer_names": list(group.layer_names),
            # vLLM's own list (0.32 and 0.33): the groups prefix caching and the offload
            # connectors use; GLM's kpool tail ring is not among them.
            "prefix_cacheable": index in cacheable,
        }
        if members:
            # vLLM 0.33 wraps every group's specs in UniformTypeKVCacheSpecs; the members tell
            # the kinds apart (GLM's MLA group holds the latent and the indexer keys).
            entry["member_specs"] = {
                name: {
                    "spec_class": _qualified(type(member)),
                    "page_size_bytes": int(member.page_size_bytes),
                }
                for name, member in members.items()
            }
            if len({type(m) for m in members.values()}) == 1:
                spec = next(iter(members.values()))
        if hasattr(spec, "shapes"):
            entry["state_shapes"] = [list(s) for s in spec.shapes]
            entry["state_dtypes"] = [str(d) for d in spec.dtypes]
            entry["mamba_cache_mode"] = getattr(spec, "mamba_cache_mode", None)
        else:
            entry["bytes_per_token"] = int(spec.page_size_bytes // spec.block_size)
            layer = context[group.layer_names[0]]
            if hasattr(layer, "get_attn_backend"):
                entry["backend_class"] = _qualified(layer.get_attn_backend())
        groups.append(entry)
    tensors = [
        {
            "layers": list(t.layers),
            "size": int(t.size),
            "offset": int(t.offset),
            "layer_stride": int(t.layer_stride),
            "block_stride": int(t.block_stride),
        }
        for t in config.kv_cache_tensors
    ]
    storage = {}
    for name, views in layer_caches(worker).items():
        spans = [_span(v) for v in views]
        storage[name] = {
            "storage": spans[0][0],
            "first_byte": min(s[1] for s in spans),
            "end_byte": max(s[2] for s in spans),
        }
    return {
        "num_blocks": int(config.num_blocks),
        "groups": groups,
        "tensors": tensors,
        "storage": storage,
    }


def _span(tensor: Any) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) a view covers inside its storage."""
    element = tensor.element_size()
    start = tensor.storage_offset() * element
    extent = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return tensor.untyped_storage().data_ptr(), start, start + (extent + 1) * element


def worker_start_block_recorder(worker: Any) -> None:
    """Wrap the worker's per-step `execute_model(scheduler_output)` to remember each request's
    block table per KV cache group.

    Why: a request's block ids live only in the scheduler and, while it runs, in the runner;
    the checkpoint-page check needs them after the request finished. The tables are rebuilt
    from the scheduler's output by the rule both of vLLM's GPU runners apply (SchedulerOutput:
    new requests bring their table, running ones append their new blocks, resumed ones
    replace), so the recorder reads no runner internals. Reading is all it does.
    """
    target = getattr(worker, "worker", worker)  # the worker behind a WorkerWrapperBase
    if getattr(target, "_glm5_block_records", None) is not None:
        return
    records: dict[str, list[list[list[int]]]] = {}
    target._glm5_block_records = records
    original = target.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        record_block_tables(records, scheduler_output)
        return original(scheduler_output, *args, **kwargs)

    target.execute_model = execute_model


def record_block_tables(records: dict[str, list[list[list[int]]]], scheduler_output: Any) -> None:
    """Apply one step's block-table changes to `records` ({request: [table per change]})."""
    for new in scheduler_output.scheduled_new_reqs:
        _record(records, new.req_id, [list(ids) for ids in new.block_ids])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if new_ids is None:
            continue
        history = records.get(req_id)
        if req_id in resumed or not history:
            _record(records, req_id, [list(ids) for ids in new_ids])
        else:
            _record(
                records,
                req_id,
                [old + list(ids) for old, ids in zip(history[-1], new_ids, strict=True)],
            )


def _record(records: dict[str, list[list[list[int]]]], req_id: str, table: list[list[int]]) -> None:
    history = records.setdefault(req_id, [])
    if not history or history[-1] != table:
        history.append(table)


def worker_recorded_block_tables(worker: Any, clear: bool) -> dict[str, list[list[list[int]]]]:
    live = getattr(getattr(worker, "worker", worker), "_glm5_block_records", None)
    records = dict(live or {})
    if clear and live is not None:
        live.clear()
    return records


def worker_read_pages(worker: Any, layer_blocks: list[tuple[str, int]]) -> list[list[Any]]:
    """Copy each (layer, block id)'s page, per state tensor, as float32 numpy."""
    caches = layer_caches(worker)
    num_blocks = _runner(worker).kv_cache_config.num_blocks
    pages = []
    for name, block in layer_blocks:
        views = caches[name]
        for view in views:
            # Mamba state views are block-major: [num_blocks, *state shape].
            if view.shape[0] != num_blocks:
                raise RuntimeError(f"{name}: cache view {tuple(view.shape)} is not block-major")
        pages.append([view[block].float().cpu().numpy().copy() for view in views])
    return pages


def worker_moe_backends(worker: Any) -> dict[str, list[str]]:
    """{FP8 MoE backend vLLM selected (Fp8MoeBackend name): [MoE layers using it]}: what the
    engine runs, read from the model, not from what was asked."""
    backends: dict[str, list[str]] = {}
    runner = _runner(worker)
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    for name, module in model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "fp8_backend", None)
        if backend is not None:
            backends.setdefault(getattr(backend, "name", str(backend)), []).append(name)
    return backends


def worker_compilation_seconds(worker: Any) -> float:
    """The torch.compile seconds this worker's start took, as vLLM counts them (0 in eager)."""
    return float(getattr(worker.vllm_config.compilation_config, "compilation_time", 0.0) or 0.0)


def worker_scheduler_limits(worker: Any) -> dict[str, Any]:
    config = worker.vllm_config
    return {
        "max_num_seqs": int(config.scheduler_config.max_num_seqs),
        "cache_dtype": str(config.cache_config.cache_dtype),
        "speculative_tokens": int(
            config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        ),
    }
