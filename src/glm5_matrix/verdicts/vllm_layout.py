"""What the installed vLLM itself computes for GLM-5.3-Flash's KV cache layout.

Used only inside cells (the `layout` suite): it imports vLLM lazily and drives vLLM's own
code, with no GPU: a real ModelConfig/VllmConfig built from a profile's config.json, the
real block-size entry point `Platform.update_block_size_for_backend` (the classmethod the
CUDA platform inherits unchanged), the real GLM-5.3 indexer and kpool-tail cache modules and
their `get_kv_cache_spec`, the model class resolved by vLLM's ModelRegistry for the Mamba
state, and vLLM's KV spec classes. vLLM's grouping (`get_kv_cache_groups`) is not driven: it
needs the KV cache layout that the engine core resolves from the GPU attention backends.

One stand-in, for one reason: the MLA latent layer (`MLAAttention`) cannot be built without a
GPU (it selects a CUDA attention backend and allocates device buffers on construction), so its
spec is built here with the fields `MLAAttention.get_kv_cache_spec` uses (one KV head of
kv_lora_rank + qk_rope_head_dim, the cache dtype, 656 B/token for `fp8_ds_mla`). Its absence
from the layer registry does not move the block size: the indexer layer, built first in every
DSA layer, is the first non-SSM backend either way, and the 128-token MLA floor of
`_align_hybrid_block_size` covers the MLA kernels' block sizes (32 or 64).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The latent layer's packed per-token sizes for the DeepSeek MLA cache formats, as in
# vllm/model_executor/layers/attention/mla_attention.py (MLAAttention.get_kv_cache_spec).
_DS_MLA_STATE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


@dataclass
class VllmLayout:
    """The block size and per-kind KV specs vLLM produced, plus its grouping."""

    vllm_version: str
    block_size: int
    mamba_page_size_padded: int | None
    mamba_page_bytes: int  # unpadded state bytes of one KDA layer
    mamba_state_shapes: list[list[int]]
    mamba_state_dtypes: list[str]
    latent_page_bytes: int
    indexer_page_bytes: int
    tail_block_size: int
    tail_page_bytes: int
    tail_prefix_cacheable: bool
    spec_classes: dict[str, str]  # group kind -> spec class of the real cache module


class VllmLayoutProbe:
    """Runs vLLM's layout code for one config at many settings.

    Parsing the config into a ModelConfig (and the MTP draft's) costs about a second, so the
    parsed configs are built once and deep-copied for each setting: every setting still gets
    fresh, unshared vLLM config objects.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="glm5-layout-")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(config))
        self._model_config: Any = None
        self._speculative: dict[tuple[int, int], Any] = {}

    def close(self) -> None:
        self._dir.cleanup()

    def __enter__(self) -> VllmLayoutProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compute(
        self,
        tp: int,
        spec_tokens: int = 0,
        kv_cache_dtype: str = "auto",
        block_size: int | None = None,
    ) -> VllmLayout:
        """vLLM's block-size alignment and KV specs for one setting, without a GPU."""
        import copy

        from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

        if self._model_config is None:
            self._model_config = ModelConfig(
                model=self._dir.name,
                tokenizer=self._dir.name,
                skip_tokenizer_init=True,
                dtype="auto",
                max_model_len=8192,
                enforce_eager=True,
            )
        model_config = copy.deepcopy(self._model_config)
        parallel_config = ParallelConfig(tensor_parallel_size=tp)
        speculative_config = None
        if spec_tokens:
            key = (tp, spec_tokens)
            if key not in self._speculative:
                self._speculative[key] = SpeculativeConfig(
                    method="mtp",
                    num_speculative_tokens=spec_tokens,
                    target_model_config=copy.deepcopy(self._model_config),
                    target_parallel_config=ParallelConfig(tensor_parallel_size=tp),
                )
            speculative_config = copy.deepcopy(self._speculative[key])
        return _compute(
            model_config, parallel_config, speculative_config, kv_cache_dtype, block_size
        )


