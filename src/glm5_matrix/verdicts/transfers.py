"""A transfer is a copy: the pages that arrived must equal the pages that left, byte for byte.

Pure: block tables and page digests in (glm5_matrix.engines.workers reads them inside the workers),
a verdict out. Used for NIXL 1P1D (P's sent blocks against D's received ones) and for KV offload
(the blocks a warm run restored from CPU against the pages the cold run wrote).

A page is one block of one layer's state tensor: an attention layer has one per block, a Mamba
(KDA/GDN) layer one per state (conv, recurrent). Pages are compared by their sha256 digests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's block pool keeps block 0 as the null block: a table entry that holds nothing (a Mamba
# group's slots outside the blocks it keeps state in, for instance).
NULL_BLOCK = 0

# (group index, position in the request's block list, layer name)
PageKey = tuple[int, int, str]


@dataclass(frozen=True)
class BlockPair:
    """Block `position` of a request in KV group `group`: its id on the sending side and on the
    receiving side."""

    group: int
    position: int
    sent: int
    received: int


def paired_blocks(
    sent: Sequence[Sequence[int]],
    received: Sequence[Sequence[int]],
    covered_blocks: int,
    whole_blocks: int,
) -> list[BlockPair]:
    """Pair each block the sender listed with the receiver's block at the same position of the
    request. The sender's list for a group holds the LAST blocks of the `covered_blocks` that
    its tokens span (all of them for attention; the one holding the state after the last token
    for a Mamba group, as vLLM's NIXL connector sends it), so block i of a list of n sits at
    position covered_blocks - n + i of the receiver's table. Only positions below
    `whole_blocks` are paired: the receiver writes its own tokens into the block after them.
    Null blocks on both sides are skipped; a null block on one side only is kept (a block that
    never arrived shows)."""
    if len(sent) != len(received):
        raise ValueError(f"{len(sent)} sent group(s), {len(received)} received")
    if not 0 <= whole_blocks <= covered_blocks:
        raise ValueError(f"whole blocks {whole_blocks} outside 0..{covered_blocks} covered")
    pairs = []
    for group, (ours, theirs) in enumerate(zip(sent, received, strict=True)):
        first = covered_blocks - len(ours)
        if ours and (first < 0 or covered_blocks > len(theirs)):
            raise ValueError(
                f"group {group}: {len(ours)} block(s) sent and {len(theirs)} received do not fit "
                f"{covered_blocks} covered block(s)"
            )
        for i, block in enumerate(ours):
            position = first + i
            if position >= whole_blocks:
                continue
            if block == NULL_BLOCK and theirs[position] == NULL_BLOCK:
                continue
            pairs.append(BlockPair(group, position, int(block), int(theirs[position])))
    return pairs


def page_reads(
    pairs: Sequence[BlockPair], group_layers: Sequence[Sequence[str]], side: str
) -> list[tuple[str, int]]:
    """The (layer, block id) reads of one side ("sent" or "received") for these pairs: every
    layer of the pair's group."""
    if side not in ("sent", "received"):
        raise ValueError(f"side must be 'sent' or 'received', not {side!r}")
    return [(layer, getattr(pair, side)) for pair in pairs for layer in group_layers[pair.group]]


def table_pages(
    table: Sequence[Sequence[int]],
    whole_blocks: int,
    groups: Sequence[int],
    group_layers: Sequence[Sequence[str]],
) -> tuple[list[PageKey], list[tuple[str, int]]]:
    """The pages of one request's first `whole_blocks` blocks in `groups` (its block table on one
    side, null blocks left out): their keys, and the (layer, block id) reads that give their
    digests in the same order. For copies read at two moments (the GPU pages before an offload,
    the restored ones after), each side is read from its own request's table."""
    keys: list[PageKey] = []
    reads: list[tuple[str, int]] = []
    for group in groups:
        blocks = table[group]
        if whole_blocks > len(blocks):
            raise ValueError(f"group {group}: {whole_blocks} blocks asked, {len(blocks)} in table")
        for position in range(whole_blocks):
            if blocks[position] == NULL_BLOCK:
                continue
            for layer in group_layers[group]:
                keys.append((group, position, layer))
                reads.append((layer, int(blocks[position])))
    return keys, reads


def keyed_reads(
    keys: Sequence[PageKey], digests: Sequence[Sequence[str]]
) -> dict[PageKey, tuple[str, ...]]:
    """Digests read for table_pages()'s reads, keyed by its keys."""
    if len(keys) != len(digests):
        raise ValueError(f"{len(keys)} pages read but {len(digests)} digests")
    return {key: tuple(d) for key, d in zip(keys, digests, strict=True)}


def keyed(
    pairs: Sequence[BlockPair],
    group_layers: Sequence[Sequence[str]],
    digests: Sequence[Sequence[str]],
) -> dict[PageKey, tuple[str, ...]]:
    """Digests read for page_reads(pairs, ...) (in that order), keyed by page."""
    keys = [(p.group, p.position, layer) for p in pairs for layer in group_layers[p.group]]
    return keyed_reads(keys, digests)


@dataclass(frozen=True)
class Copied:
    """What check_copied found equal."""

    pages: int  # (group, block, layer) pages compared
    states: int  # state tensors compared (pages x states per layer)
    groups: tuple[int, ...]  # the groups that moved

    def describe(self) -> str:
        return (
            f"{self.pages} pages ({self.states} state tensors) in groups "
            f"{list(self.groups)} byte-for-byte equal"
        )


def differing_states(
    expected: Mapping[Any, Sequence[str]], got: Mapping[Any, Sequence[str]]
) -> tuple[int, list[tuple[Any, list[int]]]]:
    """Over the keys both hold: how many state digests `expected` has, and each key whose
    digests differ with the indices that do (-1: one holds more states than the other)."""
    differing = []
    states = 0
    for key in sorted(set(expected) & set(got)):
        ours, theirs = tuple(expected[key]), tuple(got[key])
        states += len(ours)
        if ours != theirs:
            bad = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b]
            if len(ours) != len(theirs):
                bad.append(-1)
            differing.append((key, bad))
    return states, differing


