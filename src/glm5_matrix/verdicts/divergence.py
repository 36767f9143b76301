"""Where two traces of the same request part (pure; glm5_matrix.engines.worker_trace records them).

A trace is the list of a model's module calls in the order they completed, each with digests of
its inputs and of its output. Two runs of one request on one engine make the same calls; the
first call whose output digest differs, while every call before it was equal, is where the
runs part: that module's own arithmetic gave other bytes for the same inputs (a kernel that is
not deterministic: atomics, a split chosen at run time), or it read state its inputs do not show
(a cache written differently before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Divergence:
    """The first call at which trace b's output differs from trace a's."""

    index: int  # position in the traces
    module: str
    call: int  # the module's how-many-th call (0: its first)
    cls: str
    leaf: bool
    inputs_equal: bool  # its tensor inputs had the same bytes in both runs
    later_differing: int  # calls after it whose outputs differ too
    calls: int  # calls in each trace

    def describe(self) -> str:
        kind = "leaf module" if self.leaf else "module"
        inputs = "same inputs" if self.inputs_equal else "other inputs"
        return (
            f"call {self.index} of {self.calls}: {kind} {self.module} ({self.cls}), its call "
            f"{self.call}, {inputs}; {self.later_differing} later call(s) differ too"
        )


def _key(record: Record) -> tuple[str, int]:
    return str(record["module"]), int(record["call"])


def first_divergence(a: Sequence[Record], b: Sequence[Record]) -> Divergence | None:
    """The first call whose output differs between two traces of one request, or None when
    they are equal call for call. Traces that made other calls (another module, or more or
    fewer calls) are not of one request: ValueError."""
    if [_key(r) for r in a] != [_key(r) for r in b]:
        mismatch = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if _key(x) != _key(y)),
            min(len(a), len(b)),
        )
        raise ValueError(
            f"the traces made other calls: {len(a)} and {len(b)} calls, first other at {mismatch}"
        )
    differing = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x["output"] != y["output"]]
    if not differing:
        return None
    first = differing[0]
    record = a[first]
    return Divergence(
        index=first,
        module=str(record["module"]),
        call=int(record["call"]),
        cls=str(record["class"]),
        leaf=bool(record["leaf"]),
        inputs_equal=record["inputs"] == b[first]["inputs"],
        later_differing=len(differing) - 1,
        calls=len(a),
    )


def plant_site(trace: Sequence[Record], within: str) -> tuple[str, int]:
    """Where a control plants its flipped bit: the first call of a leaf module whose name
    contains `within` and whose output is a tensor (a digest), as [module, call]."""
    for record in trace:
        if within in str(record["module"]) and record["leaf"] and record["output"]:
            return str(record["module"]), int(record["call"])
    raise ValueError(f"no leaf module with a tensor output under {within!r} in the trace")
