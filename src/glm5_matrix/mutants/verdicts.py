"""What a mutant's run says, from the cell's results.json alone (pure: no files, no processes).

A mutant is caught when a selected test failed or errored; it survived when the selected tests
ran to the end and passed. A run that did not finish, that ran no test, that was skipped, or
whose control (the same tests on an unpatched copy) was not green judges nothing: its verdict
says why, and it counts neither way. A run the mutants run stopped (a signal to it) is
interrupted, whatever its tests had done by then: a test that failed while the engine was
being torn down proves nothing. The tests that caught a mutant are named; whether they are
the ones the catalogue expected is said too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CAUGHT, SURVIVED, INVALID, NOT_RUN = "caught", "survived", "invalid", "not-run"
# A run stopped by a signal to the mutants run (Ctrl-C, a cancelled job): judges nothing.
INTERRUPTED = "interrupted"
STATUSES = (CAUGHT, SURVIVED, INVALID, NOT_RUN, INTERRUPTED)
_FAILING = ("failed", "error")


@dataclass(frozen=True)
class Verdict:
    status: str  # one of STATUSES
    caught_by: tuple[str, ...] = ()  # test names (function, with parameters)
    detail: str = ""
    expected_hit: bool | None = None  # caught by one of the expected tests (None: not caught)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r} is not one of {STATUSES}")


def short_name(nodeid: str) -> str:
    """`tests/suites/test_e2e.py::test_kv_layout[x]` -> `test_kv_layout[x]`."""
    return nodeid.rsplit("::", 1)[-1]


def _outcomes(results: Mapping[str, Any]) -> dict[str, str]:
    tests = results.get("tests") or {}
    return {nodeid: str(entry.get("outcome")) for nodeid, entry in tests.items()}


def _finished(results: Mapping[str, Any]) -> bool:
    return (results.get("ended") or {}).get("how") == "finished"


def judge_control(results: Mapping[str, Any] | None) -> Verdict:
    """The unpatched copy's run: green (status "survived": nothing to catch) or not usable."""
    if results is None:
        return Verdict(INVALID, detail="the control run wrote no results.json")
    if results.get("skipped"):
        return Verdict(NOT_RUN, detail=f"control skipped: {results['skipped']}")
    outcomes = _outcomes(results)
    failing = sorted(short_name(n) for n, o in outcomes.items() if o in _FAILING)
    if failing:
        return Verdict(INVALID, tuple(failing), "the control failed: " + ", ".join(failing))
    if not _finished(results):
        how = (results.get("ended") or {}).get("how")
        return Verdict(INVALID, detail=f"the control did not finish (ended: {how})")
    if not any(o == "passed" for o in outcomes.values()):
        return Verdict(INVALID, detail="the control passed no test (selection matched none?)")
    return Verdict(
        SURVIVED, detail=f"control green: {sum(o == 'passed' for o in outcomes.values())} passed"
    )


def interrupted(signal: str, results: Mapping[str, Any] | None) -> Verdict:
    """A run stopped because the mutants run got `signal`, with what the cell recorded of it."""
    ended = (results or {}).get("ended") or {}
    where = f" during {short_name(ended['test'])}" if ended.get("test") else ""
    said = f"; the cell recorded: {ended.get('how')}{where}" if ended else ""
    return Verdict(INTERRUPTED, detail=f"stopped by {signal}, not judged{said}")


def judge(
    results: Mapping[str, Any] | None,
    expect: Sequence[str],
    control: Verdict | None,
) -> Verdict:
    """A mutant's run against its cell's control verdict (None: no control was run)."""
    if control is None or control.status != SURVIVED:
        why = control.detail if control else "no control run"
        return Verdict(INVALID, detail=f"not judged: {why}")
    if results is None:
        return Verdict(INVALID, detail="the mutant's run wrote no results.json")
    if results.get("skipped"):
        return Verdict(NOT_RUN, detail=f"skipped: {results['skipped']}")
    outcomes = _outcomes(results)
    failing = tuple(sorted(short_name(n) for n, o in outcomes.items() if o in _FAILING))
    if failing:
        hit = any(_base(f) in {_base(e) for e in expect} for f in failing) if expect else None
        return Verdict(CAUGHT, failing, "failed: " + ", ".join(failing), hit)
    if not _finished(results):
        how = (results.get("ended") or {}).get("how")
        return Verdict(INVALID, detail=f"the run did not finish (ended: {how}) and no test failed")
    passed = sum(o == "passed" for o in outcomes.values())
    if passed == 0:
        return Verdict(INVALID, detail="no selected test passed or failed")
    return Verdict(SURVIVED, detail=f"all {passed} selected tests passed")


def _base(name: str) -> str:
    return name.split("[", 1)[0]


@dataclass(frozen=True)
class Rate:
    caught: int
    judged: int  # caught + survived

    @property
    def percent(self) -> float | None:
        return 100.0 * self.caught / self.judged if self.judged else None

    def describe(self) -> str:
        pct = self.percent
        return f"{self.caught}/{self.judged}" + (f" ({pct:.0f}%)" if pct is not None else "")


def catch_rates(rows: Sequence[tuple[str, str]]) -> tuple[dict[str, Rate], Rate]:
    """(cell, status) per mutant -> catch rate per cell and overall, over the judged ones."""
    per_cell: dict[str, list[int]] = {}
    for cell, status in rows:
        counts = per_cell.setdefault(cell, [0, 0])
        if status in (CAUGHT, SURVIVED):
            counts[1] += 1
            counts[0] += status == CAUGHT
    rates = {cell: Rate(c, j) for cell, (c, j) in sorted(per_cell.items())}
    return rates, Rate(sum(r.caught for r in rates.values()), sum(r.judged for r in rates.values()))
