"""Greedy comparisons as the suites run them: measure the engine's noise on the reference done N
times, measure how often the rule built from it rejects a run of the reference path itself (its
false-red rate, leave-one-out over the same runs), judge the run under test against it, compare
the compared path's own runs with the reference path's, show with a negative control that the
comparison can fail by a wide margin (its power), and record every figure into the cell's
results (glm5_matrix.results.recorder.record_figure).

The rule itself is compare's and false_red's (pure); this module only orders the steps and
records them, so that every suite (e2e repeat, offload warm run, MTP, DFlash2, PD) judges the
same way and reports the same figures: NAME.reference_repeats, NAME.noise_pairs,
NAME.noise_min / _median / _max (nats) and _steps (logit steps), NAME.logit_step,
NAME.tolerance, NAME.false_red_share, NAME.median_margin_steps; per rule the comparison was
judged by (agreement, tokens, tokens_along_path) NAME.false_red.RULE.rate, .judged, .rejected,
.rejected_runs, .outliers, .rate_at_half (the rule from half the runs, resampled), .device; per
run or control NAME.SLUG.worst_delta, .matched_tokens, .exceedance, .power, .deciding_step,
.tokens_compared, .stopped_at; per compared path NAME.SLUG.path_thresholds, .path_p,
.path_beyond_reference, .path_rejected. docs/verdicts.md explains them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from glm5_matrix.matrix.tolerances import Tolerances
from glm5_matrix.results.recorder import record_figure, record_outputs
from glm5_matrix.verdicts import compare, false_red
from glm5_matrix.verdicts.compare import (
    Agreement,
    GreedyOutput,
    NoiseFloor,
    Scored,
    Threshold,
    TokenAgreement,
)

# Candidates per step kept for the rule (each side's token must be among the other's).
TOP_LOGPROBS = 5
AGREEMENT, TOKENS, TOKENS_ALONG_PATH = "agreement", "tokens", "tokens_along_path"

# What the figures call the device the runs were measured on (a GPU model or a CPU's name);
# the suites set it once per cell (conftest), false_red figures carry it.
_DEVICE: dict[str, str] = {}


def set_device(model: str) -> None:
    """The device the cell's runs are measured on, for the false-red figures."""
    _DEVICE["model"] = model


class NoPower(AssertionError):
    """A negative control the comparison could not tell apart from the noise (it passed the rule,
    or was rejected below the power bar): the check has no power on this run, which says
    nothing of vLLM either way. An AssertionError, so that a suite fails on it: raise the signal,
    never narrow the tolerance. A suite may catch it only where another comparison carries the
    check and is judged (test_e2e's repeat: the prefill step carries the stale block's power, the
    whole run's is recorded)."""


class FalseRedBound(AssertionError):
    """The rule's own measured false-red rate is proven above its share (false_red.Measurement.
    tripped): the verdict of this comparison cannot be trusted either way. Add reference runs."""


def _power_figure(power: float) -> float | str:
    """JSON holds no infinity: an infinite power is recorded as the string "inf"."""
    return "inf" if math.isinf(power) else round(power, 3)


def _nats(value: float) -> float | str:
    return "inf" if math.isinf(value) else round(value, 6)


