"""Greedy verdicts replayed offline, on the outputs a cell run recorded.

A cell keeps every greedy output its comparisons judged (outputs.json: the reference runs, the
judged run, its path's runs, each control; glm5_matrix.results.recorder.record_outputs) beside
the figures it recorded (results.json). From them recorded_comparisons rebuilds each comparison
and replay judges it again under a rule:

- REVISED: the rule of compare and false_red now (docs/verdicts.md): logprobs at one step (the
  prefill's output) against the tail tolerance, ties on the logits' grid counted half a step;
  whole runs by their tokens, equal until the first parting, which must be a near-tie within
  the bound of its step (how far reference #1's runs moved one candidate's score against
  another's up to that step, each step at its share of the comparison's).
- PREVIOUS: the rule as merged at 5b96543 (issue 48's first version): the tail tolerance
  without ties; logprobs judged over whole runs; tokens (MTP, the MoE backends) compared only
  up to the first step the reference wins by no more than the whole run's tolerance; runner-up
  controls steered at the first step won by more than it.

Both measure their own false-red rate the way the suites do (false_red.measure, leave-one-out,
with the self-check's outlying runs), judge the recorded run, its compared path and each
control, and say where a runner-up control would be steered. So a reviewer reruns what a GPU
measured, under either rule, without a GPU.

fit_mixture and simulate go one step further: the noise the recorded reference runs show, as a
mixture (each step's base deviations from the runs' median, and the jumps a few runs make at a
few decode steps, at the rate seen), and cell runs drawn from it, on which the same replay
measures each rule's false-red rate and how often its self-check trips (simulated_rates).

Pure: parsed JSON in, numbers out (benchmarks/replay_verdicts.py reads the files and prints).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from glm5_matrix.verdicts import compare, false_red
from glm5_matrix.verdicts.compare import GreedyOutput, NoiseFloor, Threshold

PREVIOUS, REVISED = "previous", "revised"
RULES = (PREVIOUS, REVISED)
AGREEMENT, TOKENS, TOKENS_ALONG_PATH = "agreement", "tokens", "tokens_along_path"
# A recorded reference row and the one rebuilt from the outputs agree to the recorder's
# rounding (6 decimals).
_ROW_MATCH = 2e-6
# A jump: a run's deviation at a step beyond this many times the 99th percentile of every
# (run, step) deviation. On the H100's 450 runs of 15 references the base deviations end at 9
# steps of 2^-6, the jumps start at 17: any factor from 1.3 to 2.6 splits them the same way.
JUMP_FACTOR = 2.0
MIN_POWER = 2.0  # where a comparison recorded no control (the profiles' min_power)


# --- the comparisons a cell recorded ----------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One comparison of one cell run, rebuilt from its outputs and figures."""

    name: str
    references: tuple[GreedyOutput, ...]  # reference #1 first (first steps for a prefill)
    step: float  # the logit step it was judged with (NAME.logit_step)
    share: float  # its share of the cell's false-red budget
    judged_by: str  # the rule the suite judged it by: agreement, tokens, tokens_along_path
    runs: Mapping[str, GreedyOutput] = field(default_factory=dict)  # judged runs, by slug
    paths: Mapping[str, tuple[GreedyOutput, ...]] = field(default_factory=dict)
    controls: Mapping[str, GreedyOutput] = field(default_factory=dict)
    min_power: float = MIN_POWER
    control_step: int | None = None  # where the suite steered its runner-up control

    @property
    def steps(self) -> int:
        return len(self.references[0].token_ids)

    @functools.cached_property
    def floor(self) -> NoiseFloor:
        """The noise of its reference runs (compare.noise_spread), with its recorded step."""
        names = [f"#{i + 1}" for i in range(len(self.references))]
        found = compare.noise_spread(self.references, names, self.share)
        return dataclasses.replace(found, step=self.step)


def _outputs(outputs: Mapping[str, Any]) -> dict[str, list[GreedyOutput]]:
    entries = outputs.get("outputs", outputs)
    return {
        str(label): [GreedyOutput.from_json(o) for o in entry["outputs"]]
        for label, entry in entries.items()
    }


def _row(references: Sequence[GreedyOutput]) -> list[float]:
    return [compare.unbounded_worst(references[0], run) for run in references[1:]]


def _matches(references: Sequence[GreedyOutput], recorded_row: Any) -> bool:
    if not isinstance(recorded_row, list) or len(recorded_row) != len(references) - 1:
        return False
    try:
        row = _row(references)
    except (IndexError, KeyError):
        return False
    return all(abs(a - float(b)) <= _ROW_MATCH for a, b in zip(row, recorded_row, strict=True))


