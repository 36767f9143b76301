"""What a pruned checkpoint says about its derivation: the model card and the provenance."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from glm5_matrix.checkpoints.config import mtp_count
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME, sha256_file
from glm5_matrix.checkpoints.plan import PROVENANCE_NAME, PrunePlan, format_size
from glm5_matrix.checkpoints.reading import INDEX_NAME
from glm5_matrix.models.glm_config import text_config


def provenance(plan: PrunePlan) -> dict[str, Any]:
    src = plan.source
    return {
        "tool": "glm5-matrix prune",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {
            "path": str(src.directory.resolve()),
            "revision": plan.source_revision,
            "config_sha256": sha256_file(src.directory / "config.json"),
            "index_sha256": sha256_file(src.directory / INDEX_NAME) if src.has_index else None,
            "num_hidden_layers": src.num_layers,
            "tensors": len(src.weight_map),
        },
        "layers_kept": list(range(plan.layers)),
        "layers_renamed": {str(a): b for a, b in plan.renamed_layers.items()},
        "tensors": {
            "kept": len(plan.kept) - len(plan.renamed),
            "renamed": len(plan.renamed),
            "dropped": len(plan.dropped),
        },
        "config_edits": [
            {"key": e.key, "before": e.before, "after": e.after} for e in plan.config_edits
        ],
    }


def model_card(plan: PrunePlan) -> str:
    src = plan.source
    text = text_config(plan.config)
    layer_rows = "\n".join(
        f"| {i} | {i} | {text['layer_types'][i]} | "
        f"{(text.get('mlp_layer_types') or ['?'] * plan.layers)[i]} |"
        for i in range(plan.layers)
    )
    mtp_rows = "\n".join(f"| {a} (MTP) | {b} | MTP | |" for a, b in plan.renamed_layers.items())
    edits = "\n".join(f"- `{e.key}`: {e.before} -> {e.after}" for e in plan.config_edits)
    side = ", ".join(f"`{p.as_posix()}`" for p in plan.side_files) or "none"
    return f"""# GLM-5.3-Flash, first {plan.layers} layers (layer-pruned, for testing)

Derived by `glm5-matrix prune` from a full GLM-5.3-Flash checkpoint. Not a usable language
model: its outputs are meaningless. It loads in vLLM exactly as the full model's first
{plan.layers} decoder layers plus the MTP layer, every width unchanged, so kernel selection and
the KV cache layout are the full model's.

- Source: `{src.directory.resolve()}`
- Source revision: {plan.source_revision or "unknown"}
- Source: {len(src.weight_map)} tensors, {src.num_layers} decoder layers + {mtp_count(src.config)} MTP layer(s)
- Kept: {len(plan.kept)} tensors ({len(plan.renamed)} renamed), {format_size(plan.data_bytes)};
  dropped: {len(plan.dropped)} tensors, {format_size(plan.dropped_bytes)}
- Tensor bytes are copied verbatim (fp8 e4m3 weights with their `weight_scale_inv`, bf16,
  fp32); only names change, for the renumbered MTP layer.

## Layers

| full model | this model | attention | MLP |
|---|---|---|---|
{layer_rows}
{mtp_rows}

## Config edits

{edits}

## Files

Copied unchanged: {side}. Regenerated: `config.json`, `{INDEX_NAME}`, this card,
`{PROVENANCE_NAME}` (the derivation, machine-readable) and `{MANIFEST_NAME}` (sha256 of every
file; `sha256sum -c {MANIFEST_NAME}` or `glm5-matrix verify` checks it).
"""
