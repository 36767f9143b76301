"""P at TP1, D at TP > 1: which part of each of P's pages a rank of D must hold, from the model's
config alone (not from what the connector reports or how it reads).

The tiny hybrid (a Qwen3-Next-style model: full attention + Gated DeltaNet) splits over ranks as
vLLM shards its weights:
- a GDN layer's conv state holds the conv channels [q | k | v] (key_dim, key_dim, value_dim
  channels, key_dim = linear_num_key_heads x linear_key_head_dim); each rank holds the rank-th
  1/tp of each of the three (vLLM's NIXL pull reads them as three pieces, its "3-read"
  transfer: a flat 1/tp of the channels would be wrong);
- its recurrent state holds linear_num_value_heads heads; each rank holds the rank-th 1/tp;
- an attention layer with fewer KV heads than ranks is replicated: every rank holds P's page.

A split is, per state tensor of a layer, the segment sizes along the state's channel (or head)
axis at TP1 (glm5_matrix.engines.workers.rank_part applies it inside P's worker), or None for a
whole page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from glm5_matrix.errors import UserError

Split = list[list[int] | None]  # per state tensor of a layer: segments, or None (whole page)


def gdn_split(config: Mapping[str, Any], tp: int) -> Split:
    """A GDN layer's [conv, recurrent] split (vLLM's state order)."""
    k_heads, v_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    key_dim = k_heads * int(config["linear_key_head_dim"])
    value_dim = v_heads * int(config["linear_value_head_dim"])
    if k_heads % tp or v_heads % tp:
        raise UserError(f"TP{tp} does not split the GDN heads ({k_heads} key, {v_heads} value)")
    return [[key_dim, key_dim, value_dim], [v_heads]]


def flat_split(split: Split) -> Split:
    """A negative control: the same states split into tp equal pieces along the same axis, as
    if the channels were one block (what a connector that ignores [q | k | v] would read)."""
    return [None if segments is None else [sum(segments)] for segments in split]


def flat_view(splits: Mapping[str, Split]) -> dict[str, Split]:
    """flat_split for every layer of a {layer: split} map."""
    return {layer: flat_split(split) for layer, split in splits.items()}


def attention_split(config: Mapping[str, Any], tp: int) -> Split:
    """An attention layer's split: its KV heads must be replicated at this TP (one whole page
    per rank); a model whose KV heads split over the ranks is not handled here."""
    kv_heads = int(config["num_key_value_heads"])
    if kv_heads % tp == 0 and kv_heads >= tp:
        raise UserError(
            f"{kv_heads} KV heads split over TP{tp}: per-rank attention pages are not handled"
        )
    return [None]


def layer_splits(
    config: Mapping[str, Any],
    group_layers: Sequence[Sequence[str]],
    mamba_groups: Sequence[int],
    tp: int,
) -> dict[str, Split]:
    """{layer name: its split} for every layer of every KV group."""
    gdn, attention = gdn_split(config, tp), attention_split(config, tp)
    return {
        layer: (gdn if group in mamba_groups else attention)
        for group, layers in enumerate(group_layers)
        for layer in layers
    }


def rank_key(rank: int, layer: str) -> str:
    """A page's layer name as seen on one rank (rank 0 at TP1 included)."""
    return f"rank{rank}/{layer}"


def rank_of(layer: str) -> int:
    """The rank of a page keyed by rank_key."""
    rank, _ = layer.split("/", 1)
    return int(rank.removeprefix("rank"))


def next_rank_keys(pages: Mapping[tuple[int, int, str], Any], tp: int) -> dict[Any, Any]:
    """A negative control: every rank's pages given the next rank's (rank r's split compared
    with rank r+1's)."""
    result = {}
    for group, position, layer in pages:
        other = rank_key((rank_of(layer) + 1) % tp, layer.split("/", 1)[1])
        result[(group, position, layer)] = pages[(group, position, other)]
    return result