def gpu_less_vllm_config(
    model_config: Any, cache_config: Any, parallel_config: Any, speculative_config: Any
) -> Any:
    """A real VllmConfig on a machine without a GPU. vLLM's default device inference needs a GPU;
    config-level code (aligners, KV specs, metadata builders) runs on the CPU device and
    allocates no device memory."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        speculative_config=speculative_config,
        device_config=DeviceConfig(device="cpu"),
    )


def _compute(
    model_config: Any,
    parallel_config: Any,
    speculative_config: Any,
    kv_cache_dtype: str,
    block_size: int | None,
) -> VllmLayout:
    import torch
    import vllm
    from vllm.config import CacheConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, get_kv_quant_mode

    cache_config = CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype)
    vllm_config = gpu_less_vllm_config(
        model_config, cache_config, parallel_config, speculative_config
    )
    cache_config = vllm_config.cache_config
    text = model_config.hf_text_config

    with set_current_vllm_config(vllm_config):
        from vllm.models.glm5next.common.attention import (
            Glm5NextIndexerCache,
            Glm5NextTailCache,
        )

        # The real indexer and tail cache modules of one DSA layer, built as Indexer.__init__
        # builds them (k_cache first, then the tail): they register in the layer registry
        # that update_block_size_for_backend reads.
        quant_block = 128  # Indexer.quant_block_size: one fp32 scale per 128 fp8 values
        prefix = "language_model.model.layers.3.self_attn.indexer"
        indexer_cache = Glm5NextIndexerCache(
            head_dim=text.index_head_dim + text.index_head_dim // quant_block * 4,
            dtype=torch.uint8,
            prefix=f"{prefix}.k_cache",
            cache_config=cache_config,
            index_kpool=text.index_kpool,
        )
        tail_cache = Glm5NextTailCache(
            head_dim=text.index_head_dim,
            dtype=torch.bfloat16,
            prefix=f"{prefix}.tail_cache",
            cache_config=cache_config,
            index_kpool=text.index_kpool,
        )
        Platform.update_block_size_for_backend(vllm_config)

        model_cls, _ = ModelRegistry.resolve_model_cls(
            model_config.architecture, model_config=model_config
        )
        shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
        dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
        mamba_spec = MambaSpec(
            shapes=tuple(tuple(s) for s in shapes),
            dtypes=tuple(dtypes),
            block_size=cache_config.mamba_block_size or cache_config.block_size,
            page_size_padded=cache_config.mamba_page_size_padded,
            mamba_cache_mode=cache_config.mamba_cache_mode,
            num_speculative_blocks=vllm_config.num_speculative_tokens,
        )
        indexer_spec = indexer_cache.get_kv_cache_spec(vllm_config)
        tail_spec = tail_cache.get_kv_cache_spec(vllm_config)

        # Stand-in (see the module docstring): the fields MLAAttention.get_kv_cache_spec uses.
        latent_dtype = (
            model_config.dtype
            if cache_config.cache_dtype == "auto"
            else _cache_torch_dtype(cache_config.cache_dtype)
        )
        latent_spec = MLAAttentionSpec(
            block_size=cache_config.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=model_config.get_head_size(),
            dtype=latent_dtype,
            cache_dtype_str=cache_config.cache_dtype,
            kv_quant_mode=get_kv_quant_mode(cache_config.cache_dtype),
            state_content_bytes=_DS_MLA_STATE_BYTES.get(cache_config.cache_dtype),
            is_index_group_leader=True,
        )

    return VllmLayout(
        vllm_version=vllm.__version__,
        block_size=cache_config.block_size,
        mamba_page_size_padded=cache_config.mamba_page_size_padded,
        mamba_page_bytes=mamba_spec.real_page_size_bytes,
        mamba_state_shapes=[list(s) for s in shapes],
        mamba_state_dtypes=[str(d).removeprefix("torch.") for d in dtypes],
        latent_page_bytes=latent_spec.page_size_bytes,
        indexer_page_bytes=indexer_spec.page_size_bytes,
        tail_block_size=tail_spec.block_size,
        tail_page_bytes=tail_spec.page_size_bytes,
        tail_prefix_cacheable=tail_spec.prefix_cacheable,
        spec_classes={
            "mla": type(indexer_spec).__name__,
            "tail": type(tail_spec).__name__,
            "mamba": type(mamba_spec).__name__,
        },
    )


def _cache_torch_dtype(cache_dtype: str) -> Any:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
