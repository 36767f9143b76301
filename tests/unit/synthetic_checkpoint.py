"""A synthetic full GLM-5.3-Flash checkpoint: the real structure at tiny widths.

For the pruner's tests (tests/unit/checkpoints/test_commands.py) and its benchmark
(benchmarks/prune_throughput.py), which need a real 45-layer checkpoint on disk without
downloading 330 GB: test scaffolding, not the harness (no cell or suite uses it), so it lives
with the unit tests' shared helpers. What is real here: the config's structure (45 decoder layers, their
attention/MLP schedule, the MTP layer, linear_attn_config, indexer_types, the fp8 block
quantization), the tensor names, which tensors are fp8 with a `weight_scale_inv` companion
and which are bf16 or fp32, and the shape relations between them. What is not: the widths
(a tiny config scales them down) and the values (seeded random bytes).

Sources: the config is zai-org/GLM-5.3-Flash config.json at revision 04c4e9e9 as transcribed
in the public fixture jinhuang12/vllm-neuron test/vllm_neuron/model/glm5_next/fixtures/
config.json; the tensor names and dtypes are those of the published shard headers
(fixtures/headers/*.header.json in the same repository), e.g. KDA projections are BF16,
`A_log`/`dt_bias`/`hc_*_base`/`hc_*_scale`/`e_score_correction_bias` and every
`weight_scale_inv` are F32, MoE experts and the MLA q_a/q_b/kv_a/o projections are F8_E4M3.

The shards are written in the safetensors format directly (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, contiguous data), one tensor at a time so a
multi-GB checkpoint never sits in memory; tests read them back with the `safetensors` library.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm5_matrix.models.glm_config import text_config

DSA = "deepseek_sparse_attention"
KDA = "linear_attention"

NUM_LAYERS = 45
DENSE_LAYERS = 3  # first_k_dense_replace


def _real_layer_types() -> list[str]:
    # The published schedule: DSA/MLA at i % 4 == 3 (11 layers), KDA elsewhere (34 layers).
    return [DSA if i % 4 == 3 else KDA for i in range(NUM_LAYERS)]


# The decoder fields of the published text_config that the structure depends on, at real widths.
REAL_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next_text",
    "num_hidden_layers": NUM_LAYERS,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 154880,
    "max_position_embeddings": 1048576,
    "dtype": "bfloat16",
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "first_k_dense_replace": DENSE_LAYERS,
    "layer_types": _real_layer_types(),
    "mlp_layer_types": ["dense"] * DENSE_LAYERS + ["sparse"] * (NUM_LAYERS - DENSE_LAYERS),
    "linear_attn_config": {
        "num_heads": 64,
        "gate_lower_bound": -5.0,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        # 0-based layer numbers, as in the published config (full_attn_layers starts at 3).
        "kda_layers": [i for i, t in enumerate(_real_layer_types()) if t == KDA],
        "full_attn_layers": [i for i, t in enumerate(_real_layer_types()) if t == DSA],
    },
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "mla_use_nope": True,
    "indexer_rope_interleave": True,
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_kpool": 4,
    "index_kpool_compress": True,
    "index_kpool_always_select_tail": True,
    "index_share_for_mtp_iteration": True,
    "n_routed_experts": 288,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "moe_router_dtype": "float32",
    "num_nextn_predict_layers": 1,
    "mhc": True,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "eos_token_id": [154820, 154827, 154829],
    "pad_token_id": 154820,
    "head_dim": 0,
    "indexer_types": ["full"] * NUM_LAYERS,
    "qk_head_dim": 256,
    "rms_norm_eps": 1e-05,
    "swiglu_limit": 10.0,
    "use_cache": True,
}

REAL_VISION_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next_vision",
    "depth": 24,
    "hidden_size": 1024,
    "num_heads": 16,
    "intermediate_size": 4096,
    "image_size": 448,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 4096,
    "projection_intermediate_size": 10240,
    "attention_bias": True,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
}

REAL_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

# Tiny widths: every relation the real config has (heads x head_dim, lora ranks, the fp8
# block dividing the projections) is kept; only the numbers shrink.
TINY_TEXT_WIDTHS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "eos_token_id": [250, 251, 252],
    "pad_token_id": 250,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "index_topk": 64,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "linear_attn_config": {"num_heads": 4, "head_dim": 16},
}
TINY_VISION_WIDTHS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "image_size": 28,
    "out_hidden_size": 64,
    "projection_intermediate_size": 96,
}
TINY_WEIGHT_BLOCK = [32, 32]

_DTYPE_BYTES = {"F8_E4M3": 1, "BF16": 2, "F32": 4}

# Side files a published checkpoint carries next to the weights; their content is a stand-in
# (the pruner copies them byte for byte and never reads them).
SIDE_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {"<|x|>": 0}}}\n',
    "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|x|>"}\n',
    "generation_config.json": '{"eos_token_id": [250, 251, 252], "pad_token_id": 250}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "preprocessor_config.json": '{"patch_size": 14, "merge_size": 2}\n',
}


@dataclass(frozen=True)
class SyntheticTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def full_config(
    layout: str = "multimodal",
    *,
    text_widths: dict[str, Any] | None = None,
    vision_widths: dict[str, Any] | None = None,
    weight_block_size: list[int] | None = None,
) -> dict[str, Any]:
    """A full (45-layer + MTP) GLM-5.3-Flash config.json at the given widths (tiny by default).

    layout "multimodal": Glm5NextForConditionalGeneration with text_config/vision_config;
    "text": Glm5NextForCausalLM with the text fields at the top level.
    """
    text = _merge(REAL_TEXT_CONFIG, TINY_TEXT_WIDTHS if text_widths is None else text_widths)
    vision = _merge(
        REAL_VISION_CONFIG, TINY_VISION_WIDTHS if vision_widths is None else vision_widths
    )
    quantization = dict(REAL_QUANTIZATION_CONFIG)
    quantization["weight_block_size"] = list(weight_block_size or TINY_WEIGHT_BLOCK)
    if layout == "multimodal":
        config: dict[str, Any] = {
            "architectures": ["Glm5NextForConditionalGeneration"],
            "model_type": "glm5_next",
            "image_token_id": 154854,
            "quantization_config": quantization,
            "text_config": text,
            "vision_config": vision,
        }
    elif layout == "text":
        config = {"architectures": ["Glm5NextForCausalLM"], **text}
        config["quantization_config"] = quantization
    else:
        raise ValueError(f"unknown layout {layout!r}")
    tensors = tensor_plan(config)
    quantization["modules_to_not_convert"] = _modules_left_in_bf16(tensors)
    return config


def _prefix(config: dict[str, Any]) -> str:
    return "model.language_model" if "text_config" in config else "model"


def tensor_plan(config: dict[str, Any]) -> list[SyntheticTensor]:
    """Every tensor of the full checkpoint for this config: name, dtype, shape."""
    text = text_config(config)
    block = config["quantization_config"]["weight_block_size"]
    prefix = _prefix(config)
    h = text["hidden_size"]
    num_layers = text["num_hidden_layers"]
    mtp_layers = range(num_layers, num_layers + text.get("num_nextn_predict_layers", 0))
    out: list[SyntheticTensor] = []

    def add(name: str, dtype: str, *shape: int) -> None:
        out.append(SyntheticTensor(name, dtype, tuple(shape)))

    def fp8_linear(name: str, rows: int, cols: int) -> None:
        add(f"{name}.weight", "F8_E4M3", rows, cols)
        add(f"{name}.weight_scale_inv", "F32", -(-rows // block[0]), -(-cols // block[1]))

    for i in [*range(num_layers), *mtp_layers]:
        layer = f"{prefix}.layers.{i}"
        is_mtp = i >= num_layers
        add(f"{layer}.input_layernorm.weight", "BF16", h)
        add(f"{layer}.post_attention_layernorm.weight", "BF16", h)
        attention = DSA if is_mtp else text["layer_types"][i]
        if attention == KDA:
            _add_kda(add, f"{layer}.self_attn", text)
        else:
            _add_dsa(add, fp8_linear, f"{layer}.self_attn", text)
        mlp = text["mlp_layer_types"][-1] if is_mtp else text["mlp_layer_types"][i]
        if mlp == "dense":
            for proj, rows, cols in _mlp_shapes(h, text["intermediate_size"]):
                fp8_linear(f"{layer}.mlp.{proj}", rows, cols)
        else:
            experts = text["n_routed_experts"]
            add(f"{layer}.mlp.gate.weight", "BF16", experts, h)
            add(f"{layer}.mlp.gate.e_score_correction_bias", "F32", experts)
            shared = text["moe_intermediate_size"] * text["n_shared_experts"]
            for proj, rows, cols in _mlp_shapes(h, shared):
                fp8_linear(f"{layer}.mlp.shared_experts.{proj}", rows, cols)
            for e in range(experts):
                for proj, rows, cols in _mlp_shapes(h, text["moe_intermediate_size"]):
                    fp8_linear(f"{layer}.mlp.experts.{e}.{proj}", rows, cols)
        if is_mtp:
            add(f"{layer}.eh_proj.weight", "BF16", h, 2 * h)
            add(f"{layer}.enorm.weight", "BF16", h)
            add(f"{layer}.hnorm.weight", "BF16", h)
            add(f"{layer}.shared_head.norm.weight", "BF16", h)
        else:
            mult = text["hc_mult"]
            for site in ("attn", "ffn"):
                add(f"{layer}.hc_{site}_base", "F32", (2 + mult) * mult)
                add(f"{layer}.hc_{site}_fn", "BF16", (2 + mult) * mult, mult * h)
                add(f"{layer}.hc_{site}_scale", "F32", 3)
    add(f"{prefix}.embed_tokens.weight", "BF16", text["vocab_size"], h)
    add(f"{prefix}.norm.weight", "BF16", h)
    add("lm_head.weight", "BF16", text["vocab_size"], h)
    if "vision_config" in config:
        _add_vision(add, config["vision_config"])
    return out


def _mlp_shapes(hidden: int, inner: int) -> list[tuple[str, int, int]]:
    return [("down_proj", hidden, inner), ("gate_proj", inner, hidden), ("up_proj", inner, hidden)]


def _add_kda(add: Any, attn: str, text: dict[str, Any]) -> None:
    h = text["hidden_size"]
    kda = text["linear_attn_config"]
    heads, head_dim = kda["num_heads"], kda["head_dim"]
    width = heads * head_dim
    add(f"{attn}.A_log", "F32", heads)
    add(f"{attn}.dt_bias", "F32", width)
    add(f"{attn}.b_proj.weight", "BF16", heads, h)
    for name in ("f", "g"):
        add(f"{attn}.{name}_a_proj.weight", "BF16", head_dim, h)
        add(f"{attn}.{name}_b_proj.weight", "BF16", width, head_dim)
    for name in ("q", "k", "v"):
        add(f"{attn}.{name}_proj.weight", "BF16", width, h)
        add(f"{attn}.{name}_conv1d.weight", "BF16", width, 1, kda["short_conv_kernel_size"])
    add(f"{attn}.o_norm.weight", "BF16", head_dim)
    add(f"{attn}.o_proj.weight", "BF16", h, width)


def _add_dsa(add: Any, fp8_linear: Any, attn: str, text: dict[str, Any]) -> None:
    h = text["hidden_size"]
    heads = text["num_attention_heads"]
    q_lora, kv_lora = text["q_lora_rank"], text["kv_lora_rank"]
    qk_head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    fp8_linear(f"{attn}.q_a_proj", q_lora, h)
    add(f"{attn}.q_a_layernorm.weight", "BF16", q_lora)
    fp8_linear(f"{attn}.q_b_proj", heads * qk_head, q_lora)
    fp8_linear(f"{attn}.kv_a_proj_with_mqa", kv_lora + text["qk_rope_head_dim"], h)
    add(f"{attn}.kv_a_layernorm.weight", "BF16", kv_lora)
    add(
        f"{attn}.kv_b_proj.weight",
        "BF16",
        heads * (text["qk_nope_head_dim"] + text["v_head_dim"]),
        kv_lora,
    )
    fp8_linear(f"{attn}.o_proj", h, heads * text["v_head_dim"])
    index = f"{attn}.indexer"
    index_dim = text["index_head_dim"]
    add(f"{index}.wq_b.weight", "BF16", text["index_n_heads"] * index_dim, q_lora)
    add(f"{index}.wk.weight", "BF16", index_dim, h)
    add(f"{index}.k_norm.weight", "BF16", index_dim)
    add(f"{index}.k_norm.bias", "BF16", index_dim)
    add(f"{index}.weights_proj.weight", "BF16", text["index_n_heads"], h)
    add(f"{index}.index_kpool_compress_ape", "BF16", text["index_kpool"], index_dim)
    add(f"{index}.index_kpool_compress_gate", "BF16", index_dim, h)


def _add_vision(add: Any, vision: dict[str, Any]) -> None:
    vh, inner = vision["hidden_size"], vision["intermediate_size"]
    out, proj = vision["out_hidden_size"], vision["projection_intermediate_size"]
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    head_dim = vh // vision["num_heads"]
    for b in range(vision["depth"]):
        block = f"model.visual.blocks.{b}"
        add(f"{block}.attn.qkv.weight", "BF16", 3 * vh, vh)
        add(f"{block}.attn.qkv.bias", "BF16", 3 * vh)
        add(f"{block}.attn.proj.weight", "BF16", vh, vh)
        add(f"{block}.attn.proj.bias", "BF16", vh)
        add(f"{block}.attn.q_norm.weight", "BF16", head_dim)
        add(f"{block}.attn.k_norm.weight", "BF16", head_dim)
        for name, rows, cols in _mlp_shapes(vh, inner):
            add(f"{block}.mlp.{name}.weight", "BF16", rows, cols)
            add(f"{block}.mlp.{name}.bias", "BF16", rows)
        add(f"{block}.norm1.weight", "BF16", vh)
        add(f"{block}.norm2.weight", "BF16", vh)
    add(
        "model.visual.patch_embed.proj.weight",
        "BF16",
        vh,
        3,
        vision["temporal_patch_size"],
        patch,
        patch,
    )
    add("model.visual.patch_embed.proj.bias", "BF16", vh)
    add("model.visual.post_layernorm.weight", "BF16", vh)
    add("model.visual.downsample.weight", "BF16", out, vh, merge, merge)
    add("model.visual.downsample.bias", "BF16", out)
    add("model.visual.merger.proj.weight", "BF16", out, out)
    add("model.visual.merger.post_projection_norm.weight", "BF16", out)
    add("model.visual.merger.post_projection_norm.bias", "BF16", out)
    for name, rows, cols in _mlp_shapes(out, proj):
        add(f"model.visual.merger.{name}.weight", "BF16", rows, cols)


def _modules_left_in_bf16(tensors: Iterable[SyntheticTensor]) -> list[str]:
    """The quantization skip list: every linear module whose weight is not fp8, as the
    published config lists them (per-layer entries, which the pruner must rewrite)."""
    return sorted(
        t.name.removesuffix(".weight")
        for t in tensors
        if t.name.endswith(".weight") and t.dtype != "F8_E4M3" and len(t.shape) == 2
    )


def checkpoint_bytes(config: dict[str, Any]) -> int:
    """Bytes of tensor data the full checkpoint holds for this config."""
    return sum(t.nbytes for t in tensor_plan(config))


def _split_into_shards(
    tensors: list[SyntheticTensor], num_shards: int
) -> list[list[SyntheticTensor]]:
    # Sorted names, cut into runs of about equal bytes, as the published checkpoint's index
    # does; a shard therefore mixes layers that a prune keeps, drops and renames.
    ordered = sorted(tensors, key=lambda t: t.name)
    total = sum(t.nbytes for t in ordered)
    shards: list[list[SyntheticTensor]] = [[] for _ in range(num_shards)]
    running = 0
    for tensor in ordered:
        shard = min(num_shards - 1, running * num_shards // max(total, 1))
        shards[shard].append(tensor)
        running += tensor.nbytes
    return [s for s in shards if s]


def _tensor_bytes(rng: np.random.Generator, nbytes: int) -> Iterator[bytes]:
    chunk = 64 << 20
    for start in range(0, nbytes, chunk):
        yield rng.bytes(min(chunk, nbytes - start))


def _write_shard(path: Path, tensors: list[SyntheticTensor], rng: np.random.Generator) -> None:
    # Data order as the safetensors library writes it: wider dtypes first, then by name.
    order = sorted(tensors, key=lambda t: (-_DTYPE_BYTES[t.dtype], t.name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in order:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for t in order:
            for piece in _tensor_bytes(rng, t.nbytes):
                f.write(piece)


@dataclass(frozen=True)
class SyntheticCheckpoint:
    directory: Path
    config: dict[str, Any]
    tensors: list[SyntheticTensor]
    shard_files: list[str]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def write_checkpoint(
    directory: Path,
    config: dict[str, Any] | None = None,
    *,
    num_shards: int = 6,
    seed: int = 0,
) -> SyntheticCheckpoint:
    """Write a full checkpoint (config.json, shards, index, side files) into `directory`."""
    config = config if config is not None else full_config()
    directory.mkdir(parents=True, exist_ok=True)
    tensors = tensor_plan(config)
    shards = _split_into_shards(tensors, num_shards)
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    files = []
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(directory / name, shard, rng)
        weight_map.update({t.name: name for t in shard})
        files.append(name)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, text in SIDE_FILES.items():
        (directory / name).write_text(text)
    return SyntheticCheckpoint(directory, config, tensors, files)
