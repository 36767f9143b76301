"""The judged comparisons of a cell, read back from the figures glm5_matrix.verdicts.judging
records (one comparison per NAME.tolerance):

- the reference's noise: NAME.noise_min / _median / _max (nats: each pair of reference runs'
  worst |logprob delta|), over NAME.noise_pairs pairs of NAME.reference_repeats runs;
- NAME.tolerance, the bound a faithful run must stay within;
- each run judged against it, NAME.SLUG.worst_delta (limit: the tolerance); a run judged by its
  tokens records NAME.SLUG.step_delta_max instead (recorded, not judged);
- each negative control, NAME.SLUG.control_delta (inf where it parts at no near-tie) and its
  power NAME.SLUG.power (delta / tolerance; limit: the profile's min_power);
- any other NAME.* figure whose name says false red (NAME.false_red...), shown as recorded.

A comparison whose run failed before its delta was recorded takes the delta from the failure's
first line ("|delta| D > tolerance T", compare.check_agreement's words) where T is the recorded
tolerance, marked as read from the message. What is missing is left out, never invented.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

# compare.check_agreement's failure line: "step 9: token 152021 scores -9.2028 in GPU repeat and
# -8.9214 in warm from CPU: |delta| 0.2814 > tolerance 0.2269 (6 runs, ...": the first delta past
# the tolerance (the run stops being compared there, so it is no worst delta).
_FAILED_DELTA = re.compile(
    r"(?:step (\d+): token \d+ scores \S+ in .+? and \S+ in (.+?): )?"
    r"\|delta\| ([0-9.]+) > tolerance ([0-9.]+)"
)
RUN_LEAVES = ("worst_delta", "step_delta_max")
CONTROL_LEAVES = ("control_delta", "power")


@dataclass
class Measured:
    """A run's or a control's delta (nats); math.inf where the figure says "inf"."""

    label: str  # the run's or control's slug (warm_from_cpu, stale_block)
    value: float
    judged: bool = True  # False: recorded, not judged (a run judged by its tokens)
    source: str = "figure"  # "figure", or "failure message"
    power: float | None = None  # a control's delta over the tolerance
    min_power: float | None = None  # the bar its power must reach
    tokens: tuple[int, int] | None = None  # judged by tokens: (compared, of all)

    def within(self, tolerance: float) -> bool:
        return self.value <= tolerance


@dataclass
class Comparison:
    name: str
    tolerance: float
    test: str = ""
    noise_min: float | None = None
    noise_median: float | None = None
    noise_max: float | None = None
    pairs: int | None = None
    repeats: int | None = None
    runs: list[Measured] = field(default_factory=list)
    controls: list[Measured] = field(default_factory=list)
    others: list[tuple[str, Any]] = field(default_factory=list)  # false-red figures, as recorded

    @property
    def min_power(self) -> float | None:
        bars = [c.min_power for c in self.controls if c.min_power is not None]
        return max(bars) if bars else None

    @property
    def verdict(self) -> str:
        """ "outside": a judged run beyond the tolerance, or a control short of its bar;
        "within": every judged run within and every control past its bar; "no run": nothing
        was judged against the tolerance (the test stopped before)."""
        judged = [r for r in self.runs if r.judged]
        weak = [c for c in self.controls if c.power is not None and c.min_power is not None]
        if any(not r.within(self.tolerance) for r in judged) or any(
            c.power is not None and c.min_power is not None and c.power < c.min_power for c in weak
        ):
            return "outside"
        return "within" if judged or self.controls else "no run"

    def describe(self) -> str:
        """One line: the noise, the tolerance, each run's and control's delta."""
        parts = []
        if self.noise_max is not None:
            pairs = f" over {self.pairs} pairs" if self.pairs else ""
            parts.append(
                f"noise {_num(self.noise_min)} to {_num(self.noise_max)} "
                f"(median {_num(self.noise_median)}){pairs}"
            )
        parts.append(f"tolerance {_num(self.tolerance)}")
        for run in self.runs:
            how = "" if run.judged else " (recorded, not judged)"
            if run.tokens is not None:
                how += f" (tokens equal: {run.tokens[0]} of {run.tokens[1]} compared)"
            how += " (from the failure message)" if run.source != "figure" else ""
            parts.append(f"{run.label} {_num(run.value)}{how}")
        for control in self.controls:
            power = f", power {_num(control.power)}" if control.power is not None else ""
            bar = f" (at least {control.min_power:g})" if control.min_power is not None else ""
            parts.append(f"control {control.label} {_num(control.value)}{power}{bar}")
        return "; ".join(parts)


def _num(value: float | None) -> str:
    if value is None:
        return "?"
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}"


def _number(value: Any) -> float | None:
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def comparisons(
    figures: list[dict[str, Any]], failures: dict[str, str] | None = None
) -> list[Comparison]:
    """The cell's comparisons in the order their tolerances were recorded. `failures`: a failed
    test's node id -> its first line, for the delta of a run that failed before it was
    recorded."""
    by_name = {str(f.get("name")): f for f in figures if isinstance(f, dict)}
    names = [n[: -len(".tolerance")] for n in by_name if n.endswith(".tolerance")]
    found: dict[str, Comparison] = {}
    for name in names:
        tolerance = _number(by_name[f"{name}.tolerance"].get("value"))
        if tolerance is None:
            continue

        def value(leaf: str, name: str = name) -> float | None:
            figure = by_name.get(f"{name}.{leaf}")
            return None if figure is None else _number(figure.get("value"))

        pairs, repeats = value("noise_pairs"), value("reference_repeats")
        found[name] = Comparison(
            name=name,
            tolerance=tolerance,
            test=str(by_name[f"{name}.tolerance"].get("test") or ""),
            noise_min=value("noise_min"),
            noise_median=value("noise_median"),
            noise_max=value("noise_max"),
            pairs=int(pairs) if pairs is not None else None,
            repeats=int(repeats) if repeats is not None else None,
        )
    # Each NAME.SLUG.LEAF to the comparison with the longest NAME it starts with.
    controls: dict[tuple[str, str], Measured] = {}
    for figure_name, figure in by_name.items():
        owner = max((n for n in found if figure_name.startswith(n + ".")), key=len, default=None)
        if owner is None:
            continue
        comparison, rest = found[owner], figure_name[len(owner) + 1 :]
        if rest.startswith("false_red"):
            comparison.others.append((rest, figure.get("value")))
            continue
        slug, _, leaf = rest.rpartition(".")
        if not slug or "." in slug:
            continue
        number = _number(figure.get("value"))
        if number is None:
            continue
        if leaf in RUN_LEAVES:
            judged = leaf == "worst_delta"
            if not judged and any(r.label == slug and r.judged for r in comparison.runs):
                continue
            comparison.runs = [r for r in comparison.runs if r.label != slug]
            comparison.runs.append(Measured(slug, number, judged=judged))
        elif leaf in CONTROL_LEAVES:
            control = controls.setdefault((owner, slug), Measured(slug, math.nan))
            if control not in comparison.controls:
                comparison.controls.append(control)
            if leaf == "control_delta":
                control.value = number
            else:
                control.power = number
                limit = _number(figure.get("limit"))
                control.min_power = limit
    for comparison in found.values():
        comparison.controls = [c for c in comparison.controls if not math.isnan(c.value)]
        for run in comparison.runs:
            compared = by_name.get(f"{comparison.name}.{run.label}.tokens_compared")
            if compared is not None and not run.judged:
                count, total = _number(compared.get("value")), _number(compared.get("limit"))
                if count is not None and total is not None:
                    run.tokens = (int(count), int(total))
        if not any(r.judged for r in comparison.runs) and failures:
            _delta_from_failure(comparison, failures)
    return list(found.values())


def _delta_from_failure(comparison: Comparison, failures: dict[str, str]) -> None:
    """The run's delta from its test's failure line, where that line names this comparison's
    tolerance (to the 4 decimals it prints)."""
    message = failures.get(comparison.test, "")
    for step, run, delta, tolerance in _FAILED_DELTA.findall(message):
        if abs(float(tolerance) - comparison.tolerance) < 5e-5:
            label = "_".join(run.lower().split()) or "the failed run"
            label += f" at step {step}" if step else ""
            comparison.runs.append(Measured(label, float(delta), source="failure message"))
            return
