"""glm5_matrix.compare on hand-made data (no vLLM)."""

from __future__ import annotations

import math
import random

import pytest

from glm5_matrix import compare


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


STEP = 2.0**-5  # one bf16 step of logits in [4, 8)


def _run(tokens: list[int], top: list[dict[int, float]]) -> compare.GreedyOutput:
    return compare.GreedyOutput(tokens, [step[t] for t, step in zip(tokens, top, strict=True)], top)


def _bf16_logits(rng: random.Random, vocab: int, spread: float) -> list[float]:
    """Logits as a bf16 engine makes them: values in [4, 8) on the grid of one bf16 step."""
    return [4.0 + round(rng.uniform(0.0, spread) / STEP) * STEP for _ in range(vocab)]


def _greedy(logits_per_step: list[list[float]], top: int = 5) -> compare.GreedyOutput:
    """A greedy output with top-`top` logprobs from per-step logits (ties to the lower id)."""
    tokens, scored = [], []
    for logits in logits_per_step:
        lse = math.log(math.fsum(math.exp(v) for v in logits))
        order = sorted(range(len(logits)), key=lambda t: (-logits[t], t))
        tokens.append(order[0])
        scored.append({t: logits[t] - lse for t in order[:top]})
    return _run(tokens, scored)


def _engine(seed: int, steps: int = 12, vocab: int = 64) -> list[list[float]]:
    """Per-step logits of a fixed 'model' (seed), on the bf16 grid, with clear winners."""
    model = random.Random(seed)
    out = []
    for _ in range(steps):
        logits = _bf16_logits(model, vocab, 2.5)
        logits[model.randrange(vocab)] += 1.0  # a clear winner
        out.append(logits)
    return out


def _nudged(logits: list[list[float]], steps: int, every: int = 3) -> list[list[float]]:
    """The same logits with every `every`-th token's logit moved up by `steps` bf16 steps: what
    a rerun of the request does to some logits on the GPU (one or two steps)."""
    return [
        [v + steps * STEP if t % every == 0 else v for t, v in enumerate(row)] for row in logits
    ]


def test_bf16_step() -> None:
    assert compare.bf16_step(8.1) == 2.0**-4
    assert compare.bf16_step(-7.9) == 2.0**-5
    assert compare.bf16_step(1.0) == 2.0**-7
    assert compare.bf16_step(0.0) == 0.0


