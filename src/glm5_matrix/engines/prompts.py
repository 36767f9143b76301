"""Token-id prompts without a tokenizer: drawn with a seed, the same on every run and in every
process."""

from __future__ import annotations

import random
from collections.abc import Sequence


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """Token ids drawn uniformly from [0, vocab_size) with `seed`: prompts without a tokenizer,
    the same on every run and in every process."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def with_other_tokens(
    prompt: Sequence[int], start: int, end: int, vocab_size: int, seed: int
) -> list[int]:
    """`prompt` with its tokens [start, end) drawn anew with `seed`: the prompt a stale or wrong
    cached state of that span amounts to (a negative control for comparisons across a cached
    block). Every redrawn token differs from the one it replaces."""
    if not 0 <= start < end <= len(prompt):
        raise ValueError(f"span [{start}, {end}) is not inside a {len(prompt)}-token prompt")
    rng = random.Random(seed)
    out = list(prompt)
    for i in range(start, end):
        token = rng.randrange(vocab_size - 1)
        out[i] = token if token < out[i] else token + 1
    return out
