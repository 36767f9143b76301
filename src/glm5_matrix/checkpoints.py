"""`glm5-matrix prune` and `glm5-matrix verify`: layer-pruned GLM-5.3-Flash checkpoints.

prune keeps decoder layers 0..N-1 and the MTP layer(s), renumbered to follow them (45 -> N),
and edits the config so vLLM builds exactly the full model's first N layers. Tensor bytes are
copied verbatim, range by range, from the source shards (safetensors' Python API cannot write
a file incrementally, so headers are read and written here and the data is streamed through a
fixed buffer: peak memory is that buffer, not a tensor, a shard or the model). The result is
built in a temporary directory next to DST and renamed into place only when complete.

verify checks a checkpoint directory: the config, the index against the shards' headers, the
per-layer tensors against layer_types, and the manifest hashes when a manifest is present.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError

GLM_MODEL_TYPES = {
    "Glm5NextForConditionalGeneration": "glm5_next",
    "Glm5NextForCausalLM": "glm5_next_text",
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
MANIFEST_NAME = "SHA256SUMS"
PROVENANCE_NAME = "glm5-matrix-prune.json"
MODEL_CARD_NAME = "README.md"
DEFAULT_LAYERS = 4
LINEAR_ATTENTION = "linear_attention"
# Files of the source that the pruned checkpoint replaces rather than copies.
_REGENERATED = {"config.json", INDEX_NAME, MANIFEST_NAME, PROVENANCE_NAME, MODEL_CARD_NAME}
# Per-layer lists of the text config, cut to the kept layers.
_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern")
# Quantization config keys that list modules by name (skip lists).
_SKIP_LIST_KEYS = ("modules_to_not_convert", "ignore", "ignored_layers")
# Decoder-layer tensor names of both key layouts (multimodal, text-only, vLLM-style).
_LAYER_KEY = re.compile(
    r"^(?P<prefix>model\.language_model\.layers|model\.layers|language_model\.model\.layers)"
    r"\.(?P<index>\d+)\.(?P<rest>.+)$"
)
# A decoder layer inside a module path of a skip list (which may omit the leading `model.`).
_SKIP_ENTRY_LAYER = re.compile(r"(?:^|\.)layers\.(?P<index>\d+)(?=\.|$)")
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F32": 4, "I32": 4, "U32": 4,
    "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
_COPY_BUFFER_BYTES = 16 << 20


# --------------------------------------------------------------------------------------------
# The config


def load_glm_config(directory: Path) -> dict[str, Any]:
    """config.json of a GLM-5.3-Flash checkpoint directory; UserError (one line) otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
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
    text = text_config(config)
    for key in ("num_hidden_layers", "layer_types"):
        if key not in text:
            raise UserError(f"{path}: GLM-5.3-Flash config without {key}")
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise UserError(
            f"{path}: layer_types has {len(text['layer_types'])} entries for "
            f"num_hidden_layers {text['num_hidden_layers']}"
        )
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the decoder fields: text_config (multimodal) or the top level."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _mtp_count(config: dict[str, Any]) -> int:
    return int(text_config(config).get("num_nextn_predict_layers") or 0)


def _is_sparse_attention(layer_type: str) -> bool:
    # DSA/MLA layers are spelled deepseek_sparse_attention in the published config,
    # indexed_attention or full_attention by transformers; everything but KDA is one.
    return layer_type != LINEAR_ATTENTION


def _layer_list_base(text: dict[str, Any]) -> int:
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
    base = _layer_list_base(text_config(config))
    new = copy.deepcopy(config)
    text = text_config(new)
    full_layers = text["num_hidden_layers"]
    mtp = _mtp_count(config)
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
    new_index = _new_layer_index(int(match["index"]), layers, full_layers, mtp)
    if new_index is None:
        return None
    return f"{entry[: match.start('index')]}{new_index}{entry[match.end('index') :]}"


def _new_layer_index(index: int, layers: int, full_layers: int, mtp: int) -> int | None:
    """Where a layer of the full model goes: kept, renumbered (MTP) or dropped (None)."""
    if index < layers:
        return index
    if full_layers <= index < full_layers + mtp:
        return layers + (index - full_layers)
    return None