def test_logit_step_is_read_off_the_candidates_grid() -> None:
    output = _greedy(_engine(1))
    assert compare.logit_step(output) == STEP
    # A model whose logits are no bf16 numbers: one bf16 step at the logprobs' magnitude.
    rng = random.Random(3)
    smooth = _greedy([[rng.uniform(0, 3) for _ in range(64)] for _ in range(8)])
    magnitude = sorted(abs(v) for v in smooth.logprobs)[len(smooth.logprobs) // 2]
    assert compare.logit_step(smooth) == compare.bf16_step(magnitude)


def test_identical_runs_agree_with_a_zero_floor() -> None:
    a = _greedy(_engine(1))
    floor = compare.noise_floor(a, _greedy(_engine(1)))
    assert floor.worst == 0.0 and floor.tolerance == STEP
    agreement = compare.check_agreement(a, _greedy(_engine(1)), floor, ("cold", "repeat"))
    assert (agreement.matched, agreement.total, agreement.parting_gaps) == (12, 12, None)


def test_a_run_within_the_floor_plus_one_step_agrees() -> None:
    logits = _engine(1)
    reference = _greedy(logits)
    floor = compare.noise_floor(reference, _greedy(_nudged(logits, 1)), ("a", "a'"))
    assert floor.worst == pytest.approx(STEP, rel=0.1)  # one step, less the logsumexp's shift
    assert floor.tolerance == pytest.approx(2 * STEP, rel=0.05)
    # A run one step beyond the floor agrees; two steps beyond it does not.
    compare.check_agreement(reference, _greedy(_nudged(logits, 2)), floor, ("a", "b"))
    with pytest.raises(AssertionError, match=r"\|delta\| 0\.064\d+ > tolerance 0\.0625"):
        compare.check_agreement(reference, _greedy(_nudged(logits, 3)), floor, ("a", "b"))


def test_a_run_along_another_path_gets_exactly_its_path_steps() -> None:
    logits = _engine(1)
    reference = _greedy(logits)
    floor = compare.noise_floor(reference, _greedy(logits))
    assert floor.worst == 0.0
    # Two steps off (what D recomputing the last prompt token showed on the CPU build): rejected
    # by the floor alone, accepted with path_steps = 2; three steps off is rejected even then.
    with pytest.raises(AssertionError, match=r"> tolerance 0\.0312"):
        compare.check_agreement(reference, _greedy(_nudged(logits, 2)), floor, ("P", "P->D"))
    across = floor.across_path(2)
    assert across.tolerance == pytest.approx(3 * STEP) and "2 path step(s)" in across.describe()
    compare.check_agreement(reference, _greedy(_nudged(logits, 2)), across, ("P", "P->D"))
    with pytest.raises(AssertionError, match=r"> tolerance 0\.0938"):
        compare.check_agreement(reference, _greedy(_nudged(logits, 4)), across, ("P", "P->D"))
    with pytest.raises(ValueError, match="path steps must be >= 0"):
        floor.across_path(-1)


def test_a_floor_factor_scales_the_floor_and_nothing_else() -> None:
    logits = _engine(1)
    reference = _greedy(logits)
    floor = compare.noise_floor(reference, _greedy(_nudged(logits, 2)))  # a floor of two steps
    assert floor.worst == pytest.approx(2 * STEP, rel=0.1)
    # A second pair four steps apart (as the H200 showed: 1.4x the first pair's floor) fails
    # the floor alone and passes twice it; eight steps apart fails that too.
    with pytest.raises(AssertionError, match="> tolerance"):
        compare.check_agreement(reference, _greedy(_nudged(logits, 4)), floor, ("a", "b"))
    doubled = floor.with_factor(2.0)
    assert doubled.tolerance == pytest.approx(2 * floor.worst + STEP)
    assert doubled.describe().startswith("2 x noise floor")
    compare.check_agreement(reference, _greedy(_nudged(logits, 4)), doubled, ("a", "b"))
    with pytest.raises(AssertionError, match="> tolerance"):
        compare.check_agreement(reference, _greedy(_nudged(logits, 8)), doubled, ("a", "b"))
    # A zero floor (the CPU build) stays one step whatever the factor.
    zero = compare.noise_floor(reference, _greedy(logits)).with_factor(2.0)
    assert zero.tolerance == STEP
    with pytest.raises(ValueError, match="floor factor must be >= 1"):
        floor.with_factor(0.5)


def test_a_path_is_measured_in_steps_before_it_is_judged() -> None:
    from glm5_matrix import judging

    logits = _engine(1)
    reference = _greedy(logits)
    comparison = judging.Comparison("pd", compare.noise_floor(reference, _greedy(logits)))
    measured = comparison.path_measured(reference, _greedy(_nudged(logits, 2)), ("P", "P->D"))
    assert measured == pytest.approx(2.0, abs=0.1)
    # Another model state parts outright: no path noise to measure.
    other = _greedy(_engine(2))
    assert comparison.path_measured(reference, other, ("P", "other")) == math.inf


def test_parting_at_a_near_tie_within_the_tolerance_is_accepted() -> None:
    tie = {5: -1.0, 6: -1.0, 7: -3.0}
    a = _run([1, 5, 9], [{1: -0.5, 2: -2.0}, tie, {9: -0.1}])
    b = _run([1, 6, 3], [{1: -0.5, 2: -2.0}, {6: -1.0, 5: -1.0 - STEP, 7: -3.0}, {3: -0.2}])
    floor = compare.NoiseFloor(0.0, STEP, compare.noise_floor(a, a).agreement)
    agreement = compare.check_agreement(a, b, floor, ("a", "b"))
    assert agreement.matched == 1 and agreement.compared_steps == 2
    assert agreement.parting_gaps == (0.0, STEP)
    assert "near-tie" in agreement.describe()


@pytest.mark.parametrize(
    ("b", "message"),
    [
        # parts at a clear winner
        (
            _run([1, 6], [{1: -0.5, 2: -2.0}, {6: -0.97, 5: -1.02, 7: -3.0}]),
            r"step 1: b prefers 6 over 5 by 0\.0500 > tolerance",
        ),
        # parts at a token the other run did not score
        (
            _run([1, 8], [{1: -0.5, 2: -2.0}, {8: -0.9, 6: -1.0, 7: -3.0}]),
            "step 1: a's candidates .* lack the other side's token 8",
        ),
        # same tokens, a candidate scored otherwise
        (
            _run([1, 5], [{1: -0.5, 2: -2.5}, {5: -1.0, 6: -1.0, 7: -3.0}]),
            r"step 0: token 2 scores -2\.0000 in a and -2\.5000 in b",
        ),
        (_run([1], [{1: -0.5}]), "a has 2 tokens, b 1"),
    ],
)
def test_the_rule_rejects(b: compare.GreedyOutput, message: str) -> None:
    a = _run([1, 5], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0, 7: -3.0}])
    floor = compare.NoiseFloor(0.0, STEP, compare.noise_floor(a, a).agreement)
    with pytest.raises(AssertionError, match=message):
        compare.check_agreement(a, b, floor, ("a", "b"))
    assert message.split(":")[0].split(" ")[0] in compare.check_rejected(a, b, floor, ("a", "b"))


def test_a_control_that_passes_is_a_failure() -> None:
    a = _greedy(_engine(1))
    floor = compare.noise_floor(a, a)
    with pytest.raises(AssertionError, match="negative control 'other' passes"):
        compare.check_rejected(a, _greedy(_engine(1)), floor, ("ref", "other"))
    # Another model state (another seed) is rejected at step 0.
    reason = compare.check_rejected(a, _greedy(_engine(2)), floor, ("ref", "other"))
    assert reason.startswith("step 0")


def test_a_reference_that_parts_at_an_unscored_token_is_no_floor() -> None:
    a = _run([1, 5], [{1: -0.5}, {5: -1.0, 6: -1.1}])
    b = _run([1, 9], [{1: -0.5}, {9: -1.0, 5: -1.2}])
    with pytest.raises(AssertionError, match="the reference run done twice: step 1"):
        compare.noise_floor(a, b)


def test_margins_and_decisiveness() -> None:
    out = _run([1, 5, 9], [{1: -0.5, 2: -2.0}, {5: -1.0, 6: -1.0}, {9: -0.1}])
    assert compare.margins(out) == [1.5, 0.0, math.inf]
    found = compare.check_decisive(out, STEP, 40, "out")
    assert (found.median_steps, found.least_steps, found.ties) == (48.0, 0.0, 1)
    with pytest.raises(AssertionError, match=r"out is flat: greedy margins: median 48\.0"):
        compare.check_decisive(out, STEP, 49, "out")
