"""Comparisons of engine outputs and cache pages, with failure messages that say what differed.

Pure Python (numpy arrays, torch tensors or nested lists in; floats out), so the unit tests can
feed them hand-made data without vLLM.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from glm5_matrix.verdicts import false_red


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

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> GreedyOutput:
        """One output as a cell's outputs.json holds it (results.recorder.scored_json, whose
        candidate ids are strings, as JSON keys must be)."""
        return cls(
            [int(t) for t in entry["token_ids"]],
            [float(v) for v in entry["logprobs"]],
            [{int(t): float(v) for t, v in step.items()} for step in entry["top_logprobs"]],
            entry.get("cached_tokens"),
        )


# --- greedy outputs judged against the engine's own noise ------------------------------------
#
# The rule, for greedy runs of one prompt (the reference and the run under test); docs/verdicts.md
# explains each step and the false-red bound:
# 1. The noise is measured in the same run, as a distribution: the reference done N times, as
#    vLLM would serve it N times. For each of the N (N - 1) / 2 pairs, its worst difference (over
#    every candidate both runs scored, at every step both runs saw the same tokens, and the gaps
#    where they part) is one sample of what the engine does to itself.
# 2. The tolerance comes from reference #1's row (its worst differences to the other N - 1 runs:
#    given reference #1, independent draws of what a faithful run under test would show) by
#    glm5_matrix.verdicts.false_red.tail_tolerance: the row's median plus an exponential tail
#    extrapolated from the excesses above it (a value tied with the median counted half a step
#    above it: the values sit on the logits' grid), to the comparison's share of the cell's
#    false-red budget, plus one step of the logits (the spacing of the bf16 numbers the logits
#    are, read off the candidates' own differences: a tolerance below it would count rounding as
#    a defect). A bitwise engine (as on the CPU build) gets one step. The rule's false-red rate
#    is then measured on the same runs (leave-one-out: false_red.measure, run by judging).
# 3. Logprobs are judged where the noise has no heavy tail: at one step, the prefill's own
#    output (judging.prefill_step). The run under test agrees when, at every step where both
#    runs have seen the same tokens, every candidate both scored is within the tolerance; and
#    where the greedy tokens part, each side's token is among the other's candidates and loses
#    there by at most the tolerance (a near-tie, as in vLLM's check_logprobs_close). After a
#    parting the inputs differ and nothing more is compared. agreement_threshold is the least
#    tolerance that accepts a run. Over a whole run the GPU's decode steps add a heavier tail
#    (on the H100 one run in 20 to 30 jumps by 0.3 to 0.5 nats at a decode step: the sparse
#    indexer's top-k flipping), which a row of 29 cannot bound: there logprobs are recorded.
# 4. A negative control (a run that differs in exactly what the test guards) must be rejected
#    by the same rule with the same tolerance, and by a wide margin: its power, the least
#    tolerance at which the rule would accept it over the tolerance (inf where one side's token
#    is unscored by the other: no tolerance accepts it), must reach the profile's min_power: the
#    control stays rejected under a tolerance min_power times wider, at the step that decides.
# 5. Whole runs are judged by their TOKENS (check_tokens): greedy decoding of the same model is
#    deterministic up to the noise, and greedy speculative decoding is lossless, so the run
#    must choose the reference's token at every step until they first part, and that parting
#    must be a near-tie on both sides within the bound of its step: the tail tolerance of how
#    far reference #1's runs moved one candidate's score against another's over the steps up to
#    it (accumulated_spread, NoiseFloor.bounds; early steps are judged against their own smaller
#    noise), each step at its share of the comparison's (the union bound over the step a run
#    first parts at). Along another path (along_path: a drafter's verification pass, other TP
#    sizes, P->D's kernels) the run's own scores carry that path's rounding, which the
#    reference's repeats cannot show: there only the reference's side is judged (the tokens
#    must be equal wherever the reference is decisive), its bar also what the two runs' scores
#    already differed by at the steps before, on the same tokens.
#    token_threshold is what the bound must cover for the run to be accepted. Logprob
#    differences are recorded, never bounded by a constant. Runs whose arithmetic is the
#    reference's own are compared bitwise (check_exact).

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


def accumulated_spread(a: Scored, b: Scored) -> list[float]:
    """Per step s of `a`, the most the two runs moved one candidate's score against another's
    over the steps up to s: at each step the spread of their differences over the candidates
    both scored (the largest difference less the smallest), while they saw the same tokens and
    at the step they part (inf there where a side's token is unscored by the other, or `b`
    ended); after a parting nothing more is measured (the inputs differ), so the value stays.
    A token changes where one candidate's score passes another's: what can do that is the
    change of their difference, not of either score (a shift common to every candidate, as the
    log-sum-exp moves them, changes no token). Where two faithful runs part, each side's gap is
    at most this spread at that step (the two gaps sum to the change of the two tokens'
    difference), so the token rule's bound of a step, a tail bound of this over the reference's
    runs, covers a faithful parting (NoiseFloor.bounds)."""
    found, worst, parted = [], 0.0, False
    for step in range(len(a.token_ids)):
        if not parted:
            if step >= len(b.token_ids):
                worst, parted = math.inf, True
            else:
                top_a, top_b = a.top_logprobs[step], b.top_logprobs[step]
                moved = [float(top_a[c]) - float(top_b[c]) for c in set(top_a) & set(top_b)]
                if moved:
                    worst = max(worst, max(moved) - min(moved))
                token_a, token_b = a.token_ids[step], b.token_ids[step]
                if token_a != token_b:
                    parted = True
                    both = {token_a, token_b}
                    if not (both <= set(top_a) and both <= set(top_b)):
                        worst = math.inf
        found.append(worst)
    return found


def _shown(a: Scored, b: Scored, names: tuple[str, str]) -> str:
    return f"\n{names[0]}: {list(a.token_ids)}\n{names[1]}: {list(b.token_ids)}"


@dataclass(frozen=True)
class NoiseFloor:
    """The engine against itself: the reference run done N times on one prompt, every pair of
    the N compared (the rule above, points 1 and 2)."""

    pair_worsts: tuple[float, ...]  # per pair (i < j, in order), its worst difference
    step: float  # one step of the logits (logit_step)
    runs: int  # N
    least_matched: int  # the fewest equal leading tokens of any pair
    total: int  # tokens per run
    share: float  # the false-red rate the tolerance allows (false_red.Budget.share)
    # Per pair (as pair_worsts), the most it moved one candidate's score against another's over
    # the steps up to each step (accumulated_spread); empty for a hand-built floor (then every
    # step's bound is the tolerance).
    pair_steps: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.pair_worsts:
            raise ValueError("a noise floor needs at least one pair of runs")
        if not self.runs * (self.runs - 1) // 2 == len(self.pair_worsts):
            raise ValueError(f"{len(self.pair_worsts)} pair(s) from {self.runs} runs")
        if self.pair_steps and len(self.pair_steps) != len(self.pair_worsts):
            raise ValueError(f"{len(self.pair_steps)} per-step rows for {self.pairs} pair(s)")

    @property
    def pairs(self) -> int:
        return len(self.pair_worsts)

    @property
    def row(self) -> tuple[float, ...]:
        """Reference #1's worst differences to the other runs (the pairs (0, j) come first)."""
        return self.pair_worsts[: self.runs - 1]

    def matrix(self) -> list[list[float]]:
        """Every pair's worst difference as an N x N symmetric matrix (0 on the diagonal)."""
        found = [[0.0] * self.runs for _ in range(self.runs)]
        pairs = iter(self.pair_worsts)
        for i in range(self.runs):
            for j in range(i + 1, self.runs):
                found[i][j] = found[j][i] = next(pairs)
        return found

    def matrix_steps(self) -> list[list[tuple[float, ...]]]:
        """Every pair's spread up to each step (accumulated_spread), N x N x total (zeros on
        the diagonal); each step the whole run's worst where the floor has no per-step rows."""
        steps = self.pair_steps or tuple((w,) * self.total for w in self.pair_worsts)
        zero = (0.0,) * self.total
        found = [[zero] * self.runs for _ in range(self.runs)]
        pairs = iter(steps)
        for i in range(self.runs):
            for j in range(i + 1, self.runs):
                found[i][j] = found[j][i] = next(pairs)
        return found

    @property
    def row_steps(self) -> list[list[float]]:
        """Per step s, reference #1's spreads to the other runs over the steps up to s
        (accumulated_spread; two runs: with the floor of the differences, 0, as for the
        tolerance)."""
        first = self.matrix_steps()[0][1:]
        rows = [[pair[s] for pair in first] for s in range(self.total)]
        return [row if len(row) >= false_red.MIN_ROW else [*row, 0.0] for row in rows]

    @property
    def bounds(self) -> tuple[float, ...]:
        """The token rule's tolerance at each step (rule point 5): false_red.step_bounds over
        row_steps, each step at its share of the comparison's (the union bound over the steps
        a run may first part at); the tolerance at every step for a hand-built floor. For one
        step, the tolerance itself."""
        if not self.pair_steps:
            return (self.tolerance,) * self.total
        return tuple(false_red.step_bounds(self.row_steps, self.step, self.share))

    @property
    def worst(self) -> float:
        """The largest pairwise worst difference."""
        return max(self.pair_worsts)

    @property
    def least(self) -> float:
        return min(self.pair_worsts)

    @property
    def median(self) -> float:
        return statistics.median(self.pair_worsts)

    @property
    def spread(self) -> float:
        """The distribution's range: its largest pairwise worst difference less its smallest."""
        return self.worst - self.least

    @property
    def tolerance(self) -> float:
        """false_red.tail_tolerance over reference #1's row (two runs: the one difference, with
        the floor of the differences, 0, as the threshold)."""
        row = self.row if len(self.row) >= false_red.MIN_ROW else (*self.row, 0.0)
        return false_red.tail_tolerance(row, self.step, self.share)

    def in_steps(self, value: float) -> float:
        return value / self.step if self.step else 0.0

    def describe(self) -> str:
        return (
            f"{self.runs} runs, {self.pairs} pair(s): worst |delta| per pair min "
            f"{self.least:.4f} / median {self.median:.4f} / max {self.worst:.4f} (max "
            f"{self.in_steps(self.worst):.1f} logit steps of {self.step:.4g}); tolerance "
            f"{self.tolerance:.4f} ({self.in_steps(self.tolerance):.1f} steps) from reference "
            f"#1's {len(self.row)} difference(s) (median {statistics.median(self.row):.4f}, max "
            f"{max(self.row):.4f}), its tail bounded at a false-red share of {self.share:.3g} "
            f"(every pair equal in at least {self.least_matched} of {self.total} tokens)"
        )