# --------------------------------------------------------------------------------------------
# safetensors headers


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]
    data_start: int
    file_size: int


def read_shard_header(path: Path) -> ShardHeader:
    """Parse and check one shard's header (8-byte little-endian length, then JSON)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, 1 << 30):
                raise UserError(f"{path}: not a safetensors file (header length {length})")
            raw = json.loads(f.read(length))
    except OSError as exc:
        raise UserError(f"{path}: cannot read shard ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a safetensors file (header is not an object)")
    metadata = raw.pop("__metadata__", None)
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        try:
            start, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(
                str(info["dtype"]), tuple(int(x) for x in info["shape"]), start, end
            )
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: malformed header entry for {name}") from None
        width = _DTYPE_BYTES.get(entry.dtype)
        if width is not None and entry.nbytes != width * math.prod(entry.shape):
            raise UserError(f"{path}: {name}: data_offsets do not match dtype and shape")
        tensors[name] = entry
    data_start = 8 + length
    spans = sorted((e.start, e.end) for e in tensors.values())
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise UserError(f"{path}: tensor data is not contiguous (gap or overlap at {start})")
        position = end
    if data_start + position != size:
        raise UserError(
            f"{path}: file is {size} bytes but its header describes {data_start + position} "
            "(truncated or padded shard)"
        )
    return ShardHeader(path, metadata, tensors, data_start, size)


def encode_header(entries: list[tuple[str, TensorEntry]], metadata: dict[str, str] | None) -> bytes:
    """A safetensors header (length prefix included) for entries already laid out in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    for name, e in entries:
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data section 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(encoded)) + encoded


# --------------------------------------------------------------------------------------------
# A checkpoint: config, index and shard headers, checked against each other


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


# --------------------------------------------------------------------------------------------
# The prune plan


@dataclass(frozen=True)
class KeptTensor:
    source_name: str
    name: str
    source_file: str
    entry: TensorEntry


@dataclass
class OutputShard:
    file: str
    source_file: str
    tensors: list[KeptTensor]
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass
class PrunePlan:
    source: Checkpoint
    layers: int
    config: dict[str, Any]
    config_edits: list[ConfigEdit]
    shards: list[OutputShard]
    renamed_layers: dict[int, int]
    dropped: list[str]
    side_files: list[Path]  # relative to the source directory
    ignored_files: list[Path]
    source_revision: str | None
    kept: list[KeptTensor] = field(default_factory=list)

    @property
    def renamed(self) -> list[KeptTensor]:
        return [t for t in self.kept if t.name != t.source_name]

    @property
    def data_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    @property
    def dropped_bytes(self) -> int:
        return sum(self.source.entry(n).nbytes for n in self.dropped)

    def side_bytes(self) -> int:
        return sum((self.source.directory / p).stat().st_size for p in self.side_files)

    def output_bytes(self) -> int:
        """Shards, copied files, config and index (the card and manifest add a few KB)."""
        regenerated = len(_config_json(self.config)) + len(_index_json(self).encode())
        return sum(s.size for s in self.shards) + self.side_bytes() + regenerated


