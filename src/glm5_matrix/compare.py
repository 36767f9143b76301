"""Comparisons of engine outputs and cache pages, with failure messages that say what differed.

Pure Python (numpy arrays, torch tensors or nested lists in; floats out), so the unit tests can
feed them hand-made data without vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


def assert_varies(tokens: Sequence[int], min_distinct: int, what: str = "output") -> None:
    """Fail unless `tokens` holds at least `min_distinct` distinct values.

    An equality check between two outputs proves nothing when both are one repeated token;
    call this first.
    """
    distinct = len(set(tokens))
    if distinct < min_distinct:
        raise AssertionError(
            f"{what} does not vary: {distinct} distinct token(s) < {min_distinct} in "
            f"{len(tokens)} tokens ({list(tokens)[:16]}...); an equality check on it would be vacuous"
        )


def flatten(values: Any) -> list[float]:
    """A flat list of floats from a numpy array, a torch tensor or nested sequences."""
    if hasattr(values, "ravel"):  # numpy
        return [float(v) for v in values.ravel().tolist()]
    if hasattr(values, "flatten") and hasattr(values, "tolist"):  # torch
        return [float(v) for v in values.flatten().tolist()]
    if isinstance(values, (int, float)):
        return [float(values)]
    out: list[float] = []
    for item in values:
        out.extend(flatten(item))
    return out


def relative_error(actual: Any, reference: Any) -> float:
    """||actual - reference|| / ||reference|| (L2 over all elements).

    A zero reference gives 0 when actual is zero too, inf otherwise; differing sizes raise.
    """
    a, b = flatten(actual), flatten(reference)
    if len(a) != len(b):
        raise ValueError(f"cannot compare {len(a)} elements with {len(b)}")
    diff = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    norm = math.sqrt(math.fsum(y * y for y in b))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def check_checkpoint_pages(
    cached: Mapping[str, Sequence[Any]],
    reference: Mapping[str, Sequence[Any]],
    tolerance: float,
) -> dict[str, list[float]]:
    """Check each Mamba group's cached checkpoint page against its own cold-prefill reference.

    cached / reference: {group: [one array per state tensor (conv, recurrent, ...)]}. Every group
    of `reference` must be in `cached` with the same number of states; each state's relative
    error must be <= tolerance. Returns {group: [relative error per state]}; raises an
    AssertionError naming every group that does not match (a page written to another group's
    slot, or left stale, fails here).
    """
    errors: dict[str, list[float]] = {}
    problems: list[str] = []
    missing = sorted(set(reference) - set(cached))
    if missing:
        problems.append(f"no cached page for group(s) {missing}")
    for group in sorted(set(reference) & set(cached)):
        pages, refs = cached[group], reference[group]
        if len(pages) != len(refs):
            problems.append(
                f"{group}: {len(pages)} cached state(s) vs {len(refs)} in the reference"
            )
            continue
        errors[group] = [relative_error(p, r) for p, r in zip(pages, refs, strict=True)]
        bad = [e for e in errors[group] if not e <= tolerance]
        if bad:
            shown = ", ".join(f"{e:.3g}" for e in errors[group])
            problems.append(f"{group}: relative error per state [{shown}] > {tolerance}")
    if problems:
        raise AssertionError(
            "checkpoint pages do not match their own group's cold prefill: " + "; ".join(problems)
        )
    return errors


def matched_logprob_deltas(
    tokens_a: Sequence[int],
    logprobs_a: Sequence[float],
    tokens_b: Sequence[int],
    logprobs_b: Sequence[float],
) -> list[float]:
    """|logprob_a - logprob_b| over the common prefix of equal tokens.

    Walks both outputs position by position and stops at the first position where the chosen
    tokens differ (or either output ends): a logprob of one token is never compared with a
    logprob of another. Returns one delta per matched position, so `len(result)` is the length
    of the matched prefix; the caller decides how many matched tokens it requires (an empty
    list means the first tokens already differ).
    """
    for name, tokens, logprobs in (("a", tokens_a, logprobs_a), ("b", tokens_b, logprobs_b)):
        if len(tokens) != len(logprobs):
            raise ValueError(f"output {name}: {len(tokens)} tokens but {len(logprobs)} logprobs")
    deltas: list[float] = []
    for ta, la, tb, lb in zip(tokens_a, logprobs_a, tokens_b, logprobs_b, strict=False):
        if ta != tb:
            break
        deltas.append(abs(float(la) - float(lb)))
    return deltas


class Scored(Protocol):
    """A greedy output with its scores: an offline engine's or a server's completion."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...  # the chosen token's logprob per step
    @property
    def top_logprobs(self) -> Sequence[Mapping[int, float]]: ...  # top candidates per step


