"""glm5_matrix.verdicts.judging on hand-made greedy outputs (no vLLM): what each comparison records, and
that each fails where it must."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import pytest
from scored_data import DECISIVE, STEP, greedy, model_logits, nudged, scored

from glm5_matrix.matrix.tolerances import Tolerances
from glm5_matrix.results import recorder
from glm5_matrix.verdicts import judging

TOLERANCES = Tolerances(
    min_distinct_tokens=4,
    min_median_margin_steps=12,
    reference_repeats=4,
    min_power=2.0,
    false_red_per_cell=0.01,
    comparisons_per_cell=10,
)


@pytest.fixture(autouse=True)
def fresh_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "_STATE", recorder._State())


def _figures() -> dict[str, recorder.Figure]:
    return {f.name: f for f in recorder.figures()}


def _reference(runs: int = 30) -> tuple[list[list[float]], list]:
    """A decisive model's logits and the reference done `runs` times, every other run nudged by
    one step (a GPU-like reference: the row's upper half one tied value, its tolerance about
    six steps)."""
    logits = model_logits(1, lead=DECISIVE)
    return logits, [greedy(nudged(logits, k % 2)) for k in range(runs)]


def test_repeated_records_the_distribution() -> None:
    _, runs = _reference(4)
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    floor = comparison.floor
    assert (floor.runs, floor.pairs, comparison.min_power) == (4, 6, 2.0)
    assert floor.share == 0.0005 and comparison.runs == tuple(runs)
    figures = _figures()
    assert figures["repeat.reference_repeats"].value == 4
    assert figures["repeat.noise_pairs"].value == 6
    assert figures["repeat.false_red_share"].value == 0.0005
    assert len(figures["repeat.reference_row"].value) == 3
    assert figures["repeat.noise_min"].value == round(floor.least, 6)
    assert figures["repeat.noise_median"].value == round(floor.median, 6)
    assert figures["repeat.noise_max"].value == round(floor.worst, 6)
    assert figures["repeat.noise_max_steps"].value == pytest.approx(floor.worst / STEP, abs=0.01)
    assert figures["repeat.tolerance"].value == round(floor.tolerance, 6)
    assert figures["repeat.logit_step"].value == STEP
    assert figures["repeat.median_margin_steps"].relation == ">="


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"min_median_margin_steps": 500}, "cold #1 is flat"),
        ({"min_distinct_tokens": 50}, "cold #1 does not vary"),
    ],
)
def test_repeated_refuses(changed: dict, message: str) -> None:
    # (a missing tolerance or one out of its range never gets here: tests/unit/matrix/
    # test_tolerances.py, refused when the profile is loaded)
    _, runs = _reference()
    with pytest.raises(AssertionError, match=message):
        judging.repeated("repeat", runs, "cold", dataclasses.replace(TOLERANCES, **changed))


def test_reference_runs_are_done_reference_repeats_times() -> None:
    logits, _ = _reference()

    class Engine:
        resets = 0

        def reset_prefix_cache(self) -> bool:
            Engine.resets += 1
            return True

        def generate_scored(self, prompt: list[int], max_tokens: int, top: int) -> object:
            return greedy(nudged(logits, Engine.resets))

    runs = judging.reference_runs(
        Engine(), [1], 4, dataclasses.replace(TOLERANCES, reference_repeats=5)
    )
    assert len(runs) == Engine.resets == 5


def test_power_is_recorded_and_a_weak_control_fails() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    assert comparison.floor.tolerance < 7 * STEP
    # A control whose logits moved by nine steps: rejected by the logprob rule, but too weakly.
    weak = greedy(nudged(logits, 9))
    with pytest.raises(judging.NoPower, match=r"below the bar of 2x: raise the signal"):
        comparison.rejects_by_logprobs(runs[0], weak, ("cold", "stale block"))
    weak_power = _figures()["repeat.stale_block.power"]
    assert 1.0 < weak_power.value < 2.0 and weak_power.limit == 2.0
    # The step whose difference a wider tolerance would have to cover (here the first to fail).
    assert _figures()["repeat.stale_block.deciding_step"].value == 1
    assert _figures()["repeat.stale_block.control_bound"].value == round(
        comparison.floor.tolerance, 6
    )
    # Twenty steps away: power about 3, passes.
    strong = greedy(nudged(logits, 20))
    power = comparison.power(runs[0], strong, ("cold", "strong"))
    assert 2.0 < power < 5.0
    strong_figures = _figures()
    assert strong_figures["repeat.strong.control_delta"].unit == "nats"
    assert (
        strong_figures["repeat.strong.control_worst_delta"].value
        == strong_figures["repeat.strong.control_delta"].value
    )


def test_a_control_that_parts_at_no_near_tie_has_infinite_power() -> None:
    _, runs = _reference()
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    other = greedy(model_logits(2, lead=DECISIVE))  # another model: its own tokens from step 0
    reason = comparison.rejects(runs[0], other, ("cold", "other model"))
    assert reason.startswith("step 0")
    figures = _figures()
    assert figures["repeat.other_model.power"].value == "inf"
    assert figures["repeat.other_model.control_delta"].value == "inf"
    assert figures["repeat.other_model.control_worst_delta"].value == "inf"  # unscored token
    assert comparison.power(runs[0], other, ("cold", "other model")) == math.inf


def test_a_control_within_the_tolerance_fails_before_its_power() -> None:
    _, runs = _reference()
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    with pytest.raises(AssertionError, match="negative control 'same' passes"):
        comparison.rejects(runs[0], runs[1], ("cold", "same"))


def test_tokens_agree_records_where_it_compared_up_to() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("mtp", runs, "target-only", TOLERANCES)
    drafted = greedy(nudged(logits, 30, every=7))  # far beyond the noise, the same tokens
    found = comparison.tokens_agree(runs[0], drafted, ("target-only", "MTP"))
    assert (found.compared, found.parted_at) == (12, None)
    figures = _figures()
    assert figures["mtp.mtp.tokens_compared"].value == 12
    assert "mtp.mtp.parted_at" not in figures
    assert len(figures["mtp.step_bounds"].value) == 12
    assert figures["mtp.mtp.step_delta_max"].value > 20 * STEP
    assert figures["mtp.mtp.step_delta_median"].value <= figures["mtp.mtp.step_delta_max"].value
    assert len(figures["mtp.mtp.step_deltas"].value) == 12
    assert figures["mtp.mtp.step_delta_max"].relation is None  # recorded, never judged


def test_tokens_agree_accepts_a_parting_at_a_near_tie_and_records_it() -> None:
    near = {5: -1.0, 6: -1.0 - STEP, 7: -3.0}
    reference = scored([1, 5, 9, 4], [{1: -0.5, 2: -2.0}, near, {9: -0.1}, {4: -0.1}])
    comparison = judging.Comparison("mtp", judging.compare.noise_floor(reference, reference))
    step = comparison.floor.step  # (read off these hand-made candidates' grid)
    assert comparison.bounds == (step,) * 4  # bitwise: one logit step at every step
    other = scored([1, 6, 3, 3], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.0}, {3: -0.1}, {3: -0.1}])
    found = comparison.tokens_agree(reference, other, ("target-only", "MTP"))
    assert (found.compared, found.parted_at, found.bound) == (1, 1, step)
    figures = _figures()
    assert figures["mtp.mtp.parted_at"].value == 1
    assert figures["mtp.mtp.parting_gaps"].value == [STEP, 0.0]
    assert figures["mtp.mtp.parting_bound"].value == step
    assert figures["mtp.mtp.tokens_compared"].value == 1


def test_tokens_agree_fails_on_a_changed_token_and_records_it() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("dflash", runs, "target-only", TOLERANCES)
    changed = [list(row) for row in logits]
    changed[4][runs[0].token_ids[4]] -= 10.0
    with pytest.raises(AssertionError, match="step 4: target-only chose"):
        comparison.tokens_agree(runs[0], greedy(changed), ("target-only", "DFlash2"))
    assert "step 4" in _figures()["dflash.dflash2.token_mismatch"].value
    # The differences up to and with the parting step, the evidence of what parted them.
    deltas = _figures()["dflash.dflash2.step_deltas"].value
    assert len(deltas) == 5 and deltas[:4] == [0.0] * 4 and deltas[4] > 0


def test_rejects_by_token() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("mtp", runs, "target-only", TOLERANCES)
    # What runner_up_control asks vLLM for: the reference's choice at the first step it wins by
    # min_power times the bound there, banned (logit_bias -100), the rest as it was.
    step = comparison.control_step(runs[0])
    assert step == 0
    banned = runs[0].token_ids[step]
    control = greedy([[v - 100.0 if t == banned else v for t, v in enumerate(r)] for r in logits])
    reason = comparison.rejects_by_token(runs[0], control, ("target-only", "runner-up accepted"))
    assert reason.startswith("step 0: target-only chose")
    # Its power by the token rule: infinite here, the banned token gone from the control's
    # candidates (these hand-made runs score the biased logits; vLLM's raw logprobs keep it, and
    # the power is then the reference's margin there over the bound: test_compare).
    figures = _figures()
    assert figures["mtp.runner_up_accepted.power"].value == "inf"
    assert figures["mtp.runner_up_accepted.control_bound"].value == round(comparison.bounds[0], 6)
    assert figures["mtp.runner_up_accepted.deciding_step"].value == 0
    # A control that changed nothing passes the token rule: the comparison proves nothing.
    with pytest.raises(judging.NoPower, match="passes the token rule"):
        comparison.rejects_by_token(runs[0], runs[2], ("target-only", "unchanged"))


def test_the_prefill_step_is_judged_by_its_own_noise() -> None:
    """Cold runs equal at their first step and noisy after it (what decode steps add on the
    H200): the whole run's tolerance cannot tell a control that moved only the first step by a
    few steps of the logits, the prefill step's can, with power."""
    logits = model_logits(1, lead=DECISIVE)
    runs = [greedy([logits[0], *nudged(logits[1:], 8 * k)]) for k in range(4)]
    whole = judging.repeated("repeat", runs, "cold", TOLERANCES)
    prefill = judging.prefill_step("repeat_prefill", runs, "cold", TOLERANCES, whole.floor.step)
    assert prefill.floor.worst == 0.0 and prefill.floor.tolerance == STEP
    assert whole.floor.tolerance > 20 * STEP
    assert _figures()["repeat_prefill.noise_pairs"].value == 6
    control = greedy(nudged(logits[:1], 12, every=2) + logits[1:])
    assert prefill.rejects(judging.first_step(runs[0]), judging.first_step(control), ("c", "x"))
    assert _figures()["repeat_prefill.x.power"].value >= 2.0
    # Over the whole run its logprobs lie within the decode steps' noise, and its tokens are
    # the reference's: neither rule of the whole run can tell it.
    with pytest.raises(AssertionError, match="passes the comparison"):
        whole.rejects_by_logprobs(runs[0], control, ("cold", "control"))
    with pytest.raises(judging.NoPower, match="passes the token rule"):
        whole.rejects(runs[0], control, ("cold", "control"))
    # A run with the reference's first step agrees there.
    prefill.agrees(judging.first_step(runs[0]), judging.first_step(runs[3]), ("c", "r"))