def plan_prune(source: Checkpoint, layers: int, source_revision: str | None = None) -> PrunePlan:
    """What a prune to `layers` decoder layers keeps, renames, drops and writes."""
    text = text_config(source.config)
    full_layers = source.num_layers
    mtp = _mtp_count(source.config)
    if not 1 <= layers <= full_layers:
        raise UserError(
            f"--layers {layers}: out of range (the checkpoint has {full_layers} decoder layers; "
            f"use 1..{full_layers})"
        )
    layer_types = text["layer_types"]
    if not any(_is_sparse_attention(t) for t in layer_types[:layers]):
        first = next((i for i, t in enumerate(layer_types) if _is_sparse_attention(t)), None)
        hint = f"; use --layers {first + 1} or more" if first is not None else ""
        raise UserError(
            f"--layers {layers} keeps no DSA/MLA layer (layers 0-{layers - 1} are all "
            f"{LINEAR_ATTENTION}), so the pruned model would not have the full model's KV cache "
            f"groups{hint}"
        )
    kept: list[KeptTensor] = []
    dropped: list[str] = []
    mtp_has_moe = False
    for name, file in source.weight_map.items():
        parts = split_layer_key(name)
        if parts is None:
            kept.append(KeptTensor(name, name, file, source.entry(name)))
            continue
        prefix, index, rest = parts
        if index >= full_layers + mtp:
            raise UserError(
                f"{name}: layer {index} is beyond num_hidden_layers {full_layers} + "
                f"num_nextn_predict_layers {mtp}"
            )
        if index >= full_layers and rest.startswith("mlp.gate."):
            mtp_has_moe = True
        new_index = _new_layer_index(index, layers, full_layers, mtp)
        if new_index is None:
            dropped.append(name)
        else:
            new_name = f"{prefix}.{new_index}.{rest}"
            kept.append(KeptTensor(name, new_name, file, source.entry(name)))
    mlp_types = text.get("mlp_layer_types") or []
    if mtp_has_moe and layers <= len(mlp_types) and mlp_types[layers - 1] == "dense":
        # vLLM 0.33 builds the MTP layer's MLP like the last decoder layer's
        # (glm5next/common/model.py: mlp_layer_types[-1] for layers past num_hidden_layers).
        raise UserError(
            f"--layers {layers}: the last kept layer has a dense MLP, so vLLM would build the "
            "MTP layer dense while its weights are MoE; keep a layer with an MoE MLP"
        )
    new_config, edits = pruned_config(source.config, layers)
    shards = _lay_out_shards(source, kept)
    side, ignored = _side_files(source)
    revision = source_revision or _revision_from_path(source.directory)
    return PrunePlan(
        source=source,
        layers=layers,
        config=new_config,
        config_edits=edits,
        shards=shards,
        renamed_layers={full_layers + i: layers + i for i in range(mtp)},
        dropped=sorted(dropped),
        side_files=side,
        ignored_files=ignored,
        source_revision=revision,
        kept=kept,
    )


def _lay_out_shards(source: Checkpoint, kept: list[KeptTensor]) -> list[OutputShard]:
    # One output shard per source shard that keeps anything; tensors in source order, so each
    # source shard is read front to back once.
    by_file: dict[str, list[KeptTensor]] = {}
    for tensor in kept:
        by_file.setdefault(tensor.source_file, []).append(tensor)
    files = sorted(by_file)
    shards = []
    for number, file in enumerate(files, start=1):
        tensors = sorted(by_file[file], key=lambda t: t.entry.start)
        out_name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        shard = OutputShard(out_name, file, tensors)
        entries, offset = [], 0
        for t in tensors:
            entries.append(
                (t.name, TensorEntry(t.entry.dtype, t.entry.shape, offset, offset + t.entry.nbytes))
            )
            offset += t.entry.nbytes
        shard.header = encode_header(entries, source.shards[file].metadata)
        shards.append(shard)
    return shards


def _side_files(source: Checkpoint) -> tuple[list[Path], list[Path]]:
    """Files copied unchanged (tokenizer, generation config, ...) and files left out."""
    shard_files = set(source.weight_map.values())
    side, ignored = [], []
    for path in sorted(source.directory.rglob("*")):
        relative = path.relative_to(source.directory)
        if any(part.startswith(".") for part in relative.parts):
            continue  # .cache, .git, editor files: not part of the model
        if path.is_dir():
            continue
        name = relative.as_posix()
        if name in shard_files or name in _REGENERATED:
            continue
        if relative.suffix == ".safetensors":
            ignored.append(relative)  # weights the index does not list: vLLM would not load them
            continue
        side.append(relative)
    return side, ignored


def _revision_from_path(directory: Path) -> str | None:
    # A Hugging Face cache snapshot lives in .../snapshots/<commit sha>/.
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", resolved.name):
        return resolved.name
    return None


