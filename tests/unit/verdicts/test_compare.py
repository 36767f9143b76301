"""glm5_matrix.verdicts.compare on hand-made data (no vLLM)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from scored_data import DECISIVE, STEP, greedy, model_logits, nudged, scored

from glm5_matrix.verdicts import compare, false_red


def _state(seed: int, shape: tuple[int, ...]) -> list:
    """A nested-list 'state tensor' of normal values."""
    rng = random.Random(seed)

    def build(dims: tuple[int, ...]) -> list:
        if len(dims) == 1:
            return [rng.gauss(0.0, 1.0) for _ in range(dims[0])]
        return [build(dims[1:]) for _ in range(dims[0])]

    return build(shape)


def _page(seed: int) -> list[list]:
    """A Mamba page: a conv state and a recurrent state."""
    return [_state(seed, (3, 16)), _state(seed + 1000, (2, 4, 4))]


def _perturbed(page: list[list], scale: float, seed: int) -> list[list]:
    rng = random.Random(seed)

    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x + scale * rng.gauss(0.0, 1.0)

    return walk(page)


def test_assert_varies() -> None:
    compare.assert_varies([1, 2, 3, 4, 1], 4)
    with pytest.raises(AssertionError, match="does not vary: 1 distinct"):
        compare.assert_varies([7] * 24, 4)
    with pytest.raises(AssertionError, match="2 distinct"):
        compare.assert_varies([7, 8] * 12, 4)


def test_relative_error() -> None:
    assert compare.relative_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert compare.relative_error([[3.0, 0.0]], [[0.0, 4.0]]) == pytest.approx(5.0 / 4.0)
    assert compare.relative_error([0.0], [0.0]) == 0.0
    assert math.isinf(compare.relative_error([1.0], [0.0]))
    with pytest.raises(ValueError, match="3 elements with 2"):
        compare.relative_error([1.0, 2.0, 3.0], [1.0, 2.0])


def test_checkpoint_pages_accept_own_reference_within_tolerance() -> None:
    references = {f"group{g}": _page(g) for g in range(3)}
    cached = {g: _perturbed(p, 1e-3, 7) for g, p in references.items()}
    errors = compare.check_checkpoint_pages(cached, references, tolerance=0.01)
    assert set(errors) == set(references)
    assert all(0.0 < e <= 0.01 for per_state in errors.values() for e in per_state)


def test_checkpoint_pages_reject_another_groups_page() -> None:
    """The #59536 shape of bug: group 1's checkpoint lands in group 0's page, so group 1's cached
    page is group 0's state."""
    references = {f"group{g}": _page(g) for g in range(3)}
    cached = dict(references)
    cached["group1"] = references["group0"]
    with pytest.raises(AssertionError, match="group1: relative error") as failure:
        compare.check_checkpoint_pages(cached, references, tolerance=0.05)
    # Only the misplaced group is named; the others match their own references.
    assert "group0:" not in str(failure.value) and "group2:" not in str(failure.value)


def test_checkpoint_pages_reject_stale_or_missing_pages() -> None:
    references = {"group0": _page(0), "group1": _page(1)}
    with pytest.raises(AssertionError, match=r"no cached page for group\(s\) \['group1'\]"):
        compare.check_checkpoint_pages({"group0": references["group0"]}, references, 0.05)
    zeroed = {"group0": references["group0"], "group1": [_state(0, (3, 16)), [[[0.0] * 4] * 4] * 2]}
    with pytest.raises(AssertionError, match="group1"):
        compare.check_checkpoint_pages(zeroed, references, 0.05)
    with pytest.raises(AssertionError, match="1 cached state"):
        compare.check_checkpoint_pages(
            {"group0": references["group0"][:1]}, {"group0": references["group0"]}, 0.05
        )


def test_bf16_step() -> None:
    assert compare.bf16_step(8.1) == 2.0**-4
    assert compare.bf16_step(-7.9) == 2.0**-5
    assert compare.bf16_step(1.0) == 2.0**-7
    assert compare.bf16_step(0.0) == 0.0