def test_first_step_keeps_the_prefills_output_alone() -> None:
    run = greedy(model_logits(2, lead=DECISIVE))
    first = judging.first_step(run)
    assert first.token_ids == [run.token_ids[0]]
    assert first.top_logprobs == [dict(run.top_logprobs[0])]
    assert first.logprobs == [run.logprobs[0]]


def _with_outliers(logits: list[list[float]], *steps: int) -> list:
    """28 runs at most a step apart, then runs nudged by `steps`."""
    return [greedy(nudged(logits, k % 2)) for k in range(28)] + [
        greedy(nudged(logits, k)) for k in steps
    ]


def test_agrees_measures_the_rules_false_red_rate_first() -> None:
    """Each comparison measures the rule it judges by: the prefill step its logprob rule, the
    whole run its token rule (its logprobs recorded, not judged)."""
    logits, runs = _reference()
    judging.set_device("NVIDIA H100 80GB HBM3")
    whole = judging.repeated("repeat", runs, "cold", TOLERANCES)
    prefill = judging.prefill_step("repeat_prefill", runs, "cold", TOLERANCES, whole.floor.step)
    again = greedy(nudged(logits, 1))
    prefill.agrees(judging.first_step(runs[0]), judging.first_step(again), ("cold", "repeat"))
    whole.agrees(runs[0], again, ("cold", "repeat"))
    figures = _figures()
    for name, rule in (("repeat_prefill", "agreement"), ("repeat", "tokens")):
        prefix = f"{name}.false_red.{rule}"
        assert figures[f"{prefix}.rate"].value == 0.0
        assert figures[f"{prefix}.rate"].limit == 0.0005
        assert figures[f"{prefix}.judged"].value == 30 * 29
        assert figures[f"{prefix}.outliers"].limit == 2
        assert figures[f"{prefix}.rate_at_half"].unit == "15 runs"
        assert figures[f"{prefix}.device"].value == "NVIDIA H100 80GB HBM3"
    assert "repeat.false_red.agreement.rate" not in figures
    assert figures["repeat_prefill.repeat.exceedance"].value == 1.0  # within the bulk
    assert figures["repeat_prefill.repeat.exceedance"].limit == 0.0005
    assert figures["repeat.repeat.exceedance"].limit is None  # recorded, not judged
    assert figures["repeat.repeat.logprob_worst"].value > 0
    assert "repeat.repeat.worst_delta" not in figures  # the report's judged leaf
    assert figures["repeat.repeat.tokens_compared"].value == 12
    # Recorded once per rule: a second run judged adds no second measurement.
    whole.agrees(runs[0], runs[1], ("cold", "again"))
    names = [f.name for f in recorder.figures()]
    assert names.count("repeat.false_red.tokens.rate") == 1
    # The prefill's reference runs are kept with the outputs, for a replay.
    assert len(recorder._STATE.outputs["repeat_prefill.cold"]["outputs"]) == 30