def describe_plan(plan: PrunePlan) -> list[str]:
    src = plan.source
    renamed = plan.renamed
    unchanged = len(plan.kept) - len(renamed)
    lines = [
        f"source: {src.directory} ({len(src.weight_map)} tensors in {len(src.shards)} shards, "
        f"{src.num_layers} decoder layers + {_mtp_count(src.config)} MTP)",
        f"keep: decoder layers 0-{plan.layers - 1}"
        + "".join(f", MTP layer {a} -> {b}" for a, b in plan.renamed_layers.items()),
        f"tensors: {unchanged} kept, {len(renamed)} renamed, {len(plan.dropped)} dropped "
        f"({_gb(plan.data_bytes)} kept, {_gb(plan.dropped_bytes)} dropped)",
    ]
    for t in renamed[:3]:
        lines.append(f"  rename {t.source_name} -> {t.name}")
    if len(renamed) > 3:
        lines.append(f"  ... and {len(renamed) - 3} more renames")
    lines.append("config edits:")
    lines += [f"  {e.key}: {e.before} -> {e.after}" for e in plan.config_edits]
    lines.append(
        f"shards: {len(plan.shards)} (from "
        + ", ".join(f"{s.source_file}" for s in plan.shards[:4])
        + (", ..." if len(plan.shards) > 4 else "")
        + ")"
    )
    lines.append(f"side files copied: {', '.join(p.as_posix() for p in plan.side_files) or 'none'}")
    if plan.ignored_files:
        lines.append(
            "not copied (safetensors the index does not list): "
            + ", ".join(p.as_posix() for p in plan.ignored_files)
        )
    lines.append(f"output size: {_gb(plan.output_bytes())} ({plan.output_bytes()} bytes)")
    return lines


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


# --------------------------------------------------------------------------------------------
# Writing


class _HashedStream:
    """Writes one file from byte ranges of source files, hashing what it writes.

    Ranges are read into one reused buffer, many small tensors per buffer; a full buffer is
    hashed and written in one call. Memory: the buffer, whatever the tensor sizes. (Hashing in
    a second thread measured slower on a loaded 2-CPU machine, so it stays inline.)
    """

    def __init__(self, dst: Any, buffer: bytearray, prefix: bytes = b"") -> None:
        self._dst = dst
        self._view = memoryview(buffer)
        self._fill = 0
        self._digest = hashlib.sha256(prefix)
        dst.write(prefix)

    def copy_from(self, src: Any, offset: int, length: int) -> None:
        """Append `length` bytes of the unbuffered file `src`, starting at `offset`."""
        src.seek(offset)
        remaining = length
        while remaining:
            want = min(len(self._view) - self._fill, remaining)
            got = src.readinto(self._view[self._fill : self._fill + want])
            if not got:
                raise UserError(
                    f"{src.name}: unexpected end of file at {offset + length - remaining}"
                )
            self._fill += got
            remaining -= got
            if self._fill == len(self._view):
                self._flush()

    def _flush(self) -> None:
        chunk = self._view[: self._fill]
        self._digest.update(chunk)
        self._dst.write(chunk)
        self._fill = 0

    def finish(self) -> str:
        self._flush()
        return self._digest.hexdigest()


def _write_shard(plan: PrunePlan, shard: OutputShard, target: Path, buffer: bytearray) -> str:
    source = plan.source.shards[shard.source_file]
    # Unbuffered reads straight into the copy buffers; writes are whole buffers.
    with open(source.path, "rb", buffering=0) as src, target.open("wb") as dst:
        stream = _HashedStream(dst, buffer, prefix=shard.header)
        for start, end in _contiguous_runs(shard.tensors):
            stream.copy_from(src, source.data_start + start, end - start)
        digest = stream.finish()
        dst.flush()
        os.fsync(dst.fileno())
    return digest


def _contiguous_runs(tensors: list[KeptTensor]) -> list[tuple[int, int]]:
    """Source byte ranges of tensors in output order, adjacent ones merged into one read."""
    runs: list[tuple[int, int]] = []
    for t in tensors:
        if runs and runs[-1][1] == t.entry.start:
            runs[-1] = (runs[-1][0], t.entry.end)
        else:
            runs.append((t.entry.start, t.entry.end))
    return runs


