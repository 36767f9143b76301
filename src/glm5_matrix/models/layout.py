"""The KV cache layout vLLM gives GLM-5.3-Flash, planned from a config.json without vLLM.

GLM-5.3-Flash is hybrid: KDA (linear attention) layers keep a Mamba-style state, DSA layers
keep an MLA latent, kpool-compressed indexer keys and a small ring of raw tail keys. vLLM
makes every group's page the same size, so the attention block grows until one MLA latent
page holds a KDA state (`Platform._align_hybrid_block_size`), and the KDA pages are padded
up to the latent page. This module repeats that arithmetic so a user can see the layout of
a setting before starting an engine; the `layout` suite checks it against vLLM's own code.

`glm5-matrix layout (--profile NAME | --config PATH) --tp N [--spec-tokens K]
[--kv-cache-dtype auto|fp8] [--block-size B] [--json]`
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.models.glm_config import required, text_config

KV_CACHE_DTYPES = ("auto", "fp8")

# Bytes per element of the dtypes a config names.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# MLA + hybrid models: the block is a multiple of 128 so TRTLLM/FlashInfer MLA decode kernels
# see whole 128-token groups (_align_hybrid_block_size).
_MLA_BLOCK_FLOOR = 128
# DeepGEMM's paged-MQA logits kernels take pages of 32 or 64 indexer states (64 only on SM120,
# which this planner does not cover); the indexer's smallest kernel block is kpool x 32.
_INDEXER_MIN_STATES_PER_PAGE = 32
# The indexer stores fp8 keys plus one fp32 scale per 128 values (Indexer.quant_block_size).
_INDEXER_QUANT_BLOCK = 128
_FP32_BYTES = 4
# The kpool tail ring stores a raw bf16 key and a bf16 gate score row per slot.
_TAIL_ROWS_PER_SLOT = 2
_BF16_BYTES = 2


@dataclass(frozen=True)
class LayoutGroup:
    """One KV cache group: the layers sharing a block table, and what one block holds."""

    kind: str  # "mla" (latent + indexer), "tail", "mamba"
    spec: str  # vLLM's KV spec class for the group's layers
    block_size: int  # tokens per block
    page_bytes: int  # bytes of one block, summed over one layer of each member kind
    layers: list[str]
    members: dict[str, int] = field(default_factory=dict)  # member -> page bytes per layer
    unpadded_page_bytes: int | None = None  # Mamba: the state before padding
    padding_bytes: int = 0
    shares_tensor_with: str | None = None  # Mamba pages live in the MLA latent's tensor
    prefix_cacheable: bool = True
    note: str = ""


@dataclass(frozen=True)
class LayoutPlan:
    tp: int
    spec_tokens: int
    kv_cache_dtype: str
    user_block_size: int | None
    block_size: int
    # The arithmetic, for the human output and for checking against vLLM.
    model_dtype: str
    conv_state_shape: tuple[int, int]
    recurrent_state_shape: tuple[int, int, int]
    conv_state_bytes: int
    recurrent_state_bytes: int
    mamba_state_bytes: int
    attn_bytes_per_token: int
    block_alignment: int
    mamba_page_size_padded: int | None
    latent_page_bytes: int
    indexer_page_bytes: int
    tail_ring: int
    tail_page_bytes: int
    groups: list[LayoutGroup]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def offload_bytes(self, blocks: int) -> int:
        """CPU room for `blocks` KV blocks of every prefix-cacheable group: what an offload
        connector stores per block (the tail ring is per request and never offloaded)."""
        return blocks * sum(g.page_bytes for g in self.groups if g.prefix_cacheable)

    def describe(self) -> str:
        bpt = self.attn_bytes_per_token
        kda = [g for g in self.groups if g.kind == "mamba"]
        lines = [
            f"GLM-5.3-Flash KV layout at TP{self.tp}, {self.spec_tokens} speculative token(s), "
            f"KV dtype {self.kv_cache_dtype}"
            + (f", --block-size {self.user_block_size}" if self.user_block_size else "")
            + f": block size {self.block_size} tokens",
            f"  KDA state per layer: conv {list(self.conv_state_shape)} {self.model_dtype} = "
            f"{self.conv_state_bytes:,} B + recurrent {list(self.recurrent_state_shape)} float32 "
            f"= {self.recurrent_state_bytes:,} B -> {self.mamba_state_bytes:,} B",
            f"  MLA latent: {bpt} B/token; block = {self.block_alignment} x "
            f"ceil({self.mamba_state_bytes:,} / ({self.block_alignment} x {bpt})) = "
            f"{self.block_size}",
            f"  latent page {self.latent_page_bytes:,} B; KDA pages padded "
            f"{self.mamba_state_bytes:,} -> {self.mamba_page_size_padded or self.mamba_state_bytes:,} B",
            "  groups:",
        ]
        for group in self.groups:
            members = ", ".join(f"{name} {size:,} B" for name, size in group.members.items())
            lines.append(
                f"    {group.kind:<5} {group.spec:<18} block {group.block_size:>5}  "
                f"page {group.page_bytes:>10,} B  layers {', '.join(group.layers)}"
                + (f"  ({members})" if members else "")
                + (f"  [{group.note}]" if group.note else "")
            )
        lines.append(f"  ({len(kda)} KDA group(s), one per KDA layer, in the MLA latent's tensor)")
        return "\n".join(lines)


def plan_layout(
    config: dict[str, Any],
    tp: int,
    spec_tokens: int = 0,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    drafter: Mapping[str, Any] | None = None,
) -> LayoutPlan:
    """Plan vLLM's KV cache layout for a GLM-5.3-Flash config at one setting; `drafter` (a
    DFlash2 drafter's config.json) adds its full-attention layers, which keep the target's block
    size (their kernels take any multiple of 16)."""
    text = text_config(config)
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if spec_tokens < 0:
        raise UserError(f"--spec-tokens must be >= 0, got {spec_tokens}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
    if block_size is not None and block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {block_size}")

    layer_types = required(text, "layer_types", list)
    kda_layers = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
    dsa_layers = [i for i, kind in enumerate(layer_types) if kind != "linear_attention"]
    if not kda_layers or not dsa_layers:
        raise UserError("layer_types must hold both linear_attention (KDA) and DSA layers")
    linear = required(text, "linear_attn_config", dict)
    listed = linear.get("kda_layers")
    if listed is not None and sorted(listed) != kda_layers:
        raise UserError(
            f"linear_attn_config.kda_layers {listed} disagrees with layer_types (KDA layers "
            f"{kda_layers}; the lists are 0-based)"
        )
    heads = required(linear, "num_heads")
    head_dim = required(linear, "head_dim")
    conv_kernel = required(linear, "short_conv_kernel_size")
    if heads % tp:
        raise UserError(f"--tp {tp} does not divide the {heads} KDA heads")
    kv_lora_rank = required(text, "kv_lora_rank")
    rope_dim = required(text, "qk_rope_head_dim")
    kpool = required(text, "index_kpool")
    index_head_dim = required(text, "index_head_dim")
    if kpool < 2:
        raise UserError(f"index_kpool must be > 1, got {kpool}")
    model_dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype")
    if model_dtype not in _DTYPE_BYTES:
        raise UserError(
            f"config dtype must be one of {', '.join(_DTYPE_BYTES)}, got {model_dtype!r}"
        )
    dtype_bytes = _DTYPE_BYTES[model_dtype]

    # KDA state: q, k, v short convolutions (width kernel - 1, plus a column per draft token)
    # in the model dtype, and the fp32 recurrent state, both split over TP by heads.
    conv_shape = (3 * heads * head_dim // tp, conv_kernel - 1 + spec_tokens)
    recurrent_shape = (heads // tp, head_dim, head_dim)
    conv_bytes = math.prod(conv_shape) * dtype_bytes
    recurrent_bytes = math.prod(recurrent_shape) * _FP32_BYTES
    mamba_bytes = conv_bytes + recurrent_bytes

    # The aligner's attention bytes per token: one latent of kv_lora_rank + rope dims.
    kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else 1
    attn_bytes_per_token = (kv_lora_rank + rope_dim) * kv_bytes

    # Phase 1 (no --block-size): the smallest size every DSA backend takes, the indexer's
    # kpool x 32. Phase 2 rounds to a multiple of max(that, the MLA floor, the entry block).
    indexer_kernel_block = kpool * _INDEXER_MIN_STATES_PER_PAGE
    entry_block = block_size if block_size is not None else indexer_kernel_block
    alignment = max(indexer_kernel_block, entry_block, _MLA_BLOCK_FLOOR)
    aligned = alignment * -(-mamba_bytes // (alignment * attn_bytes_per_token))
    final_block = max(entry_block, aligned)
    latent_page = final_block * attn_bytes_per_token
    padded = latent_page if latent_page != mamba_bytes else None

    if final_block % kpool:
        raise UserError(f"block size {final_block} is not a multiple of index_kpool {kpool}")
    index_state_bytes = index_head_dim + index_head_dim // _INDEXER_QUANT_BLOCK * _FP32_BYTES
    indexer_page = final_block // kpool * index_state_bytes
    # Tail ring: kpool slots times the next power of two covering one pool plus the drafts.
    pools = -(-(kpool + spec_tokens) // kpool)
    ring = kpool * (1 << (pools - 1).bit_length())
    if final_block % ring:
        raise UserError(f"block size {final_block} is not a multiple of the tail ring {ring}")
    tail_page = ring * _TAIL_ROWS_PER_SLOT * index_head_dim * _BF16_BYTES

    dsa_names = [f"model.layers.{i}" for i in dsa_layers]
    groups = [
        LayoutGroup(
            kind="mla",
            spec="MLAAttentionSpec",
            block_size=final_block,
            page_bytes=latent_page + indexer_page,
            layers=dsa_names,
            members={"latent": latent_page, "indexer": indexer_page},
            note=f"indexer keeps one {index_state_bytes} B state per {kpool} tokens",
        ),
        LayoutGroup(
            kind="tail",
            spec="CircularBufferSpec",
            block_size=ring,
            page_bytes=tail_page,
            layers=dsa_names,
            prefix_cacheable=False,
            note=f"one ring of {ring} slots per request",
        ),
    ]
    for index in kda_layers:
        groups.append(
            LayoutGroup(
                kind="mamba",
                spec="MambaSpec",
                block_size=final_block,
                page_bytes=padded or mamba_bytes,
                layers=[f"model.layers.{index}"],
                unpadded_page_bytes=mamba_bytes,
                padding_bytes=(padded or mamba_bytes) - mamba_bytes,
                shares_tensor_with="mla latent",
            )
        )
    if drafter is not None:
        groups.append(_drafter_group(drafter, tp, final_block, kv_bytes))
    return LayoutPlan(
        tp=tp,
        spec_tokens=spec_tokens,
        kv_cache_dtype=kv_cache_dtype,
        user_block_size=block_size,
        block_size=final_block,
        model_dtype=model_dtype,
        conv_state_shape=conv_shape,
        recurrent_state_shape=recurrent_shape,
        conv_state_bytes=conv_bytes,
        recurrent_state_bytes=recurrent_bytes,
        mamba_state_bytes=mamba_bytes,
        attn_bytes_per_token=attn_bytes_per_token,
        block_alignment=alignment,
        mamba_page_size_padded=padded,
        latent_page_bytes=latent_page,
        indexer_page_bytes=indexer_page,
        tail_ring=ring,
        tail_page_bytes=tail_page,
        groups=groups,
    )


def _drafter_group(drafter: Mapping[str, Any], tp: int, block: int, kv_bytes: int) -> LayoutGroup:
    """A drafter's GQA layers: one FullAttentionSpec page per layer of K and V for its KV heads
    on this rank (replicated when TP exceeds them)."""
    config = dict(drafter)
    layers = required(config, "num_hidden_layers")
    kv_heads = max(1, required(config, "num_key_value_heads") // tp)
    head_dim = required(config, "head_dim")
    per_token = 2 * kv_heads * head_dim * kv_bytes
    return LayoutGroup(
        kind="draft",
        spec="FullAttentionSpec",
        block_size=block,
        page_bytes=block * per_token,
        layers=[f"drafter.layers.{i}" for i in range(layers)],
        note=f"{per_token} B/token per layer (K and V, {kv_heads} KV head(s) x {head_dim})",
    )


def load_config(path: Path) -> dict[str, Any]:
    """A config.json, or the config.json inside a model directory."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{file}: not found") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"{file}: not valid JSON: not UTF-8 text (a binary file?)") from None
    except OSError as exc:
        raise UserError(f"{file}: cannot read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: not a JSON object")
    return data


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "layout",
        help="plan the KV cache layout (block size, groups) vLLM gives GLM-5.3-Flash",
        description=__doc__.split("\n\n")[0],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a profile under profiles/ with a config.json")
    source.add_argument("--config", type=Path, help="a config.json or a model directory")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    parser.add_argument("--spec-tokens", type=int, default=0, help="MTP speculative tokens")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--block-size", type=int, default=None, help="a user --block-size")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.profile is not None:
        from glm5_matrix.matrix.profiles import load_profile

        config = load_profile(args.profile).config()
    else:
        config = load_config(args.config)
    plan = plan_layout(config, args.tp, args.spec_tokens, args.kv_cache_dtype, args.block_size)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.describe())
    return 0
