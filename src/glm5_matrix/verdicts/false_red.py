"""How often a greedy comparison rejects a faithful run (its false-red rate), and the tolerance
that bounds it. Pure Python: numbers in, numbers out (docs/verdicts.md says why each step is so).

The suites judge a run under test against reference #1 of N runs of the reference path, all in
one engine start. Three parts:

1. The tolerance (tail_tolerance). Reference #1's worst differences to the other N - 1 runs
   (its row) are, given reference #1, N - 1 independent draws of what the rule would measure
   on a faithful run under test. The stated noise model: above the row's median (its
   (j + 1)-th largest value, j = floor(M / 2) of M = N - 1) the excesses are exponential with
   an unknown scale (or lighter-tailed). Then a fresh faithful run exceeds
   X_(j+1) + c * S_j, where S_j sums the j largest excesses over X_(j+1), with probability
   exactly (j + 1) / (M + 1) * (1 + c) ** -j, whatever the scale: c is solved for the
   comparison's share of the cell's false-red budget, and one step of the logits is added for
   the grid the values sit on; a value tied with X_(j+1) counts half a step of excess
   (tail_excess: a row's tied upper half is no exponential of scale zero). No constant
   measured on a host enters; more runs mean less extrapolation (a smaller c). The token rule
   judges a run at the step where it first parts from the reference, against a tolerance per
   step (step_bounds: the row of reference #1's spreads up to that step, compare.
   accumulated_spread), each at its share of the comparison's (step_share: the union bound
   over the step a run first parts at).
2. The measurement (measure): leave-one-out over every ordered pair (reference r, held-out h)
   of the K runs: the tolerance from r's row without h (at the step that judges h, for the
   token rule), and h judged by the suite's own rule through what it compares with the
   tolerance (compare.agreement_threshold / token_threshold). Its rate is the rule's measured
   false-red rate at N - 1 runs; resampled_rate does the same for n < K - 1 reference runs,
   by resampling.
3. The self-check (Measurement.tripped). One run of K can only show a rate near 1/K, and one
   outlying run among K is what a faithful engine at the share shows about K times the share
   of cell runs: failing on the point estimate would itself be a false red. So outlying runs
   are counted one at a time, each set aside before the next is sought (a second outlier in
   the reference widens the tolerance the first is judged by: masking), and the check fails
   only at a count that a rule at its share reaches with probability at most the self-check's
   own share (a binomial tail with each run an outlier with probability at most twice the
   share: Markov's inequality on its rejection fraction).

compare_paths is the two-sample comparison of a compared path's runs (several warm runs, say)
with the reference path's own row: a heavier tail on the compared path is a finding, flagged.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The fewest values a row may have: the rule needs j >= 1 excess over a threshold below it.
MIN_ROW = 2
# A held-out run is an outlier when at least this fraction of the references reject it.
OUTLIER_FRACTION = 0.5
# Below this many runs left, no further outlier is sought (a row of MIN_ROW needs 4 runs).
MIN_RUNS_LEFT = MIN_ROW + 2
# The two-sample flag: a compared path whose deltas exceed the reference's own at this level.
PATH_LEVEL = 0.01
PERMUTATIONS = 20000


# --- the budget -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """The cell's false-red budget split over its judged comparisons: each comparison's verdict
    gets `share`, and its self-check as much, so that a cell of at most `comparisons` judged
    comparisons fails a faithful vLLM at most `per_cell` of its runs (a union bound)."""

    per_cell: float  # the bound per cell run, e.g. 0.01
    comparisons: int  # judged comparisons a cell may hold at most

    def __post_init__(self) -> None:
        if not 0.0 < self.per_cell < 1.0:
            raise ValueError(f"false_red_per_cell {self.per_cell} must be in (0, 1)")
        if self.comparisons < 1:
            raise ValueError(f"comparisons_per_cell {self.comparisons} must be >= 1")

    @property
    def share(self) -> float:
        """What one comparison's verdict may spend (and its self-check as much)."""
        return self.per_cell / (2 * self.comparisons)

    @classmethod
    def of(cls, tolerances: Any) -> Budget:
        """The budget a profile's tolerances give (glm5_matrix.matrix.tolerances.Tolerances:
        false_red_per_cell, comparisons_per_cell)."""
        return cls(float(tolerances.false_red_per_cell), int(tolerances.comparisons_per_cell))


