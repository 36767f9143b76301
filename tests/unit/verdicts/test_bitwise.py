"""glm5_matrix.verdicts.bitwise: identical outputs, determinism of a set of runs, and where two
outputs first differ."""

from __future__ import annotations

import pytest

from glm5_matrix.verdicts import bitwise
from glm5_matrix.verdicts.compare import GreedyOutput


def _out(
    tokens: list[int], logprobs: list[float], top: list[dict[int, float]] | None = None
) -> GreedyOutput:
    return GreedyOutput(
        tokens, logprobs, top or [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
    )


def test_identical_and_deterministic() -> None:
    a = _out([1, 2], [-0.5, -0.25])
    assert bitwise.identical(a, _out([1, 2], [-0.5, -0.25]))
    assert bitwise.deterministic([a, _out([1, 2], [-0.5, -0.25]), a])
    assert not bitwise.deterministic([a])  # one run shows nothing
    assert not bitwise.deterministic([a, _out([1, 2], [-0.5, -0.2500001])])


@pytest.mark.parametrize(
    ("other", "where"),
    [
        (_out([1, 3], [-0.5, -0.25]), "step 1: token 2 vs 3"),
        (_out([1, 2], [-0.5, -0.26]), "step 1: token 2's logprob"),
        (_out([1, 2], [-0.5, -0.25], [{1: -0.5}, {2: -0.25, 7: -3.0}]), "candidates' scores"),
        (_out([1], [-0.5]), "lengths 2 vs 1"),
    ],
)
def test_the_first_difference_is_named(other: GreedyOutput, where: str) -> None:
    a = _out([1, 2], [-0.5, -0.25])
    assert where in bitwise.first_difference(a, other)
    with pytest.raises(AssertionError, match="is not bit for bit"):
        bitwise.check_identical(a, other, ("alone", "under load"))
    bitwise.check_identical(a, a, ("alone", "again"))
