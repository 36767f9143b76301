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
NAME.tolerance, NAME.step_bounds (the token rule's per step), NAME.false_red_share,
NAME.median_margin_steps; per rule the comparison was judged by (agreement, tokens,
tokens_along_path) NAME.false_red.RULE.rate, .judged, .rejected, .rejected_runs, .outliers,
.rate_at_half (the rule from half the runs, resampled), .device; per run judged by logprobs
NAME.SLUG.worst_delta, .matched_tokens, .exceedance; per run judged by tokens
NAME.SLUG.tokens_compared, .parted_at, .parting_gaps, .parting_bound, .step_deltas and
.step_delta_max (recorded), .logprob_worst (a whole run's, recorded); per control .power,
.control_delta, .deciding_step, .control_bound; per compared path NAME.SLUG.path_thresholds,
.path_p, .path_beyond_reference, .path_rejected. docs/verdicts.md explains them.
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
    runs[0] being reference #1: the one runs under test are judged against.

    What it judges follows what the engine guarantees (docs/verdicts.md): a comparison of one
    step (prefill_step: the prefill's own output) judges logprobs against the tolerance; a
    comparison of whole runs (repeated) judges tokens, equal wherever the reference is decisive
    by its own noise up to each step, and records the logprob differences without judging them
    (on the GPU decode steps have a tail no row of 29 runs bounds). agrees() and rejects() do
    what the comparison judges; tokens_agree() / rejects_by_token() judge tokens on any
    comparison (a drafter along its own path), rejects_by_logprobs() a control by the logprob
    rule (what a bitwise verdict's control is measured against)."""

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

    @property
    def whole_run(self) -> bool:
        """Judged by its tokens (runs of several steps), not by its logprobs (one step)."""
        return self.floor.total > 1

    @property
    def bounds(self) -> tuple[float, ...]:
        """The token rule's bound at each step (NoiseFloor.bounds)."""
        return self.floor.bounds

    def control_step(self, reference: Scored) -> int | None:
        """Where a runner-up control is steered: the first step the reference wins by at least
        min_power times the bound there with a token not chosen before (compare.decisive_step),
        so that the control, rejected at that step, has the power the profile asks for."""
        return compare.decisive_step(reference, self.bounds, self.min_power)

    def _label(self, names: tuple[str, str]) -> str:
        """The figures' and outputs' name for the run or control `names[1]`."""
        return f"{self.name}.{_slug(names[1])}"

    def _is_reference(self, reference: Scored) -> bool:
        """The run under test is judged against reference #1 (what the leave-one-out measures);
        a suite judging against another output (PD's mid-block prompt) gets no measurement."""
        return bool(self.runs) and _same(reference, self.runs[0])

    def _rule_inputs(
        self, rule: str
    ) -> tuple[list[list[Any]], list[list[float]], list[list[int | None]] | None]:
        """What false_red.measure replays the rule on: the noise per pair (per step for the
        token rules), the value each held-out run is judged by against each reference, and the
        step whose tolerance judges it."""
        if rule == AGREEMENT:
            noise = self.floor.matrix()
            return list(noise), noise, None
        along = rule == TOKENS_ALONG_PATH
        found = [
            [
                Threshold(0.0, None) if r == h else compare.token_threshold(a, b, along)
                for h, b in enumerate(self.runs)
            ]
            for r, a in enumerate(self.runs)
        ]
        values = [[t.value for t in row] for row in found]
        steps = [[t.step for t in row] for row in found]
        return list(self.floor.matrix_steps()), values, steps

    def measure_false_red(self, rule: str = AGREEMENT) -> false_red.Measurement | None:
        """The rule's false-red rate on the reference runs (false_red.measure), measured and
        recorded once per rule; None where there are too few runs to hold one out."""
        if rule in self._measured:
            return self._measured[rule]
        found = None
        prefix = f"{self.name}.false_red.{rule}"
        if len(self.runs) >= false_red.MIN_RUNS_LEFT:
            noise, accept, at = self._rule_inputs(rule)
            step, share = self.floor.step, self.floor.share
            found = false_red.measure(noise, accept, step, share, at)
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
                rate = false_red.resampled_rate(noise, accept, step, share, half, at_step=at)
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
        """The compared path's runs against the reference path's own, by `rule`'s measure
        (recorded, a finding when shifted); None without both."""
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

    def _exceedance(self, label: str, threshold: Threshold, judged: bool) -> None:
        if self.floor.runs >= 3 and not math.isinf(threshold.value):
            tail = false_red.exceedance(self.floor.row, threshold.value, self.floor.step)
            limit: dict[str, Any] = {"limit": self.floor.share, "relation": ">"} if judged else {}
            record_figure(f"{label}.exceedance", round(tail, 6), **limit)

    def agrees(
        self,
        reference: Scored,
        run: Scored,
        names: tuple[str, str],
        path_runs: Sequence[Scored] = (),
    ) -> Agreement | TokenAgreement:
        """`run` must agree with `reference` in what the comparison judges: at one step, every
        logprob within the tolerance (agrees_by_logprobs); over whole runs, the tokens
        (tokens_agree), with the logprob differences recorded and `path_runs` compared with the
        reference path's own by them (a noisier path is a finding, shown, not judged)."""
        if not self.whole_run:
            return self.agrees_by_logprobs(reference, run, names, path_runs)
        label = self._label(names)
        threshold = compare.agreement_threshold(reference, run)
        record_figure(f"{label}.logprob_worst", _nats(threshold.value), unit="nats")
        self._exceedance(label, threshold, judged=False)
        paths = self._paths(AGREEMENT, reference, path_runs, names)
        print(
            f"{self.name}: {names[1]}'s worst logprob difference {_nats(threshold.value)} nats "
            f"at step {threshold.step} (recorded, not judged: tolerance {self.floor.tolerance:.4f}"
            " over the whole run, whose tail the reference runs cannot bound)"
        )
        return self._judge_tokens(reference, run, names, False, paths)

    def agrees_by_logprobs(
        self,
        reference: Scored,
        run: Scored,
        names: tuple[str, str],
        path_runs: Sequence[Scored] = (),
    ) -> Agreement:
        """`run` must agree with `reference` under the floor's tolerance (compare.
        check_agreement). The rule's false-red rate is measured first (when `reference` is
        reference #1), `path_runs` (more runs of the run's own path) compared with the reference
        path's; a failure says both, and a measurement that proves the rule over its share fails
        the comparison (FalseRedBound)."""
        label = self._label(names)
        record_outputs(label, [run])
        measured = self.measure_false_red(AGREEMENT) if self._is_reference(reference) else None
        paths = self._paths(AGREEMENT, reference, path_runs, names)
        threshold = compare.agreement_threshold(reference, run)
        self._exceedance(label, threshold, judged=True)
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
        """How far the rule (AGREEMENT: the logprob rule under the tolerance; TOKENS: the token
        rule under the bounds) keeps rejecting the control: what the bound at the step that
        decides must cover for the control to pass (compare.agreement_threshold, or
        token_threshold: the gap where it parts), over that bound. Printed and recorded with
        the deciding step and its bound, and at least the profile's min_power, or an
        AssertionError that says to raise the signal."""
        if rule == AGREEMENT:
            threshold = compare.agreement_threshold(reference, control)
            bound = self.floor.tolerance
            power = threshold.power(bound)
        else:
            threshold = compare.token_threshold(reference, control)
            at = threshold.step if threshold.step is not None else 0
            bound = self.bounds[at]
            power = threshold.power_at(self.bounds)
        label = self._label(names)
        shown = (
            "inf (a token the other side did not score: no tolerance accepts it)"
            if math.isinf(threshold.value)
            else f"{threshold.value:.4f}"
        )
        print(
            f"{self.name}: the control {names[1]!r}: accepted only from {shown} / bound "
            f"{bound:.4f} = power {power:.2f} at step {threshold.step} (at least "
            f"{self.min_power:g})"
        )
        record_figure(f"{label}.control_delta", _nats(threshold.value), unit="nats")
        record_figure(f"{label}.power", _power_figure(power), limit=self.min_power, relation=">=")
        record_figure(f"{label}.deciding_step", threshold.step, unit="step")
        record_figure(f"{label}.control_bound", round(bound, 6), unit="nats")
        # Its worst difference by the agreement measure, whatever decided it.
        worst = compare.unbounded_worst(reference, control)
        record_figure(f"{label}.control_worst_delta", _nats(worst), unit="nats")
        if not power >= self.min_power:
            raise NoPower(
                f"{self.name}: the control {names[1]!r} is only {power:.2f}x the bound at the "
                f"step that decides, {threshold.step} (accepted from {threshold.value:.4f}, "
                f"bound {bound:.4f}; {self.floor.describe()}), below the bar of "
                f"{self.min_power:g}x: raise the signal (weights under which the guarded defect "
                "moves the output far beyond rounding, a control that differs in more of what "
                "the test guards, or a stronger comparison), never narrow the tolerance below "
                "the noise measured here"
            )
        return power

    def rejects(self, reference: Scored, control: Scored, names: tuple[str, str]) -> str:
        """The negative control must fail what the comparison judges (by its tokens over whole
        runs, by its logprobs at one step), with at least min_power; returns why it failed."""
        if self.whole_run:
            return self.rejects_by_token(reference, control, names)
        return self.rejects_by_logprobs(reference, control, names)

    def rejects_by_logprobs(
        self, reference: Scored, control: Scored, names: tuple[str, str]
    ) -> str:
        """The negative control must fail the logprob rule under the tolerance, with at least
        min_power; returns why it failed."""
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
        reference's tokens until they first part at a near-tie within the bound of that step
        (compare.check_tokens under the floor's bounds; with `along_path`, a run along another
        path: a drafter, other TP sizes, another MoE backend, P->D across TP sizes or
        mid-block, only the reference's side judged there, and above the differences the two
        runs showed on the same tokens before); printed and
        recorded, with the per-step logprob differences over the equal steps as a distribution
        (recorded, not judged). The token rule's false-red rate is measured on the reference
        runs first, and `path_runs` compared with them, as in agrees_by_logprobs()."""
        rule = TOKENS_ALONG_PATH if along_path else TOKENS
        paths = self._paths(rule, reference, path_runs, names)
        return self._judge_tokens(reference, run, names, along_path, paths)

    def _judge_tokens(
        self,
        reference: Scored,
        run: Scored,
        names: tuple[str, str],
        along_path: bool,
        paths: false_red.PathComparison | None,
    ) -> TokenAgreement:
        label = self._label(names)
        record_outputs(label, [run])
        rule = TOKENS_ALONG_PATH if along_path else TOKENS
        measured = self.measure_false_red(rule) if self._is_reference(reference) else None
        try:
            found = compare.check_tokens(reference, run, self.bounds, names, along_path=along_path)
        except AssertionError as failed:
            record_figure(f"{label}.token_mismatch", str(failed).split("\n")[0][:300])
            # The differences up to and with the parting step (the same tokens before it):
            # evidence for telling a path's rounding from a defect.
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
        print(f"{self.name}: {names[0]} vs {names[1]}: {found.describe()}")
        record_figure(f"{label}.tokens_compared", found.compared, limit=found.total, unit="tokens")
        if found.parted_at is not None and found.gaps is not None and found.bound is not None:
            record_figure(f"{label}.parted_at", found.parted_at, unit="step")
            record_figure(f"{label}.parting_gaps", [round(g, 6) for g in found.gaps])
            record_figure(f"{label}.parting_bound", round(found.bound, 6), unit="nats")
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
        """The control (the reference's runner-up taken at a decisive step; a stale block over a
        whole run) must fail the token rule under the bounds, and its power by that rule must
        reach min_power; returns why it failed."""
        record_outputs(self._label(names), [control])
        try:
            found = compare.check_tokens(reference, control, self.bounds, names)
        except AssertionError as failed:
            reason = str(failed).split("\n")[0]
        else:
            raise NoPower(
                f"{self.name}: the negative control {names[1]!r} passes the token rule against "
                f"{names[0]!r} ({found.describe()}): the check cannot tell a changed token from "
                "noise"
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
    if floor.total > 1:
        # The token rule's bound per step (what a whole run is judged by).
        record_figure(f"{name}.step_bounds", [_nats(b) for b in floor.bounds], unit="nats")


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
    is this step; the decode steps after it add noise of their own (on the H100 a run in 20 to
    30 jumps by 0.3 to 0.5 nats at a decode step), which is why logprobs are judged here and
    the whole run by its tokens (docs/verdicts.md)."""
    names = [f"{names_prefix} #{i + 1}" for i in range(len(runs))]
    firsts = [first_step(r) for r in runs]
    record_outputs(f"{name}.{_slug(names_prefix)}", firsts)
    share = false_red.Budget.of(tolerances).share
    floor = dataclasses.replace(compare.noise_spread(firsts, names, share), step=step)
    _record_floor(name, floor)
    return Comparison(name, floor, float(tolerances.min_power), tuple(firsts))


def runner_up_control(
    engine: Any, prompt: list[int], max_tokens: int, reference: Scored, comparison: Comparison
) -> Scored:
    """The reference request steered (logit_bias) off its own choice at the first step it wins
    by at least min_power times the bound there (Comparison.control_step), so that it takes the
    runner-up there: what a drafted token accepted against the target's greedy choice amounts
    to (a broken verification), rejected by the token rule with that power at that step. Its
    logprobs stay vLLM's raw ones."""
    step = comparison.control_step(reference)
    assert step is not None, (
        f"{comparison.name}: no step of the reference wins by {comparison.min_power:g}x the "
        "bound of its own noise there with a token it had not chosen before: no control can be "
        f"told apart from noise with that power (bounds {[round(b, 4) for b in comparison.bounds]}"
        f", margins {[round(m, 4) for m in compare.margins(reference)]})"
    )
    token = reference.token_ids[step]
    margin, bound = compare.margins(reference)[step], comparison.bounds[step]
    print(
        f"{comparison.name}: control takes the runner-up at step {step} (not {token}: it wins "
        f"by {margin:.4f}, {margin / bound:.1f}x the bound {bound:.4f} there)"
    )
    record_figure(f"{comparison.name}.control_step", step)
    record_figure(f"{comparison.name}.control_step_margin", round(margin, 6), unit="nats")
    record_figure(f"{comparison.name}.control_step_bound", round(bound, 6), unit="nats")
    assert engine.reset_prefix_cache(), "reset refused"
    return engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS, logit_bias={token: -100.0})