# --- the tolerance --------------------------------------------------------------------------------


def tail_parameters(values: int, share: float) -> tuple[int, float]:
    """(j, c) of the rule for a row of `values` (M) numbers at false-red `share`: j = M // 2
    excesses over the (j + 1)-th largest, and the factor c on their sum that makes the
    probability of a fresh draw beyond the tolerance `share` under the model."""
    if values < MIN_ROW:
        raise ValueError(f"a row of {values} value(s): the rule needs at least {MIN_ROW}")
    if not 0.0 < share < 1.0:
        raise ValueError(f"share {share} must be in (0, 1)")
    j = values // 2
    above = (j + 1) / ((values + 1) * share)  # P(beyond X_(j+1)) over the share
    return j, max(0.0, above ** (1.0 / j) - 1.0)


def tail_excess(row: Sequence[float], step: float) -> tuple[float, float]:
    """(X_(j+1), S_j) of the rule over `row`: the (j + 1)-th largest value and the sum of the j
    largest values' excesses over it, a value tied with X_(j+1) (within a quarter step) counted
    half a step above it. The values sit on the logits' grid (`step`), and a tie hides where in
    the step around the threshold a value lay: counting no excess for it reads a row whose upper
    half is one tied value as an exponential of scale zero. On the H100's prefill step most rows
    are such (20 of 28 values at 4 logit steps, 7 at 2; the differences there fall on a grid of
    two steps), and the rule without this rejected 13 of 13050 leave-one-out judgements (a run
    one grid value past the tie), with it none (glm5_matrix.verdicts.replay). A row without
    ties is unchanged; on rounded exponential values the rate only falls (tests/unit/verdicts/
    test_false_red.py). A threshold of zero (at least half the pairs bitwise equal) is exact,
    not rounded: no tie is counted there."""
    j, _ = tail_parameters(len(row), 0.5)
    ordered = sorted(row, reverse=True)
    threshold = ordered[j]
    excess = math.fsum(v - threshold for v in ordered[:j])
    if threshold > step / 4:
        excess += sum(1 for v in ordered[:j] if v - threshold <= step / 4) * step / 2
    return threshold, excess


def tail_tolerance(row: Sequence[float], step: float, share: float) -> float:
    """X_(j+1) + c * S_j + step over `row` (module doc, point 1; tail_excess). A bitwise row
    (all zero) gives one step; a row holding inf (a run that parted at an unscored token) gives
    inf."""
    _, c = tail_parameters(len(row), share)
    if math.isinf(max(row)):
        return math.inf
    threshold, excess = tail_excess(row, step)
    return threshold + c * excess + step


def step_share(share: float, steps: int) -> float:
    """What each of `steps` per-step tolerances may spend of a comparison's `share`: a run is
    judged at whichever step it first parts from the reference, so the steps' tolerances are
    split by the union bound (Bonferroni)."""
    if steps < 1:
        raise ValueError(f"{steps} steps: a comparison has at least one")
    return share / steps


def step_bounds(rows: Sequence[Sequence[float]], step: float, share: float) -> list[float]:
    """The per-step tolerances of a row per step (rows[s]: reference #1's differences to the
    other runs over the steps up to s, compare.accumulated_spread): tail_tolerance of each at
    step_share(share, S), never below an earlier step's. The rows only grow from step to step,
    but a row's tail estimate need not (ties broken at a later step count less excess): a
    value beyond step s's bound is beyond the larger one too, so the running largest keeps each
    step's share and makes the bound the noise accumulated up to the step."""
    each = step_share(share, len(rows))
    found: list[float] = []
    for row in rows:
        found.append(max(tail_tolerance(row, step, each), found[-1] if found else 0.0))
    return found


