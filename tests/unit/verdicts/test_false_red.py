"""glm5_matrix.verdicts.false_red on synthetic noise: the tolerance's false-red rate is its share
under the stated model (and below it for lighter tails), the leave-one-out measurement sees a
faithful engine as such, flags a heavy-tailed one and fails on a gross one without failing a
faithful one itself, and a compared path with a heavier tail than its reference is flagged."""

from __future__ import annotations

import math
import random

import pytest

from glm5_matrix.matrix.tolerances import Tolerances
from glm5_matrix.verdicts import false_red

STEP = 2.0**-7
SHARE = 0.0005  # 0.01 per cell over 10 comparisons, half for the verdicts


def _runs(scales: list[float], rng: random.Random, elements: int = 40) -> list[list[float]]:
    """The worst |difference| of every pair of runs, each run `elements` Gaussian deviations
    times its scale: what the pair worsts of an engine with per-run noise look like (the
    largest of many small differences: a light, Gumbel-like tail)."""
    runs = [[rng.gauss(0.0, 1.0) * s for _ in range(elements)] for s in scales]
    return [[max(abs(a - b) for a, b in zip(x, y, strict=True)) for y in runs] for x in runs]


def test_the_budget_splits_the_cell_bound() -> None:
    budget = false_red.Budget(0.01, 10)
    assert budget.share == pytest.approx(0.0005)
    tolerances = Tolerances(4, 12, 30, 2.0, false_red_per_cell=0.01, comparisons_per_cell=10)
    assert false_red.Budget.of(tolerances) == budget
    with pytest.raises(ValueError, match="must be in"):
        false_red.Budget(1.5, 10)
    with pytest.raises(ValueError, match=">= 1"):
        false_red.Budget(0.01, 0)


@pytest.mark.parametrize(("values", "share"), [(29, 0.01), (5, 0.02), (11, 0.05)])
def test_the_tolerance_rejects_its_share_under_the_model(values: int, share: float) -> None:
    """Exponential excesses (the model's edge): a fresh draw lies beyond the tolerance of
    `values` draws with probability `share`, whatever the scale and location."""
    rng = random.Random(values)
    trials, beyond = 40000, 0
    for _ in range(trials):
        scale = rng.uniform(0.1, 3.0)
        location = rng.uniform(0.0, 1.0)
        row = [location + rng.expovariate(1.0 / scale) for _ in range(values)]
        fresh = location + rng.expovariate(1.0 / scale)
        beyond += fresh > false_red.tail_tolerance(row, 0.0, share)
    sigma = math.sqrt(share * (1 - share) / trials)
    assert abs(beyond / trials - share) < 4 * sigma


def test_lighter_tails_are_rejected_less_often() -> None:
    rng = random.Random(1)
    trials, beyond = 20000, 0
    for _ in range(trials):
        row = [abs(rng.gauss(0, 1)) for _ in range(29)]
        beyond += abs(rng.gauss(0, 1)) > false_red.tail_tolerance(row, 0.0, 0.01)
    assert beyond / trials < 0.005


def test_the_tolerance_of_a_bitwise_row_is_one_step_and_more_runs_need_less_room() -> None:
    assert false_red.tail_tolerance([0.0] * 5, STEP, SHARE) == STEP
    assert false_red.tail_tolerance([0.1, math.inf, 0.2], STEP, SHARE) == math.inf
    _, few = false_red.tail_parameters(5, SHARE)
    _, many = false_red.tail_parameters(29, SHARE)
    assert few > 5 * many > 0
    with pytest.raises(ValueError, match="at least 2"):
        false_red.tail_parameters(1, SHARE)


def test_a_value_tied_with_the_threshold_counts_half_a_step() -> None:
    """The H100's prefill rows: most values one grid value, the rest below it. Without the
    half step per tie the excess is zero and the tolerance one step above the tie, which a run
    one grid value (two steps) further out crosses."""
    row = [4 * STEP] * 21 + [2 * STEP] * 7
    j, c = false_red.tail_parameters(28, SHARE)
    threshold, excess = false_red.tail_excess(row, STEP)
    assert (threshold, excess) == (4 * STEP, j * STEP / 2)
    assert false_red.tail_tolerance(row, STEP, SHARE) == pytest.approx(
        4 * STEP + c * j * STEP / 2 + STEP
    )
    assert false_red.tail_tolerance(row, STEP, SHARE) > 8 * STEP
    # Values above the threshold count as they are; a zero threshold is exact (bitwise pairs).
    assert false_red.tail_excess([3 * STEP, 2 * STEP, 2 * STEP, STEP], STEP) == (
        2 * STEP,
        pytest.approx(1.5 * STEP),
    )
    assert false_red.tail_excess([0.0] * 4, STEP) == (0.0, 0.0)