@dataclass(frozen=True)
class Comparison:
    """One named comparison of a suite, with the noise it is judged against, the power its
    controls must reach, and (through repeated()) the reference runs the noise was measured on,
    runs[0] being reference #1: the one runs under test are judged against."""

    name: str
    floor: NoiseFloor
    # The bar every control's power must reach: the profile's min_power through repeated(); the
    # default, 1, only asks for a rejection (hand-built Comparisons of the unit tests).
    min_power: float = 1.0
    # The reference runs (empty for a hand-built Comparison: then no false-red measurement).
    runs: tuple[Any, ...] = ()
    _measured: dict[str, false_red.Measurement | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def _label(self, names: tuple[str, str]) -> str:
        """The figures' and outputs' name for the run or control `names[1]`."""
        return f"{self.name}.{_slug(names[1])}"

    def _is_reference(self, reference: Scored) -> bool:
        """The run under test is judged against reference #1 (what the leave-one-out measures);
        a suite judging against another output (PD's mid-block prompt) gets no measurement."""
        return bool(self.runs) and _same(reference, self.runs[0])

    def _accept_at(self, rule: str) -> list[list[float]]:
        noise = self.floor.matrix()
        if rule == AGREEMENT:
            return noise
        along = rule == TOKENS_ALONG_PATH
        return [
            [
                0.0 if r == h else compare.token_threshold(a, b, along).value
                for h, b in enumerate(self.runs)
            ]
            for r, a in enumerate(self.runs)
        ]

    def measure_false_red(self, rule: str = AGREEMENT) -> false_red.Measurement | None:
        """The rule's false-red rate on the reference runs (false_red.measure), measured and
        recorded once per rule; None where there are too few runs to hold one out."""
        if rule in self._measured:
            return self._measured[rule]
        found = None
        prefix = f"{self.name}.false_red.{rule}"
        if len(self.runs) >= false_red.MIN_RUNS_LEFT:
            noise, accept = self.floor.matrix(), self._accept_at(rule)
            found = false_red.measure(noise, accept, self.floor.step, self.floor.share)
            print(f"{self.name}: false red ({rule}): {found.describe()}")
            record_figure(f"{prefix}.rate", round(found.rate, 6), limit=found.share, relation="<=")
            record_figure(f"{prefix}.judged", found.judged, unit="judgements")
            record_figure(f"{prefix}.rejected", found.rejected, unit="judgements")
            record_figure(f"{prefix}.rejected_runs", found.rejected_runs, unit="runs")
            record_figure(
                f"{prefix}.outliers", len(found.outliers), limit=found.trip_at, relation="<"
            )
            half = max(false_red.MIN_ROW + 1, len(self.runs) // 2)
            if half < len(self.runs) - 1:
                rate = false_red.resampled_rate(
                    noise, accept, self.floor.step, self.floor.share, half
                )
                record_figure(f"{prefix}.rate_at_half", round(rate, 6), unit=f"{half} runs")
            record_figure(f"{prefix}.device", _DEVICE.get("model", "unknown"))
        else:
            record_figure(f"{prefix}.rate", f"not measured: {len(self.runs)} reference run(s)")
        self._measured[rule] = found
        return found

    def _self_check(self, found: false_red.Measurement | None) -> None:
        if found is not None and found.tripped:
            raise FalseRedBound(
                f"{self.name}: the rule's own false-red rate is above its share of the cell's "
                f"bound: {found.describe()} ({found.trip_at} outlying runs happen under a rule "
                f"at its share {found.share:.3g} at most that often): add reference runs "
                f"([tolerances] reference_repeats, now {self.floor.runs}), so that the "
                "tolerance rests on more of the tail and extrapolates less"
            )

    def _paths(
        self, rule: str, reference: Scored, path_runs: Sequence[Scored], names: tuple[str, str]
    ) -> false_red.PathComparison | None:
        """The compared path's runs against the reference path's own (recorded, a finding when
        shifted); None without both."""
        if not path_runs or not self._is_reference(reference):
            return None
        label = self._label(names)
        record_outputs(f"{label}.path", list(path_runs))
        along = rule == TOKENS_ALONG_PATH
        threshold: Callable[[Scored, Scored], Threshold] = (
            compare.agreement_threshold
            if rule == AGREEMENT
            else lambda a, b: compare.token_threshold(a, b, along)
        )
        path = [threshold(reference, run).value for run in path_runs]
        own = [threshold(reference, run).value for run in self.runs[1:]]
        found = false_red.compare_paths(path, own, self.floor.step, self.floor.share)
        print(f"{self.name}: {names[1]}'s path: {found.describe()}")
        record_figure(f"{label}.path_thresholds", [_nats(v) for v in path], unit="nats")
        record_figure(
            f"{label}.path_p", round(found.p_value, 6), limit=false_red.PATH_LEVEL, relation=">="
        )
        record_figure(f"{label}.path_beyond_reference", found.beyond_reference, unit="runs")
        record_figure(f"{label}.path_rejected", found.rejected, unit="runs")
        return found

    def _record_run(self, label: str, threshold: Threshold) -> None:
        if self.floor.runs >= 3 and not math.isinf(threshold.value):
            tail = false_red.exceedance(self.floor.row, threshold.value, self.floor.step)
            record_figure(
                f"{label}.exceedance", round(tail, 6), limit=self.floor.share, relation=">"
            )

    def agrees(
        self,
        reference: Scored,
        run: Scored,
        names: tuple[str, str],
        path_runs: Sequence[Scored] = (),
    ) -> Agreement:
        """`run` must agree with `reference` under the floor's tolerance. The rule's false-red
        rate is measured first (when `reference` is reference #1), `path_runs` (more runs of
        the run's own path) compared with the reference path's; a failure says both, and a
        measurement that proves the rule over its share fails the comparison (FalseRedBound)."""
        label = self._label(names)
        record_outputs(label, [run])
        measured = self.measure_false_red(AGREEMENT) if self._is_reference(reference) else None
        paths = self._paths(AGREEMENT, reference, path_runs, names)
        threshold = compare.agreement_threshold(reference, run)
        self._record_run(label, threshold)
        try:
            agreement = compare.check_agreement(reference, run, self.floor, names)
        except AssertionError as failed:
            record_figure(
                f"{label}.worst_delta",
                _nats(threshold.value),
                limit=round(self.floor.tolerance, 6),
                relation="<=",
                unit="nats",
            )
            raise AssertionError(f"{failed}{_context(measured, paths)}") from None
        print(f"{self.name}: {names[0]} vs {names[1]}: {agreement.describe()}")
        record_figure(
            f"{label}.worst_delta",
            round(agreement.worst_delta, 6),
            limit=round(self.floor.tolerance, 6),
            relation="<=",
            unit="nats",
        )
        record_figure(f"{label}.matched_tokens", agreement.matched, unit="tokens")
        if agreement.parting_gaps is not None:
            record_figure(f"{label}.parting_gaps", [round(g, 6) for g in agreement.parting_gaps])
        self._self_check(measured)
        return agreement

    def power(
        self, reference: Scored, control: Scored, names: tuple[str, str], rule: str = AGREEMENT
    ) -> float:
        """The least tolerance at which the rule would accept the control (compare.
        agreement_threshold, or token_threshold for rule TOKENS), over the tolerance: the
        control stays rejected under a tolerance that many times wider, at the step that then
        decides (recorded). Printed and recorded, and at least the profile's min_power, or an
        AssertionError that says to raise the signal."""
        threshold = (
            compare.agreement_threshold(reference, control)
            if rule == AGREEMENT
            else compare.token_threshold(reference, control)
        )
        tolerance = self.floor.tolerance
        power = threshold.power(tolerance)
        label = self._label(names)
        shown = (
            "inf (a token the other side did not score: no tolerance accepts it)"
            if math.isinf(threshold.value)
            else f"{threshold.value:.4f}"
        )
        print(
            f"{self.name}: the control {names[1]!r}: accepted only from {shown} / tolerance "
            f"{tolerance:.4f} = power {power:.2f} at step {threshold.step} (at least "
            f"{self.min_power:g})"
        )
        record_figure(f"{label}.control_delta", _nats(threshold.value), unit="nats")
        record_figure(f"{label}.power", _power_figure(power), limit=self.min_power, relation=">=")
        record_figure(f"{label}.deciding_step", threshold.step, unit="step")
        # Its worst difference by the agreement measure, whatever decided it.
        worst = compare.unbounded_worst(reference, control)
        record_figure(f"{label}.control_worst_delta", _nats(worst), unit="nats")
        if not power >= self.min_power:
            raise NoPower(
                f"{self.name}: the control {names[1]!r} is only {power:.2f}x the tolerance at "
                f"the step that decides, {threshold.step} (accepted from {threshold.value:.4f}, "
                f"tolerance {tolerance:.4f}; {self.floor.describe()}), below the bar of "
                f"{self.min_power:g}x: raise the signal (weights under which the guarded defect "
                "moves the output far beyond rounding, a control that differs in more of what "
                "the test guards, or a stronger comparison), never narrow the tolerance below "
                "the noise measured here"
            )
        return power

    def rejects(self, reference: Scored, control: Scored, names: tuple[str, str]) -> str:
        """The negative control must fail the same rule, with at least min_power; returns why it
        failed."""
        record_outputs(self._label(names), [control])
        reason = compare.check_rejected(reference, control, self.floor, names)
        print(f"{self.name}: the control {names[1]!r} is rejected: {reason}")
        record_figure(f"{self.name}.control_rejected", reason.split("\n")[0][:300])
        self.power(reference, control, names)
        return reason

    def tokens_agree(
        self,
        reference: Scored,
        run: Scored,
        names: tuple[str, str],
        along_path: bool = False,
        path_runs: Sequence[Scored] = (),
    ) -> TokenAgreement:
        """`run` (along another path: a cached boundary, a drafter's verification) chooses the
        reference's tokens at every decisive step (compare.check_tokens_while_decisive under the
        floor's tolerance; with `along_path`, a drafter's, also above the differences the two
        runs showed on the same tokens before); printed and recorded, with the per-step logprob
        differences over the compared steps as a distribution (recorded, not judged). The
        token rule's false-red rate is measured on the reference runs first, and `path_runs`
        compared with them, as in agrees()."""
        tolerance = self.floor.tolerance
        label = self._label(names)
        record_outputs(label, [run])
        rule = TOKENS_ALONG_PATH if along_path else TOKENS
        measured = self.measure_false_red(rule) if self._is_reference(reference) else None
        paths = self._paths(rule, reference, path_runs, names)
        try:
            found = compare.check_tokens_while_decisive(
                reference, run, tolerance, names, along_path=along_path
            )
        except AssertionError as failed:
            record_figure(f"{label}.token_mismatch", str(failed).split("\n")[0][:300])
            # The differences up to the parting (the same tokens before it): evidence for
            # telling a path's rounding from a defect.
            steps = min(
                compare.equal_prefix(reference, run) + 1,
                len(reference.token_ids),
                len(run.token_ids),
            )
            record_figure(
                f"{label}.step_deltas",
                [round(d, 6) for d in compare.step_deltas(reference, run, steps)],
                unit="nats",
            )
            raise AssertionError(f"{failed}{_context(measured, paths)}") from None
        print(f"{self.name}: {names[0]} vs {names[1]}: {found.describe(tolerance)}")
        if found.bar is not None:
            record_figure(f"{label}.path_bar", round(found.bar, 6), unit="nats")
        record_figure(f"{label}.tokens_compared", found.compared, limit=found.total, unit="tokens")
        if found.stopped_at is not None and found.stop_margin is not None:
            record_figure(f"{label}.stopped_at", found.stopped_at, unit="step")
            record_figure(
                f"{label}.stop_reason",
                f"the reference's margin {found.stop_margin:.6f} at step {found.stopped_at} is "
                f"within the tolerance {tolerance:.6f}"
                + (
                    f" or the paths' own difference before it {found.bar:.6f}"
                    if found.bar is not None
                    else ""
                ),
            )
        deltas = compare.step_deltas(reference, run, found.compared)
        if deltas:
            step = self.floor.step
            worst, median = max(deltas), statistics.median(deltas)
            print(
                f"{self.name}: {names[1]}'s logprobs over those steps differ per step by max "
                f"{worst:.4f} ({self.floor.in_steps(worst):.1f} logit steps), median "
                f"{median:.4f} (recorded, not judged: greedy decoding judges by tokens)"
            )
            record_figure(f"{label}.step_delta_max", round(worst, 6), unit="nats")
            record_figure(f"{label}.step_delta_median", round(median, 6), unit="nats")
            record_figure(
                f"{label}.step_delta_max_steps",
                round(worst / step, 2) if step else 0.0,
                unit="logit steps",
            )
            record_figure(f"{label}.step_deltas", [round(d, 6) for d in deltas], unit="nats")
        self._self_check(measured)
        return found

    def rejects_by_token(self, reference: Scored, control: Scored, names: tuple[str, str]) -> str:
        """The control (the reference's runner-up taken at a decisive step) must fail
        tokens_agree's rule, and its power (by that rule) must reach min_power; returns why it
        failed."""
        record_outputs(self._label(names), [control])
        try:
            found = compare.check_tokens_while_decisive(
                reference, control, self.floor.tolerance, names
            )
        except AssertionError as failed:
            reason = str(failed).split("\n")[0]
        else:
            raise NoPower(
                f"{self.name}: the negative control {names[1]!r} passes the token rule against "
                f"{names[0]!r} ({found.describe(self.floor.tolerance)}): the check cannot tell "
                "a changed token from noise"
            )
        print(f"{self.name}: the control {names[1]!r} is rejected by its token: {reason}")
        record_figure(f"{self.name}.control_rejected", reason[:300])
        self.power(reference, control, names, rule=TOKENS)
        return reason


def _same(a: Scored, b: Scored) -> bool:
    return a is b or (
        list(a.token_ids) == list(b.token_ids)
        and [dict(t) for t in a.top_logprobs] == [dict(t) for t in b.top_logprobs]
    )


def _context(measured: false_red.Measurement | None, paths: false_red.PathComparison | None) -> str:
    """What a failed verdict's message adds: the rule's measured false-red rate, and how the
    run's own path compared with the reference path."""
    text = ""
    if measured is not None:
        text += f"\n[the rule on the reference runs: {measured.describe()}]"
    if paths is not None:
        text += f"\n[this path's own runs: {paths.describe()}]"
    return text


def _record_floor(name: str, floor: NoiseFloor) -> None:
    print(f"{name}: {floor.describe()}")
    record_figure(f"{name}.reference_repeats", floor.runs, unit="runs")
    record_figure(f"{name}.noise_pairs", floor.pairs, unit="pairs")
    for label, value in (("min", floor.least), ("median", floor.median), ("max", floor.worst)):
        record_figure(f"{name}.noise_{label}", round(value, 6), unit="nats")
        record_figure(
            f"{name}.noise_{label}_steps", round(floor.in_steps(value), 2), unit="logit steps"
        )
    record_figure(f"{name}.noise_spread", round(floor.spread, 6), unit="nats")
    record_figure(f"{name}.logit_step", floor.step, unit="nats")
    record_figure(f"{name}.tolerance", round(floor.tolerance, 6), unit="nats")
    record_figure(
        f"{name}.tolerance_steps", round(floor.in_steps(floor.tolerance), 2), unit="logit steps"
    )
    record_figure(f"{name}.false_red_share", floor.share)
    record_figure(f"{name}.reference_row", [round(v, 6) for v in floor.row], unit="nats")


def _check_decisive(name: str, output: Scored, what: str, step: float, minimum: float) -> None:
    decisive = compare.check_decisive(output, step, minimum, what)
    print(f"{name}: {what}: {decisive.describe()}")
    record_figure(
        f"{name}.median_margin_steps",
        round(decisive.median_steps, 2),
        limit=minimum,
        relation=">=",
        unit="logit steps",
    )
    record_figure(f"{name}.exact_ties", decisive.ties, unit="steps")


def repeated(name: str, runs: list[Any], names_prefix: str, tolerances: Tolerances) -> Comparison:
    """The reference done N = len(runs) >= 2 times: every pair compared (compare.noise_spread),
    the distribution recorded, and the tolerance taken from reference #1's row at the
    comparison's false-red share. `tolerances` (the profile's, ranges checked when it was
    loaded) gives min_distinct_tokens (the first run must vary that much),
    min_median_margin_steps (its greedy choices must win by that median margin), min_power (what
    every control of the comparison must reach), and false_red_per_cell and
    comparisons_per_cell (the cell's false-red budget and how many judged comparisons share it:
    false_red.Budget). Runs are named "PREFIX #1" .. "PREFIX #N" in messages; runs[0] is
    reference #1, the one runs under test are judged against."""
    budget = false_red.Budget.of(tolerances)
    names = [f"{names_prefix} #{i + 1}" for i in range(len(runs))]
    record_outputs(f"{name}.{_slug(names_prefix)}", runs)
    compare.assert_varies(runs[0].token_ids, tolerances.min_distinct_tokens, names[0])
    floor = compare.noise_spread(runs, names, budget.share)
    _record_floor(name, floor)
    minimum = float(tolerances.min_median_margin_steps)
    _check_decisive(name, runs[0], names[0], floor.step, minimum)
    return Comparison(name, floor, float(tolerances.min_power), tuple(runs))


def _slug(text: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def reference_runs(
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    tolerances: Tolerances,
    names_prefix: str = "cold",
    reset: Callable[[], object] | None = None,
) -> list[Scored]:
    """`prompt` on a running glm5_matrix.engines.client.Engine from an empty prefix cache (emptied
    by `reset`, default the engine's reset_prefix_cache), done the profile's reference_repeats
    times (at least four, so that one can be held out: Tolerances refuses fewer when the
    profile is loaded); every run must be cold."""
    runs: list[Scored] = []
    for i in range(tolerances.reference_repeats):
        if reset is None:
            assert engine.reset_prefix_cache(), "reset_prefix_cache() refused"
        else:
            reset()
        run = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        assert not run.cached_tokens, (
            f"{names_prefix} #{i + 1} is not cold: {run.cached_tokens} cached"
        )
        runs.append(run)
    return runs


def reference_repeated(
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    name: str,
    tolerances: Tolerances,
    names_prefix: str = "cold",
    reset: Callable[[], object] | None = None,
) -> tuple[Scored, Comparison]:
    """The reference (reference_runs) and the comparison measured from all of its runs
    (repeated(): the profile's min_distinct_tokens, min_median_margin_steps and min_power).
    Returns the first run and the comparison."""
    runs = reference_runs(engine, prompt, max_tokens, tolerances, names_prefix, reset)
    return runs[0], repeated(name, runs, names_prefix, tolerances)


def first_step(output: Scored) -> GreedyOutput:
    """The output's first step alone: what the prefill itself computed, before any decode step
    (the token chosen from the prompt's last position and its candidates)."""
    return GreedyOutput(
        [int(output.token_ids[0])],
        [float(output.logprobs[0])],
        [dict(output.top_logprobs[0])],
        getattr(output, "cached_tokens", None),
    )


def prefill_step(
    name: str, runs: list[Any], names_prefix: str, tolerances: Tolerances, step: float
) -> Comparison:
    """The reference runs (repeated() has judged them whole) compared at their first step
    alone, the prefill's own output: the noise of that step as a distribution over every pair,
    the tolerance from it as in repeated() with `step`, the logit step read off the whole runs,
    and the profile's min_power for its controls. What a wrong prefix-cache state changes first
    is this step; the decode steps after it add noise of their own (on the H200 the sparse
    indexer's top-k at every step), which a comparison of the whole run must allow for."""
    names = [f"{names_prefix} #{i + 1}" for i in range(len(runs))]
    firsts = [first_step(r) for r in runs]
    share = false_red.Budget.of(tolerances).share
    floor = dataclasses.replace(compare.noise_spread(firsts, names, share), step=step)
    _record_floor(name, floor)
    return Comparison(name, floor, float(tolerances.min_power), tuple(firsts))


def runner_up_control(
    engine: Any, prompt: list[int], max_tokens: int, reference: Scored, comparison: Comparison
) -> Scored:
    """The reference request steered (logit_bias) off its own choice at its first decisive step,
    so that it takes the runner-up there: what a drafted token accepted against the target's
    greedy choice amounts to (a broken verification). Its logprobs stay vLLM's raw ones."""
    tolerance = comparison.floor.tolerance
    step = compare.decisive_step(reference, tolerance)
    assert step is not None, (
        f"{comparison.name}: no step of the reference before its first within the noise wins by "
        f"more than the tolerance {tolerance:.4f} with a token it had not chosen before: no "
        "control can be told apart from noise"
    )
    token = reference.token_ids[step]
    print(f"{comparison.name}: control takes the runner-up at step {step} (not {token})")
    record_figure(f"{comparison.name}.control_step", step)
    assert engine.reset_prefix_cache(), "reset refused"
    return engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS, logit_bias={token: -100.0})