def _first_steps(runs: Sequence[GreedyOutput]) -> list[GreedyOutput]:
    return [
        GreedyOutput([r.token_ids[0]], [r.logprobs[0]], [dict(r.top_logprobs[0])]) for r in runs
    ]


def recorded_comparisons(
    outputs: Mapping[str, Any], figures: Sequence[Mapping[str, Any]]
) -> list[Recorded]:
    """Every comparison of a cell run whose reference runs the outputs hold (outputs.json's
    content, results.json's figures), in the order their tolerances were recorded. A
    comparison's references are the recorded runs whose row rebuilds its recorded
    NAME.reference_row (a prefill comparison recorded before its references were kept: the
    first steps of its whole run's). Runs with a NAME.SLUG.power figure are controls."""
    by_name = {str(f.get("name")): f for f in figures}
    found_outputs = _outputs(outputs)
    found = []
    for tolerance_name in [n for n in by_name if n.endswith(".tolerance")]:
        name = tolerance_name[: -len(".tolerance")]

        def value(leaf: str, name: str = name) -> Any:
            figure = by_name.get(f"{name}.{leaf}")
            return None if figure is None else figure.get("value")

        repeats, row = value("reference_repeats"), value("reference_row")
        if not isinstance(repeats, int) or repeats < false_red.MIN_RUNS_LEFT:
            continue
        own = [
            label
            for label, runs in found_outputs.items()
            if label.startswith(name + ".") and len(runs) == repeats
        ]
        others = [label for label, runs in found_outputs.items() if len(runs) == repeats]
        references, reference_label = None, None
        for label in [*own, *others]:
            for candidate in (found_outputs[label], _first_steps(found_outputs[label])):
                if _matches(candidate, row):
                    references, reference_label = candidate, label
                    break
            if references is not None:
                break
        if references is None:
            continue
        rules = [
            n[len(name) + len(".false_red.") : -len(".rate")]
            for n in by_name
            if n.startswith(f"{name}.false_red.") and n.endswith(".rate")
        ]
        runs: dict[str, GreedyOutput] = {}
        paths: dict[str, tuple[GreedyOutput, ...]] = {}
        controls: dict[str, GreedyOutput] = {}
        bars = []
        for label, recorded in found_outputs.items():
            if not label.startswith(name + ".") or label == reference_label:
                continue
            slug = label[len(name) + 1 :]
            if slug.endswith(".path"):
                paths[slug[: -len(".path")]] = tuple(recorded)
            elif "." in slug:
                continue
            elif f"{name}.{slug}.power" in by_name:
                controls[slug] = recorded[0]
                limit = by_name[f"{name}.{slug}.power"].get("limit")
                if isinstance(limit, int | float):
                    bars.append(float(limit))
            else:
                runs[slug] = recorded[0]
        found.append(
            Recorded(
                name=name,
                references=tuple(references),
                step=float(value("logit_step")),
                share=float(value("false_red_share")),
                judged_by=rules[0] if rules else AGREEMENT,
                runs=runs,
                paths=paths,
                controls=controls,
                min_power=max(bars) if bars else MIN_POWER,
                control_step=value("control_step"),
            )
        )
    return found


# --- the rules ----------------------------------------------------------------------------------


def previous_tail_tolerance(row: Sequence[float], step: float, share: float) -> float:
    """The tail rule as merged at 5b96543: X_(j+1) + c * S_j + step, ties counted as they are."""
    j, c = false_red.tail_parameters(len(row), share)
    ordered = sorted(row, reverse=True)
    if math.isinf(ordered[0]):
        return math.inf
    threshold = ordered[j]
    return threshold + c * math.fsum(v - threshold for v in ordered[:j]) + step


def previous_token_threshold(
    reference: GreedyOutput, run: GreedyOutput, along_path: bool = False
) -> Threshold:
    """The least tolerance at which the token rule as merged at 5b96543 accepted a run: it
    stopped at the first step the reference won by no more than the tolerance (or, along a
    path, than the runs' difference before it), and failed at a step before that where the
    tokens differ."""
    total = len(reference.token_ids)
    deltas = (
        compare.step_deltas(reference, run, min(total, len(run.token_ids))) if along_path else []
    )
    bar_before, least, at = 0.0, math.inf, None
    for step, margin in enumerate(compare.margins(reference)):
        if margin <= bar_before:
            return Threshold(0.0, None)
        if margin < least:
            least, at = margin, step
        if step >= len(run.token_ids) or reference.token_ids[step] != run.token_ids[step]:
            return Threshold(least, at)
        if along_path:
            bar_before = max(bar_before, deltas[step])
    return Threshold(0.0, None)