def noise_spread(runs: Sequence[Scored], names: Sequence[str], share: float) -> NoiseFloor:
    """Measure the noise from the reference run done N >= 2 times: every pair compared with no
    bound. Two runs must part, if at all, where both sides' tokens are among the other's
    candidates: a request served twice that parts at a token the other run did not even score
    is no noise but a broken engine. `share`: the comparison's false-red share."""
    if len(runs) < 2:
        raise ValueError(f"the noise needs the reference at least twice, not {len(runs)} run(s)")
    if len(names) != len(runs):
        raise ValueError(f"{len(names)} name(s) for {len(runs)} runs")
    worsts, matched, steps = [], [], []
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            pair = (names[i], names[j])
            agreement, broken = _judge(runs[i], runs[j], math.inf, pair)
            if agreement is None:
                raise AssertionError(
                    f"the reference run done {len(runs)} times: {broken}"
                    f"{_shown(runs[i], runs[j], pair)}"
                )
            worsts.append(agreement.worst_delta)
            matched.append(agreement.matched)
            steps.append(tuple(accumulated_spread(runs[i], runs[j])))
    return NoiseFloor(
        tuple(worsts),
        logit_step(*runs),
        len(runs),
        min(matched),
        len(runs[0].token_ids),
        share,
        tuple(steps),
    )


