"""Greedy comparisons as the suites run them: measure the engine's noise floor on the reference,
judge the run under test against it, show with a negative control that the comparison can fail,
and record every figure into the cell's results (results.record_figure).

The rule itself is compare's (pure); this module only orders the steps and records them, so that
every suite (e2e repeat, offload warm run, MTP, DFlash2, PD) judges the same way and reports the
same figures: NAME.noise_floor, NAME.logit_step, NAME.tolerance, NAME.median_margin_steps,
NAME.worst_delta, NAME.matched_tokens, NAME.control_rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glm5_matrix import compare
from glm5_matrix.compare import Agreement, NoiseFloor, Scored
from glm5_matrix.results import record_figure

# Candidates per step kept for the rule (each side's token must be among the other's).
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class Comparison:
    """One named comparison of a suite, with the noise floor it is judged against."""

    name: str
    floor: NoiseFloor

    def agrees(self, reference: Scored, run: Scored, names: tuple[str, str]) -> Agreement:
        """`run` must agree with `reference` under the floor's tolerance."""
        agreement = compare.check_agreement(reference, run, self.floor, names)
        print(f"{self.name}: {names[0]} vs {names[1]}: {agreement.describe()}")
        label = f"{self.name}.{_slug(names[1])}"
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

    def across_path(self, steps: int, why: str) -> Comparison:
        """This comparison for a run computed along another path (`why`), allowed `steps` logit
        steps beyond the floor's tolerance: a measured profile value, recorded."""
        floor = self.floor.across_path(steps)
        print(f"{self.name}: {steps} path step(s) allowed ({why}): {floor.describe()}")
        record_figure(f"{self.name}.path_steps", steps, unit="logit steps")
        record_figure(f"{self.name}.path_tolerance", round(floor.tolerance, 6), unit="nats")
        return Comparison(self.name, floor)

    def path_measured(self, reference: Scored, run: Scored, names: tuple[str, str]) -> float:
        """How far `run` (computed along another path) is from `reference`, in logit steps, by
        the same rule with no bound: printed and recorded before it is judged, so that a failing
        run still shows the value a profile's path_steps would be re-measured from."""
        try:
            worst = compare.noise_floor(reference, run, names).worst
        except AssertionError:  # they part outright: no path noise; agrees() says where
            worst = float("inf")
        steps = worst / self.floor.step if self.floor.step else 0.0
        print(
            f"{self.name}: {names[0]} vs {names[1]} measured: worst |delta| {worst:.4f} = "
            f"{steps:.1f} logit steps"
        )
        record_figure(f"{self.name}.path_worst_delta", round(worst, 6), unit="nats")
        record_figure(f"{self.name}.path_worst_steps", round(steps, 2), unit="logit steps")
        return steps

    def rejects(self, reference: Scored, control: Scored, names: tuple[str, str]) -> str:
        """The negative control must fail the same rule; returns why it failed."""
        reason = compare.check_rejected(reference, control, self.floor, names)
        print(f"{self.name}: the control {names[1]!r} is rejected: {reason}")
        record_figure(f"{self.name}.control_rejected", reason.split("\n")[0][:300])
        return reason


def measured(
    name: str,
    first: Scored,
    second: Scored,
    names: tuple[str, str],
    min_median_margin_steps: float | None = None,
    floor_factor: float = 1.0,
) -> Comparison:
    """The reference run done twice: its noise floor (recorded; the tolerance takes it
    `floor_factor` times, the profile's measured [tolerances] floor_factor), and, when a minimum
    is given, the check that its greedy choices win by that median margin in logit steps."""
    floor = compare.noise_floor(first, second, names).with_factor(floor_factor)
    print(f"{name}: {floor.describe()}")
    record_figure(f"{name}.noise_floor", round(floor.worst, 6), unit="nats")
    record_figure(f"{name}.logit_step", floor.step, unit="nats")
    record_figure(f"{name}.tolerance", round(floor.tolerance, 6), unit="nats")
    if min_median_margin_steps is not None:
        decisive = compare.check_decisive(first, floor.step, min_median_margin_steps, names[0])
        print(f"{name}: {names[0]}: {decisive.describe()}")
        record_figure(
            f"{name}.median_margin_steps",
            round(decisive.median_steps, 2),
            limit=min_median_margin_steps,
            relation=">=",
            unit="logit steps",
        )
        record_figure(f"{name}.exact_ties", decisive.ties, unit="steps")
    return Comparison(name, floor)


def _slug(text: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def reference_twice(
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    name: str,
    tolerances: dict[str, Any],
    names: tuple[str, str] = ("cold", "cold again"),
    reset: Callable[[], object] | None = None,
) -> tuple[Scored, Comparison]:
    """The reference: `prompt` on a running glm5_matrix.engines.Engine from an empty prefix cache
    (emptied by `reset`, default the engine's reset_prefix_cache), done twice. Returns the first
    run and the comparison measured from the two (the profile's min_distinct_tokens and
    min_median_margin_steps apply to it)."""
    runs: list[Scored] = []
    for _ in range(2):
        if reset is None:
            assert engine.reset_prefix_cache(), "reset_prefix_cache() refused"
        else:
            reset()
        run = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        assert not run.cached_tokens, f"{names[len(runs)]} is not cold: {run.cached_tokens} cached"
        runs.append(run)
    compare.assert_varies(runs[0].token_ids, int(tolerances["min_distinct_tokens"]), names[0])
    comparison = measured(
        name,
        runs[0],
        runs[1],
        names,
        min_median_margin_steps=float(tolerances["min_median_margin_steps"]),
        floor_factor=float(tolerances["floor_factor"]),
    )
    return runs[0], comparison


def runner_up_control(
    engine: Any, prompt: list[int], max_tokens: int, reference: Scored, comparison: Comparison
) -> Scored:
    """The reference request steered (logit_bias) off its own choice at its first decisive step,
    so that it takes the runner-up there: what a drafted token accepted against the target's
    greedy choice amounts to (a broken verification). Its logprobs stay vLLM's raw ones."""
    step = compare.decisive_step(reference, comparison.floor.tolerance)
    assert step is not None, (
        f"{comparison.name}: no step of the reference wins by more than the tolerance "
        f"{comparison.floor.tolerance:.4f}: no control can be told apart from noise"
    )
    token = reference.token_ids[step]
    print(f"{comparison.name}: control takes the runner-up at step {step} (not {token})")
    record_figure(f"{comparison.name}.control_step", step)
    assert engine.reset_prefix_cache(), "reset refused"
    return engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS, logit_bias={token: -100.0})
