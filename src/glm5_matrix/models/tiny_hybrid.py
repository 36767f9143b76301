"""The tiny hybrid model: a small Qwen3-Next-style checkpoint with random weights.

vLLM's CPU build cannot run GLM-5.3-Flash (sparse MLA), but it serves Qwen3-Next: gated-delta-net
linear attention (one Mamba KV group per layer) next to full attention and MoE, the same KV
layout problem. The config comes from the profile's [model] table; the weights are drawn with a
fixed seed on first use and cached, so every process (engine workers, P and D servers) loads
identical bytes.

Contract of ensure_model(cache_dir=None) -> Path:
- returns a folder holding config.json, model.safetensors and tiny-hybrid.json (the manifest);
  no tokenizer (use skip_tokenizer_init / --skip-tokenizer-init and token-id prompts);
- the folder is cache_dir/<name>-<hash of config, dtype, seed, init>; cache_dir defaults to
  glm5_matrix.cache.models_dir(), which also says how the folder is written once, atomically,
  and safely for concurrent callers;
- the same profile data gives the same folder name and the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.cache import ensure_folder, models_dir
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import Profile, load_profile

PROFILE = "tiny-hybrid-cpu"
MANIFEST = "tiny-hybrid.json"
# Bump when the weight generator changes, so cached folders of an older generator are not reused.
GENERATOR_VERSION = 2
_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TinyHybridSpec:
    """What defines the model: the profile's [model] table."""

    name: str
    architecture: str
    model_type: str
    dtype: str
    seed: int
    init_gain: float
    embedding_std: float
    config: dict[str, Any]

    @classmethod
    def from_profile(cls, profile: Profile) -> TinyHybridSpec:
        where = f"{profile.directory / 'profile.toml'} [model]"
        model = profile.section("model")
        try:
            spec = cls(
                name=str(model["name"]),
                architecture=str(model["architecture"]),
                model_type=str(model["model_type"]),
                dtype=str(model["dtype"]),
                seed=int(model["seed"]),
                init_gain=float(model["init_gain"]),
                embedding_std=float(model["embedding_std"]),
                config=dict(model["config"]),
            )
        except KeyError as exc:
            raise UserError(f"{where}: missing {exc.args[0]!r}") from None
        layer_types = spec.config.get("layer_types")
        if not layer_types or any(t not in _LAYER_TYPES for t in layer_types):
            raise UserError(f"{where}.config.layer_types: a non-empty list of {_LAYER_TYPES}")
        if spec.dtype not in ("bfloat16", "float16", "float32"):
            raise UserError(f"{where}.dtype: {spec.dtype!r} is not bfloat16, float16 or float32")
        return spec

    def hf_config(self) -> dict[str, Any]:
        """config.json: the profile's fields plus what identifies the architecture."""
        config = dict(self.config)
        config["num_hidden_layers"] = len(config["layer_types"])
        config["model_type"] = self.model_type
        config["architectures"] = [self.architecture]
        config["torch_dtype"] = self.dtype
        return config

    def digest(self) -> str:
        identity = {
            "config": self.hf_config(),
            "seed": self.seed,
            "init_gain": self.init_gain,
            "embedding_std": self.embedding_std,
            "generator": GENERATOR_VERSION,
        }
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.digest()}"


def ensure_model(cache_dir: Path | None = None, profile: str = PROFILE) -> Path:
    """The tiny model's folder, generated on first use (see the module docstring)."""
    spec = TinyHybridSpec.from_profile(load_profile(profile))
    models = Path(cache_dir) if cache_dir is not None else models_dir()
    # The folder name holds the digest of everything the weights depend on.
    return ensure_folder(
        models / spec.folder_name, lambda staging: write_model(spec, staging), MANIFEST
    )


