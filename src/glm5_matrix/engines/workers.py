"""What runs inside vLLM's worker processes, through collective_rpc: the KV layout the engine
decided, the block-table recorder, the MoE backends, compile seconds and scheduler limits, and
the bytes of KV cache pages, as digests per block and group. Imports nothing of the harness, so
a worker loads this module alone.


What a transfer guarantees is a copy: the pages D received for a block must equal, bit for bit,
the pages P sent for it (NIXL 1P1D), and the GPU pages of a block restored from CPU must equal
those the cold run wrote (KV offload). This module reads those bytes where they live, in the
worker, and hands back sha256 digests (small, JSON-safe, exact); glm5_matrix.verdicts.transfers compares
them. Nothing here changes the cache.

Two ways in:
- an offline engine (glm5_matrix.engines.client.Engine) calls `worker_page_digests` through
  `LLM.collective_rpc` with the function itself;
- an API server cannot be handed a function: it is started with
  `--worker-extension-cls glm5_matrix.engines.workers.PageReader` (methods mixed into vLLM's worker
  class) and `VLLM_SERVER_DEV_MODE=1`, whose `/collective_rpc` endpoint calls a worker method by
  name with string arguments (glm5_matrix.engines.servers.VllmServer.worker_rpc is the client).

A block id is the scheduler's (logical) id. Where a layer's kernel block is smaller than the
scheduler's (GLM's MLA: 128-token kernel blocks inside a 4352-token block), the cache view has
ratio x num_blocks rows and logical block b is rows [b * ratio, (b + 1) * ratio), the mapping
vLLM's block tables apply.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def layer_caches(worker: Any) -> dict[str, list[Any]]:
    """Each KV layer's allocated cache tensors (one per state for Mamba layers)."""
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    caches: dict[str, list[Any]] = {}
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            cache = context[name].kv_cache
            caches[name] = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    return caches


def block_rows(view: Any, num_blocks: int, block: int, block_stride: int = 0) -> Any:
    """The rows of a cache view that hold scheduler block `block`.

    `block_stride` is the bytes from one block to the next in the view's buffer (the
    KVCacheTensor's block_stride; 0 where vLLM does not say). Two shapes occur:
    - a packed buffer (vLLM 0.33's BLHNC on the H200: one allocation, each block holding every
      layer's page): row r of the view lies `row bytes` after row r - 1, so a block spans
      stride = block_stride / row bytes rows, of which its own page is the first per_block; the
      view has (num_blocks - 1) * stride + per_block rows. GLM's kpool indexer is viewed so, in
      kernel pages that step over the other layers' pages (vLLM's
      AttentionGroup.map_kv_cache_to_kernel_blocks); a Mamba state has stride 1;
    - a block-major view without a block stride (the CPU build): ratio x num_blocks rows, ratio
      kernel blocks per scheduler block."""
    rows = int(view.shape[0])
    if not 0 <= block < num_blocks:
        raise ValueError(f"block {block} outside 0..{num_blocks - 1}")
    row_bytes = int(view.stride(0)) * int(view.element_size()) if view.ndim else 0
    if block_stride and row_bytes and block_stride % row_bytes == 0:
        stride = block_stride // row_bytes
        per_block = rows - (num_blocks - 1) * stride
        if 1 <= per_block <= stride:
            return view[block * stride : block * stride + per_block]
    if rows % num_blocks == 0:
        ratio = rows // num_blocks
        return view[block * ratio : (block + 1) * ratio]
    raise RuntimeError(
        f"cache view {tuple(view.shape)} (row {row_bytes} B, block stride {block_stride} B) is "
        f"neither packed nor block-major over {num_blocks} blocks"
    )


def block_strides(worker: Any) -> dict[str, int]:
    """{layer name: its KVCacheTensor's block_stride in bytes} (0 where vLLM sets none)."""
    config = worker.model_runner.kv_cache_config
    return {
        name: int(getattr(tensor, "block_stride", 0) or 0)
        for tensor in config.kv_cache_tensors
        for name in tensor.layers
    }


