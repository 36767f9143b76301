"""glm5_matrix.verdicts.retention: the hits each prefix-cache retention mode promises, on the
numbers of the CPU cell's scenarios (block 384) and GLM-5.3-Flash's (4352), and that a reported
hit off the promise either way fails with the reasons."""

from __future__ import annotations

import pytest

from glm5_matrix.verdicts import retention
from glm5_matrix.verdicts.retention import Mode

B = 384
DENSE, SEMANTIC, PERIODIC = Mode(None), Mode(0), Mode(2 * B)

# The follow-up turn of tiny-hybrid-cpu: a 730-token prompt prefilled in two chunks (the second
# from its replay boundary 384), 440 answer tokens decoded one by one (the last one not computed).
PROMPT, ANSWER, NEW = 730, 440, 32
STEPS = [[0, 384], [384, PROMPT - 384]] + [[p, 1] for p in range(PROMPT, PROMPT + ANSWER - 1)]


def test_modes_by_name() -> None:
    assert retention.mode_named("dense", B) == DENSE
    assert retention.mode_named("semantic", B) == SEMANTIC
    assert retention.mode_named("periodic", B, 2) == PERIODIC
    assert [m.name for m in (DENSE, SEMANTIC, PERIODIC)] == ["dense", "semantic", "periodic"]
    assert "prefix_cache_retention_interval=None" in DENSE.describe()
    with pytest.raises(ValueError, match="at least 2 blocks"):
        retention.mode_named("periodic", B, 1)
    with pytest.raises(ValueError, match="unknown retention mode"):
        retention.mode_named("sparse", B)


def test_states_exist_where_a_step_ends_on_a_block_boundary() -> None:
    assert retention.step_boundaries(STEPS, B) == {384, 768, 1152}
    # A prefill in one chunk past a boundary keeps no state there.
    assert retention.step_boundaries([[0, 700], [700, 1]], B) == set()
    assert retention.step_boundaries([[0, 0]], B) == set()


def test_replay_boundary_is_the_last_block_before_the_last_token() -> None:
    assert retention.replay_boundary(730, B) == 384
    assert retention.replay_boundary(768, B) == 384  # an aligned prompt: its last token is computed
    assert retention.replay_boundary(769, B) == 768
    assert retention.replay_boundary(100, B) == 0


@pytest.mark.parametrize(
    ("mode", "hit", "kept"),
    [
        (SEMANTIC, 384, (384,)),  # only because the replay boundary is kept
        (PERIODIC, 768, (384, 768)),
        (DENSE, 1152, (384, 768, 1152)),
    ],
)
def test_a_follow_up_turn_is_served_what_its_mode_keeps(
    mode: Mode, hit: int, kept: tuple[int, ...]
) -> None:
    states = retention.step_boundaries(STEPS, B)
    promised = retention.promise(mode, states, PROMPT, PROMPT + ANSWER, PROMPT + ANSWER + NEW, B)
    assert (promised.hit, promised.kept) == (hit, kept)
    assert f"the hit is {hit}" in promised.describe()


def test_glm_follow_up_on_the_gpu() -> None:
    block = 4352
    prompt, answer = round(1.9 * block), 500
    steps = [[0, block], [block, prompt - block]] + [
        [p, 1] for p in range(prompt, prompt + answer - 1)
    ]
    states = retention.step_boundaries(steps, block)
    assert states == {block, 2 * block}
    total = prompt + answer + 32
    assert retention.promise(SEMANTIC, states, prompt, prompt + answer, total, block).hit == block
    assert retention.promise(DENSE, states, prompt, prompt + answer, total, block).hit == 2 * block


def test_no_hit_past_the_common_prefix_or_the_last_token() -> None:
    kept = {384, 768, 1152}
    assert retention.promised_hit(kept, common_tokens=900, request_tokens=2000, block=B) == 768
    # A resend of an aligned prompt: its last token is always computed.
    assert retention.promised_hit(kept, common_tokens=768, request_tokens=768, block=B) == 384
    assert retention.promised_hit(kept, common_tokens=300, request_tokens=2000, block=B) == 0


def test_a_periodic_interval_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block"):
        retention.kept(Mode(500), {384}, 730, B)


def test_the_junction_is_kept_in_every_mode() -> None:
    """A (883 tokens: prefix 499 + tail 384) keeps 768 (its replay boundary); B sharing the
    499-token prefix finds the attention blocks to 384 cached but no Mamba state there: it is
    served nothing and pins 384, which C is then served in every mode."""
    a_steps = [[0, 768], [768, 115]]
    for mode in (SEMANTIC, PERIODIC, DENSE):
        states_a = retention.step_boundaries(a_steps, B)
        b = retention.promise(mode, states_a, 883, 499, 883, B)
        assert b.hit == 0
        junction = retention.junction(499, 883, b.hit, B)
        assert junction == 384
        b_steps = [[0, 384], [384, 384], [768, 115]]  # the scheduler stops B at the junction
        kept = retention.kept(mode, retention.step_boundaries(b_steps, B), 883, B, [junction])
        assert retention.promised_hit(kept, 499, 883, B) == 384
    # No junction where the Mamba hit reaches the attention hit.
    assert retention.junction(499, 883, 384, B) == 0


def test_a_hit_off_the_promise_fails_either_way() -> None:
    promised = retention.promise(SEMANTIC, {384, 768, 1152}, PROMPT, 1170, 1202, B)
    retention.check_hit(384, promised, "follow-up")
    with pytest.raises(AssertionError, match="more than the retention promises"):
        retention.check_hit(1152, promised, "follow-up")  # semantic kept the decode's states
    with pytest.raises(AssertionError, match="fewer than the retention promises"):
        retention.check_hit(0, promised, "follow-up")  # the replay boundary not kept
    with pytest.raises(AssertionError, match="keeps states at \\[384\\]"):
        retention.check_hit(None, promised, "follow-up")


def test_common_prefix() -> None:
    assert retention.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert retention.common_prefix([1, 2], [1, 2, 3]) == 2
    assert retention.common_prefix([], [1]) == 0


def test_a_block_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        retention.replay_boundary(10, 0)
