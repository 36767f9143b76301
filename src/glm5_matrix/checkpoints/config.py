"""The GLM-5.3-Flash config of a checkpoint: read and checked, and cut to the first N decoder
layers. Its decoder fields are found by glm5_matrix.models.glm_config.text_config, the one
reader of the config the layout planner uses too.

pruned_config keeps layers 0..N-1 and the MTP layer(s), renumbered to follow them (45 -> N), so
vLLM builds exactly the full model's first N layers; every width stays the full model's.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.models.glm_config import GLM_MODEL_TYPES, text_config

LINEAR_ATTENTION = "linear_attention"
# Per-layer lists of the text config, cut to the kept layers.
_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern")
# Quantization config keys that list modules by name (skip lists).
_SKIP_LIST_KEYS = ("modules_to_not_convert", "ignore", "ignored_layers")
# A decoder layer inside a module path of a skip list (which may omit the leading `model.`).
_SKIP_ENTRY_LAYER = re.compile(r"(?:^|\.)layers\.(?P<index>\d+)(?=\.|$)")


def load_glm_config(directory: Path) -> dict[str, Any]:
    """config.json of a GLM-5.3-Flash checkpoint directory; UserError (one line) otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        if directory.exists():
            raise UserError(f"{directory}: a file, not a checkpoint directory")
        raise UserError(f"{directory}: checkpoint directory not found")
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory}: no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    known = [a for a in architectures if a in GLM_MODEL_TYPES]
    if not known or model_type != GLM_MODEL_TYPES[known[0]]:
        raise UserError(
            f"{path}: not a GLM-5.3-Flash config (architectures {architectures}, model_type "
            f"{model_type!r}; expected Glm5NextForConditionalGeneration/glm5_next or "
            "Glm5NextForCausalLM/glm5_next_text)"
        )
    try:
        text = text_config(config)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    for key in ("num_hidden_layers", "layer_types"):
        if key not in text:
            raise UserError(f"{path}: GLM-5.3-Flash config without {key}")
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise UserError(
            f"{path}: layer_types has {len(text['layer_types'])} entries for "
            f"num_hidden_layers {text['num_hidden_layers']}"
        )
    return config


def mtp_count(config: dict[str, Any]) -> int:
    return int(text_config(config).get("num_nextn_predict_layers") or 0)


def is_sparse_attention(layer_type: str) -> bool:
    # DSA/MLA layers are spelled deepseek_sparse_attention in the published config,
    # indexed_attention or full_attention by transformers; everything but KDA is one.
    return layer_type != LINEAR_ATTENTION


def layer_list_base(text: dict[str, Any]) -> int:
    """Whether linear_attn_config numbers layers from 0 (the published config) or 1."""
    lac = text.get("linear_attn_config") or {}
    kda = set(lac.get("kda_layers") or [])
    full = set(lac.get("full_attn_layers") or [])
    types = text["layer_types"]
    for base in (0, 1):
        expect_kda = {i + base for i, t in enumerate(types) if t == LINEAR_ATTENTION}
        expect_full = {i + base for i, t in enumerate(types) if t != LINEAR_ATTENTION}
        if (not kda or kda == expect_kda) and (not full or full == expect_full):
            return base
    raise UserError(
        "linear_attn_config kda_layers/full_attn_layers disagree with layer_types "
        "(neither 0- nor 1-based numbering matches)"
    )


@dataclass(frozen=True)
class ConfigEdit:
    key: str
    before: str
    after: str


def _summarize(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} entries]"
    return json.dumps(value)


def pruned_config(config: dict[str, Any], layers: int) -> tuple[dict[str, Any], list[ConfigEdit]]:
    """The config of the first `layers` decoder layers + MTP, and the edits made to get it."""
    base = layer_list_base(text_config(config))
    new = copy.deepcopy(config)
    text = text_config(new)
    full_layers = text["num_hidden_layers"]
    mtp = mtp_count(config)
    nested = text is not new
    prefix = "text_config." if nested else ""
    unknown = sorted(
        key
        for key, value in text.items()
        if isinstance(value, list) and len(value) == full_layers and key not in _PER_LAYER_LISTS
    )
    if unknown:
        raise UserError(
            f"config field(s) {', '.join(unknown)} hold one entry per layer and this tool does "
            "not know how to cut them; refusing rather than guessing"
        )
    edits: list[ConfigEdit] = []

    def edit(container: dict[str, Any], key: str, value: Any, label: str) -> None:
        if container.get(key) != value:
            edits.append(ConfigEdit(label, _summarize(container.get(key)), _summarize(value)))
            container[key] = value

    edit(text, "num_hidden_layers", layers, f"{prefix}num_hidden_layers")
    if nested and "num_hidden_layers" in new:
        edit(new, "num_hidden_layers", layers, "num_hidden_layers")
    for key in _PER_LAYER_LISTS:
        value = text.get(key)
        if isinstance(value, (list, str)) and len(value) == full_layers:
            edit(text, key, value[:layers], f"{prefix}{key}")
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict):
        for key in ("kda_layers", "full_attn_layers"):
            if isinstance(lac.get(key), list):
                kept = [i for i in lac[key] if i - base < layers]
                edit(lac, key, kept, f"{prefix}linear_attn_config.{key}")
    holders = [(new, "")] + ([(text, prefix)] if nested else [])
    for holder, label in holders:
        quant = holder.get("quantization_config")
        if not isinstance(quant, dict):
            continue
        for key in _SKIP_LIST_KEYS:
            entries = quant.get(key)
            if not isinstance(entries, list):
                continue
            rewritten = [
                e
                for e in (_rewrite_skip_entry(x, layers, full_layers, mtp) for x in entries)
                if e is not None
            ]
            if rewritten != entries:
                edits.append(
                    ConfigEdit(
                        f"{label}quantization_config.{key}",
                        f"[{len(entries)} entries]",
                        f"[{len(rewritten)} entries: per-layer entries cut to layers "
                        f"0-{layers - 1}, MTP renumbered]",
                    )
                )
                quant[key] = rewritten
    return new, edits


def _rewrite_skip_entry(entry: Any, layers: int, full_layers: int, mtp: int) -> Any:
    if not isinstance(entry, str) or "visual" in entry.split(".")[:2]:
        return entry
    match = _SKIP_ENTRY_LAYER.search(entry)
    if match is None:
        return entry
    new_index = new_layer_index(int(match["index"]), layers, full_layers, mtp)
    if new_index is None:
        return None
    return f"{entry[: match.start('index')]}{new_index}{entry[match.end('index') :]}"


def new_layer_index(index: int, layers: int, full_layers: int, mtp: int) -> int | None:
    """Where a layer of the full model goes: kept, renumbered (MTP) or dropped (None)."""
    if index < layers:
        return index
    if full_layers <= index < full_layers + mtp:
        return layers + (index - full_layers)
    return None
