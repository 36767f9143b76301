"""Comparisons of engine outputs and cache pages, with failure messages that say what differed.

Pure Python (numpy arrays, torch tensors or nested lists in; floats out), so the unit tests can
feed them hand-made data without vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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


# --- greedy outputs judged against the engine's own noise ------------------------------------
#
# The rule, for two greedy runs of one prompt (the reference and the run under test):
# 1. The noise floor is measured in the same run: the reference done twice, as vLLM would serve
#    it twice. Its worst difference (over every candidate both runs scored, at every step both
#    runs saw the same tokens, and the gaps where they part) is what the engine does to itself.
# 2. The tolerance is that floor plus one step of the logits: the spacing of the bf16 numbers
#    the logits are (read off the candidates' own differences: logprobs of one step differ
#    exactly as their logits do). A tolerance below the floor would fail the engine against
#    itself; one step above it is the smallest difference a bf16 logit can show.
# 3. The run under test agrees when, at every step where both runs have seen the same tokens,
#    every candidate both scored is within the tolerance; and where the greedy tokens part, each
#    side's token is among the other's candidates and loses there by at most the tolerance (a
#    near-tie, as in vLLM's check_logprobs_close). After a parting the inputs differ and
#    nothing more is compared.
# 4. A negative control (a run that differs in exactly what the test guards) must be rejected
#    by the same rule with the same tolerance, or the comparison proves nothing.

BF16_STORED_MANTISSA_BITS = 7
# How closely a difference must sit on a multiple of the spacing to count as one: the logprobs
# are fp32 values of magnitude < 100, whose rounding is below 1e-5.
_ON_GRID = 1e-3


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at |value| (their step there)."""
    if value == 0.0 or not math.isfinite(value):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - BF16_STORED_MANTISSA_BITS)


def _on_grid(differences: list[float], spacing: float) -> bool:
    return all(abs(d / spacing - round(d / spacing)) <= _ON_GRID for d in differences)


