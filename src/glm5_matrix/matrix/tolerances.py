"""A profile's tolerances ([tolerances], [pd.tolerances], [dflash.tolerances]) as a frozen value,
built when the profile is loaded (glm5_matrix.matrix.profiles.load_profile): the judges
(glm5_matrix.verdicts.judging) and the suites read its fields, never a table, and a value out of
its range is refused when it is built, before any environment is built or engine started, not
after minutes of reference runs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec

# The fewest reference runs a profile may ask for: the leave-one-out measurement of the rule's
# false-red rate (glm5_matrix.verdicts.false_red) holds one run out and builds the tolerance
# from a row of at least two of the others.
MIN_REFERENCE_REPEATS = 4

# The table's contract (glm5_matrix.contracts): the profile's reader checks it at load, and a
# Tolerances built by hand is checked against it too.
TOLERANCES = contracts.table(
    {
        "min_distinct_tokens": Spec(
            "int",
            "the first reference run must hold this many distinct tokens (a constant output "
            "would match anything)",
            required=True,
            minimum=2,
        ),
        "min_median_margin_steps": Spec(
            "number",
            "the reference's greedy choices must win by this median margin (logit steps)",
            required=True,
            minimum=0,
        ),
        "reference_repeats": Spec(
            "int",
            "the reference is done this many times in one engine start: every pair compared for "
            "the noise, reference #1's row for the tolerance, and one held out at a time to "
            "measure the rule's own false-red rate (four are the least that allows)",
            required=True,
            minimum=MIN_REFERENCE_REPEATS,
        ),
        "false_red_per_cell": Spec(
            "number",
            "a cell run may fail a faithful vLLM at most this often (the false-red bound; each "
            "judged comparison gets this / (2 x comparisons_per_cell) for its verdict and as "
            "much for its self-check: docs/verdicts.md)",
            required=True,
            above=0,
            maximum=0.5,
        ),
        "comparisons_per_cell": Spec(
            "int",
            "the most judged greedy comparisons a cell of this profile holds (the bound is "
            "split over them)",
            required=True,
            minimum=1,
        ),
        "compared_runs": Spec(
            "int",
            "runs of a compared path (warm runs, repeats, drafted runs) drawn to compare its "
            "distribution with the reference path's; the first is the one judged",
            default=1,
            minimum=1,
        ),
        "min_power": Spec(
            "number",
            "every negative control's delta over the tolerance must reach this",
            required=True,
            above=1,
        ),
        "control_changed_blocks": Spec(
            "number",
            "the stale-block controls draw this many blocks of tokens anew before the first "
            "block boundary",
            above=0,
            maximum=1,
        ),
        "checkpoint_page_rel": Spec("number", "the checkpoint pages' relative tolerance", above=0),
    },
    "what a suite's comparisons are judged by; the noise itself is measured in the same run",
)


@dataclass(frozen=True)
class Tolerances:
    """What a comparison of a suite is judged by (TOLERANCES says what each field means). The
    noise itself is measured in the same run (glm5_matrix.verdicts.compare.noise_spread); these
    say how much of it to measure and what the run and its controls must show beyond it."""

    min_distinct_tokens: int
    min_median_margin_steps: float
    reference_repeats: int
    min_power: float
    false_red_per_cell: float
    comparisons_per_cell: int
    compared_runs: int = 1
    control_changed_blocks: float | None = None
    checkpoint_page_rel: float | None = None
    # The profile table they were read from, for messages: "tolerances", "pd.tolerances".
    table: str = "tolerances"

    def __post_init__(self) -> None:
        values = {k: v for k, v in self._values().items() if v is not None}
        found = contracts.problems(values, TOLERANCES, self.table)
        if found:
            raise ValueError("; ".join(f"{problem.where}: {problem.text}" for problem in found))

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "table"}

    @classmethod
    def from_table(cls, table: str, values: dict[str, Any]) -> Tolerances:
        """The tolerances of a profile table (checked against TOLERANCES when the profile was
        loaded; a ValueError here names what is out of its range)."""
        return cls(table=table, **values)

    def needed(self, key: str) -> float:
        """An optional tolerance a suite reads (control_changed_blocks, checkpoint_page_rel)."""
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"the profile's [{self.table}] lacks {key!r}, which this check reads")
        return float(value)
