"""What a prefix-cache retention mode promises the next request: which Mamba states stay in the
cache and how many tokens a later request must be served from it. Pure: the harness computes the
promise from the requests' own tokens, the steps the worker was told to compute (the chunk
recorder, glm5_matrix.engines.workers.record_chunks), the block size and the mode, never from
vLLM's cache bookkeeping; the suites compare vLLM's reported hit with it.

Why states only at some positions: in align mode (hybrid prefix caching) a Mamba layer keeps one
running state per request, and vLLM keeps the state after p tokens only where one of the
request's steps ends exactly at p = k x block: a prefill chunk that ends on a block boundary, or
the decode step that reaches one. Which of those stay in the prefix cache is vLLM's
`cache_config.prefix_cache_retention_interval` (vLLM 0.32 CPU and 0.33: config/cache.py,
MambaManager.reachable_block_mask in v1/core/single_type_kv_cache_manager.py):

- `None`, **dense**: every one of them;
- `0`, **semantic** (vLLM's default): the replay boundary, the last block boundary before the
  prompt's last token ((P - 1) // block x block, where a resend of the prompt resumes), and
  shared-prefix junctions;
- `I > 0`, **periodic** (I a multiple of the block): those of semantic, and every state at a
  multiple of I.

A shared-prefix junction: a request whose lookup finds the attention layers' cache longer than
the Mamba layers' (a common prefix with an earlier request whose Mamba state at its end was not
kept) pins that boundary: the scheduler ends the request's chunk there and the state is kept in
every mode, so the next request sharing the prefix is served from it (v1/core/kv_cache_manager.py
get_computed_blocks, v1/core/sched/scheduler.py's junction stop).

A later request is served the longest kept boundary within its cacheable prefix: its common
prefix with the earlier request, down to a block, and short of its own last token (always
computed for its logits: vLLM's max_cache_hit_length = tokens - 1). Hits are at block
boundaries where every prefix-cacheable group has one block size (the suites check it; finer
hash hits, vLLM's prefix_match_unit, are not modelled and would show as a mismatch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The modes the suites name, and vLLM's prefix_cache_retention_interval for each (periodic's
# interval comes from the profile, in blocks).
DENSE, SEMANTIC, PERIODIC = "dense", "semantic", "periodic"
MODES = (SEMANTIC, DENSE, PERIODIC)


@dataclass(frozen=True)
class Mode:
    """A retention mode as vLLM is given it: `interval` None (dense), 0 (semantic) or > 0."""

    interval: int | None

    @property
    def name(self) -> str:
        if self.interval is None:
            return DENSE
        return SEMANTIC if self.interval == 0 else PERIODIC

    def describe(self) -> str:
        shown = "None" if self.interval is None else str(self.interval)
        return f"{self.name} (prefix_cache_retention_interval={shown})"


def mode_named(name: str, block: int, periodic_blocks: int | None = None) -> Mode:
    """The Mode a suite's name stands for; periodic needs its interval in blocks (>= 2: an
    interval of one block keeps every state, which is dense)."""
    if name == DENSE:
        return Mode(None)
    if name == SEMANTIC:
        return Mode(0)
    if name == PERIODIC:
        if periodic_blocks is None or periodic_blocks < 2:
            raise ValueError(
                f"periodic retention needs an interval of at least 2 blocks (given "
                f"{periodic_blocks}): at one block it keeps every state, as dense does"
            )
        return Mode(periodic_blocks * block)
    raise ValueError(f"unknown retention mode {name!r} (known: {', '.join(MODES)})")


def replay_boundary(prompt_tokens: int, block: int) -> int:
    """Where a resend of a prompt of `prompt_tokens` resumes: the last block boundary before its
    last token, (P - 1) // block x block (0: none)."""
    _check_block(block)
    return max(prompt_tokens - 1, 0) // block * block