def previous_decisive_step(output: GreedyOutput, tolerance: float) -> int | None:
    """Where the previous rule steered a runner-up control: the first step won by more than
    the tolerance with a token not chosen before, before the first won by no more."""
    seen: set[int] = set()
    for step, (token, margin) in enumerate(
        zip(output.token_ids, compare.margins(output), strict=True)
    ):
        if margin <= tolerance:
            return None
        if token not in seen and math.isfinite(margin):
            return step
        seen.add(token)
    return None


@dataclass(frozen=True)
class Verdict:
    """A recorded run or control judged again: what the bound must cover (value), the bound at
    the step that decides, and whether it passed (a run accepted; a control rejected with at
    least min_power)."""

    slug: str
    value: float
    bound: float
    step: int | None
    passed: bool

    @property
    def power(self) -> float:
        if math.isinf(self.value):
            return math.inf
        return self.value / self.bound if self.bound > 0 else math.inf


@dataclass(frozen=True)
class Replayed:
    """One comparison judged again under one rule."""

    name: str
    rule: str
    judged_by: str  # agreement, tokens or tokens_along_path
    references: int
    steps: int
    tolerance: float  # the logprob tolerance (agreement), or the largest step bound (tokens)
    bounds: tuple[float, ...]  # the bound per step (agreement: the tolerance at each)
    measurement: false_red.Measurement
    rate_at_half: float | None
    runs: tuple[Verdict, ...]
    paths: tuple[tuple[str, int, int], ...]  # (slug, runs rejected, runs)
    controls: tuple[Verdict, ...]
    steer: Verdict | None  # where a runner-up control is steered: value = the margin there

    @property
    def judged_runs_pass(self) -> bool:
        return all(v.passed for v in self.runs)


def _judged_by(recorded: Recorded, rule: str) -> str:
    if rule == PREVIOUS:
        return recorded.judged_by
    if recorded.steps == 1:
        return AGREEMENT
    return TOKENS_ALONG_PATH if recorded.judged_by == TOKENS_ALONG_PATH else TOKENS