def logit_step(*outputs: Scored) -> float:
    """One step of the logits the outputs' candidates were scored from.

    The logprobs of one step differ exactly as their logits do, so the candidates' differences
    sit on the grid of the bf16 numbers the logits are: the step is the largest power of two
    that the differences of at least half of the steps are whole multiples of (a step whose
    candidates straddle a binade, or happen to sit on a coarser grid, does not decide it).
    Logits that are no bf16 numbers fall back to one bf16 step at the chosen logprobs' median
    magnitude.
    """
    steps = [
        [max(top.values()) - v for v in top.values() if max(top.values()) - v > 0]
        for output in outputs
        for top in output.top_logprobs
    ]
    steps = [d for d in steps if d]
    for exponent in range(4, -17, -1):
        spacing = 2.0**exponent
        if steps and 2 * sum(_on_grid(d, spacing) for d in steps) >= len(steps):
            return spacing
    magnitudes = sorted(abs(v) for output in outputs for v in output.logprobs)
    return bf16_step(magnitudes[len(magnitudes) // 2]) if magnitudes else 0.0


@dataclass(frozen=True)
class Agreement:
    """How two greedy runs of one prompt compare under a tolerance."""

    matched: int  # equal leading tokens
    total: int
    worst_delta: float  # over every candidate both runs scored, up to and including a parting
    tolerance: float
    parting_gaps: tuple[float, float] | None  # where they part: each side's loss to the other

    @property
    def compared_steps(self) -> int:
        return self.matched + (1 if self.parting_gaps is not None else 0)

    def describe(self) -> str:
        text = f"{self.matched} of {self.total} tokens equal, worst |delta| "
        text += f"{self.worst_delta:.4f} (tolerance {self.tolerance:.4f})"
        if self.parting_gaps is not None:
            text += f"; they part at step {self.matched} at a near-tie (gaps "
            text += f"{self.parting_gaps[0]:.4f} / {self.parting_gaps[1]:.4f})"
        return text


def _judge(
    a: Scored, b: Scored, tolerance: float, names: tuple[str, str]
) -> tuple[Agreement | None, str]:
    """(the agreement, "") when b agrees with a under `tolerance`, else (None, the first rule
    that broke, with the step and the values)."""
    total = len(a.token_ids)
    if len(b.token_ids) != total:
        return None, f"{names[0]} has {total} tokens, {names[1]} {len(b.token_ids)}"
    worst = 0.0
    for step in range(total):
        top_a, top_b = a.top_logprobs[step], b.top_logprobs[step]
        for candidate in sorted(set(top_a) & set(top_b)):
            delta = abs(float(top_a[candidate]) - float(top_b[candidate]))
            if delta > tolerance:
                return None, (
                    f"step {step}: token {candidate} scores {top_a[candidate]:.4f} in "
                    f"{names[0]} and {top_b[candidate]:.4f} in {names[1]}: |delta| "
                    f"{delta:.4f} > tolerance {tolerance:.4f}"
                )
            worst = max(worst, delta)
        token_a, token_b = a.token_ids[step], b.token_ids[step]
        if token_a == token_b:
            continue
        gaps = []
        for name, top, chosen, rival in (
            (names[0], top_a, token_a, token_b),
            (names[1], top_b, token_b, token_a),
        ):
            if rival not in top or chosen not in top:
                return None, (
                    f"step {step}: {name}'s candidates {dict(top)} lack the other side's token "
                    f"{rival}: not a near-tie"
                )
            gap = float(top[chosen]) - float(top[rival])
            if gap > tolerance:
                return None, (
                    f"step {step}: {name} prefers {chosen} over {rival} by {gap:.4f} > "
                    f"tolerance {tolerance:.4f}: not a near-tie"
                )
            gaps.append(gap)
            worst = max(worst, gap)
        return Agreement(step, total, worst, tolerance, (gaps[0], gaps[1])), ""
    return Agreement(total, total, worst, tolerance, None), ""


def _shown(a: Scored, b: Scored, names: tuple[str, str]) -> str:
    return f"\n{names[0]}: {list(a.token_ids)}\n{names[1]}: {list(b.token_ids)}"


@dataclass(frozen=True)
class NoiseFloor:
    """The engine against itself: the reference run done twice on one prompt."""

    worst: float  # the largest difference of the two runs (candidates, and gaps at a parting)
    step: float  # one step of the logits (logit_step)
    agreement: Agreement  # how the two runs compared
    # Steps a run computed along another path may differ by beyond the floor (a measured
    # profile value: e.g. D recomputing a prompt's last token alone over KV it was sent).
    path_steps: int = 0
    # The floor is one sample (the largest difference of one pair of runs) of a spread that
    # varies from pair to pair where the engine is not bitwise reproducible (the GPU): the
    # tolerance takes it times this measured profile value. Without effect on a zero floor.
    factor: float = 1.0

    @property
    def tolerance(self) -> float:
        return self.factor * self.worst + (1 + self.path_steps) * self.step

    def across_path(self, steps: int) -> NoiseFloor:
        """The floor for a run computed along another path, allowed `steps` more logit steps."""
        if steps < 0:
            raise ValueError(f"path steps must be >= 0, not {steps}")
        return replace(self, path_steps=steps)

    def with_factor(self, factor: float) -> NoiseFloor:
        """The floor whose tolerance takes its worst difference `factor` times (>= 1)."""
        if not factor >= 1.0:
            raise ValueError(f"a floor factor must be >= 1, not {factor}")
        return replace(self, factor=factor)

    def describe(self) -> str:
        path = f" + {self.path_steps} path step(s)" if self.path_steps else ""
        times = f"{self.factor:g} x " if self.factor != 1.0 else ""
        return (
            f"{times}noise floor {self.worst:.4f} + one logit step {self.step:.4f}{path} = tolerance "
            f"{self.tolerance:.4f} ({self.agreement.matched} of {self.agreement.total} tokens "
            "equal between the two runs)"
        )


def noise_floor(first: Scored, second: Scored, names: tuple[str, str] = ("a", "a'")) -> NoiseFloor:
    """Measure the noise floor from the reference run done twice. The two runs must part, if at
    all, where both sides' tokens are among the other's candidates: a request served twice that
    parts at a token the other run did not even score is no noise but a broken engine."""
    agreement, broken = _judge(first, second, math.inf, names)
    if agreement is None:
        raise AssertionError(
            f"the reference run done twice: {broken}{_shown(first, second, names)}"
        )
    return NoiseFloor(agreement.worst_delta, logit_step(first, second), agreement)


def check_agreement(
    reference: Scored, run: Scored, floor: NoiseFloor, names: tuple[str, str]
) -> Agreement:
    """`run` agrees with `reference` under the floor's tolerance (the rule above), or an
    AssertionError says which rule broke."""
    agreement, broken = _judge(reference, run, floor.tolerance, names)
    if agreement is None:
        raise AssertionError(f"{broken} ({floor.describe()}){_shown(reference, run, names)}")
    return agreement


def check_rejected(
    reference: Scored, control: Scored, floor: NoiseFloor, names: tuple[str, str]
) -> str:
    """A negative control must fail the same rule under the same tolerance; returns why it
    failed. When it passes, the comparison cannot tell the defect it guards from noise."""
    agreement, broken = _judge(reference, control, floor.tolerance, names)
    if agreement is not None:
        raise AssertionError(
            f"the negative control {names[1]!r} passes the comparison with {names[0]!r} "
            f"({agreement.describe()}): the check cannot tell what it guards from noise"
            f"{_shown(reference, control, names)}"
        )
    return broken


def margins(output: Scored) -> list[float]:
    """Per step, by how much the chosen token beats the best other candidate (inf when no other
    candidate was scored)."""
    found = []
    for token, top in zip(output.token_ids, output.top_logprobs, strict=True):
        others = [float(v) for t, v in top.items() if t != token]
        found.append(float(top[token]) - max(others) if others else math.inf)
    return found


@dataclass(frozen=True)
class Decisiveness:
    """How clearly an output's greedy choices win, in steps of its logits."""

    median_steps: float
    least_steps: float
    ties: int  # steps won by no margin at all: the choice is the tie-break's

    def describe(self) -> str:
        return (
            f"greedy margins: median {self.median_steps:.1f} logit steps, least "
            f"{self.least_steps:.1f}, {self.ties} exact tie(s)"
        )


def check_decisive(output: Scored, step: float, min_median_steps: float, what: str) -> Decisiveness:
    """Fail unless the output's greedy choices win by a median of at least `min_median_steps`
    logit steps: on flat outputs, whose choices are decided by the tie-break and by one step of
    noise, a comparison of greedy runs is weak whatever its rule."""
    if step <= 0:
        raise ValueError(f"logit step {step} must be > 0")
    in_steps = sorted(m / step for m in margins(output))
    if not in_steps:
        raise AssertionError(f"{what} has no steps")
    found = Decisiveness(
        median_steps=in_steps[len(in_steps) // 2],
        least_steps=in_steps[0],
        ties=sum(1 for m in in_steps if m <= _ON_GRID),
    )
    if not found.median_steps >= min_median_steps:
        raise AssertionError(
            f"{what} is flat: {found.describe()} < {min_median_steps} (median): its greedy "
            "choices are decided by noise, so comparing greedy runs of it proves little"
        )
    return found


def decisive_step(output: Scored, tolerance: float) -> int | None:
    """The first step whose greedy choice wins by more than `tolerance` and whose token was not
    chosen before: where a control can accept the runner-up instead (what a broken verification
    of drafted tokens does) and be told apart from noise. None when no step qualifies."""
    seen: set[int] = set()
    for step, (token, margin) in enumerate(zip(output.token_ids, margins(output), strict=True)):
        if margin > tolerance and token not in seen and math.isfinite(margin):
            return step
        seen.add(token)
    return None