@dataclass(frozen=True)
class GreedyOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Agreement:
    """How far two greedy outputs of the same prompt agree."""

    matched: int  # equal leading tokens
    total: int
    worst_logprob_delta: float  # over the matched tokens
    parting_gaps: (
        tuple[float, float] | None
    )  # where they part: each side's gap to the other's token

    def describe(self) -> str:
        text = f"{self.matched} of {self.total} tokens equal, max |logprob delta| "
        text += f"{self.worst_logprob_delta:.4f}"
        if self.parting_gaps is not None:
            text += f"; they part at a near-tie (gaps {self.parting_gaps[0]:.4f} / "
            text += f"{self.parting_gaps[1]:.4f})"
        return text


def check_greedy_agreement(
    a: Scored,
    b: Scored,
    *,
    min_matched: int,
    logprob_abs: float,
    names: tuple[str, str] = ("a", "b"),
) -> Agreement:
    """Check that two greedy runs of one prompt agree up to rounding, as vLLM's own
    check_logprobs_close does: equal tokens with close logprobs, and where they part (if they
    do), a near-tie on both sides: each side's token is among the other's top candidates, within
    `logprob_abs` of the other's choice. Two runs that differ by more than rounding (another
    state, another group's page) part at a clear winner and fail here.

    `min_matched` equal leading tokens are required in any case. Raises AssertionError saying
    which rule broke; returns the agreement for the caller to print.
    """
    total = len(a.token_ids)
    if len(b.token_ids) != total:
        raise AssertionError(f"{names[0]} has {total} tokens, {names[1]} {len(b.token_ids)}")
    deltas = matched_logprob_deltas(a.token_ids, a.logprobs, b.token_ids, b.logprobs)
    matched = len(deltas)
    shown = f"\n{names[0]}: {list(a.token_ids)}\n{names[1]}: {list(b.token_ids)}"
    if matched < min_matched:
        raise AssertionError(f"only {matched} leading tokens equal, < {min_matched}:{shown}")
    worst = max(deltas, default=0.0)
    if worst > logprob_abs:
        step = deltas.index(worst)
        raise AssertionError(
            f"step {step}: same token, |logprob delta| {worst:.4f} > {logprob_abs}:{shown}"
        )
    if matched == total:
        return Agreement(matched, total, worst, None)
    gaps = []
    for (name, run), other in zip(((names[0], a), (names[1], b)), (b, a), strict=True):
        top = run.top_logprobs[matched]
        chosen, rival = run.token_ids[matched], other.token_ids[matched]
        if rival not in top:
            raise AssertionError(
                f"step {matched}: {name}'s top {len(top)} {dict(top)} lacks the other side's "
                f"token {rival}: not a near-tie{shown}"
            )
        gap = float(top[chosen]) - float(top[rival])
        if gap > logprob_abs:
            raise AssertionError(
                f"step {matched}: {name} prefers {chosen} over {rival} by {gap:.4f} > "
                f"{logprob_abs}: not a near-tie{shown}"
            )
        gaps.append(gap)
    return Agreement(matched, total, worst, (gaps[0], gaps[1]))


def check_resumed_agreement(
    cold: Scored, resumed: Scored, tolerances: Mapping[str, Any], names: tuple[str, str]
) -> Agreement:
    """A run that resumed from cached block-boundary state (a prefix-cache hit, blocks restored
    from an offload) against the cold run: check_greedy_agreement with the profile's
    repeat_matching_prefix_tokens and repeat_logprob_abs."""
    return check_greedy_agreement(
        cold,
        resumed,
        min_matched=int(tolerances["repeat_matching_prefix_tokens"]),
        logprob_abs=float(tolerances["repeat_logprob_abs"]),
        names=names,
    )