def test_a_whole_run_is_judged_by_its_tokens() -> None:
    """Over a whole run the logprobs may lie far beyond the tolerance (what a decode step's
    jump does on the GPU): the tokens decide. A token changed where the reference is decisive
    fails."""
    logits, runs = _reference()
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    far = greedy(nudged(logits, 40, every=7))
    assert far.token_ids == runs[0].token_ids
    found = comparison.agrees(runs[0], far, ("cold", "repeat"))
    assert found == judging.TokenAgreement(12, 12)
    figures = _figures()
    assert figures["repeat.repeat.logprob_worst"].value > 5 * comparison.floor.tolerance
    assert figures["repeat.repeat.step_delta_max"].relation is None
    changed = [list(row) for row in logits]
    changed[3][runs[0].token_ids[3]] -= judging.compare.margins(runs[0])[3] + 2 * STEP
    with pytest.raises(AssertionError, match=r"step 3: cold chose .*a decisive step"):
        comparison.agrees(runs[0], greedy(changed), ("cold", "changed"))


def _jumpy(logits: list[list[float]], jumps: dict[int, int], runs: int = 30) -> list:
    """The H100's mixture in small: every run a step or two off the others at every step, and
    the runs in `jumps` (run -> steps) moved by that many steps more at decode step 7 only."""
    third = sorted(range(len(logits[7])), key=lambda t: -logits[7][t])[2]
    found = []
    for k in range(runs):
        moved = nudged(logits, k % 3)
        if k in jumps:  # one candidate moves, as a top-k flip moves some keys' attention
            moved[7] = [v + jumps[k] * STEP if t == third else v for t, v in enumerate(moved[7])]
        found.append(greedy(moved))
    return found