def test_logit_step_is_read_off_the_candidates_grid() -> None:
    output = greedy(model_logits(1))
    assert compare.logit_step(output) == STEP
    # A model whose logits are no bf16 numbers: one bf16 step at the logprobs' magnitude.
    rng = random.Random(3)
    smooth = greedy([[rng.uniform(0, 3) for _ in range(64)] for _ in range(8)])
    magnitude = sorted(abs(v) for v in smooth.logprobs)[len(smooth.logprobs) // 2]
    assert compare.logit_step(smooth) == compare.bf16_step(magnitude)


def test_identical_runs_agree_with_a_zero_floor() -> None:
    a = greedy(model_logits(1))
    floor = compare.noise_floor(a, greedy(model_logits(1)))
    assert floor.worst == 0.0 and floor.tolerance == STEP
    assert (floor.runs, floor.pairs, floor.spread, floor.least_matched) == (2, 1, 0.0, 12)
    agreement = compare.check_agreement(a, greedy(model_logits(1)), floor, ("cold", "repeat"))
    assert (agreement.matched, agreement.total, agreement.parting_gaps) == (12, 12, None)


def test_two_runs_extrapolate_far_and_more_runs_less() -> None:
    """With two runs the row is one difference: the rule, at a false-red share of 5e-4, must
    reach far beyond it (the model's tail from one sample); the same difference among many runs
    needs far less room."""
    logits = model_logits(1)
    reference = greedy(logits)
    floor = compare.noise_floor(reference, greedy(nudged(logits, 1)), ("a", "a'"))
    assert floor.worst == pytest.approx(STEP, rel=0.1)  # one step, less the logsumexp's shift
    _, c = false_red.tail_parameters(2, floor.share)
    assert floor.tolerance == pytest.approx(c * floor.worst + STEP)
    assert floor.tolerance > 100 * STEP
    runs = [greedy(nudged(logits, k % 2)) for k in range(30)]
    many = compare.noise_spread(runs, [f"r{i}" for i in range(30)], 0.0005)
    # (the row's upper half is one tied value: each counted half a step above the threshold)
    assert many.tolerance < 8 * STEP < floor.tolerance / 10


def test_the_tolerance_is_reference_one_s_row_with_its_tail() -> None:
    """Four runs nudged by 0, 1, 2 and 3 steps: six pairs, 1 to 3 steps apart; reference #1's
    row is its three differences (1, 2, 3 steps), and the tolerance the row's median plus c
    times the excess above it, plus one step."""
    logits = model_logits(1, lead=DECISIVE)
    runs = [greedy(nudged(logits, k)) for k in range(4)]
    floor = compare.noise_spread(runs, [f"cold #{i + 1}" for i in range(4)], 0.01)
    assert (floor.runs, floor.pairs, floor.total, floor.least_matched) == (4, 6, 12, 12)
    in_steps = sorted(round(w / STEP) for w in floor.pair_worsts)
    assert in_steps == [1, 1, 1, 2, 2, 3]
    assert [round(w / STEP) for w in floor.row] == [1, 2, 3]
    # (Each a little under its nudge: the logsumexp moves with the nudged logits.)
    assert floor.worst == max(floor.pair_worsts) and floor.least == min(floor.pair_worsts)
    j, c = false_red.tail_parameters(3, 0.01)
    ordered = sorted(floor.row, reverse=True)
    assert floor.tolerance == pytest.approx(ordered[j] + c * (ordered[0] - ordered[j]) + STEP)
    assert "4 runs, 6 pair(s)" in floor.describe()
    matrix = floor.matrix()
    assert (
        matrix[0][1:] == list(floor.row) and matrix[3][2] == matrix[2][3] == floor.pair_worsts[-1]
    )
    # A run just inside the tolerance agrees; one beyond it does not.
    inside = int(floor.tolerance / STEP) - 1
    compare.check_agreement(runs[0], greedy(nudged(logits, inside)), floor, ("cold #1", "r"))
    with pytest.raises(AssertionError, match="> tolerance"):
        compare.check_agreement(
            runs[0], greedy(nudged(logits, 2 * inside)), floor, ("cold #1", "b")
        )


def test_a_bitwise_engine_has_a_one_step_tolerance_whatever_n() -> None:
    runs = [greedy(model_logits(1, lead=DECISIVE)) for _ in range(3)]
    floor = compare.noise_spread(runs, ["a", "b", "c"], 0.0005)
    assert floor.pair_worsts == (0.0, 0.0, 0.0) and floor.tolerance == STEP


def test_the_noise_refuses_too_few_runs_and_a_broken_pair() -> None:
    a = greedy(model_logits(1, lead=DECISIVE))
    with pytest.raises(ValueError, match="at least twice, not 1 run"):
        compare.noise_spread([a], ["a"], 0.0005)
    with pytest.raises(ValueError, match="2 name"):
        compare.noise_spread([a, a, a], ["a", "b"], 0.0005)
    with pytest.raises(ValueError, match="3 pair"):
        compare.NoiseFloor((0.0, 0.0, 0.0), STEP, runs=2, least_matched=1, total=1, share=0.0005)
    # The third run parts from the second at a token the second did not score: broken, whichever
    # pair it is in.
    b = scored([1, 5], [{1: -0.5}, {5: -1.0, 6: -1.1}])
    c = scored([1, 9], [{1: -0.5}, {9: -1.0, 5: -1.2}])
    with pytest.raises(AssertionError, match="the reference run done 3 times: step 1"):
        compare.noise_spread([b, b, c], ["a", "b", "c"], 0.0005)


def test_parting_at_a_near_tie_within_the_tolerance_is_accepted() -> None:
    tie = {5: -1.0, 6: -1.0, 7: -3.0}
    a = scored([1, 5, 9], [{1: -0.5, 2: -2.0}, tie, {9: -0.1}])
    b = scored([1, 6, 3], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.0 - STEP, 7: -3.0}, {3: -0.2}])
    floor = compare.NoiseFloor((0.0,), STEP, runs=2, least_matched=3, total=3, share=0.0005)
    agreement = compare.check_agreement(a, b, floor, ("a", "b"))
    assert agreement.matched == 1 and agreement.compared_steps == 2
    assert agreement.parting_gaps == (0.0, STEP)
    assert "near-tie" in agreement.describe()