def exceedance(row: Sequence[float], value: float, step: float) -> float:
    """The model's probability that a faithful run lies beyond `value` given `row`: the share at
    which the rule's tolerance would equal `value` (1 at or below X_(j+1) + step; 0 for inf).
    How far into the tail a run under test sits, in the rule's own terms."""
    j, _ = tail_parameters(len(row), 0.5)
    threshold, excess = tail_excess(row, step)
    if math.isinf(value):
        return 0.0
    beyond = (j + 1) / (len(row) + 1)
    room = value - step - threshold
    if room <= 0.0:
        return 1.0
    if excess <= 0.0:
        return 0.0
    return min(1.0, beyond * (1.0 + room / excess) ** -j)


# --- the measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """The rule's false-red rate measured on K runs of the reference path (module doc, 2, 3)."""

    runs: int  # K
    judged: int  # ordered (reference, held-out) pairs judged: K (K - 1)
    rejected: int  # of those, rejected by the rule built without the held-out run
    rejected_runs: int  # distinct held-out runs rejected at least once
    outliers: tuple[int, ...]  # run indices found outlying, one at a time
    share: float  # the comparison's share (verdict and self-check alike)
    trip_at: int  # outliers that fail the self-check

    @property
    def rate(self) -> float:
        return self.rejected / self.judged if self.judged else 0.0

    @property
    def exceeds_share(self) -> bool:
        """The point estimate is above the share: shown, not failed (one run of K cannot prove
        a rate below about 1/K)."""
        return self.rate > self.share

    @property
    def tripped(self) -> bool:
        return len(self.outliers) >= self.trip_at

    @property
    def resolution(self) -> float:
        """The smallest non-zero rate the measurement can show."""
        return 1.0 / self.judged if self.judged else 1.0

    def describe(self) -> str:
        text = (
            f"leave-one-out over {self.runs} runs: {self.rejected} of {self.judged} held-out "
            f"judgements rejected (rate {self.rate:.4g}, resolution {self.resolution:.2g}; "
            f"share {self.share:.3g}), {self.rejected_runs} run(s) rejected at least once, "
            f"{len(self.outliers)} outlying run(s) (the self-check fails at {self.trip_at})"
        )
        if self.outliers:
            text += f": run(s) {', '.join(f'#{i + 1}' for i in self.outliers)}"
        return text


def binomial_tail(trials: int, p: float, at_least: int) -> float:
    """P(Binomial(trials, p) >= at_least)."""
    if at_least <= 0:
        return 1.0
    if at_least > trials:
        return 0.0
    below = math.fsum(
        math.comb(trials, k) * p**k * (1.0 - p) ** (trials - k) for k in range(at_least)
    )
    return max(0.0, 1.0 - below)


def trip_count(runs: int, share: float) -> int:
    """The fewest outlying runs of `runs` that a rule at false-red `share` shows with probability
    at most `share` (each run outlying with probability at most 2 x share, independently: the
    rule's masking only makes two outliers rarer). Never below 2: one outlier is what the share
    itself predicts about `runs` x share of the time."""
    p = min(1.0, 2.0 * share)
    count = 2
    while count <= runs and binomial_tail(runs, p, count) > share:
        count += 1
    return count


Noise = Sequence[Sequence[Any]]  # K x K: a float per pair, or a sequence per step
# A tolerance from a row, a logit step and a share: tail_tolerance, or another rule replayed
# against it (glm5_matrix.verdicts.replay).
Tail = Callable[[Sequence[float], float, float], float]


def _per_step(noise: Noise) -> list[list[tuple[float, ...]]]:
    """K x K x S: each pair's worst difference per step (one step for a float per pair)."""
    return [[tuple(v) if isinstance(v, Sequence) else (float(v),) for v in row] for row in noise]


