"""glm5_matrix.engines.prompts: seeded token-id prompts."""

from __future__ import annotations

from glm5_matrix.engines import prompts


def test_random_prompt_is_reproducible_and_in_the_vocabulary() -> None:
    prompt = prompts.random_prompt(1000, 500, seed=7)
    assert prompt == prompts.random_prompt(1000, 500, seed=7)
    assert prompt != prompts.random_prompt(1000, 500, seed=8)
    assert len(prompt) == 500 and min(prompt) >= 0 and max(prompt) < 1000
    assert len(set(prompt)) > 300  # drawn, not a constant