@pytest.mark.parametrize(
    ("b", "message"),
    [
        # parts at a clear winner
        (
            scored([1, 6], [{1: -0.5, 2: -2.0}, {6: -0.97, 5: -1.02, 7: -3.0}]),
            r"step 1: b prefers 6 over 5 by 0\.0500 > tolerance",
        ),
        # parts at a token the other run did not score
        (
            scored([1, 8], [{1: -0.5, 2: -2.0}, {8: -0.9, 6: -1.0, 7: -3.0}]),
            "step 1: a's candidates .* lack the other side's token 8",
        ),
        # same tokens, a candidate scored otherwise
        (
            scored([1, 5], [{1: -0.5, 2: -2.5}, {5: -1.0, 6: -1.0, 7: -3.0}]),
            r"step 0: token 2 scores -2\.0000 in a and -2\.5000 in b",
        ),
        (scored([1], [{1: -0.5}]), "a has 2 tokens, b 1"),
    ],
)
def test_the_rule_rejects(b: compare.GreedyOutput, message: str) -> None:
    a = scored([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0, 7: -3.0}])
    floor = compare.NoiseFloor((0.0,), STEP, runs=2, least_matched=2, total=2, share=0.0005)
    with pytest.raises(AssertionError, match=message):
        compare.check_agreement(a, b, floor, ("a", "b"))
    assert message.split(":")[0].split(" ")[0] in compare.check_rejected(a, b, floor, ("a", "b"))


def test_a_control_that_passes_is_a_failure() -> None:
    a = greedy(model_logits(1))
    floor = compare.noise_floor(a, a)
    with pytest.raises(AssertionError, match="negative control 'other' passes"):
        compare.check_rejected(a, greedy(model_logits(1)), floor, ("ref", "other"))
    # Another model state (another seed) is rejected at step 0.
    reason = compare.check_rejected(a, greedy(model_logits(2)), floor, ("ref", "other"))
    assert reason.startswith("step 0")


def test_a_reference_that_parts_at_an_unscored_token_is_no_floor() -> None:
    a = scored([1, 5], [{1: -0.5}, {5: -1.0, 6: -1.1}])
    b = scored([1, 9], [{1: -0.5}, {9: -1.0, 5: -1.2}])
    with pytest.raises(AssertionError, match="the reference run done 2 times: step 1"):
        compare.noise_floor(a, b)


