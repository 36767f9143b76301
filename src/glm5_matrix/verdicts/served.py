"""A prefix hit is served from the checkpoint: the Mamba state a request starts from after a
hit at a block boundary must equal, bit for bit, the checkpoint page cached there.

Pure: digests in (glm5_matrix.engines.workers reads the starting state in the worker, as the
model is about to run the request's first post-hit step, at the block the harness locates),
a verdict out. The checkpoint was read before the hit, from the cold request's own block table
at the column the harness computes for the boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glm5_matrix.verdicts.transfers import differing_states


@dataclass(frozen=True)
class Served:
    """What check_served found equal."""

    layers: int
    states: int
    start: int

    def describe(self) -> str:
        return (
            f"{self.layers} Mamba layers ({self.states} state tensors) start from the checkpoint "
            f"at token {self.start} bit for bit"
        )


def start_column(start: int, tokens: int, block_size: int) -> int:
    """The block-table column a request that computes `tokens` tokens from position `start`
    runs its Mamba state in (align mode): that of its last token, (start + tokens - 1) //
    block_size; the checkpoint it starts from is copied there before the model runs."""
    if block_size <= 0 or tokens <= 0 or start < 0:
        raise ValueError(f"no column for {tokens} tokens from {start} in {block_size}-token blocks")
    return (start + tokens - 1) // block_size


def check_served(
    entry: Mapping[str, Any],
    checkpoint: Mapping[str, Sequence[str]],
    boundary: int,
    block_sizes: Mapping[str, int],
) -> Served:
    """`entry`: the worker's record of a request's first post-hit step (start, tokens, columns
    per group, blocks, digests per layer, kernel_blocks where known); `checkpoint`: per layer,
    the digests of the checkpoint page at `boundary`; `block_sizes`: per group (as a string)
    its block size. The step must start at the boundary, in the column the harness computes,
    where the kernel reads (where the metadata says), from the checkpoint's bytes in every
    layer; an AssertionError names every difference."""
    if not checkpoint:
        raise AssertionError("no checkpoint pages: a comparison of nothing proves nothing")
    problems = []
    start, tokens = int(entry["start"]), int(entry["tokens"])
    if start != boundary:
        problems.append(f"the hit served {start} tokens, not the boundary {boundary}")
    for group, column in dict(entry.get("columns") or {}).items():
        wanted = start_column(start, tokens, int(block_sizes[group]))
        if int(column) != wanted:
            problems.append(f"group {group}: read column {column}, the state runs in {wanted}")
    digests = dict(entry.get("digests") or {})
    missing = sorted(set(checkpoint) - set(digests))
    if missing:
        problems.append(f"{len(missing)} layer(s) not read at the step: {missing[:4]}")
    kernel = dict(entry.get("kernel_blocks") or {})
    for layer, block in kernel.items():
        if block is not None and int(block) != int(entry["blocks"][layer]):
            problems.append(
                f"{layer}: the kernel reads block {block}, the harness located {entry['blocks'][layer]}"
            )
    states, differing = differing_states(checkpoint, digests)
    if differing:
        shown = "; ".join(f"{layer} state(s) {bad}" for layer, bad in differing[:6])
        problems.append(
            f"{len(differing)} of {len(checkpoint)} layer(s) start from other bytes than the "
            f"checkpoint: {shown}"
        )
    if problems:
        raise AssertionError(
            "the prefix hit is not served from its checkpoint: " + "; ".join(problems)
        )
    return Served(len(checkpoint), states, start)