def raw_bytes(tensor: Any) -> bytes:
    """A tensor's bytes as stored (any dtype, any layout: read as bytes, never converted)."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def page_digest(page: Any) -> str:
    """sha256 of a page's raw bytes."""
    return hashlib.sha256(raw_bytes(page)).hexdigest()


def worker_page_digests(worker: Any, layer_blocks: list[tuple[str, int]]) -> list[list[str]]:
    """For each (layer, block id): the digest of its page per state tensor (one for an
    attention layer, one per state for a Mamba layer), in the layer's tensor order."""
    target = getattr(worker, "worker", worker)  # the worker behind a WorkerWrapperBase
    caches = layer_caches(target)
    num_blocks = int(target.model_runner.kv_cache_config.num_blocks)
    strides = block_strides(target)
    return [
        [
            page_digest(block_rows(view, num_blocks, int(block), strides.get(name, 0)))
            for view in caches[name]
        ]
        for name, block in layer_blocks
    ]


def rank_part(page: Any, segments: list[int], rank: int, tp: int) -> Any:
    """Rank `rank`'s part of an unsplit (TP1) page at TP `tp`: along the one axis past the row
    axis whose length is sum(segments), the rank-th 1/tp of each segment, concatenated in order.
    A GDN conv state is [q | k | v] channels, each split over the ranks (three segments); a
    recurrent state is its value heads (one segment). The segments come from the model's config
    (glm5_matrix.verdicts.tp_split), not from the connector."""
    import torch

    full = sum(segments)
    axes = [a for a in range(1, page.ndim) if int(page.shape[a]) == full]
    if len(axes) != 1:
        raise ValueError(f"page {tuple(page.shape)}: {len(axes)} axes of length {full}")
    if any(size % tp for size in segments):
        raise ValueError(f"segments {segments} do not split over TP{tp}")
    (axis,) = axes
    parts, start = [], 0
    for size in segments:
        share = size // tp
        parts.append(page.narrow(axis, start + rank * share, share))
        start += size
    return torch.cat(parts, dim=axis)


def worker_rank_part_digests(
    worker: Any, reads: list[tuple[str, int, list[list[int] | None]]], rank: int, tp: int
) -> list[list[str]]:
    """For each (layer, block id, per state tensor: its segments or None): the digest of rank
    `rank`'s part (rank_part) of each state's page at TP `tp`, or of the whole page where None
    (a replicated one). Read on an unsplit (TP1) server: what a rank of a TP `tp` server must
    hold of it."""
    target = getattr(worker, "worker", worker)
    caches = layer_caches(target)
    num_blocks = int(target.model_runner.kv_cache_config.num_blocks)
    strides = block_strides(target)
    digests = []
    for name, block, splits in reads:
        views = caches[name]
        if len(splits) != len(views):
            raise ValueError(f"{name}: {len(splits)} splits for {len(views)} state tensors")
        row = []
        for view, segments in zip(views, splits, strict=True):
            page = block_rows(view, num_blocks, int(block), strides.get(name, 0))
            row.append(
                page_digest(page if segments is None else rank_part(page, segments, rank, tp))
            )
        digests.append(row)
    return digests


def worker_group_layers(worker: Any) -> list[dict[str, Any]]:
    """Per KV cache group, in the scheduler's group order: its layer names, block size, and
    whether it is a Mamba group (its layers hold a state per request, not tokens)."""
    target = getattr(worker, "worker", worker)
    groups = target.model_runner.kv_cache_config.kv_cache_groups
    return [
        {
            "layers": list(group.layer_names),
            "block_size": int(group.kv_cache_spec.block_size),
            "mamba": is_mamba_spec(group.kv_cache_spec),
        }
        for group in groups
    ]


def is_mamba_spec(spec: Any) -> bool:
    """A Mamba group's spec: vLLM's MambaSpec, or (vLLM 0.33) a UniformTypeKVCacheSpecs whose
    members all are."""
    from vllm.v1.kv_cache_interface import MambaSpec

    members = list((getattr(spec, "kv_cache_specs", None) or {}).values())
    if members:
        return all(isinstance(member, MambaSpec) for member in members)
    return isinstance(spec, MambaSpec)