@dataclass(frozen=True)
class _Rule:
    """The rule as the measurement replays it: run h held out against reference r is rejected
    when accept_at[r][h] exceeds the tolerance of r's row (without h) at step at_step[r][h]."""

    rows: list[list[tuple[float, ...]]]  # K x K x S
    accept_at: Sequence[Sequence[float]]
    at_step: Sequence[Sequence[int | None]] | None
    step: float
    share: float  # per step: step_share of the comparison's
    tail: Tail

    def rejects(self, r: int, h: int, others: Sequence[int]) -> bool:
        value = self.accept_at[r][h]
        if not value > 0.0:
            return False
        at = self.at_step[r][h] if self.at_step is not None else None
        s = len(self.rows[r][h]) - 1 if at is None else at
        row = [self.rows[r][x][s] for x in others if x not in (r, h)]
        return value > self.tail(row, self.step, self.share)


def _rule(
    noise: Noise,
    accept_at: Sequence[Sequence[float]],
    step: float,
    share: float,
    at_step: Sequence[Sequence[int | None]] | None,
    tail: Tail,
) -> _Rule:
    runs = len(noise)
    if any(len(row) != runs for row in noise) or len(accept_at) != runs:
        raise ValueError("noise and accept_at must be K x K")
    rows = _per_step(noise)
    steps = len(rows[0][1 if runs > 1 else 0])
    return _Rule(rows, accept_at, at_step, step, step_share(share, steps), tail)


def _rejections(rule: _Rule, alive: Sequence[int]) -> dict[int, list[bool]]:
    """{held-out h: [rejected against r, for each other alive r]} under the rule built from the
    alive runs without h."""
    found: dict[int, list[bool]] = {h: [] for h in alive}
    for r in alive:
        for h in alive:
            if h != r:
                found[h].append(rule.rejects(r, h, alive))
    return found


def measure(
    noise: Noise,
    accept_at: Sequence[Sequence[float]],
    step: float,
    share: float,
    at_step: Sequence[Sequence[int | None]] | None = None,
    tail: Tail = tail_tolerance,
) -> Measurement:
    """The rule's false-red rate on K runs (module doc, points 2 and 3). `noise[r][h]`: the
    worst difference of runs r and h by the agreement rule's measure (symmetric; what the
    tolerance is built from), a float, or a sequence per step (the token rule's measure over
    the steps up to each: its per-step tolerances, each at step_share of `share`); `accept_at[r][h]`:
    the value the suite's rule compares with the tolerance when judging h against reference r
    (the noise itself for the agreement rule; the gap where they part for the token rule, 0 where
    nothing can reject it); `at_step[r][h]`: the step whose tolerance judges it (default: the
    last); `tail`: the tolerance of a row (tail_tolerance). K >= MIN_RUNS_LEFT."""
    runs = len(noise)
    if runs < MIN_RUNS_LEFT:
        raise ValueError(f"{runs} runs: leave-one-out needs at least {MIN_RUNS_LEFT}")
    rule = _rule(noise, accept_at, step, share, at_step, tail)
    alive = list(range(runs))
    first = _rejections(rule, alive)
    rejected = sum(sum(v) for v in first.values())
    outliers: list[int] = []
    found = first
    spread = [statistics.median(max(v) for v in row) for row in rule.rows]
    while len(alive) >= MIN_RUNS_LEFT:
        fraction = {h: sum(v) / len(v) for h, v in found.items()}
        worst = max(alive, key=lambda h: (fraction[h], spread[h]))
        if fraction[worst] < OUTLIER_FRACTION:
            break
        outliers.append(worst)
        alive.remove(worst)
        if len(alive) >= MIN_RUNS_LEFT:
            found = _rejections(rule, alive)
    return Measurement(
        runs=runs,
        judged=runs * (runs - 1),
        rejected=rejected,
        rejected_runs=sum(1 for v in first.values() if any(v)),
        outliers=tuple(outliers),
        share=share,
        trip_at=trip_count(runs, share),
    )