def noise_floor(
    first: Scored, second: Scored, names: tuple[str, str] = ("a", "a'"), share: float = 0.0005
) -> NoiseFloor:
    """The noise of one pair of runs (noise_spread of two; the unit tests' floor)."""
    return noise_spread([first, second], names, share)


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


def unbounded_worst(reference: Scored, control: Scored) -> float:
    """The worst difference by the rule's measure with no bound (every candidate both scored up
    to and including a parting, and the gaps there); inf only where one side's token is unscored
    by the other at the parting (no gap to measure) or the lengths differ."""
    agreement, _ = _judge(reference, control, math.inf, ("reference", "control"))
    return math.inf if agreement is None else agreement.worst_delta


def control_delta(reference: Scored, control: Scored, tolerance: float) -> float:
    """How far a control is from the reference by the rule's measure with no bound: the worst
    difference over every candidate both scored up to and including a parting, or inf where
    they part at a step that is no near-tie under `tolerance` (either side's token unscored by
    the other, or preferred by more than the tolerance): a token of its own, told apart by any
    tolerance. Power = this / the tolerance."""
    agreement, _ = _judge(reference, control, math.inf, ("reference", "control"))
    if agreement is None:
        return math.inf
    if agreement.parting_gaps is not None and max(agreement.parting_gaps) > tolerance:
        return math.inf
    return agreement.worst_delta


