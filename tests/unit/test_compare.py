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


def test_matched_logprob_deltas_stop_at_first_differing_token() -> None:
    deltas = compare.matched_logprob_deltas(
        [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [5, 6, 9, 8], [-0.15, -0.2, -5.0, -0.4]
    )
    # Position 2 differs (7 vs 9): neither it nor the equal token after it is compared.
    assert deltas == pytest.approx([0.05, 0.0])


def test_matched_logprob_deltas_edge_cases() -> None:
    assert compare.matched_logprob_deltas([1], [-1.0], [2], [-1.0]) == []
    assert compare.matched_logprob_deltas([1, 2], [-1.0, -2.0], [1], [-1.5]) == [0.5]
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        compare.matched_logprob_deltas([1, 2], [-1.0], [1, 2], [-1.0, -2.0])


def _run(tokens: list[int], top: list[dict[int, float]]) -> compare.GreedyOutput:
    return compare.GreedyOutput(tokens, [step[t] for t, step in zip(tokens, top, strict=True)], top)


def test_greedy_agreement_equal_outputs() -> None:
    top = [{5: -0.1, 6: -2.0}, {7: -0.5, 8: -1.5}]
    agreement = compare.check_greedy_agreement(
        _run([5, 7], top), _run([5, 7], top), min_matched=2, logprob_abs=0.0
    )
    assert (agreement.matched, agreement.total, agreement.parting_gaps) == (2, 2, None)


def test_greedy_agreement_accepts_parting_at_a_near_tie() -> None:
    a = _run([5, 7, 1], [{5: -0.1}, {7: -0.70, 8: -0.71}, {1: -0.2}])
    b = _run([5, 8, 2], [{5: -0.12}, {8: -0.69, 7: -0.70}, {2: -0.3}])
    agreement = compare.check_greedy_agreement(a, b, min_matched=1, logprob_abs=0.05)
    assert agreement.matched == 1
    assert agreement.parting_gaps is not None
    assert [round(g, 3) for g in agreement.parting_gaps] == [0.01, 0.01]
    assert "near-tie" in agreement.describe()


def test_greedy_agreement_rejects_a_clear_winner_at_the_parting_step() -> None:
    a = _run([5, 7], [{5: -0.1}, {7: -0.1, 8: -3.0}])
    b = _run([5, 8], [{5: -0.1}, {8: -0.1, 7: -3.0}])
    with pytest.raises(AssertionError, match=r"prefers 7 over 8 by 2\.9"):
        compare.check_greedy_agreement(a, b, min_matched=1, logprob_abs=0.1)


def test_greedy_agreement_rejects_a_token_outside_the_other_top() -> None:
    a = _run([5, 7], [{5: -0.1}, {7: -0.1, 9: -0.2}])
    b = _run([5, 8], [{5: -0.1}, {8: -0.1, 7: -0.15}])
    with pytest.raises(AssertionError, match="lacks the other side's token 8"):
        compare.check_greedy_agreement(a, b, min_matched=1, logprob_abs=0.1)


def test_greedy_agreement_rejects_short_prefix_and_drifting_logprobs() -> None:
    a = _run([5, 7], [{5: -0.1}, {7: -0.1, 8: -0.1}])
    b = _run([5, 8], [{5: -0.1}, {8: -0.1, 7: -0.1}])
    with pytest.raises(AssertionError, match="only 1 leading tokens equal, < 2"):
        compare.check_greedy_agreement(a, b, min_matched=2, logprob_abs=1.0)
    drift = _run([5, 7], [{5: -0.9}, {7: -0.1}])
    with pytest.raises(AssertionError, match=r"step 0: same token, \|logprob delta\| 0.8000"):
        compare.check_greedy_agreement(a, drift, min_matched=1, logprob_abs=0.5)


def test_resumed_agreement_reads_the_repeat_tolerances() -> None:
    a = _run([5, 7], [{5: -0.1}, {7: -0.70, 8: -0.71}])
    b = _run([5, 8], [{5: -0.1}, {8: -0.70, 7: -0.71}])
    loose = {"repeat_matching_prefix_tokens": 1, "repeat_logprob_abs": 0.05}
    assert compare.check_resumed_agreement(a, b, loose, ("cold", "repeat")).matched == 1
    with pytest.raises(AssertionError, match="only 1 leading tokens equal, < 2"):
        compare.check_resumed_agreement(
            a, b, {**loose, "repeat_matching_prefix_tokens": 2}, ("c", "r")
        )