def _copy_file(src: Path, dst: Path, buffer: bytearray) -> str:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb", buffering=0) as fin, dst.open("wb") as fout:
        stream = _HashedStream(fout, buffer)
        stream.copy_from(fin, 0, os.fstat(fin.fileno()).st_size)
        digest = stream.finish()
    shutil.copymode(src, dst)
    return digest


def _write_text(path: Path, text: str) -> str:
    data = text.encode()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _check_destination(source: Path, dst: Path, force: bool) -> None:
    src_real, dst_real = source.resolve(), dst.resolve()
    if dst_real == src_real or src_real in dst_real.parents or dst_real in src_real.parents:
        raise UserError(f"{dst}: DST must be outside SRC and must not contain it")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise UserError(f"{dst}: already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise UserError(f"{dst.parent}: parent directory of DST does not exist")


def execute_prune(plan: PrunePlan, dst: Path, force: bool, log: Any = print) -> dict[str, str]:
    """Write the pruned checkpoint to dst (atomically); returns the manifest {file: sha256}."""
    _check_destination(plan.source.directory, dst, force)
    free = shutil.disk_usage(dst.parent).free
    if free < plan.output_bytes():
        raise UserError(
            f"{dst.parent}: {_gb(free)} free, the pruned checkpoint needs {_gb(plan.output_bytes())}"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        hashes: dict[str, str] = {}
        buffer = bytearray(_COPY_BUFFER_BYTES)
        for shard in plan.shards:
            hashes[shard.file] = _write_shard(plan, shard, staging / shard.file, buffer)
            log(f"wrote {shard.file} ({_gb(shard.size)}, {len(shard.tensors)} tensors)")
        for relative in plan.side_files:
            hashes[relative.as_posix()] = _copy_file(
                plan.source.directory / relative, staging / relative, buffer
            )
        hashes["config.json"] = _write_text(staging / "config.json", _config_json(plan.config))
        hashes[INDEX_NAME] = _write_text(staging / INDEX_NAME, _index_json(plan))
        hashes[PROVENANCE_NAME] = _write_text(
            staging / PROVENANCE_NAME, json.dumps(_provenance(plan), indent=2) + "\n"
        )
        hashes[MODEL_CARD_NAME] = _write_text(staging / MODEL_CARD_NAME, model_card(plan))
        (staging / MANIFEST_NAME).write_text(format_manifest(hashes))
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700; DST is an ordinary directory
        _move_into_place(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return hashes


def _move_into_place(staging: Path, dst: Path) -> None:
    if not (dst.exists() or dst.is_symlink()):
        os.rename(staging, dst)
        return
    # --force: set the old DST aside, move the new one in, then delete the old one, so DST is
    # never missing or half-written.
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.replaced-", dir=dst.parent))
    os.rename(dst, aside / "old")
    try:
        os.rename(staging, dst)
    except BaseException:
        os.rename(aside / "old", dst)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"


def _index_json(plan: PrunePlan) -> str:
    metadata = dict(plan.source.index_metadata)
    metadata["total_size"] = plan.data_bytes
    weight_map = {t.name: s.file for s in plan.shards for t in s.tensors}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_COPY_BUFFER_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _provenance(plan: PrunePlan) -> dict[str, Any]:
    src = plan.source
    return {
        "tool": "glm5-matrix prune",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {
            "path": str(src.directory.resolve()),
            "revision": plan.source_revision,
            "config_sha256": _sha256_file(src.directory / "config.json"),
            "index_sha256": _sha256_file(src.directory / INDEX_NAME) if src.has_index else None,
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
- Source: {len(src.weight_map)} tensors, {src.num_layers} decoder layers + {_mtp_count(src.config)} MTP layer(s)
- Kept: {len(plan.kept)} tensors ({len(plan.renamed)} renamed), {_gb(plan.data_bytes)};
  dropped: {len(plan.dropped)} tensors, {_gb(plan.dropped_bytes)}
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


# --------------------------------------------------------------------------------------------
# The manifest


def format_manifest(hashes: dict[str, str]) -> str:
    # sha256sum's format, so `sha256sum -c SHA256SUMS` checks it too.
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(hashes.items()))


def read_manifest(path: Path) -> dict[str, str]:
    hashes = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if match is None:
            raise UserError(f"{path}:{number}: not a sha256sum line")
        hashes[match[2]] = match[1]
    return hashes


# --------------------------------------------------------------------------------------------
# Verify


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
    mtp = _mtp_count(ckpt.config)
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
        attention = "dsa" if is_mtp or _is_sparse_attention(layer_types[i]) else "kda"
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
    base = _layer_list_base(text)
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
        elif _sha256_file(path) != expected:
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
        from glm5_matrix.layout import plan_layout  # written alongside; optional here
    except ImportError as exc:
        return [f"KV cache groups: not computed ({exc})"]
    try:
        plan = plan_layout(config, tp=1)
    except UserError as exc:
        problems.append(f"KV cache layout: {exc}")
        return []
    return ["KV cache groups vLLM should build (TP1):", plan.describe()]


# --------------------------------------------------------------------------------------------
# CLI

_PRUNE_HELP = f"""\
Build a layer-pruned GLM-5.3-Flash checkpoint: decoder layers 0..N-1 and the MTP layer(s),
renumbered to follow them (45 -> N), every width unchanged. Tensor bytes are copied verbatim;
config.json, the safetensors index, a model card ({MODEL_CARD_NAME}), the derivation
({PROVENANCE_NAME}) and a sha256 manifest ({MANIFEST_NAME}) are written; tokenizer and other
side files are copied unchanged. SRC is never modified; DST appears only when complete.

Refused (exit 2, one line): N outside 1..num_hidden_layers; an N that keeps no DSA/MLA layer
(layers 0-2 of GLM-5.3-Flash are all KDA, so N >= 4), because the pruned model would lack the
full model's MLA/indexer KV cache groups; an N whose last layer has a dense MLP while the MTP
layer is MoE (vLLM builds the MTP MLP like the last layer's).
"""


def register(subparsers: Any) -> None:
    prune = subparsers.add_parser(
        "prune",
        help="build a layer-pruned GLM-5.3-Flash checkpoint",
        description=_PRUNE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prune.add_argument(
        "src", metavar="SRC", type=Path, help="full GLM-5.3-Flash checkpoint directory"
    )
    prune.add_argument("dst", metavar="DST", type=Path, help="directory to create")
    prune.add_argument(
        "--layers", type=int, default=DEFAULT_LAYERS, metavar="N",
        help=f"decoder layers to keep (default {DEFAULT_LAYERS})",
    )  # fmt: skip
    prune.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    prune.add_argument("--force", action="store_true", help="replace an existing DST")
    prune.add_argument(
        "--source-revision", metavar="REV",
        help="source revision for the model card (default: read from a HF cache snapshot path)",
    )  # fmt: skip
    prune.set_defaults(func=run_prune)

    verify = subparsers.add_parser(
        "verify",
        help="check a GLM-5.3-Flash checkpoint directory",
        description="Check config, index against shard headers, per-layer tensors and the "
        "manifest hashes (when present); print the layer types and the KV cache groups vLLM "
        "should build. Exit 1 when a check fails.",
    )
    verify.add_argument("directory", metavar="DIR", type=Path)
    verify.set_defaults(func=run_verify)


def run_prune(args: argparse.Namespace) -> int:
    src: Path = args.src
    if not src.is_dir():
        raise UserError(f"{src}: SRC directory not found")
    plan = plan_prune(open_checkpoint(src), args.layers, args.source_revision)
    if args.dry_run:
        _check_destination(src, args.dst, args.force)
        print("\n".join(["dry run: nothing written", *describe_plan(plan)]))
        return 0
    execute_prune(plan, args.dst, args.force)
    print(
        f"{args.dst}: {plan.layers} layers + MTP, {len(plan.kept)} tensors, "
        f"{_gb(plan.output_bytes())}"
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    report = verify_checkpoint(args.directory)
    print("\n".join(report.lines))
    for problem in report.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    if report.problems:
        print(f"{args.directory}: {len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.directory}: OK")
    return 0