def step_boundaries(steps: Iterable[Sequence[int]], block: int) -> set[int]:
    """The block boundaries where a request's Mamba state existed: the ends of the steps the
    worker computed for it ([first position, tokens] each, prefill chunks and decode steps
    alike) that fall on a block boundary past 0."""
    _check_block(block)
    ends = {int(start) + int(count) for start, count in steps if int(count) > 0}
    return {end for end in ends if end > 0 and end % block == 0}


def kept(
    mode: Mode,
    states: Iterable[int],
    prompt_tokens: int,
    block: int,
    junctions: Iterable[int] = (),
) -> set[int]:
    """The boundaries of a request's states that `mode` keeps in the prefix cache: its replay
    boundary and the junctions it computed through in every mode, its other states (`states`,
    from step_boundaries) all under dense and at multiples of the interval under periodic."""
    _check_block(block)
    states = set(states)
    kept_now = {b for b in set(junctions) if b > 0 and b % block == 0}
    replay = replay_boundary(prompt_tokens, block)
    if replay > 0:
        kept_now.add(replay)
    if mode.interval is None:
        kept_now |= states
    elif mode.interval > 0:
        if mode.interval % block:
            raise ValueError(f"interval {mode.interval} is not a multiple of the block {block}")
        kept_now |= {b for b in states if b % mode.interval == 0}
    return kept_now


def cacheable_prefix(common_tokens: int, request_tokens: int, block: int) -> int:
    """How far a request may be served from the cache: its common prefix with the cached
    request down to a block, and short of its own last token."""
    _check_block(block)
    return min(common_tokens // block * block, max(request_tokens - 1, 0))


def promised_hit(
    kept_boundaries: Iterable[int], common_tokens: int, request_tokens: int, block: int
) -> int:
    """The tokens a request must be served from the cache: the longest kept boundary within its
    cacheable prefix (0 when none is)."""
    limit = cacheable_prefix(common_tokens, request_tokens, block)
    return max((b for b in kept_boundaries if 0 < b <= limit), default=0)


def junction(common_tokens: int, request_tokens: int, mamba_hit: int, block: int) -> int:
    """The shared-prefix junction a request pins (0 when none): the attention layers' hit (its
    cacheable prefix, every attention block of the common prefix being cached) where it is
    longer than the Mamba layers' hit `mamba_hit` (the promised one)."""
    attention = cacheable_prefix(common_tokens, request_tokens, block)
    return attention if attention > mamba_hit else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Promise:
    """What the harness promised a request and why: the hit, the boundaries it was chosen from,
    the cacheable prefix, and the mode."""

    hit: int
    kept: tuple[int, ...]
    limit: int
    mode: Mode

    def describe(self) -> str:
        return (
            f"{self.mode.describe()} keeps states at {list(self.kept)}; within the cacheable "
            f"prefix of {self.limit} tokens the hit is {self.hit}"
        )


def promise(
    mode: Mode,
    states: Iterable[int],
    prompt_tokens: int,
    common_tokens: int,
    request_tokens: int,
    block: int,
    junctions: Iterable[int] = (),
) -> Promise:
    """kept() of the cached request and promised_hit() of the next one, with the reasons."""
    boundaries = kept(mode, states, prompt_tokens, block, junctions)
    limit = cacheable_prefix(common_tokens, request_tokens, block)
    hit = promised_hit(boundaries, common_tokens, request_tokens, block)
    return Promise(hit, tuple(sorted(boundaries)), limit, mode)


def check_hit(reported: int | None, promised: Promise, what: str) -> None:
    """vLLM's reported hit must be the promised one: fewer tokens is a state the mode keeps that
    was not served (or not kept); more is a state the mode does not keep, or one served beyond
    the prompts' common prefix."""
    got = int(reported or 0)
    if got != promised.hit:
        side = "fewer" if got < promised.hit else "more"
        raise AssertionError(
            f"{what}: vLLM served {got} cached tokens, {side} than the retention promises "
            f"({promised.hit}): {promised.describe()}"
        )


def _check_block(block: int) -> None:
    if block <= 0:
        raise ValueError(f"block size {block} must be positive")
