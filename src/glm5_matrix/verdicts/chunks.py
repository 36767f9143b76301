"""How a request's prefill was chunked, and whether a prefix-cache repeat computed the same path
as its cold reference. Pure: the records come from the worker's chunk recorder
(glm5_matrix.engines.workers.record_chunks: [first position, tokens] per step, as the worker was
told to compute them).

Why it matters: a cold prefill that runs the whole prompt in one pass has other shapes than a
repeat that resumes from the cached block boundary (on the H200 the GEMMs' split and the sparse
indexer's top-k follow the token count), so the two differ by more than the cold runs differ
among themselves and a comparison of them says nothing of the cache. A cold prefill that ends a
chunk at the boundary computes its second chunk with the repeat's shapes, from the state the
repeat is served from.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

Chunk = tuple[int, int]  # (first position, end position)


def prefill_chunks(record: Sequence[Sequence[int]], prompt_tokens: int) -> list[Chunk]:
    """The steps of one request's record that computed prompt tokens, as (start, end): those
    starting before the prompt's end (the steps after it are decode steps)."""
    chunks = [(int(start), int(start) + int(count)) for start, count in record]
    return [(start, end) for start, end in chunks if start < prompt_tokens]


def check_repeat_path(
    cold: Sequence[Chunk], repeat: Sequence[Chunk], prompt_tokens: int, block: int
) -> int:
    """The repeat starts at a block boundary past 0 (its prefix hit), the cold prefill covers the
    prompt from 0 and ends a chunk exactly there, and from there on both computed the same
    chunks. Returns the boundary; an AssertionError says where the paths part."""
    shown = f"cold chunks {list(cold)}, repeat chunks {list(repeat)}"
    if not repeat:
        raise AssertionError(f"the repeat computed no prompt token: {shown}")
    boundary = repeat[0][0]
    if boundary <= 0 or boundary % block:
        raise AssertionError(
            f"the repeat starts at token {boundary}, not at a block boundary past 0 "
            f"(block {block}): {shown}"
        )
    for name, chunks in (("cold", cold), ("repeat", repeat)):
        ends = [end for _, end in chunks]
        contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
        if not contiguous or not chunks or ends[-1] != prompt_tokens:
            raise AssertionError(
                f"the {name} prefill does not cover the prompt's {prompt_tokens} tokens in "
                f"consecutive chunks: {shown}"
            )
    if cold[0][0] != 0:
        raise AssertionError(f"the cold prefill does not start at token 0: {shown}")
    ends = [end for _, end in cold]
    if boundary not in ends:
        raise AssertionError(
            f"the cold prefill ends no chunk at the repeat's boundary {boundary}: its second "
            f"part has other shapes than the repeat's (set the prefill's chunk budget to the "
            f"block, max_num_batched_tokens = {block}): {shown}"
        )
    after = [chunk for chunk in cold if chunk[0] >= boundary]
    if after != list(repeat):
        raise AssertionError(f"from token {boundary} on the paths differ: {shown}")
    return boundary


def prompt_runs(
    records: dict[str, Sequence[Sequence[int]]], prompt_tokens: int
) -> list[list[Chunk]]:
    """The prefill chunks of each recorded request that computed a prompt of `prompt_tokens`
    tokens to its end (others, such as one-token probes, left out), in the order recorded."""
    runs = [prefill_chunks(record, prompt_tokens) for record in records.values()]
    return [run for run in runs if run and run[-1][1] == prompt_tokens]


def recomputed(record: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Where a request went back: (the end it had computed to, the position it computed from
    next) for every step that starts before the previous step's end. A request preempted and
    resumed is recomputed from its prefix hit (0 without one), so its record shows the
    preemption without asking vLLM: [[767, 1], [0, 768]] is one that had computed 768 tokens
    and was resumed from nothing."""
    found = []
    for (start, count), (next_start, _) in itertools.pairwise(record):
        end = int(start) + int(count)
        if int(next_start) < end:
            found.append((end, int(next_start)))
    return found