def test_margins_and_decisiveness() -> None:
    out = scored([1, 5, 9], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0}, {9: -0.1}])
    assert compare.margins(out) == [1.5, 0.0, math.inf]
    found = compare.check_decisive(out, STEP, 40, "out")
    assert (found.median_steps, found.least_steps, found.ties) == (48.0, 0.0, 1)
    with pytest.raises(AssertionError, match=r"out is flat: greedy margins: median 48\.0"):
        compare.check_decisive(out, STEP, 49, "out")


def test_decisive_step_reaches_min_power_times_the_bound_with_a_new_token() -> None:
    out = scored(
        [1, 1, 5, 9],
        [{1: -0.1, 2: -2.0}, {1: -0.1, 2: -2.0}, {5: -0.5, 6: -0.5}, {9: -0.1, 3: -3.0}],
    )
    assert compare.decisive_step(out, STEP) == 0
    # Step 0 wins by 1.9, short of twice a bound of 1.0; step 1 repeats its token (a bias
    # against it would steer step 0 too), step 2 is a tie: step 3 wins by 2.9.
    assert compare.decisive_step(out, 1.0, min_power=2.0) == 3
    # Bounds per step: a small bound at step 0 puts it first again.
    assert compare.decisive_step(out, [0.5, 1.0, 1.0, 1.0], min_power=2.0) == 0
    # Unlike the rule that stopped at the first step within the noise, a tie does not end the
    # search: the token rule walks on while the tokens are equal.
    later = scored(out.token_ids[2:], list(out.top_logprobs[2:]))
    assert compare.decisive_step(later, STEP) == 1
    assert compare.decisive_step(out, 5.0) is None  # no margin beats a bound of 5


# --- accumulated_spread and the bounds per step -------------------------------------------------


def test_accumulated_spread_grows_step_by_step_and_stops_at_a_parting() -> None:
    a = scored(
        [1, 5, 9, 4],
        [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.1}, {9: -1.0, 3: -1.02}, {4: -0.1}],
    )
    b = scored(
        [1, 5, 3, 7],
        [{1: -0.5, 2: -2.25}, {5: -1.0, 6: -1.0}, {3: -1.0, 9: -1.01}, {7: -0.1, 4: -0.9}],
    )
    found = compare.accumulated_spread(a, b)
    # Token 2 moved by 0.25 against token 1 at step 0; at the parting at step 2 the two gaps
    # (0.02 and 0.01) sum to the spread there, 0.03; nothing is compared after it.
    assert found == pytest.approx([0.25, 0.25, 0.25, 0.25])
    parting = compare.first_parting(a, b)
    assert parting is not None and parting.step == 2
    assert sum(parting.gaps) == pytest.approx(0.03)
    # A shift common to every candidate (the log-sum-exp's) moves no token: no spread.
    shifted = scored(
        list(a.token_ids), [{t: v - 0.3 for t, v in top.items()} for top in a.top_logprobs]
    )
    assert compare.accumulated_spread(a, shifted) == pytest.approx([0.0] * 4)
    assert compare.unbounded_worst(a, shifted) == pytest.approx(0.3)
    c = scored([1, 5, 8, 4], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.1}, {8: -0.9}, {4: -0.1}])
    # c parts at step 2 at a token a did not score: no gap, inf from there.
    assert compare.accumulated_spread(a, c) == [0.0, 0.0, math.inf, math.inf]
    assert compare.accumulated_spread(a, scored([1], [{1: -0.5}]))[1:] == [math.inf] * 3


def test_early_steps_are_bounded_by_their_own_smaller_noise() -> None:
    """30 runs bitwise at their first six steps and a step or two apart after: the bounds of
    the first steps are one logit step, those after wider, every step's the tail tolerance of
    reference #1's spreads up to it at its share of the comparison's."""
    logits = model_logits(1, lead=DECISIVE)
    runs = [greedy(logits[:6] + nudged(logits[6:], k % 3)) for k in range(30)]
    floor = compare.noise_spread(runs, [f"r{i}" for i in range(30)], 0.0005)
    assert floor.bounds[:6] == (STEP,) * 6
    assert all(b > 2 * STEP for b in floor.bounds[6:])
    assert list(floor.bounds) == false_red.step_bounds(floor.row_steps, STEP, 0.0005)
    assert floor.row_steps[-1] == [compare.accumulated_spread(runs[0], r)[-1] for r in runs[1:]]
    assert floor.matrix_steps()[2][5] == tuple(compare.accumulated_spread(runs[2], runs[5]))
    # A one-step floor's bound is its tolerance; a hand-built floor's every bound too.
    first = compare.noise_spread([judge_first(r) for r in runs], ["r"] * 30, 0.0005)
    assert first.bounds == (first.tolerance,)
    hand = compare.NoiseFloor((0.1,), STEP, runs=2, least_matched=3, total=3, share=0.0005)
    assert hand.bounds == (hand.tolerance,) * 3


