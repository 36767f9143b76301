"""What a reproduction's run says (pure): the verdict its script prints last, and the line
`nox -s upstream` prints for it.

A script (upstream/NAME/repro.py) prints `expected: ...` and `actual: ...` lines and, last, a
JSON object with `reproduced` (true, false or null: no check made), `vllm`, `expected`,
`actual` and `detail`; its exit status says the same: 1 reproduced, 0 not reproduced, 2 no
check made."""

from __future__ import annotations

import json
from dataclasses import dataclass

EXIT_STATUS = {True: 1, False: 0, None: 2}


@dataclass(frozen=True)
class Verdict:
    reproduced: bool | None  # None: the script could not make its check
    vllm: str | None
    detail: str
    expected: str = ""
    actual: str = ""


def parse_verdict(stdout: str) -> Verdict | None:
    """The last line of a reproduction's stdout as a Verdict; None when it is not one."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("reproduced") not in (True, False, None):
        return None

    def text(key: str) -> str:
        value = data.get(key)
        return value if isinstance(value, str) else ""

    return Verdict(
        reproduced=data["reproduced"],
        vllm=text("vllm") or None,
        detail=str(data.get("detail", "")),
        expected=text("expected"),
        actual=text("actual"),
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
    def made(self) -> bool:
        """The script made its check, said so in its exit status too, and left nothing."""
        return (
            self.verdict is not None
            and self.verdict.reproduced is not None
            and self.exit_status == EXIT_STATUS[self.verdict.reproduced]
            and self.leftovers == 0
        )

    @property
    def ok(self) -> bool:
        """The run made its check; a control must also not reproduce (else the reproduction
        passes whatever vLLM does)."""
        if self.control is not None:
            return self.made and self.verdict is not None and self.verdict.reproduced is False
        return self.made

    def line(self, installed_vllm: str | None) -> str:
        """`NAME: reproduced on vLLM X (12 s): actual` / `NAME: not reproduced on vLLM X ...` /
        an error; a control's line says whether it showed the check able to fail."""
        name = self.finding if self.control is None else f"{self.finding} [{self.control}]"
        took = f"({self.seconds:.0f} s)"
        v = self.verdict
        version = (v.vllm if v else None) or installed_vllm or "unknown"
        if v is None or v.reproduced is None or (not self.made and not self.leftovers):
            why = v.detail or v.actual if v is not None else "no verdict line"
            return f"{name}: ERROR, no check made (exit {self.exit_status}: {why}) {took}"
        state = f"{'reproduced' if v.reproduced else 'not reproduced'} on vLLM {version}"
        left = f", {self.leftovers} process(es) left and killed: FAIL" if self.leftovers else ""
        said = v.actual or v.detail
        if self.control is not None:
            judged = (
                "check can fail" if not v.reproduced else "FAIL: the defect-absent run reproduced"
            )
            return f"{name}: {state}, {judged}{left} {took}: {said}"
        return f"{name}: {state}{left} {took}: {said}"