@pytest.mark.parametrize("grid", [0.5, 1.0, 2.0])
def test_on_rounded_values_the_half_step_only_lowers_the_rate(grid: float) -> None:
    """Exponential excesses rounded up to a grid (the logits' step): the rule with ties counted
    half a step rejects a fresh rounded draw no more often than the share, and no more often
    than the rule that counted none."""
    rng = random.Random(int(grid * 10))
    share, trials = 0.01, 20000
    new = old = 0
    for _ in range(trials):
        draw = lambda: math.ceil((1.0 + rng.expovariate(1.0)) / grid) * grid  # noqa: E731
        row, fresh = [draw() for _ in range(29)], draw()
        new += fresh > false_red.tail_tolerance(row, grid, share)
        j, c = false_red.tail_parameters(29, share)
        ordered = sorted(row, reverse=True)
        untied = ordered[j] + c * math.fsum(v - ordered[j] for v in ordered[:j]) + grid
        old += fresh > untied
    assert new <= old
    assert new / trials <= share


def test_per_step_bounds_split_the_share_over_the_steps() -> None:
    assert false_red.step_share(0.0005, 24) == pytest.approx(0.0005 / 24)
    with pytest.raises(ValueError, match="at least one"):
        false_red.step_share(0.0005, 0)
    rows = [[0.0] * 29, [0.01 * k for k in range(29)]]
    bounds = false_red.step_bounds(rows, STEP, SHARE)
    assert bounds[0] == STEP
    assert bounds[1] == false_red.tail_tolerance(rows[1], STEP, SHARE / 2)
    assert bounds[1] > false_red.tail_tolerance(rows[1], STEP, SHARE)


def test_measure_judges_each_run_at_its_own_step() -> None:
    """Per-step noise: a held-out run parting at step 0, where the others are a step apart, by
    12 steps is rejected; parting at step 1, where they are 20 steps apart, by as much is not."""
    runs = 6
    noise = [
        [(0.0, 0.0) if r == h else (STEP, 20 * STEP + (r + h) * STEP / 8) for h in range(runs)]
        for r in range(runs)
    ]
    accept = [[0.0] * runs for _ in range(runs)]
    at: list[list[int | None]] = [[None] * runs for _ in range(runs)]
    for r in range(1, runs):
        accept[r][0], at[r][0] = 12 * STEP, 0
    found = false_red.measure(noise, accept, STEP, 0.05, at)
    assert found.rejected == runs - 1 and found.rejected_runs == 1
    for r in range(1, runs):
        at[r][0] = 1
    assert false_red.measure(noise, accept, STEP, 0.05, at).rejected == 0


def test_exceedance_is_the_share_at_which_the_tolerance_reaches_a_value() -> None:
    row = [0.06, 0.07, 0.08, 0.09, 0.10, 0.12, 0.16]
    for share in (0.3, 0.01, 0.0005):
        tolerance = false_red.tail_tolerance(row, STEP, share)
        assert false_red.exceedance(row, tolerance, STEP) == pytest.approx(share)
    assert false_red.exceedance(row, 0.05, STEP) == 1.0
    assert false_red.exceedance(row, math.inf, STEP) == 0.0


def test_binomial_tail_and_the_trip_count() -> None:
    assert false_red.binomial_tail(3, 0.5, 2) == pytest.approx(0.5)
    assert false_red.binomial_tail(3, 0.5, 0) == 1.0
    assert false_red.binomial_tail(3, 0.5, 4) == 0.0
    # 30 runs at a share of 5e-4: two outliers happen with probability <= 4.3e-4 <= the share.
    assert false_red.trip_count(30, SHARE) == 2
    assert false_red.binomial_tail(30, 2 * SHARE, 2) <= SHARE
    # A larger share needs more outliers before they prove anything.
    assert false_red.trip_count(30, 0.005) > 2


def test_a_faithful_engine_is_measured_as_such() -> None:
    noise = _runs([1.0] * 30, random.Random(5))
    found = false_red.measure(noise, noise, STEP, SHARE)
    assert (found.runs, found.judged) == (30, 870)
    assert found.rate == 0.0 and not found.exceeds_share and not found.tripped
    assert found.resolution == pytest.approx(1 / 870)
    assert "0 of 870" in found.describe()