def replay(recorded: Recorded, rule: str, resamples: int = 0, seed: int = 0) -> Replayed:
    """`recorded` judged again under `rule` (PREVIOUS or REVISED): its false-red measurement on
    its reference runs (with the rate at half the runs, resampled `resamples` times, where
    asked), the recorded runs, paths and controls, and where a runner-up control is steered."""
    if rule not in RULES:
        raise ValueError(f"rule {rule!r}: one of {RULES}")
    floor = recorded.floor
    refs, step, share = recorded.references, recorded.step, recorded.share
    judged_by = _judged_by(recorded, rule)
    along = judged_by == TOKENS_ALONG_PATH
    tail = previous_tail_tolerance if rule == PREVIOUS else false_red.tail_tolerance
    at: list[list[int | None]] | None = None
    noise: list[list[Any]]
    if judged_by == AGREEMENT:
        tolerance = tail(_padded(floor.row), step, share)
        bounds = (tolerance,) * recorded.steps
        noise = list(floor.matrix())
        accept: list[list[float]] = floor.matrix()

        def judge(run: GreedyOutput, control: bool = False) -> Threshold:
            return compare.agreement_threshold(refs[0], run)

    elif rule == PREVIOUS:
        tolerance = tail(_padded(floor.row), step, share)
        bounds = (tolerance,) * recorded.steps
        noise = list(floor.matrix())
        accept = [
            [
                0.0 if r == h else previous_token_threshold(a, b, along).value
                for h, b in enumerate(refs)
            ]
            for r, a in enumerate(refs)
        ]

        def judge(run: GreedyOutput, control: bool = False) -> Threshold:
            return previous_token_threshold(refs[0], run, along and not control)

    else:
        bounds = floor.bounds
        tolerance = max(bounds)
        noise = list(floor.matrix_steps())
        found = [
            [
                Threshold(0.0, None) if r == h else compare.token_threshold(a, b, along)
                for h, b in enumerate(refs)
            ]
            for r, a in enumerate(refs)
        ]
        accept = [[t.value for t in row] for row in found]
        at = [[t.step for t in row] for row in found]

        def judge(run: GreedyOutput, control: bool = False) -> Threshold:
            return compare.token_threshold(refs[0], run, along and not control)

    measurement = false_red.measure(noise, accept, step, share, at, tail=tail)
    half = max(false_red.MIN_ROW + 1, len(refs) // 2)
    rate_at_half = None
    if resamples and half < len(refs) - 1:
        rate_at_half = false_red.resampled_rate(
            noise, accept, step, share, half, resamples, seed, at_step=at, tail=tail
        )

    def verdict(slug: str, run: GreedyOutput, control: bool) -> Verdict:
        threshold = judge(run, control)
        bound = bounds[threshold.step] if threshold.step is not None else bounds[0]
        if control:
            power = threshold.power(bound) if threshold.step is not None else 0.0
            passed = power >= recorded.min_power
        else:
            passed = threshold.value <= bound
        return Verdict(slug, threshold.value, bound, threshold.step, passed)

    paths = []
    for slug, runs in recorded.paths.items():
        rejected = sum(1 for run in runs if not verdict(slug, run, False).passed)
        paths.append((slug, rejected, len(runs)))
    steer = None
    if judged_by != AGREEMENT:
        if rule == PREVIOUS:
            at_step = previous_decisive_step(refs[0], tolerance)
        else:
            at_step = compare.decisive_step(refs[0], bounds, recorded.min_power)
        if at_step is not None:
            margin = compare.margins(refs[0])[at_step]
            steer = Verdict(
                "runner-up",
                margin,
                bounds[at_step],
                at_step,
                margin >= recorded.min_power * bounds[at_step],
            )
    return Replayed(
        name=recorded.name,
        rule=rule,
        judged_by=judged_by,
        references=len(refs),
        steps=recorded.steps,
        tolerance=tolerance,
        bounds=tuple(bounds),
        measurement=measurement,
        rate_at_half=rate_at_half,
        runs=tuple(verdict(s, r, False) for s, r in recorded.runs.items()),
        paths=tuple(paths),
        controls=tuple(verdict(s, c, True) for s, c in recorded.controls.items()),
        steer=steer,
    )


def _padded(row: Sequence[float]) -> list[float]:
    return list(row) if len(row) >= false_red.MIN_ROW else [*row, 0.0]


# --- the noise as a mixture, and cell runs drawn from it ----------------------------------------


@dataclass(frozen=True)
class Mixture:
    """The reference path's noise as recorded runs show it. Per step: the candidates' centre
    (each candidate's median logprob over the runs that reached the step on reference #1's
    tokens), the base deviations from it (one per run: its candidates' differences to the
    centre), and the jumps: a run's deviation whose largest candidate difference exceeds
    JUMP_FACTOR times the 99th percentile of every (run, step) deviation, with its rate among
    the runs there (on the H100: 0.3 to 0.5 nats at decode steps 1, 9 and 19, in 20 of 450
    runs; none at the prefill step)."""

    centre: tuple[dict[int, float], ...]
    base: tuple[tuple[dict[int, float], ...], ...]
    jumps: tuple[tuple[dict[int, float], ...], ...]
    rates: tuple[float, ...]
    jump_at: float  # the deviation that counts as a jump

    def describe(self) -> str:
        seen = [
            (s, len(j), r) for s, (j, r) in enumerate(zip(self.jumps, self.rates, strict=True)) if j
        ]
        where = ", ".join(f"step {s}: {n} run(s), rate {r:.3f}" for s, n, r in seen) or "none"
        return (
            f"{len(self.centre)} steps, {len(self.base[0])} runs; jumps beyond "
            f"{self.jump_at:.4f} nats: {where}"
        )


def _size(deviation: Mapping[int, float]) -> float:
    return max((abs(v) for v in deviation.values()), default=0.0)


def fit_mixture(references: Sequence[GreedyOutput], jump_factor: float = JUMP_FACTOR) -> Mixture:
    """The mixture the reference runs show (Mixture)."""
    first = references[0]
    centres, deviations = [], []
    for step in range(len(first.token_ids)):
        reached = [
            r for r in references if list(r.token_ids[:step]) == list(first.token_ids[:step])
        ]
        scored: dict[int, list[float]] = {}
        for run in reached:
            for candidate, value in run.top_logprobs[step].items():
                scored.setdefault(candidate, []).append(float(value))
        centre = {c: statistics.median(v) for c, v in scored.items() if 2 * len(v) >= len(reached)}
        centres.append(centre)
        deviations.append(
            [
                {c: float(v) - centre[c] for c, v in run.top_logprobs[step].items() if c in centre}
                for run in reached
            ]
        )
    sizes = sorted(_size(d) for step in deviations for d in step)
    jump_at = jump_factor * sizes[min(len(sizes) - 1, int(0.99 * len(sizes)))]
    base = tuple(tuple(d for d in step if _size(d) <= jump_at) for step in deviations)
    jumps = tuple(tuple(d for d in step if _size(d) > jump_at) for step in deviations)
    rates = tuple(len(j) / len(d) for j, d in zip(jumps, deviations, strict=True))
    return Mixture(tuple(centres), base, jumps, rates, jump_at)


def simulate(
    mixture: Mixture, runs: int, rng: random.Random, jump_scale: float = 1.0, top: int = 5
) -> list[GreedyOutput]:
    """`runs` greedy runs drawn from the mixture: at each step a base deviation of a random
    recorded run, or, at the step's jump rate times `jump_scale`, one of the jumps seen there,
    added to the centre; the token is the best candidate (a run may so part from the others at
    a near-tie, as recorded runs do)."""
    drawn = []
    for _ in range(runs):
        tokens, logprobs, tops = [], [], []
        for step, centre in enumerate(mixture.centre):
            jumps = mixture.jumps[step]
            jumped = bool(jumps) and rng.random() < mixture.rates[step] * jump_scale
            deviation = rng.choice(jumps if jumped else mixture.base[step])
            scored = {c: v + deviation.get(c, 0.0) for c, v in centre.items()}
            best = sorted(scored, key=lambda c: (-scored[c], c))[:top]
            tokens.append(best[0])
            logprobs.append(scored[best[0]])
            tops.append({c: scored[c] for c in best})
        drawn.append(GreedyOutput(tokens, logprobs, tops))
    return drawn


@dataclass
class Simulated:
    """A rule's false-red figures over simulated cell runs of one comparison."""

    rule: str
    judged_by: str
    cells: int = 0
    judged: int = 0  # leave-one-out judgements
    rejected: int = 0
    runs: int = 0  # runs held out
    outlying: int = 0  # runs the self-check found outlying
    tripped: int = 0  # cells whose self-check failed
    broken: int = 0  # cells whose references parted at an unscored token (no floor)
    trip_at: int = 2
    share: float = 0.0005

    @property
    def rate(self) -> float:
        return self.rejected / self.judged if self.judged else 0.0

    def trip_bound(self, level: float = 0.95) -> float:
        """An upper bound on the self-check's trip rate per cell run: the binomial tail of
        trip_at outlying runs among a cell's, each outlying at most at the upper `level` bound
        of the per-run rate measured here (masking only makes two outliers rarer)."""
        per_run = clopper_pearson_upper(self.outlying, self.runs, level)
        per_cell = self.runs // self.cells if self.cells else 0
        return false_red.binomial_tail(per_cell, per_run, self.trip_at)


def clopper_pearson_upper(successes: int, trials: int, level: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a binomial rate (bisection)."""
    if trials == 0 or successes >= trials:
        return 1.0
    low, high = successes / trials, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        below = 1.0 - false_red.binomial_tail(trials, mid, successes + 1)
        low, high = (mid, high) if below > 1 - level else (low, mid)
    return high


def simulated_rates(
    recorded: Recorded,
    cells: int,
    seed: int = 0,
    jump_scale: float = 1.0,
    prefill: bool = False,
) -> list[Simulated]:
    """Each rule's leave-one-out false-red rate and self-check over `cells` simulated cell runs
    of `recorded` (its mixture fitted on its reference runs: fit_mixture; as many runs per cell
    as it recorded), judged as the comparison is (its whole run), or at its first step alone
    with `prefill`."""
    mixture = fit_mixture(recorded.references)
    rng = random.Random(seed)
    found = {rule: Simulated(rule, "") for rule in RULES}
    for _ in range(cells):
        runs = simulate(mixture, len(recorded.references), rng, jump_scale)
        if prefill:
            runs = _first_steps(runs)
        cell = dataclasses.replace(recorded, references=tuple(runs), runs={}, paths={}, controls={})
        for rule in RULES:
            tally = found[rule]
            try:
                replayed = replay(cell, rule)
            except AssertionError:  # the drawn references parted at an unscored token
                tally.broken += 1
                continue
            measured = replayed.measurement
            tally.judged_by = replayed.judged_by
            tally.cells += 1
            tally.judged += measured.judged
            tally.rejected += measured.rejected
            tally.runs += measured.runs
            tally.outlying += len(measured.outliers)
            tally.tripped += measured.tripped
            tally.trip_at, tally.share = measured.trip_at, measured.share
    return [found[rule] for rule in RULES]