def judge_first(run: compare.GreedyOutput) -> compare.GreedyOutput:
    return compare.GreedyOutput([run.token_ids[0]], [run.logprobs[0]], [run.top_logprobs[0]])


# --- control_delta: the power's numerator ------------------------------------------------------


def test_control_delta_measures_with_no_bound() -> None:
    logits = model_logits(1, lead=DECISIVE)
    reference = greedy(logits)
    assert compare.control_delta(reference, greedy(logits), STEP) == 0.0
    # Same tokens, logits moved by 9 steps: its worst difference, however far past the bound.
    moved = compare.control_delta(reference, greedy(nudged(logits, 9)), STEP)
    assert 7 * STEP < moved <= 9 * STEP
    # Another model parts at step 0, a token of its own: infinite.
    assert (
        compare.control_delta(reference, greedy(model_logits(2, lead=DECISIVE)), STEP) == math.inf
    )


def test_control_delta_of_a_parting() -> None:
    a = scored([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.5, 7: -3.0}])
    # Parts where a prefers 5 by 0.5: no near-tie under a tolerance of 0.1 -> infinite; under a
    # tolerance of 1.0 it is a near-tie, measured by its gap.
    b = scored([1, 6], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.25, 7: -3.0}])
    assert compare.control_delta(a, b, 0.1) == math.inf
    assert compare.control_delta(a, b, 1.0) == pytest.approx(0.5)
    assert compare.unbounded_worst(a, b) == pytest.approx(0.5)
    assert compare.unbounded_worst(a, scored([1], [{1: -0.5}])) == math.inf


# --- check_exact -------------------------------------------------------------------------------


def test_check_exact_accepts_the_same_bits() -> None:
    a = greedy(model_logits(1, lead=DECISIVE))
    assert compare.check_exact(a, greedy(model_logits(1, lead=DECISIVE)), ("P alone", "P->D")) == 12


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("ulp", r"step 3: token \d+ scores .* not bitwise equal"),
        ("chosen", r"step 3: token \d+ scores .* not bitwise equal"),
        ("token", r"step 3: P alone chose \d+, P->D \d+"),
        ("candidates", r"step 3: candidates \["),
        ("length", "P alone has 12 tokens, P->D 11"),
    ],
)
def test_check_exact_names_the_first_difference(change: str, message: str) -> None:
    a = greedy(model_logits(1, lead=DECISIVE))
    tokens, logprobs = list(a.token_ids), list(a.logprobs)
    top = [dict(t) for t in a.top_logprobs]
    other = next(t for t in top[3] if t != tokens[3])
    if change == "ulp":  # one candidate one float apart: nothing a tolerance would see
        top[3][other] = math.nextafter(top[3][other], 0.0)
    elif change == "chosen":
        logprobs[3] = math.nextafter(logprobs[3], 0.0)
    elif change == "token":
        tokens[3] = other
    elif change == "candidates":
        del top[3][other]
    else:
        tokens, logprobs, top = tokens[:-1], logprobs[:-1], top[:-1]
    b = compare.GreedyOutput(tokens, logprobs, top)
    with pytest.raises(AssertionError, match=message):
        compare.check_exact(a, b, ("P alone", "P->D"))


# --- check_tokens -------------------------------------------------------------------------------


def test_tokens_equal_pass_whatever_the_logprobs() -> None:
    """A run along another path: same tokens, logprobs 40 steps off (what no tolerance from
    the noise would accept): the token rule passes it, over every step."""
    logits = model_logits(1, lead=DECISIVE)
    reference = greedy(logits)
    drafted = greedy(nudged(logits, 40, every=7))
    assert drafted.token_ids == reference.token_ids
    found = compare.check_tokens(reference, drafted, STEP, ("target", "MTP"))
    assert found == compare.TokenAgreement(12, 12)
    assert found.describe() == "12 of 12 tokens equal"
    deltas = compare.step_deltas(reference, drafted, found.compared)
    assert len(deltas) == 12 and 30 * STEP < max(deltas) <= 40 * STEP