def test_a_gross_outlier_process_trips_the_self_check_through_masking() -> None:
    """Two outlying runs (4x and 12x the others' noise): held out, the 12x one is rejected by
    every reference; the 4x one hides behind it (the 12x run in the reference row widens the
    tolerance) and is found once the first is set aside."""
    noise = _runs([1.0] * 28 + [4.0, 12.0], random.Random(5))
    found = false_red.measure(noise, noise, STEP, SHARE)
    assert found.outliers == (29, 28)
    # Masking: all at once, the 4x run is rejected by fewer than half of its 29 references.
    assert found.rejected < 29 + 29 // 2
    assert found.exceeds_share and found.tripped


def test_a_heavy_tailed_engine_is_flagged() -> None:
    """Per-run noise scales with a Pareto(1.5) tail: the measured rate is above the share (a
    finding recorded with the verdict), on the seeds where a tail run was drawn."""
    flagged = 0
    for seed in range(6):
        rng = random.Random(seed)
        scales = [rng.random() ** (-1 / 1.5) for _ in range(30)]
        noise = _runs(scales, rng)
        found = false_red.measure(noise, noise, STEP, SHARE)
        flagged += found.exceeds_share
    assert flagged >= 3


def test_the_self_check_fails_a_faithful_engine_at_most_its_share() -> None:
    """The model's edge (pair differences with exponential tails, |e_a - e_b| of Laplace run
    noise) at a share large enough to count: the self-check trips at most its share of cell
    runs, while the point estimate exceeds the share far more often (why it is not failed on)."""
    share, cells = 0.02, 600
    tripped = exceeded = 0
    rng = random.Random(11)
    for _ in range(cells):
        noise_of_run = [rng.expovariate(1.0) * rng.choice((-1, 1)) for _ in range(12)]
        noise = [[abs(a - b) for b in noise_of_run] for a in noise_of_run]
        found = false_red.measure(noise, noise, 0.0, share)
        tripped += found.tripped
        exceeded += found.exceeds_share
    assert tripped / cells <= share
    assert exceeded / cells > 5 * share


def test_the_resampled_rate_approaches_leave_one_out_at_n_k_minus_1() -> None:
    noise = _runs([1.0] * 20 + [3.0], random.Random(2))
    found = false_red.measure(noise, noise, STEP, 0.01)
    resampled = false_red.resampled_rate(noise, noise, STEP, 0.01, 20, resamples=20000)
    assert found.rate > 0
    assert resampled == pytest.approx(found.rate, abs=0.01)
    # Fewer reference runs extrapolate further: here no more rejections than with 20.
    assert (
        false_red.resampled_rate(noise, noise, STEP, 0.01, 5, resamples=5000) <= found.rate + 0.01
    )
    with pytest.raises(ValueError, match="3 <= n < K"):
        false_red.resampled_rate(noise, noise, STEP, 0.01, 21)


def test_measure_refuses_too_few_runs() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        false_red.measure([[0.0] * 3] * 3, [[0.0] * 3] * 3, STEP, SHARE)


def test_a_noisier_compared_path_is_flagged_and_a_faithful_one_is_not() -> None:
    rng = random.Random(4)
    reference = [0.06 + rng.expovariate(1 / 0.02) for _ in range(29)]
    faithful = [0.06 + rng.expovariate(1 / 0.02) for _ in range(8)]
    shifted = [0.06 + rng.expovariate(1 / 0.06) for _ in range(8)]
    same = false_red.compare_paths(faithful, reference, STEP, SHARE)
    assert not same.shifted and same.p_value > false_red.PATH_LEVEL
    heavier = false_red.compare_paths(shifted, reference, STEP, SHARE)
    assert heavier.shifted and "noisier than the reference path" in heavier.describe()
    assert heavier.beyond_reference >= 1


def test_the_rank_sum_counts_ties_half_and_inf_as_the_largest() -> None:
    assert false_red.rank_sum_p([1.0, 1.0], [1.0, 1.0, 1.0], permutations=200) == 1.0
    assert false_red.rank_sum_p([math.inf], [0.1] * 30, permutations=2000) < 0.05
    with pytest.raises(ValueError, match="at least one value"):
        false_red.rank_sum_p([], [0.1])
