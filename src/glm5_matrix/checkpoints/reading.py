"""A checkpoint directory: config, index and shard headers, checked against each other."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.checkpoints.config import load_glm_config
from glm5_matrix.checkpoints.safetensors_header import ShardHeader, TensorEntry, read_shard_header
from glm5_matrix.errors import UserError
from glm5_matrix.models.glm_config import text_config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
# Decoder-layer tensor names of both key layouts (multimodal, text-only, vLLM-style).
_LAYER_KEY = re.compile(
    r"^(?P<prefix>model\.language_model\.layers|model\.layers|language_model\.model\.layers)"
    r"\.(?P<index>\d+)\.(?P<rest>.+)$"
)


@dataclass
class Checkpoint:
    directory: Path
    config: dict[str, Any]
    index_metadata: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> shard file name
    shards: dict[str, ShardHeader]
    has_index: bool

    @property
    def num_layers(self) -> int:
        return int(text_config(self.config)["num_hidden_layers"])

    def entry(self, name: str) -> TensorEntry:
        return self.shards[self.weight_map[name]].tensors[name]


def open_checkpoint(directory: Path) -> Checkpoint:
    """Load a checkpoint directory; UserError (one line) when the index and shards disagree."""
    directory = Path(directory)
    config = load_glm_config(directory)
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{index_path}: not a safetensors index ({exc})") from None
        index_metadata = dict(index.get("metadata") or {})
        has_index = True
    elif (directory / SINGLE_SHARD_NAME).is_file():
        single = read_shard_header(directory / SINGLE_SHARD_NAME)
        weight_map = {name: SINGLE_SHARD_NAME for name in single.tensors}
        index_metadata, has_index = {}, False
    else:
        raise UserError(f"{directory}: no {INDEX_NAME} and no {SINGLE_SHARD_NAME}")
    shards: dict[str, ShardHeader] = {}
    for file in sorted(set(weight_map.values())):
        path = directory / file
        if Path(file).name != file:
            raise UserError(f"{index_path}: shard name {file!r} is not a plain file name")
        if not path.is_file():
            count = sum(1 for f in weight_map.values() if f == file)
            raise UserError(
                f"{directory}: missing shard {file} (the index maps {count} tensors to it)"
            )
        shards[file] = read_shard_header(path)
    problems = _index_disagreements(weight_map, shards)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{directory}: index and shards disagree: {problems[0]}{more}")
    return Checkpoint(directory, config, index_metadata, weight_map, shards, has_index)


def _index_disagreements(weight_map: dict[str, str], shards: dict[str, ShardHeader]) -> list[str]:
    problems = []
    for name, file in weight_map.items():
        if name not in shards[file].tensors:
            problems.append(f"{name} is mapped to {file} but is not in it")
    for file, header in shards.items():
        for name in header.tensors:
            if weight_map.get(name) != file:
                where = weight_map.get(name)
                problems.append(
                    f"{name} is in {file} but the index "
                    + (f"maps it to {where}" if where else "does not list it")
                )
    return problems


def split_layer_key(name: str) -> tuple[str, int, str] | None:
    """(prefix, layer index, rest) for a decoder-layer tensor name, else None."""
    match = _LAYER_KEY.match(name)
    if match is None:
        return None
    return match["prefix"], int(match["index"]), match["rest"]