def test_the_heavy_tailed_mixture_breaks_the_logprob_rule_not_the_token_rule() -> None:
    """Two of 30 runs jump by 10 and 24 steps at one decode step (the H100: 0.3 to 0.5 nats, 20
    of 450 runs). Over the whole run the logprob rule rejects each against nearly every reference that
    lacks it (far above its share, and two outliers trip its self-check: the first H100 control
    run's failure), while the token rule, which the jump cannot move past a decisive margin,
    rejects none; the prefill step, where no run jumps, stays within its share."""
    logits = model_logits(1, lead=DECISIVE)
    runs = _jumpy(logits, {11: 10, 23: 24})
    assert all(r.token_ids == runs[0].token_ids for r in runs)
    comparison = judging.repeated("offload_repeat", runs, "GPU repeat", TOLERANCES)
    logprobs = comparison.measure_false_red(judging.AGREEMENT)
    tokens = comparison.measure_false_red(judging.TOKENS)
    assert logprobs is not None and tokens is not None
    assert logprobs.rate > 10 * logprobs.share and logprobs.tripped
    assert set(logprobs.outliers) == {11, 23}
    assert tokens.rate == 0.0 and not tokens.tripped
    comparison.agrees(runs[0], runs[1], ("GPU repeat", "warm from CPU"))  # no FalseRedBound
    prefill = judging.prefill_step(
        "offload_repeat_prefill", runs, "GPU repeat", TOLERANCES, comparison.floor.step
    )
    measured = prefill.measure_false_red(judging.AGREEMENT)
    assert measured is not None and measured.rate == 0.0 and not measured.tripped


