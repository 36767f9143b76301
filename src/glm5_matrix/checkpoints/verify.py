"""`glm5-matrix verify`: the config, the index against the shards' headers, the per-layer
tensors against layer_types, and the manifest hashes when a manifest is present."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.checkpoints.config import (
    is_sparse_attention,
    layer_list_base,
    load_glm_config,
    mtp_count,
)
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME, read_manifest, sha256_file
from glm5_matrix.checkpoints.reading import open_checkpoint, split_layer_key
from glm5_matrix.errors import UserError
from glm5_matrix.models.glm_config import text_config

# One tensor that each kind of layer must carry (published names); a misnumbered or mixed-up
# layer lacks it.
_LAYER_MARKERS = {
    "kda": "self_attn.A_log",
    "dsa": "self_attn.kv_a_proj_with_mqa.weight",
    "dense": "mlp.gate_proj.weight",
    "sparse": "mlp.gate.weight",
    "mtp": "eh_proj.weight",
}


@dataclass
class VerifyReport:
    lines: list[str]
    problems: list[str]


def verify_checkpoint(directory: Path) -> VerifyReport:
    """Check a checkpoint; UserError only when it is not a GLM-5.3-Flash checkpoint at all."""
    directory = Path(directory)
    load_glm_config(directory)
    try:
        ckpt = open_checkpoint(directory)
    except UserError as exc:  # index/shard disagreement, missing or malformed shard
        return VerifyReport(lines=[], problems=[str(exc)])
    text = text_config(ckpt.config)
    layers = ckpt.num_layers
    mtp = mtp_count(ckpt.config)
    problems: list[str] = []
    by_layer: dict[int, set[str]] = {}
    for name in ckpt.weight_map:
        parts = split_layer_key(name)
        if parts is not None:
            by_layer.setdefault(parts[1], set()).add(parts[2])
    layer_types = text["layer_types"]
    mlp_types = text.get("mlp_layer_types") or []
    described = []
    for i in range(layers + mtp):
        is_mtp = i >= layers
        attention = "dsa" if is_mtp or is_sparse_attention(layer_types[i]) else "kda"
        mlp = (mlp_types[-1] if is_mtp else mlp_types[i]) if mlp_types else None
        present = by_layer.get(i, set())
        needed = (
            [attention] + ([mlp] if mlp in _LAYER_MARKERS else []) + (["mtp"] if is_mtp else [])
        )
        for kind in needed:
            if _LAYER_MARKERS[kind] not in present:
                problems.append(f"layer {i} ({kind}) has no {_LAYER_MARKERS[kind]}")
        label = "MTP" if is_mtp else layer_types[i]
        described.append(f"{i}:{label}/{mlp or '?'}")
    extra = sorted(i for i in by_layer if i >= layers + mtp)
    if extra:
        problems.append(
            f"tensors for layers {extra} beyond the {layers} + {mtp} MTP the config has"
        )
    base = layer_list_base(text)
    lines = [
        f"config: {ckpt.config['architectures'][0]} ({ckpt.config.get('model_type')}), "
        f"{layers} decoder layers + {mtp} MTP, linear_attn_config numbered from {base}",
        f"tensors: {len(ckpt.weight_map)} in {len(ckpt.shards)} shards, index and shards agree",
        "layers: " + " ".join(described),
    ]
    manifest = directory / MANIFEST_NAME
    if manifest.is_file():
        problems += _manifest_problems(directory, read_manifest(manifest))
        lines.append(f"manifest: {MANIFEST_NAME} checked")
    else:
        lines.append("manifest: none (hashes not checked)")
    lines += _layout_lines(ckpt.config, problems)
    return VerifyReport(lines, problems)


def _manifest_problems(directory: Path, hashes: dict[str, str]) -> list[str]:
    problems = []
    for name, expected in sorted(hashes.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"manifest lists {name}, which is missing")
        elif sha256_file(path) != expected:
            problems.append(f"{name}: sha256 differs from the manifest")
    for path in sorted(directory.rglob("*")):
        parts = path.relative_to(directory).parts
        relative = "/".join(parts)
        hidden = any(part.startswith(".") for part in parts)
        if path.is_file() and not hidden and relative not in {MANIFEST_NAME, *hashes}:
            problems.append(f"{relative} is not in the manifest")
    return problems


def _layout_lines(config: dict[str, Any], problems: list[str]) -> list[str]:
    try:
        from glm5_matrix.models.layout import plan_layout  # written alongside; optional here
    except ImportError as exc:
        return [f"KV cache groups: not computed ({exc})"]
    try:
        plan = plan_layout(config, tp=1)
    except UserError as exc:
        problems.append(f"KV cache layout: {exc}")
        return []
    return ["KV cache groups vLLM should build (TP1):", plan.describe()]