class PageReader:
    """Mixed into vLLM's worker class (`--worker-extension-cls`): the reads above, and the
    block-table recorder above, by name for the dev-mode `/collective_rpc`
    endpoint, which passes string arguments only (JSON here) and returns JSON values."""

    def glm5_group_layers(self) -> list[dict[str, Any]]:
        return worker_group_layers(self)

    def glm5_page_digests(self, layer_blocks: str) -> list[list[str]]:
        pairs = [(str(name), int(block)) for name, block in json.loads(layer_blocks)]
        return worker_page_digests(self, pairs)

    def glm5_rank_part_digests(self, request: str) -> list[list[str]]:
        asked = json.loads(request)
        reads = [(str(n), int(b), list(splits)) for n, b, splits in asked["reads"]]
        return worker_rank_part_digests(self, reads, int(asked["rank"]), int(asked["tp"]))

    def glm5_start_block_recorder(self) -> list[int]:
        worker_start_block_recorder(self)
        return []

    def glm5_recorded_block_tables(self, clear: str = "true") -> dict[str, Any]:
        return worker_recorded_block_tables(self, json.loads(clear))


def _runner(worker: Any) -> Any:
    return worker.model_runner


def model_of(worker: Any) -> Any:
    """The model the worker's runner holds (the worker behind a WorkerWrapperBase too)."""
    runner = _runner(getattr(worker, "worker", worker))
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


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
    block table per KV cache group, and the chunks (first position, tokens) it computes.

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
    chunks: dict[str, list[list[int]]] = {}
    target._glm5_block_records = records
    target._glm5_chunk_records = chunks
    original = target.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        record_block_tables(records, scheduler_output)
        record_chunks(chunks, scheduler_output)
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


def record_chunks(chunks: dict[str, list[list[int]]], scheduler_output: Any) -> None:
    """Append this step's [first position, token count] to each scheduled request's list: the
    chunks the worker is told to compute (a prefill split at a block boundary shows as
    [[0, block], [block, rest]]; a prefix hit of `block` tokens as [[block, rest]])."""
    starts = {
        new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs
    }
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        starts[req_id] = int(computed)
    for req_id, count in scheduler_output.num_scheduled_tokens.items():
        chunks.setdefault(req_id, []).append([starts.get(req_id, -1), int(count)])


def worker_recorded_chunks(worker: Any, clear: bool) -> dict[str, list[list[int]]]:
    live = getattr(getattr(worker, "worker", worker), "_glm5_chunk_records", None)
    records = dict(live or {})
    if clear and live is not None:
        live.clear()
    return records


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
    for name, module in model_of(worker).named_modules():
        backend = getattr(getattr(module, "quant_method", None), "fp8_backend", None)
        if backend is not None:
            backends.setdefault(getattr(backend, "name", str(backend)), []).append(name)
    return backends