def check_copied(
    sent: Mapping[PageKey, Sequence[str]],
    received: Mapping[PageKey, Sequence[str]],
    names: tuple[str, str] = ("sent", "received"),
) -> Copied:
    """Every page sent must have arrived with the same bytes (every state tensor's digest
    equal), and nothing more or less; an AssertionError lists the pages that differ."""
    if not sent:
        raise AssertionError(f"nothing {names[0]}: a copy of no pages proves nothing")
    problems = []
    missing = sorted(set(sent) - set(received))
    extra = sorted(set(received) - set(sent))
    if missing:
        problems.append(f"{len(missing)} page(s) never {names[1]}: {missing[:4]}")
    if extra:
        problems.append(f"{len(extra)} page(s) {names[1]} that were not {names[0]}: {extra[:4]}")
    states, differing = differing_states(sent, received)
    if differing:
        shown = "; ".join(
            f"group {g} block {p} layer {layer} state(s) {bad}"
            for (g, p, layer), bad in differing[:6]
        )
        problems.append(f"{len(differing)} of {len(sent)} page(s) differ: {shown}")
    if problems:
        raise AssertionError(
            f"{names[1]} pages are not a copy of {names[0]}: " + "; ".join(problems)
        )
    return Copied(len(sent), states, tuple(sorted({key[0] for key in sent})))


def swapped(pages: Mapping[PageKey, Sequence[str]]) -> dict[PageKey, tuple[str, ...]]:
    """A negative control: the same pages with the first two blocks of the first group that has
    two distinct ones exchanged (a block written into the other's slot). Raises when no group
    has two blocks whose pages differ (then no control can tell a misplaced block)."""
    by_group: dict[int, dict[int, list[PageKey]]] = {}
    for key in pages:
        by_group.setdefault(key[0], {}).setdefault(key[1], []).append(key)
    for group in sorted(by_group):
        positions = sorted(by_group[group])
        for a, b in itertools.pairwise(positions):
            keys_a, keys_b = sorted(by_group[group][a]), sorted(by_group[group][b])
            if [pages[k] for k in keys_a] == [pages[k] for k in keys_b]:
                continue
            result = {key: tuple(value) for key, value in pages.items()}
            for key_a, key_b in zip(keys_a, keys_b, strict=True):
                result[key_a], result[key_b] = tuple(pages[key_b]), tuple(pages[key_a])
            return result
    raise AssertionError("no group has two blocks with different pages: nothing to swap")


