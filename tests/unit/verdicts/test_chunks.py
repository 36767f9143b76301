"""glm5_matrix.verdicts.chunks on recorded chunk lists: a repeat from a cached block boundary is
told apart from a cold prefill that took another path."""

from __future__ import annotations

import pytest

from glm5_matrix.verdicts import chunks

BLOCK, LENGTH = 4352, 6528


def test_prefill_chunks_leave_out_the_decode_steps() -> None:
    record = [[0, BLOCK], [BLOCK, LENGTH - BLOCK], [LENGTH, 1], [LENGTH + 1, 1]]
    assert chunks.prefill_chunks(record, LENGTH) == [(0, BLOCK), (BLOCK, LENGTH)]


def test_prompt_runs_leave_out_other_requests() -> None:
    records = {
        "probe": [[0, 1]],  # a one-token request (the offload suite's reset polling)
        "cold": [[0, BLOCK], [BLOCK, LENGTH - BLOCK], [LENGTH, 1]],
    }
    assert chunks.prompt_runs(records, LENGTH) == [[(0, BLOCK), (BLOCK, LENGTH)]]


def test_a_cold_prefill_chunked_at_the_boundary_takes_the_repeats_path() -> None:
    cold = [(0, BLOCK), (BLOCK, LENGTH)]
    assert chunks.check_repeat_path(cold, [(BLOCK, LENGTH)], LENGTH, BLOCK) == BLOCK


@pytest.mark.parametrize(
    ("cold", "repeat", "message"),
    [
        # The GPU before: the cold prefill in one pass (flashkda saves the checkpoint inside it).
        ([(0, LENGTH)], [(BLOCK, LENGTH)], "ends no chunk at the repeat's boundary 4352"),
        # The repeat chunked otherwise from the boundary on.
        ([(0, BLOCK), (BLOCK, LENGTH)], [(BLOCK, 5000), (5000, LENGTH)], "from token 4352 on"),
        # A hit that is no block boundary, or none at all.
        ([(0, BLOCK), (BLOCK, LENGTH)], [(4000, LENGTH)], "not at a block boundary"),
        ([(0, BLOCK), (BLOCK, LENGTH)], [(0, LENGTH)], "not at a block boundary past 0"),
        ([(0, BLOCK), (BLOCK, LENGTH)], [], "computed no prompt token"),
        # Records that do not cover the prompt.
        ([(0, BLOCK), (BLOCK, 6000)], [(BLOCK, LENGTH)], "cold prefill does not cover"),
        ([(0, BLOCK), (5000, LENGTH)], [(BLOCK, LENGTH)], "cold prefill does not cover"),
        ([(BLOCK, LENGTH)], [(BLOCK, LENGTH)], "does not start at token 0"),
    ],
)
def test_other_paths_are_refused(
    cold: list[tuple[int, int]], repeat: list[tuple[int, int]], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        chunks.check_repeat_path(cold, repeat, LENGTH, BLOCK)


def test_a_preempted_request_shows_where_it_went_back() -> None:
    """Resumed from nothing after 768 tokens, and one resumed from its own 384-token hit."""
    assert chunks.recomputed([[0, 384], [384, 66], [450, 1], [767, 1], [0, 768], [768, 1]]) == [
        (768, 0)
    ]
    assert chunks.recomputed([[0, 500], [500, 1], [384, 118], [502, 1]]) == [(501, 384)]
    assert chunks.recomputed([[0, 384], [384, 1], [385, 1]]) == []
