"""Greedy outputs compared bit for bit, where the build is deterministic. Pure.

Whether it is comes from the run itself: the reference done N times from an empty cache gave
the same tokens, logprobs and candidates every time (vLLM's CPU build does: every pair 0.0 in
the suites' measurements). There a run along the reference's own path must be identical too,
and anything less is a difference the noise cannot explain; elsewhere (a GPU, whose cold runs
differ among themselves) the suites judge by the noise rule of glm5_matrix.verdicts.judging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def identical(a: Any, b: Any) -> bool:
    """The same tokens, the same logprobs and the same candidates with the same scores."""
    return (
        list(a.token_ids) == list(b.token_ids)
        and list(a.logprobs) == list(b.logprobs)
        and [dict(s) for s in a.top_logprobs] == [dict(s) for s in b.top_logprobs]
    )


def deterministic(runs: Sequence[Any]) -> bool:
    """At least two runs, all identical to the first."""
    return len(runs) >= 2 and all(identical(runs[0], run) for run in runs[1:])


def first_difference(a: Any, b: Any) -> str:
    """Where two outputs first differ, for a message ('' when they are identical)."""
    for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x != y:
            return f"step {step}: token {x} vs {y}"
        if a.logprobs[step] != b.logprobs[step]:
            return f"step {step}: token {x}'s logprob {a.logprobs[step]!r} vs {b.logprobs[step]!r}"
        if dict(a.top_logprobs[step]) != dict(b.top_logprobs[step]):
            return f"step {step}: the candidates' scores differ"
    if len(a.token_ids) != len(b.token_ids):
        return f"lengths {len(a.token_ids)} vs {len(b.token_ids)}"
    return ""


def check_identical(reference: Any, run: Any, names: tuple[str, str]) -> None:
    """`run` must be identical to `reference`; an AssertionError says where it is not."""
    where = first_difference(reference, run)
    if where:
        raise AssertionError(
            f"{names[1]} is not bit for bit {names[0]} on a build whose reference runs are: {where}"
        )