def test_a_reference_with_outlying_runs_fails_its_own_comparison() -> None:
    """Two runs far out at the prefill step (12 and 40 steps) among 30: the 40-step one masks
    the 12-step one, found once the first is set aside; two outliers prove the rule over its
    share, and the comparison fails saying to add reference runs, though the run under test
    agrees."""
    logits, _ = _reference()
    runs = _with_outliers(logits, 12, 40)
    prefill = judging.prefill_step("offload_repeat_prefill", runs, "GPU repeat", TOLERANCES, STEP)
    with pytest.raises(judging.FalseRedBound, match="add reference runs"):
        prefill.agrees(
            judging.first_step(runs[0]),
            judging.first_step(runs[1]),
            ("GPU repeat", "warm from CPU"),
        )
    figures = _figures()
    assert figures["offload_repeat_prefill.false_red.agreement.outliers"].value == 2
    assert figures["offload_repeat_prefill.false_red.agreement.rate"].value > 0.0005
    assert figures["offload_repeat_prefill.warm_from_cpu.worst_delta"].value <= 2 * STEP


def test_a_failed_verdict_says_what_the_rule_measured_and_how_its_path_compared() -> None:
    """The issue's false red, in small: the warm path's own runs sit further from reference #1
    than the reference's do; the judged warm run fails at the prefill step, and its message says
    the rule's measured rate (none of the reference's own runs rejected) and that the path is
    shifted: a finding about the path, which no tolerance widened for it would show. Over the
    whole run the same path keeps the reference's tokens and passes, the shift recorded."""
    logits, runs = _reference()
    prefill = judging.prefill_step("offload_repeat_prefill", runs, "GPU repeat", TOLERANCES, STEP)
    warm = [greedy(nudged(logits, k)) for k in (12, 9, 10, 11, 9, 10, 12, 11)]
    firsts = [judging.first_step(w) for w in warm]
    with pytest.raises(AssertionError, match="> tolerance") as failed:
        prefill.agrees(
            judging.first_step(runs[0]),
            firsts[0],
            ("GPU repeat", "warm from CPU"),
            path_runs=firsts[1:],
        )
    message = str(failed.value)
    assert "0 of 870 held-out judgements rejected" in message
    assert "noisier than the reference path" in message
    figures = _figures()
    assert figures["offload_repeat_prefill.warm_from_cpu.path_p"].value < 0.01
    assert figures["offload_repeat_prefill.warm_from_cpu.path_beyond_reference"].value == 7
    assert (
        figures["offload_repeat_prefill.warm_from_cpu.worst_delta"].value
        > figures["offload_repeat_prefill.tolerance"].value
    )
    whole = judging.repeated("offload_repeat", runs, "GPU repeat", TOLERANCES)
    whole.agrees(runs[0], warm[0], ("GPU repeat", "warm from CPU"), path_runs=warm[1:])
    assert _figures()["offload_repeat.warm_from_cpu.path_p"].value < 0.01