@dataclass(frozen=True)
class Threshold:
    """The least tolerance at which a rule accepts a run against the reference (inf: none
    does), and the step that decides it: where a tolerance just below it rejects the run."""

    value: float
    step: int | None

    def power(self, tolerance: float) -> float:
        """How many times the tolerance the run stays rejected by: value / tolerance."""
        if math.isinf(self.value):
            return math.inf
        return self.value / tolerance if tolerance > 0 else math.inf

    def power_at(self, bounds: Bounds) -> float:
        """The power against per-step bounds: value over the bound of the step that decides
        (0 where nothing decides: the run is accepted at any bound)."""
        if self.step is None:
            return 0.0
        return self.power(_bound_at(bounds, self.step))


def agreement_threshold(reference: Scored, run: Scored) -> Threshold:
    """The least tolerance at which check_agreement accepts `run` (rule point 3): its worst
    difference over every candidate both scored up to and including a parting, and the gaps
    there; inf where the lengths differ or a side's token is unscored by the other at the
    parting (no tolerance accepts it)."""
    total = len(reference.token_ids)
    if len(run.token_ids) != total:
        return Threshold(math.inf, None)
    worst, at = 0.0, None
    for step in range(total):
        top_a, top_b = reference.top_logprobs[step], run.top_logprobs[step]
        for candidate in set(top_a) & set(top_b):
            delta = abs(float(top_a[candidate]) - float(top_b[candidate]))
            if delta > worst:
                worst, at = delta, step
        token_a, token_b = reference.token_ids[step], run.token_ids[step]
        if token_a == token_b:
            continue
        for top, chosen, rival in ((top_a, token_a, token_b), (top_b, token_b, token_a)):
            if rival not in top or chosen not in top:
                return Threshold(math.inf, step)
            gap = float(top[chosen]) - float(top[rival])
            if gap > worst:
                worst, at = gap, step
        break
    return Threshold(worst, at)


Bounds = float | Sequence[float]  # one tolerance, or one per step


def _bound_at(bounds: Bounds, step: int) -> float:
    return float(bounds) if isinstance(bounds, int | float) else float(bounds[step])


@dataclass(frozen=True)
class Parting:
    """Where two greedy runs first choose other tokens: each side's preference for its own
    token over the other's (its gap; inf where that token is unscored by the side, or the run
    under test ended there), and, along another path, the largest difference the two showed at
    the steps before it on the same tokens."""

    step: int
    chosen: tuple[int | None, int | None]  # the reference's token, the run's (None: it ended)
    gaps: tuple[float, float]
    before: float  # the largest step_deltas before it

    @property
    def gap(self) -> float:
        return max(self.gaps)


def first_parting(reference: Scored, run: Scored) -> Parting | None:
    """The first step where `run` chooses another token than `reference` (or has ended), or
    None where it chose every one of the reference's tokens."""
    shared = equal_prefix(reference, run)
    if shared >= len(reference.token_ids):
        return None
    before = max(step_deltas(reference, run, shared), default=0.0)
    if shared >= len(run.token_ids):
        return Parting(shared, (reference.token_ids[shared], None), (math.inf, math.inf), before)
    top_a, top_b = reference.top_logprobs[shared], run.top_logprobs[shared]
    token_a, token_b = reference.token_ids[shared], run.token_ids[shared]
    gaps = []
    for top, chosen, rival in ((top_a, token_a, token_b), (top_b, token_b, token_a)):
        known = chosen in top and rival in top
        gaps.append(float(top[chosen]) - float(top[rival]) if known else math.inf)
    return Parting(shared, (token_a, token_b), (gaps[0], gaps[1]), before)


