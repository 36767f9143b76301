"""Inside vLLM's worker processes: the bytes of KV cache pages, as digests per block and group.

What a transfer guarantees is a copy: the pages D received for a block must equal, bit for bit,
the pages P sent for it (NIXL 1P1D), and the GPU pages of a block restored from CPU must equal
those the cold run wrote (KV offload). This module reads those bytes where they live, in the
worker, and hands back sha256 digests (small, JSON-safe, exact); glm5_matrix.verdicts.transfers compares
them. Nothing here changes the cache.

Two ways in:
- an offline engine (glm5_matrix.engines.Engine) calls `worker_page_digests` through
  `LLM.collective_rpc` with the function itself;
- an API server cannot be handed a function: it is started with
  `--worker-extension-cls glm5_matrix.worker_pages.PageReader` (methods mixed into vLLM's worker
  class) and `VLLM_SERVER_DEV_MODE=1`, whose `/collective_rpc` endpoint calls a worker method by
  name with string arguments (glm5_matrix.disagg.worker_rpc is the client).

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


def block_rows(view: Any, num_blocks: int, block: int) -> Any:
    """The rows of a block-major cache view that hold scheduler block `block`."""
    rows = int(view.shape[0])
    if rows % num_blocks:
        raise RuntimeError(
            f"cache view {tuple(view.shape)} is not block-major over {num_blocks} blocks"
        )
    ratio = rows // num_blocks
    return view[block * ratio : (block + 1) * ratio]


def page_digest(page: Any) -> str:
    """sha256 of a page's raw bytes (any dtype: read as bytes, never converted)."""
    import torch

    raw = page.detach().contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def worker_page_digests(worker: Any, layer_blocks: list[tuple[str, int]]) -> list[list[str]]:
    """For each (layer, block id): the digest of its page per state tensor (one for an
    attention layer, one per state for a Mamba layer), in the layer's tensor order."""
    target = getattr(worker, "worker", worker)  # the worker behind a WorkerWrapperBase
    caches = layer_caches(target)
    num_blocks = int(target.model_runner.kv_cache_config.num_blocks)
    return [
        [page_digest(block_rows(view, num_blocks, int(block))) for view in caches[name]]
        for name, block in layer_blocks
    ]


def worker_group_layers(worker: Any) -> list[dict[str, Any]]:
    """Per KV cache group, in the scheduler's group order: its layer names and block size."""
    target = getattr(worker, "worker", worker)
    groups = target.model_runner.kv_cache_config.kv_cache_groups
    return [
        {"layers": list(group.layer_names), "block_size": int(group.kv_cache_spec.block_size)}
        for group in groups
    ]


class PageReader:
    """Mixed into vLLM's worker class (`--worker-extension-cls`): the reads above, and the
    block-table recorder of glm5_matrix.engines, by name for the dev-mode `/collective_rpc`
    endpoint, which passes string arguments only (JSON here) and returns JSON values."""

    def glm5_group_layers(self) -> list[dict[str, Any]]:
        return worker_group_layers(self)

    def glm5_page_digests(self, layer_blocks: str) -> list[list[str]]:
        pairs = [(str(name), int(block)) for name, block in json.loads(layer_blocks)]
        return worker_page_digests(self, pairs)

    def glm5_start_block_recorder(self) -> list[int]:
        from glm5_matrix.engines import worker_start_block_recorder

        worker_start_block_recorder(self)
        return []

    def glm5_recorded_block_tables(self, clear: str = "true") -> dict[str, Any]:
        from glm5_matrix.engines import worker_recorded_block_tables

        return worker_recorded_block_tables(self, json.loads(clear))
