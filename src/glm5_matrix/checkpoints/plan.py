"""The prune plan: which tensors a prune keeps, renames and drops, and the shards it writes.

Nothing here writes; the plan is what `--dry-run` prints and what the writer carries out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from glm5_matrix.checkpoints.config import (
    LINEAR_ATTENTION,
    ConfigEdit,
    is_sparse_attention,
    mtp_count,
    new_layer_index,
    pruned_config,
)
from glm5_matrix.checkpoints.manifest import MANIFEST_NAME
from glm5_matrix.checkpoints.reading import INDEX_NAME, Checkpoint, split_layer_key
from glm5_matrix.checkpoints.safetensors_header import TensorEntry, encode_header
from glm5_matrix.errors import UserError
from glm5_matrix.models.glm_config import text_config

PROVENANCE_NAME = "glm5-matrix-prune.json"
MODEL_CARD_NAME = "README.md"
# Files of the source that the pruned checkpoint replaces rather than copies.
_REGENERATED = {"config.json", INDEX_NAME, MANIFEST_NAME, PROVENANCE_NAME, MODEL_CARD_NAME}


class KeptTensor(NamedTuple):
    source_name: str
    name: str
    source_file: str
    entry: TensorEntry


@dataclass(frozen=True)
class CopyRun:
    """Consecutive kept tensors of one source shard: one byte range there, one in the output.

    Offsets are relative to the data sections, which is why a renamed tensor (layer 45 -> 4)
    does not end a run: its header entry changes, its bytes and their order do not.
    """

    source_offset: int
    offset: int
    length: int


def copy_runs(tensors: list[KeptTensor]) -> list[CopyRun]:
    """The runs that copy `tensors` (in output order) back to back into a data section: a
    tensor that starts where the previous one ends in the source extends the run."""
    runs: list[CopyRun] = []
    start = end = offset = 0  # the open run: source bytes [start, end), written at offset
    for t in tensors:
        if t.entry.start != end:
            if end > start:
                runs.append(CopyRun(start, offset, end - start))
            offset += end - start
            start = t.entry.start
        end = t.entry.end
    if end > start:
        runs.append(CopyRun(start, offset, end - start))
    return runs


@dataclass
class OutputShard:
    file: str
    source_file: str
    tensors: list[KeptTensor]
    header: bytes = b""
    runs: list[CopyRun] = field(init=False)

    def __post_init__(self) -> None:
        self.runs = copy_runs(self.tensors)

    @property
    def data_bytes(self) -> int:
        return sum(run.length for run in self.runs)

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

    @cached_property
    def index_json(self) -> str:
        """The safetensors index of the output (built once: it lists every kept tensor)."""
        metadata = dict(self.source.index_metadata)
        metadata["total_size"] = self.data_bytes
        weight_map = {t.name: s.file for s in self.shards for t in s.tensors}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        return json.dumps(index, indent=2) + "\n"

    def output_bytes(self) -> int:
        """Shards, copied files, config and index (the card and manifest add a few KB)."""
        regenerated = len(config_json(self.config)) + len(self.index_json.encode())
        return sum(s.size for s in self.shards) + self.side_bytes() + regenerated


def plan_prune(source: Checkpoint, layers: int, source_revision: str | None = None) -> PrunePlan:
    """What a prune to `layers` decoder layers keeps, renames, drops and writes."""
    text = text_config(source.config)
    full_layers = source.num_layers
    mtp = mtp_count(source.config)
    if not 1 <= layers <= full_layers:
        raise UserError(
            f"--layers {layers}: out of range (the checkpoint has {full_layers} decoder layers; "
            f"use 1..{full_layers})"
        )
    layer_types = text["layer_types"]
    if not any(is_sparse_attention(t) for t in layer_types[:layers]):
        first = next((i for i, t in enumerate(layer_types) if is_sparse_attention(t)), None)
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
        new_index = new_layer_index(index, layers, full_layers, mtp)
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
        f"{src.num_layers} decoder layers + {mtp_count(src.config)} MTP)",
        f"keep: decoder layers 0-{plan.layers - 1}"
        + "".join(f", MTP layer {a} -> {b}" for a, b in plan.renamed_layers.items()),
        f"tensors: {unchanged} kept, {len(renamed)} renamed, {len(plan.dropped)} dropped "
        f"({format_size(plan.data_bytes)} kept, {format_size(plan.dropped_bytes)} dropped)",
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
    lines.append(f"output size: {format_size(plan.output_bytes())} ({plan.output_bytes()} bytes)")
    return lines


def format_size(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"