def token_threshold(reference: Scored, run: Scored, along_path: bool = False) -> Threshold:
    """What check_tokens compares with the bound of the step that decides (rule point 5): the
    gap judged where the runs first part (_judged_gap: inf where a side's token is unscored by
    the other or the run ended, no bound accepts it), at that step; 0 where they never part,
    or, along a path, where that gap lies within what the paths moved the scores by before it
    (no bound rejects it). The run is accepted iff value <= the bound at `step`; its power
    against a control is value / that bound."""
    parting = first_parting(reference, run)
    if parting is None:
        return Threshold(0.0, None)
    judged = _judged_gap(parting, along_path)
    if along_path and judged <= parting.before:
        return Threshold(0.0, parting.step)
    return Threshold(judged, parting.step)


def _judged_gap(parting: Parting, along_path: bool) -> float:
    """What the bound must cover at a parting: the larger of the two sides' preferences on one
    path; along another path the reference's alone (the run's carries the path's rounding),
    unless a side did not score the other's token at all (inf: no near-tie on any path)."""
    if along_path and not math.isinf(parting.gap):
        return parting.gaps[0]
    return parting.gap


def check_exact(a: Scored, b: Scored, names: tuple[str, str]) -> int:
    """`b` is `a` bit for bit: the same tokens, the same candidates, and every candidate's
    logprob (and the chosen one's) the same float at every step. Returns the steps compared;
    an AssertionError names the first step and candidate that differ."""
    total = len(a.token_ids)
    if len(b.token_ids) != total:
        raise AssertionError(f"{names[0]} has {total} tokens, {names[1]} {len(b.token_ids)}")
    for step in range(total):
        token_a, token_b = a.token_ids[step], b.token_ids[step]
        if token_a != token_b:
            raise AssertionError(
                f"step {step}: {names[0]} chose {token_a}, {names[1]} {token_b}"
                f"{_shown(a, b, names)}"
            )
        top_a, top_b = a.top_logprobs[step], b.top_logprobs[step]
        if set(top_a) != set(top_b):
            raise AssertionError(
                f"step {step}: candidates {sorted(top_a)} in {names[0]}, {sorted(top_b)} in "
                f"{names[1]}"
            )
        chosen = {token_a: (float(a.logprobs[step]), float(b.logprobs[step]))}
        both = {t: (float(top_a[t]), float(top_b[t])) for t in sorted(top_a)}
        for candidate, (x, y) in (*chosen.items(), *both.items()):
            if x != y and not (math.isnan(x) and math.isnan(y)):
                raise AssertionError(
                    f"step {step}: token {candidate} scores {x!r} in {names[0]} and {y!r} in "
                    f"{names[1]} (|delta| {abs(x - y):.3g}): not bitwise equal"
                )
    return total


@dataclass(frozen=True)
class TokenAgreement:
    """How a run's greedy tokens compared with the reference's (rule point 5)."""

    compared: int  # equal leading tokens (all of them where the runs never part)
    total: int
    parted_at: int | None = None  # where they part, at a near-tie within the bound there
    gaps: tuple[float, float] | None = None  # each side's preference for its own token there
    bound: float | None = None  # the bound there (along a path: or what the paths moved before)

    def describe(self) -> str:
        text = f"{self.compared} of {self.total} tokens equal"
        if self.parted_at is not None and self.gaps is not None and self.bound is not None:
            text += (
                f"; they part at step {self.parted_at} at a near-tie within the noise up to it "
                f"(gaps {self.gaps[0]:.4f} / {self.gaps[1]:.4f} <= {self.bound:.4f}; from there "
                "the inputs differ and nothing more is compared)"
            )
        return text