def worker_mapped_files(worker: Any, needle: str) -> list[str]:
    """The files mapped into this worker's process whose path holds `needle` (/proc/self/maps):
    which build of a compiled module the process really runs (a FlashInfer module loaded from
    the kernel cache's AOT folder, or built into its JIT folder)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and needle in fields[5]:
                found.add(fields[5].strip())
    return sorted(found)


def worker_attention_backends(worker: Any) -> dict[str, str]:
    """{layer name: qualified class of its attention backend} for every KV layer (attention
    and Mamba alike), as the model runner resolved them."""
    context = _runner(getattr(worker, "worker", worker)).compilation_config.static_forward_context
    return {
        name: _qualified(layer.get_attn_backend())
        for name, layer in context.items()
        if hasattr(layer, "get_attn_backend")
    }


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
        # The retention mode the engine runs (None dense, 0 semantic, > 0 periodic; vLLM's own
        # default where nothing set it) and whether it caches prefixes at all.
        "prefix_cache_retention_interval": config.cache_config.prefix_cache_retention_interval,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
    }


def worker_start_served_state_recorder(worker: Any, groups: dict[str, list[str]]) -> None:
    """Read the Mamba state a request starts from right after a prefix hit, where it is served.

    `groups` maps a KV group index (as a string) to the Mamba layers to read in it. At every step
    that schedules a new request whose first chunk starts past 0 (a prefix-cache hit), the block
    it runs from is located by the rule the harness applies, not by vLLM's state bookkeeping:
    block-table column (first position + tokens - 1) // block size of that group (the column
    align mode runs a request's state in, into which it copies the checkpoint before the model
    runs). Each layer's page there is read, as digests per state tensor, in a forward pre-hook
    of the model: after vLLM's pre-copy, before any Mamba layer changes the state. Where the
    attention metadata of a layer gives the state index its kernel reads (GDN's
    non_spec_state_indices_tensor, Mamba's state_indices_tensor) and the step has one request,
    that index is recorded too. Reading is all it does.
    """
    target = getattr(worker, "worker", worker)
    if getattr(target, "_glm5_served_states", None) is not None:
        return
    wanted = {int(group): list(layers) for group, layers in groups.items()}
    block_sizes = {
        index: int(group.kv_cache_spec.block_size)
        for index, group in enumerate(target.model_runner.kv_cache_config.kv_cache_groups)
    }
    served: dict[str, dict[str, Any]] = {}
    pending: list[dict[str, Any]] = []
    target._glm5_served_states = served
    original = target.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        pending.clear()
        for new in scheduler_output.scheduled_new_reqs:
            start = int(new.num_computed_tokens)
            if start <= 0:
                continue
            tokens = int(scheduler_output.num_scheduled_tokens[new.req_id])
            entry: dict[str, Any] = {
                "request": new.req_id,
                "start": start,
                "tokens": tokens,
                "batch": len(scheduler_output.num_scheduled_tokens),
                "blocks": {},
            }
            for group, layers in wanted.items():
                column = (start + tokens - 1) // block_sizes[group]
                block = int(new.block_ids[group][column])
                entry.setdefault("columns", {})[str(group)] = column
                for layer in layers:
                    entry["blocks"][layer] = block
            pending.append(entry)
        return original(scheduler_output, *args, **kwargs)

    def before_model(module: Any, args: Any, kwargs: Any = None) -> None:
        if not pending:
            return
        caches = layer_caches(target)
        num_blocks = int(target.model_runner.kv_cache_config.num_blocks)
        strides = block_strides(target)
        metadata = _attention_metadata()
        for entry in pending:
            entry["digests"] = {
                layer: [
                    page_digest(block_rows(view, num_blocks, block, strides.get(layer, 0)))
                    for view in caches[layer]
                ]
                for layer, block in entry["blocks"].items()
            }
            if entry["batch"] == 1:
                entry["kernel_blocks"] = {
                    layer: _kernel_state_index(metadata.get(layer)) for layer in entry["blocks"]
                }
            served[entry["request"]] = entry
        pending.clear()

    model_of(target).register_forward_pre_hook(before_model, with_kwargs=True)
    target.execute_model = execute_model


def _attention_metadata() -> dict[str, Any]:
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batches: the first
        metadata = metadata[0] if metadata else None
    return dict(metadata) if isinstance(metadata, dict) else {}


def _kernel_state_index(metadata: Any) -> int | None:
    """The state index a Mamba layer's kernel reads for the step's only request, where its
    metadata names one (None where it does not)."""
    for name in ("non_spec_state_indices_tensor", "state_indices_tensor"):
        indices = getattr(metadata, name, None)
        if indices is not None and indices.numel() > 0:
            return int(indices.reshape(indices.shape[0], -1)[0, 0])
    return None


def worker_served_states(worker: Any, clear: bool) -> dict[str, dict[str, Any]]:
    live = getattr(getattr(worker, "worker", worker), "_glm5_served_states", None)
    records = dict(live or {})
    if clear and live is not None:
        live.clear()
    return records
