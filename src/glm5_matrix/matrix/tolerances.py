"""A profile's tolerances ([tolerances], [pd.tolerances], [dflash.tolerances]) as a frozen value,
built when the profile is loaded (glm5_matrix.matrix.profiles.load_profile): the judges
(glm5_matrix.verdicts.judging) and the suites read its fields, never a table, and a value out of
its range is refused when it is built, before any environment is built or engine started, not
after minutes of reference runs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# The fewest reference runs a profile may ask for: three give three pairs, the least from which
# a spread (largest less smallest pairwise difference) can be read.
MIN_REFERENCE_REPEATS = 3


@dataclass(frozen=True)
class Tolerances:
    """What a comparison of a suite is judged by. The noise itself is measured in the same run
    (glm5_matrix.verdicts.compare.noise_spread); these say how much of it to measure and what
    the run and its controls must show beyond it."""

    # The first reference run must hold at least this many distinct tokens (a constant output
    # would match anything).
    min_distinct_tokens: int
    # The reference's greedy choices must win by at least this median margin (logit steps).
    min_median_margin_steps: float
    # How many times the reference is done: every pair compared for the noise.
    reference_repeats: int
    # What every negative control's delta must reach, over the tolerance.
    min_power: float
    # The stale-block controls: this many blocks' worth of tokens before the first block
    # boundary drawn anew (a fraction of a block, at most one).
    control_changed_blocks: float | None = None
    # The checkpoint pages' relative tolerance (test_prefill_checkpoint_pages).
    checkpoint_page_rel: float | None = None
    # The profile table they were read from, for messages: "tolerances", "pd.tolerances".
    table: str = "tolerances"

    def __post_init__(self) -> None:
        found = range_problems(self)
        if found:
            raise ValueError(f"[{self.table}] " + "; ".join(found))

    @classmethod
    def from_table(cls, table: str, values: dict[str, Any]) -> Tolerances:
        """The tolerances of a profile table already checked for its keys and types
        (glm5_matrix.matrix.profile_schema); a ValueError names a value out of its range."""
        known = {f.name for f in fields(cls)} - {"table"}
        return cls(table=table, **{k: v for k, v in values.items() if k in known})

    def needed(self, key: str) -> float:
        """An optional tolerance a suite reads (control_changed_blocks, checkpoint_page_rel)."""
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"the profile's [{self.table}] lacks {key!r}, which this check reads")
        return float(value)


def range_problems(tolerances: Tolerances) -> list[str]:
    """Each value out of its range, one phrase each."""
    found = []
    if not tolerances.min_power > 1:
        found.append(f"min_power = {tolerances.min_power}: must be > 1")
    if not tolerances.reference_repeats >= MIN_REFERENCE_REPEATS:
        found.append(
            f"reference_repeats = {tolerances.reference_repeats}: must be >= "
            f"{MIN_REFERENCE_REPEATS} (a spread of the noise needs three pairs)"
        )
    if not tolerances.min_distinct_tokens >= 2:
        found.append(f"min_distinct_tokens = {tolerances.min_distinct_tokens}: must be >= 2")
    if not tolerances.min_median_margin_steps >= 0:
        found.append(
            f"min_median_margin_steps = {tolerances.min_median_margin_steps}: must be >= 0"
        )
    changed = tolerances.control_changed_blocks
    if changed is not None and not 0 < changed <= 1:
        found.append(f"control_changed_blocks = {changed}: must be > 0 and <= 1")
    rel = tolerances.checkpoint_page_rel
    if rel is not None and not rel > 0:
        found.append(f"checkpoint_page_rel = {rel}: must be > 0")
    return found
