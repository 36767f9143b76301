"""Greedy comparisons as the suites run them: measure the engine's noise on the reference done N
times, judge the run under test against it, show with a negative control that the comparison
can fail by a wide margin (its power), and record every figure into the cell's results
(glm5_matrix.results.recorder.record_figure).

The rule itself is compare's (pure); this module only orders the steps and records them, so that
every suite (e2e repeat, offload warm run, MTP, DFlash2, PD) judges the same way and reports the
same figures: NAME.reference_repeats, NAME.noise_pairs, NAME.noise_min / _median / _max (nats)
and _steps (logit steps), NAME.logit_step, NAME.tolerance, NAME.median_margin_steps, and per
run or control NAME.SLUG.worst_delta, .matched_tokens, .power, .tokens_compared, .stopped_at.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glm5_matrix.matrix.tolerances import Tolerances
from glm5_matrix.results.recorder import record_figure, record_outputs
from glm5_matrix.verdicts import compare
from glm5_matrix.verdicts.compare import (
    Agreement,
    GreedyOutput,
    NoiseFloor,
    Scored,
    TokenAgreement,
)

# Candidates per step kept for the rule (each side's token must be among the other's).
TOP_LOGPROBS = 5


class NoPower(AssertionError):
    """A negative control the comparison could not tell apart from the noise (it passed the rule,
    or was rejected below the power bar): the check has no power on this run, which says
    nothing of vLLM either way. An AssertionError, so that a suite fails on it: raise the signal,
    never narrow the tolerance. A suite may catch it only where another comparison carries the
    check and is judged (test_e2e's repeat: the prefill step carries the stale block's power, the
    whole run's is recorded)."""


def _power_figure(power: float) -> float | str:
    """JSON holds no infinity: an infinite power is recorded as the string "inf"."""
    return "inf" if math.isinf(power) else round(power, 3)


@dataclass(frozen=True)
class Comparison:
    """One named comparison of a suite, with the noise it is judged against and the power its
    controls must reach."""

    name: str
    floor: NoiseFloor
    # The bar every control's power must reach: the profile's min_power through repeated(); the
    # default, 1, only asks for a rejection (hand-built Comparisons of the unit tests).
    min_power: float = 1.0

    def _label(self, names: tuple[str, str]) -> str:
        """The figures' and outputs' name for the run or control `names[1]`."""
        return f"{self.name}.{_slug(names[1])}"

    def agrees(self, reference: Scored, run: Scored, names: tuple[str, str]) -> Agreement:
        """`run` must agree with `reference` under the floor's tolerance."""
        label = self._label(names)
        record_outputs(label, [run])
        agreement = compare.check_agreement(reference, run, self.floor, names)
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
        return agreement

    def power(self, reference: Scored, control: Scored, names: tuple[str, str]) -> float:
        """The control's delta (the rule's measure with no bound; infinite where it parts from
        the reference at no near-tie) over the tolerance: printed and recorded, and at least the
        profile's min_power, or an AssertionError that says to raise the signal."""
        delta = compare.control_delta(reference, control, self.floor.tolerance)
        tolerance = self.floor.tolerance
        power = delta / tolerance if tolerance > 0 else math.inf
        label = self._label(names)
        shown = "inf (it parts at no near-tie)" if math.isinf(delta) else f"{delta:.4f}"
        print(
            f"{self.name}: the control {names[1]!r}: delta {shown} / tolerance {tolerance:.4f} = "
            f"power {power:.2f} (at least {self.min_power:g})"
        )
        record_figure(
            f"{label}.control_delta",
            "inf" if math.isinf(delta) else round(delta, 6),
            unit="nats",
        )
        record_figure(f"{label}.power", _power_figure(power), limit=self.min_power, relation=">=")
        # Where it parts at no near-tie (power inf), how far its scores moved all the same.
        worst = compare.unbounded_worst(reference, control)
        record_figure(
            f"{label}.control_worst_delta",
            "inf" if math.isinf(worst) else round(worst, 6),
            unit="nats",
        )
        if not power >= self.min_power:
            raise NoPower(
                f"{self.name}: the control {names[1]!r} is only {power:.2f}x the tolerance "
                f"(delta {delta:.4f}, tolerance {tolerance:.4f}; {self.floor.describe()}), below "
                f"the bar of {self.min_power:g}x: raise the signal (weights under which the "
                "guarded defect moves the output far beyond rounding, a control that differs in "
                "more of what the test guards, or a stronger comparison), never narrow the "
                "tolerance below the noise measured here"
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
    ) -> TokenAgreement:
        """`run` (along another path: a cached boundary, a drafter's verification) chooses the
        reference's tokens at every decisive step (compare.check_tokens_while_decisive under the
        floor's tolerance; with `along_path`, a drafter's, also above the differences the two
        runs showed on the same tokens before); printed and recorded, with the per-step logprob
        differences over the compared steps as a distribution (recorded, not judged)."""
        tolerance = self.floor.tolerance
        label = self._label(names)
        record_outputs(label, [run])
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
            raise
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
        return found

    def rejects_by_token(self, reference: Scored, control: Scored, names: tuple[str, str]) -> str:
        """The control (the reference's runner-up taken at a decisive step) must fail
        tokens_agree's rule, and its power must reach min_power; returns why it failed."""
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
        self.power(reference, control, names)
        return reason


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
    the distribution recorded, and the tolerance taken from it. `tolerances` (the profile's,
    ranges checked when it was loaded) gives min_distinct_tokens (the first run must vary that
    much), min_median_margin_steps (its greedy choices must win by that median margin) and
    min_power (what every control of the comparison must reach). Runs are named "PREFIX #1" ..
    "PREFIX #N" in messages."""
    names = [f"{names_prefix} #{i + 1}" for i in range(len(runs))]
    record_outputs(f"{name}.{_slug(names_prefix)}", runs)
    compare.assert_varies(runs[0].token_ids, tolerances.min_distinct_tokens, names[0])
    floor = compare.noise_spread(runs, names)
    _record_floor(name, floor)
    minimum = float(tolerances.min_median_margin_steps)
    _check_decisive(name, runs[0], names[0], floor.step, minimum)
    return Comparison(name, floor, float(tolerances.min_power))


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
    times (at least three: Tolerances refuses fewer when the profile is loaded); every run must
    be cold."""
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
    floor = dataclasses.replace(
        compare.noise_spread([first_step(r) for r in runs], names), step=step
    )
    _record_floor(name, floor)
    return Comparison(name, floor, float(tolerances.min_power))


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