def check_tokens(
    reference: Scored,
    run: Scored,
    bounds: Bounds,
    names: tuple[str, str],
    along_path: bool = False,
) -> TokenAgreement:
    """`run` chooses `reference`'s token at every step, until they first part, which must be a
    near-tie on both sides within the bound of that step (`bounds`: the reference's own noise
    up to each step, NoiseFloor.bounds; one float for every step): each side's token among the
    other's candidates and preferred by it by no more than the bound. Greedy decoding of the
    same model chooses the same wherever the reference wins by more than its noise; after a
    parting the inputs differ and nothing more is compared. With `along_path` (the run computes
    along another path: a drafter's verification pass of other shapes, other TP sizes summing
    their partial products in another order, P->D's kernels; rounding the reference's repeats
    cannot show) only the reference's preference is judged at the parting (the run's carries
    the path's rounding: where the reference ties, the run may prefer its token by more than the
    reference's noise), and its bar is also at least the largest difference the two runs showed
    at the steps before it, on the same tokens; the parting step's own difference never raises
    it. A token one side did not score is no near-tie on any path. An AssertionError names a
    parting at a decisive step, an unscored token, or a run that ended early."""
    total = len(reference.token_ids)
    parting = first_parting(reference, run)
    if parting is None:
        return TokenAgreement(total, total)
    step, (chosen, other) = parting.step, parting.chosen
    bound = _bound_at(bounds, step)
    if not bound >= 0.0:
        raise ValueError(f"bound {bound} at step {step} must be >= 0")
    bar = max(bound, parting.before) if along_path else bound
    path = (
        f", the paths' own difference before it {parting.before:.4f}"
        if along_path and parting.before > bound
        else ""
    )
    if other is None:
        raise AssertionError(
            f"{names[1]} has {len(run.token_ids)} tokens; {names[0]} has {total}, equal up to "
            f"there{_shown(reference, run, names)}"
        )
    if math.isinf(parting.gap):
        raise AssertionError(
            f"step {step}: {names[0]} chose {chosen}, {names[1]} {other}, a token the other "
            f"side did not score ({names[0]}: {dict(reference.top_logprobs[step])}, "
            f"{names[1]}: {dict(run.top_logprobs[step])}): not a near-tie"
            f"{_shown(reference, run, names)}"
        )
    if _judged_gap(parting, along_path) > bar:
        tags = (" (judged)", " (its path's, recorded)") if along_path else ("", "")
        raise AssertionError(
            f"step {step}: {names[0]} chose {chosen}, {names[1]} {other}, where {names[0]} "
            f"wins by {parting.gaps[0]:.4f}{tags[0]} and {names[1]} by {parting.gaps[1]:.4f}"
            f"{tags[1]} > bound {bound:.4f}{path} (a decisive step: greedy decoding of the same model must choose "
            f"the same); {names[1]} scored {dict(run.top_logprobs[step])}"
            f"{_shown(reference, run, names)}"
        )
    return TokenAgreement(step, total, step, parting.gaps, bar)


def equal_prefix(a: Scored, b: Scored) -> int:
    """How many leading tokens the two runs share."""
    shared = 0
    for token_a, token_b in zip(a.token_ids, b.token_ids, strict=False):
        if token_a != token_b:
            break
        shared += 1
    return shared


def step_deltas(reference: Scored, run: Scored, steps: int) -> list[float]:
    """Per step of the first `steps`, the largest |logprob difference| over the candidates both
    runs scored: the distribution a run along another path is recorded with."""
    found = []
    for step in range(steps):
        top_a, top_b = reference.top_logprobs[step], run.top_logprobs[step]
        shared = set(top_a) & set(top_b)
        found.append(max((abs(float(top_a[t]) - float(top_b[t])) for t in shared), default=0.0))
    return found


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


def decisive_step(output: Scored, bounds: Bounds, min_power: float = 1.0) -> int | None:
    """The first step whose greedy choice wins by at least `min_power` times the bound there
    (and by more than the bound) with a token not chosen before: where a control can accept the
    runner-up instead (what a broken verification of drafted tokens does) and be rejected by
    the token rule with that power (a logit_bias against the token steers every step, so it
    must not have been chosen earlier). None when no step qualifies."""
    seen: set[int] = set()
    for step, (token, margin) in enumerate(zip(output.token_ids, margins(output), strict=True)):
        bound = _bound_at(bounds, step)
        fresh = token not in seen and math.isfinite(margin)
        if fresh and margin > bound and margin >= min_power * bound:
            return step
        seen.add(token)
    return None