def test_a_token_changed_at_a_decisive_step_fails() -> None:
    logits = model_logits(1, lead=DECISIVE)
    reference = greedy(logits)
    changed = [list(row) for row in logits]
    winner = reference.token_ids[5]
    # The runner-up wins step 5 by 0.1, the winner still among the candidates.
    changed[5][winner] -= compare.margins(reference)[5] + 0.1
    control = greedy(changed)
    assert control.token_ids[:5] == reference.token_ids[:5]
    with pytest.raises(
        AssertionError, match=r"step 5: target chose \d+, MTP \d+, where target wins by"
    ):
        compare.check_tokens(reference, control, STEP, ("target", "MTP"))
    # Where the winner falls out of the run's candidates, no gap can be measured: no near-tie.
    changed[5][winner] -= 10.0
    with pytest.raises(AssertionError, match="a token the other side did not score"):
        compare.check_tokens(reference, greedy(changed), STEP, ("target", "MTP"))


def test_a_parting_at_a_near_tie_within_its_steps_bound_ends_the_comparison() -> None:
    near = {5: -1.0, 6: -1.0 - STEP, 7: -3.0}  # the reference wins step 1 by one step
    reference = scored([1, 5, 9], [{1: -0.5, 2: -2.0}, near, {9: -0.1, 3: -2.0}])
    # The run takes the other side of the near-tie, and then goes its own way.
    other = scored([1, 6, 3], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.0}, {3: -0.1, 9: -2.0}])
    found = compare.check_tokens(reference, other, 2 * STEP, ("target", "MTP"))
    assert (found.compared, found.total, found.parted_at, found.bound) == (1, 3, 1, 2 * STEP)
    assert found.gaps == pytest.approx((STEP, 0.0))
    assert "they part at step 1 at a near-tie" in found.describe()
    # Under a bound below that margin, step 1 is decisive and the run fails there.
    with pytest.raises(AssertionError, match="step 1: target chose 5, MTP 6"):
        compare.check_tokens(reference, other, STEP / 2, ("target", "MTP"))
    # Each step has its own bound: the parting's step decides.
    compare.check_tokens(reference, other, [STEP / 2, 2 * STEP, STEP / 2], ("target", "MTP"))
    with pytest.raises(AssertionError, match="step 1"):
        compare.check_tokens(reference, other, [2.0, STEP / 2, 2.0], ("target", "MTP"))


def test_the_rule_walks_past_a_near_tie_the_run_chose_alike() -> None:
    """The reference wins step 1 by one step only, and the run chooses the same there: its
    inputs stay the reference's, so step 2, won by 2 nats, still binds it (the rule that
    stopped at the first step within the noise compared nothing after step 1)."""
    near = {5: -1.0, 6: -1.0 - STEP}
    reference = scored([1, 5, 9], [{1: -0.5, 2: -2.0}, near, {9: -0.1, 3: -2.1}])
    run = scored([1, 5, 3], [{1: -0.5, 2: -2.0}, near, {3: -0.1, 9: -2.1}])
    with pytest.raises(AssertionError, match="step 2: target chose 9, run 3"):
        compare.check_tokens(reference, run, 2 * STEP, ("target", "run"))


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (scored([1, 8], [{1: -0.5, 2: -2.0}, {8: -0.9, 5: -1.0}]), "a token the other side"),
        (scored([1], [{1: -0.5, 2: -2.0}]), "run has 1 tokens; target has 2"),
    ],
)
def test_the_token_rule_refuses_an_unscored_token_and_a_short_run(
    run: compare.GreedyOutput, message: str
) -> None:
    reference = scored([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0}])
    with pytest.raises(AssertionError, match=message):
        compare.check_tokens(reference, run, 10.0, ("target", "run"))
    assert compare.token_threshold(reference, run).value == math.inf


def test_the_token_rule_refuses_a_negative_bound() -> None:
    reference = scored([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0}])
    other = scored([1, 6], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.0}])
    with pytest.raises(ValueError, match="must be >= 0"):
        compare.check_tokens(reference, other, -1.0, ("a", "b"))