def test_the_runner_up_control_is_steered_where_it_has_the_power() -> None:
    """The reference wins step 0 by less than twice the bound there: the control is steered at
    the first step it wins by min_power times its bound, with a token not chosen before."""
    logits = model_logits(1, lead=DECISIVE)
    first = sorted(range(len(logits[0])), key=lambda t: -logits[0][t])
    logits[0][first[0]] = logits[0][first[1]] + STEP  # step 0 won by one step only
    runs = [greedy(nudged(logits, k % 2)) for k in range(30)]
    comparison = judging.repeated("moe_agree", runs, "deep_gemm", TOLERANCES)
    margins = judging.compare.margins(runs[0])
    assert margins[0] < 2 * comparison.bounds[0]
    step = comparison.control_step(runs[0])
    assert step is not None and step > 0
    assert margins[step] >= 2 * comparison.bounds[step]

    class Engine:
        asked: ClassVar[dict[int, float]] = {}

        def reset_prefix_cache(self) -> bool:
            return True

        def generate_scored(
            self, prompt: list[int], max_tokens: int, top: int, logit_bias: dict[int, float]
        ) -> object:
            Engine.asked = logit_bias
            return greedy(
                [[v + logit_bias.get(t, 0.0) for t, v in enumerate(row)] for row in logits]
            )

    control = judging.runner_up_control(Engine(), [1], 12, runs[0], comparison)
    assert Engine.asked == {runs[0].token_ids[step]: -100.0}
    figures = _figures()
    assert figures["moe_agree.control_step"].value == step
    assert figures["moe_agree.control_step_bound"].value == round(comparison.bounds[step], 6)
    comparison.rejects_by_token(runs[0], control, ("deep_gemm", "off its own choice"))
    assert _figures()["moe_agree.off_its_own_choice.deciding_step"].value == step


def test_a_faithful_path_is_no_finding() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("repeat", runs, "cold", TOLERANCES)
    again = [greedy(nudged(logits, k % 2)) for k in range(1, 9)]
    comparison.agrees(runs[0], again[0], ("cold", "repeat"), path_runs=again[1:])
    assert _figures()["repeat.repeat.path_p"].value >= 0.01


def test_tokens_agree_measures_the_token_rule() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("mtp", runs, "target-only", TOLERANCES)
    drafted = greedy(nudged(logits, 30, every=7))
    comparison.tokens_agree(runs[0], drafted, ("target-only", "MTP"), along_path=True)
    figures = _figures()
    assert figures["mtp.false_red.tokens_along_path.rate"].value == 0.0
    assert "mtp.false_red.agreement.rate" not in figures


def test_a_reference_other_than_reference_one_gets_no_measurement() -> None:
    logits, runs = _reference()
    comparison = judging.repeated("pd", runs, "P-only", TOLERANCES)
    other = greedy(nudged(logits, 1))
    comparison.tokens_agree(other, runs[0], ("P-only mid-block", "P->D"))
    assert not any(".false_red." in f.name for f in recorder.figures())