def resampled_rate(
    noise: Noise,
    accept_at: Sequence[Sequence[float]],
    step: float,
    share: float,
    reference_runs: int,
    resamples: int = 20000,
    seed: int = 0,
    at_step: Sequence[Sequence[int | None]] | None = None,
    tail: Tail = tail_tolerance,
) -> float:
    """The rate of the rule built from `reference_runs` (n) runs: n of the K runs drawn at random
    (the first drawn is reference #1), one of the others held out and judged, `resamples` times
    (20000 resolve 1e-3 to about +-2e-4). n = K - 1 is measure()'s exhaustive leave-one-out."""
    runs = len(noise)
    if not MIN_ROW + 1 <= reference_runs < runs:
        raise ValueError(f"{reference_runs} reference runs of {runs}: need 3 <= n < K")
    rule = _rule(noise, accept_at, step, share, at_step, tail)
    draw = random.Random(seed)
    rejected = 0
    for _ in range(resamples):
        chosen = draw.sample(range(runs), reference_runs + 1)
        r, h = chosen[0], chosen[-1]
        rejected += rule.rejects(r, h, chosen[:-1])
    return rejected / resamples


# --- a compared path against the reference path ---------------------------------------------------


@dataclass(frozen=True)
class PathComparison:
    """A compared path's runs (their acceptance thresholds against reference #1) against the
    reference path's own (reference #1's row under the same rule)."""

    path: tuple[float, ...]
    reference: tuple[float, ...]
    p_value: float  # one-sided permutation test of the rank sums: the path's are larger
    beyond_reference: int  # path runs above the reference row's largest
    rejected: int  # path runs beyond the tolerance the reference row gives

    @property
    def shifted(self) -> bool:
        """A finding: the compared path differs from reference #1 by more than the reference
        path's own runs do (at PATH_LEVEL)."""
        return self.p_value < PATH_LEVEL

    def describe(self) -> str:
        shown = ", ".join(f"{v:.4f}" for v in sorted(self.path))
        text = (
            f"{len(self.path)} run(s) of the compared path at [{shown}] against the reference "
            f"path's {len(self.reference)} (median {statistics.median(self.reference):.4f}, max "
            f"{max(self.reference):.4f}): {self.beyond_reference} beyond its max, "
            f"{self.rejected} beyond the tolerance, rank-sum p = {self.p_value:.3g}"
        )
        if self.shifted:
            text += (
                f" < {PATH_LEVEL}: the compared path is noisier than the reference path (a "
                "finding about vLLM, not noise to widen a tolerance for)"
            )
        return text


def _midranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        k = i
        while k + 1 < len(order) and values[order[k + 1]] == values[order[i]]:
            k += 1
        for m in range(i, k + 1):
            ranks[order[m]] = (i + k) / 2.0 + 1.0
        i = k + 1
    return ranks


def rank_sum_p(
    path: Sequence[float], reference: Sequence[float], permutations: int = PERMUTATIONS
) -> float:
    """One-sided p-value that `path` holds larger values than `reference` (the rank sum of the
    pooled mid-ranks, against `permutations` random relabellings with a fixed seed; ties, as on
    the logit grid, count half)."""
    if not path or not reference:
        raise ValueError("both samples need at least one value")
    pooled = [*path, *reference]
    # inf sorts above every finite value, and ties among infs share their rank.
    ranks = _midranks([v if not math.isnan(v) else math.inf for v in pooled])
    observed = math.fsum(ranks[: len(path)])
    draw = random.Random(0)
    at_least = 0
    for _ in range(permutations):
        at_least += math.fsum(draw.sample(ranks, len(path))) >= observed - 1e-9
    return (1 + at_least) / (1 + permutations)


def compare_paths(
    path: Sequence[float], reference_row: Sequence[float], step: float, share: float
) -> PathComparison:
    """The compared path's acceptance thresholds against reference #1 (`path`) with reference
    #1's own row (`reference_row`, the same rule's thresholds to the other reference runs)."""
    tolerance = tail_tolerance(reference_row, step, share)
    return PathComparison(
        path=tuple(path),
        reference=tuple(reference_row),
        p_value=rank_sum_p(path, reference_row),
        beyond_reference=sum(1 for v in path if v > max(reference_row)),
        rejected=sum(1 for v in path if v > tolerance),
    )