def test_along_a_path_the_bar_is_what_the_paths_moved_the_scores_by_before() -> None:
    """A drafter's verification pass rounds otherwise: scores 3 steps apart at steps 0 and 1
    (same tokens), then a parting at step 2 where the reference wins by 2 steps. Within the
    reference's own noise alone (one step) that parting is decisive; along the path it lies
    within the 3 steps the paths already differed by, and the comparison stops there."""
    reference = scored(
        [1, 1, 5],
        [{1: -1.0, 2: -3.0}, {1: -1.0, 2: -3.0}, {5: -1.0, 6: -1.0 - 2 * STEP, 7: -4.0}],
    )
    drafted = scored(
        [1, 1, 6],
        [
            {1: -1.0 - 3 * STEP, 2: -3.0},
            {1: -1.0, 2: -3.0 + 3 * STEP},
            {6: -1.0, 5: -1.0 - STEP, 7: -4.0},
        ],
    )
    with pytest.raises(AssertionError, match="step 2: target chose 5, MTP 6"):
        compare.check_tokens(reference, drafted, STEP, ("target", "MTP"))
    found = compare.check_tokens(reference, drafted, STEP, ("target", "MTP"), along_path=True)
    assert (found.compared, found.parted_at) == (2, 2)
    assert found.bound == pytest.approx(3 * STEP)
    assert "<= 0.0938" in found.describe()


def test_along_a_path_a_jump_at_the_parting_step_itself_is_not_excused() -> None:
    """The bar comes from the steps before only: scores equal until step 2, where the run's
    scores move by 8 steps and it takes the reference's runner-up (won by 2 steps): what a
    corrupted verification does. It fails at step 2, as without the path."""
    before = [{1: -1.0, 2: -3.0}, {1: -1.0, 2: -3.0}]
    reference = scored([1, 1, 5], [*before, {5: -1.0, 6: -1.0 - 2 * STEP, 7: -4.0}])
    jumped = scored([1, 1, 6], [*before, {6: -1.0 + 6 * STEP, 5: -1.0, 7: -4.0}])
    with pytest.raises(AssertionError, match="step 2: target chose 5, MTP 6"):
        compare.check_tokens(reference, jumped, STEP, ("target", "MTP"), along_path=True)
    same = compare.check_tokens(reference, reference, STEP, ("target", "MTP"), along_path=True)
    assert same == compare.TokenAgreement(3, 3)


def test_along_a_path_the_runs_own_preference_at_a_reference_tie_is_its_paths() -> None:
    """What CI's e2e-cpu-tp4 met (2026-12-06): TP1 (the reference, deterministic: bound one
    logit step) ties 56 and 448 exactly at step 1 and keeps 56; TP4, whose all-reduce sums in
    another order, prefers 448 by 0.0469 (six steps). The reference is not decisive there, so
    along the path the parting ends the comparison; judged as one path (both sides within the
    reference's noise) it was a false red. A tie the run breaks the other way by any margin is
    still a tie of the reference's; the reference winning by more than its bound still fails."""
    first = {764: -0.2, 56: -3.0}
    tie = {56: -4.6582, 448: -4.6582, 71: -5.1426}
    reference = scored([764, 56], [first, tie])
    tp4 = scored([764, 448], [first, {448: -4.634829521179199, 56: -4.681704521179199, 71: -5.14}])
    bound = 0.0078125
    with pytest.raises(AssertionError, match=r"TP1 wins by 0.0000 and TP4 by 0.0469 > bound"):
        compare.check_tokens(reference, tp4, bound, ("TP1", "TP4"))
    found = compare.check_tokens(reference, tp4, bound, ("TP1", "TP4"), along_path=True)
    assert (found.compared, found.parted_at) == (1, 1)
    assert found.gaps == pytest.approx((0.0, 0.046875))
    assert compare.token_threshold(reference, tp4, along_path=True).value == 0.0
    # The reference deciding the step (56 by 0.1) is judged along the path as on one.
    decided = scored([764, 56], [first, {**tie, 56: -4.5582}])
    with pytest.raises(AssertionError, match=r"TP1 wins by 0.1000 \(judged\)"):
        compare.check_tokens(decided, tp4, bound, ("TP1", "TP4"), along_path=True)
    assert compare.token_threshold(decided, tp4, along_path=True).value == pytest.approx(0.1)
    # A token the reference did not score at all is no tie on any path.
    unscored = scored([764, 9], [first, {9: -4.0, 56: -4.7}])
    with pytest.raises(AssertionError, match="a token the other side did not score"):
        compare.check_tokens(reference, unscored, bound, ("TP1", "TP4"), along_path=True)