# The harness's own location of a Mamba state, from token counts and the block size alone (not
# from the blocks a connector says it sent or restored).


def checkpoint_column(tokens: int, block_size: int, *, boundary: bool = False) -> int:
    """The block-table column that holds a Mamba group's state after the first `tokens` tokens
    of a request in vLLM's align mode: (tokens - 1) // block_size (the state after
    (p + 1) * block_size tokens is kept in column p; a running state in the column of the
    block its last token lies in). It is also the column a request that has `tokens` tokens
    computed starts its next step from. `boundary=True` insists that `tokens` ends a block:
    only there does a request that ran past it keep a checkpoint (a P-alone run's table)."""
    if block_size <= 0:
        raise ValueError(f"block size {block_size} must be positive")
    if tokens <= 0:
        raise ValueError(f"no state after {tokens} tokens")
    if boundary and tokens % block_size:
        raise ValueError(f"{tokens} tokens do not end a {block_size}-token block")
    return (tokens - 1) // block_size


def located_pages(
    table: Sequence[Sequence[int]],
    column: int,
    groups: Sequence[int],
    group_layers: Sequence[Sequence[str]],
) -> tuple[list[PageKey], list[tuple[str, int]]]:
    """The pages of block-table column `column` in each of `groups` (a Mamba group's state at a
    position the caller located): keys (group, column, layer) and the (layer, block id) reads
    that give their digests in the same order. A null block there is an error: no state was
    kept where the harness says it must be."""
    if not groups:
        raise ValueError("no groups to locate a state in")
    keys: list[PageKey] = []
    reads: list[tuple[str, int]] = []
    for group in groups:
        blocks = table[group]
        if not 0 <= column < len(blocks):
            raise ValueError(f"group {group}: column {column} outside a table of {len(blocks)}")
        if blocks[column] == NULL_BLOCK:
            raise ValueError(f"group {group}: column {column} is the null block ({list(blocks)})")
        for layer in group_layers[group]:
            keys.append((group, column, layer))
            reads.append((layer, int(blocks[column])))
    return keys, reads


def boundary_pages(
    table: Sequence[Sequence[int]],
    boundary_blocks: int,
    groups: Sequence[int],
    mamba_groups: Sequence[int],
    group_layers: Sequence[Sequence[str]],
) -> tuple[list[PageKey], list[tuple[str, int]]]:
    """The pages a prefix hit of `boundary_blocks` whole blocks must bring back, where the
    harness computes them: in every group of `groups` that is not a Mamba group, each of the
    first `boundary_blocks` blocks; in each Mamba group, the checkpoint it resumes from, column
    boundary_blocks - 1 (checkpoint_column). A null block at any of them is an error: nothing
    came back where something must."""
    if boundary_blocks <= 0:
        raise ValueError(f"a hit of {boundary_blocks} blocks restores nothing")
    keys: list[PageKey] = []
    reads: list[tuple[str, int]] = []
    for group in groups:
        if group in mamba_groups:
            column = checkpoint_column(boundary_blocks, 1)
            more_keys, more_reads = located_pages(table, column, [group], group_layers)
            keys += more_keys
            reads += more_reads
            continue
        blocks = table[group]
        if boundary_blocks > len(blocks):
            raise ValueError(
                f"group {group}: {boundary_blocks} blocks asked, {len(blocks)} in table"
            )
        for position in range(boundary_blocks):
            if blocks[position] == NULL_BLOCK:
                raise ValueError(f"group {group}: block {position} is the null block")
            for layer in group_layers[group]:
                keys.append((group, position, layer))
                reads.append((layer, int(blocks[position])))
    return keys, reads


def other_layers(pages: Mapping[PageKey, Sequence[str]]) -> dict[PageKey, tuple[str, ...]]:
    """A negative control: each page given the digests of the next page in key order (another
    layer's state, or another group's, at the same place). Raises when fewer than two pages
    differ (then no control can tell a wrong layer)."""
    keys = sorted(pages)
    if len({tuple(pages[k]) for k in keys}) < 2:
        raise AssertionError("fewer than two distinct pages: nothing to tell apart")
    return {key: tuple(pages[keys[(i + 1) % len(keys)]]) for i, key in enumerate(keys)}
