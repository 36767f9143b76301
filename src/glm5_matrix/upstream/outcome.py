"""What a reproduction's run says (pure): the verdict line its script prints last, and the line
`nox -s upstream` prints for it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    reproduced: bool | None  # None: the script could not make its check
    vllm: str | None
    detail: str


def parse_verdict(stdout: str) -> Verdict | None:
    """The last line of a reproduction's stdout, a JSON object with `reproduced` (true, false or
    null), `vllm` and `detail`; None when it is not one."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("reproduced") not in (True, False, None):
        return None
    vllm = data.get("vllm")
    return Verdict(
        reproduced=data["reproduced"],
        vllm=vllm if isinstance(vllm, str) else None,
        detail=str(data.get("detail", "")),
    )


@dataclass(frozen=True)
class Run:
    """One run of a reproduction: the finding's, or one of its controls'."""

    finding: str
    control: str | None  # None: the reproduction itself
    verdict: Verdict | None
    exit_status: int
    seconds: float
    leftovers: int  # processes the kill domain found left when the script had ended

    @property
    def ok(self) -> bool:
        """The run made its check and left nothing; a control must also not reproduce (else the
        reproduction passes whatever vLLM does)."""
        made = (
            self.verdict is not None
            and self.verdict.reproduced is not None
            and self.exit_status == 0
            and self.leftovers == 0
        )
        if self.control is not None:
            return made and self.verdict is not None and self.verdict.reproduced is False
        return made

    def line(self, installed_vllm: str | None) -> str:
        """`NAME: reproduced (12 s)` / `NAME: not reproduced on vLLM X (12 s)` / an error; a
        control's line says whether it showed the check able to fail."""
        name = self.finding if self.control is None else f"{self.finding} [{self.control}]"
        took = f"({self.seconds:.0f} s)"
        v = self.verdict
        if v is None or v.reproduced is None or self.exit_status != 0:
            why = v.detail if v is not None else "no verdict line"
            return f"{name}: ERROR, no check made (exit {self.exit_status}: {why}) {took}"
        state = (
            "reproduced"
            if v.reproduced
            else f"not reproduced on vLLM {v.vllm or installed_vllm or 'unknown'}"
        )
        left = f", {self.leftovers} process(es) left and killed: FAIL" if self.leftovers else ""
        if self.control is not None:
            judged = (
                "check can fail" if not v.reproduced else "FAIL: the defect-absent run reproduced"
            )
            return f"{name}: {state}, {judged}{left} {took}: {v.detail}"
        return f"{name}: {state}{left} {took}: {v.detail}"