def test_equal_prefix_counts_the_shared_leading_tokens() -> None:
    a = scored([1, 2, 3], [{1: -1.0}, {2: -1.0}, {3: -1.0}])
    b = scored([1, 2, 4], [{1: -1.0}, {2: -1.0}, {4: -1.0}])
    assert compare.equal_prefix(a, b) == 2
    assert compare.equal_prefix(a, a) == 3
    assert compare.equal_prefix(a, scored([1], [{1: -1.0}])) == 1


def _random_pair(rng: random.Random) -> tuple[compare.GreedyOutput, compare.GreedyOutput]:
    """A reference and a run of a small vocabulary whose logits move by a few steps, so that
    near-ties part some pairs and not others."""
    steps = rng.randint(1, 6)
    base = [[4.0 + rng.randint(0, 40) * STEP for _ in range(8)] for _ in range(steps)]
    moved = [[v + rng.randint(-3, 3) * STEP for v in row] for row in base]
    return greedy(base, top=4), greedy(moved, top=4)


def test_the_agreement_threshold_is_where_the_rule_starts_to_accept() -> None:
    rng = random.Random(7)
    floor = lambda tolerance: dataclasses.replace(  # noqa: E731
        compare.NoiseFloor((0.0,), 0.0, 2, 0, 0, 0.5), pair_worsts=(tolerance,)
    )
    seen_inf = seen_finite = 0
    for _ in range(300):
        reference, run = _random_pair(rng)
        found = compare.agreement_threshold(reference, run)
        if math.isinf(found.value):
            seen_inf += 1
            with pytest.raises(AssertionError):
                compare.check_rejected(reference, reference, floor(1e9), ("a", "a"))
            continue
        seen_finite += 1
        accepted, _ = compare._judge(reference, run, found.value, ("a", "b"))
        assert accepted is not None
        if found.value > 0:
            below, _ = compare._judge(reference, run, found.value * (1 - 1e-9), ("a", "b"))
            assert below is None
    assert seen_inf and seen_finite


@pytest.mark.parametrize("along_path", [False, True])
def test_the_token_threshold_is_what_the_bound_must_cover(along_path: bool) -> None:
    rng = random.Random(8 + along_path)
    failing = 0
    for _ in range(300):
        reference, run = _random_pair(rng)
        found = compare.token_threshold(reference, run, along_path)
        names = ("a", "b")
        if math.isinf(found.value):
            with pytest.raises(AssertionError):
                compare.check_tokens(reference, run, 1e9, names, along_path)
            continue
        compare.check_tokens(reference, run, found.value, names, along_path)
        if found.value > 0:
            failing += 1
            assert found.step == compare.equal_prefix(reference, run)
            with pytest.raises(AssertionError, match="decisive step"):
                compare.check_tokens(reference, run, found.value * (1 - 1e-9), names, along_path)
    assert failing > 10


def test_a_threshold_s_power_and_deciding_step() -> None:
    a = scored([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.5, 7: -3.0}])
    b = scored([1, 6], [{1: -0.5, 2: -2.0}, {6: -0.97, 5: -1.02, 7: -3.0}])
    found = compare.agreement_threshold(a, b)
    # Token 6 scored -1.5 and -0.97 at the parting step (more than a's gap there, 0.5).
    assert found.step == 1 and found.value == pytest.approx(0.53)
    assert found.power(0.1) == pytest.approx(5.3)
    assert compare.Threshold(math.inf, 0).power(0.1) == math.inf
    tokens = compare.token_threshold(a, b)
    assert tokens.step == 1 and tokens.value == pytest.approx(0.5)  # a's gap there
    assert tokens.power_at([1.0, 0.25]) == pytest.approx(2.0)  # over the parting step's bound
    assert compare.token_threshold(a, a).power_at([1.0, 1.0]) == 0.0  # nothing decides