def write_model(spec: TinyHybridSpec, folder: Path) -> None:
    """Write config.json, model.safetensors and the manifest into an existing folder."""
    from safetensors.torch import save_file

    config = spec.hf_config()
    tensors = generate_weights(spec)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    parameters = sum(t.numel() for t in tensors.values())
    manifest = {
        "name": spec.name,
        "digest": spec.digest(),
        "seed": spec.seed,
        "generator": GENERATOR_VERSION,
        "parameters": parameters,
        "bytes": (folder / "model.safetensors").stat().st_size,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in the layout of Qwen3-Next's released checkpoints (one tensor
    per expert, q/k/v separate), which is what vLLM's Qwen3NextForCausalLM loader reads."""
    hidden = config["hidden_size"]
    vocab = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    value_heads = config["linear_num_value_heads"]
    head_dim = config["head_dim"]
    moe = config["moe_intermediate_size"]
    shared = config["shared_expert_intermediate_size"]
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        if layer_type == "linear_attention":
            shapes[f"{p}.linear_attn.in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, hidden)
            shapes[f"{p}.linear_attn.in_proj_ba.weight"] = (2 * value_heads, hidden)
            shapes[f"{p}.linear_attn.conv1d.weight"] = (
                2 * key_dim + value_dim,
                1,
                config["linear_conv_kernel_dim"],
            )
            shapes[f"{p}.linear_attn.dt_bias"] = (value_heads,)
            shapes[f"{p}.linear_attn.A_log"] = (value_heads,)
            shapes[f"{p}.linear_attn.norm.weight"] = (config["linear_value_head_dim"],)
            shapes[f"{p}.linear_attn.out_proj.weight"] = (hidden, value_dim)
        else:
            # The query projection carries the output gate next to the query (2x width).
            shapes[f"{p}.self_attn.q_proj.weight"] = (
                2 * config["num_attention_heads"] * head_dim,
                hidden,
            )
            shapes[f"{p}.self_attn.k_proj.weight"] = (
                config["num_key_value_heads"] * head_dim,
                hidden,
            )
            shapes[f"{p}.self_attn.v_proj.weight"] = (
                config["num_key_value_heads"] * head_dim,
                hidden,
            )
            shapes[f"{p}.self_attn.o_proj.weight"] = (
                hidden,
                config["num_attention_heads"] * head_dim,
            )
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}.mlp.gate.weight"] = (config["num_experts"], hidden)
        for e in range(config["num_experts"]):
            shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (moe, hidden)
            shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (moe, hidden)
            shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (hidden, moe)
        shapes[f"{p}.mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[f"{p}.mlp.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[f"{p}.mlp.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def generate_weights(spec: TinyHybridSpec) -> dict[str, Any]:
    """Random weights, deterministic in the seed, scaled so activations keep unit size.

    Matrices: normal(0, gain / sqrt(fan_in)); the output head's rows are further scaled like
    glm5-random's (weights.head_row_scales), so greedy choices win by a margin and do not fall
    to the tie-break. Embeddings: normal(0, embedding_std). Norms
    that vLLM applies as (1 + w) (GemmaRMSNorm: layer, final, q/k norms) get 0; the gated norm
    of the linear attention gets 1. A_log and dt_bias follow Mamba's init (decay rates in
    [1, 16], time steps in [1e-3, 1e-1]) so the recurrent state neither explodes nor vanishes.
    """
    import torch

    dtype = getattr(torch, spec.dtype)
    generator = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, Any] = {}
    # Sorted names: the draw order, hence the bytes, does not depend on dict construction.
    for name, shape in sorted(weight_shapes(spec.hf_config()).items()):
        tensors[name] = _init(name, shape, spec, generator).to(dtype).contiguous()
    return tensors


def _init(name: str, shape: tuple[int, ...], spec: TinyHybridSpec, generator: Any) -> Any:
    import torch

    if name.endswith("linear_attn.A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("linear_attn.dt_bias"):
        dt = torch.exp(
            torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
        )
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.weight"):
        return torch.zeros(shape)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=generator) * spec.embedding_std
    fan_in = math.prod(shape[1:])
    matrix = torch.randn(shape, generator=generator) * (spec.init_gain / math.sqrt(fan_in))
    if name == "lm_head.weight":
        from glm5_matrix.models.weights import head_row_scales

        matrix *= torch.from_numpy(head_row_scales(shape[0], seed=spec.seed))[:, None]
    return matrix
