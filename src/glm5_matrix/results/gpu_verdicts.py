"""mutants/gpu-verdicts.toml: the GPU half of the mutant catalogue, judged and kept.

A GPU runner is lent for minutes and given back, and its results-mutants/ goes with it; these
verdicts are what a CPU box cannot measure again. So `nox -s mutants` on a GPU box writes each
GPU cell's judged verdict here (glm5_matrix.mutants.run), and the repository keeps the file: the
report and the catalogue's table read it. A CPU run never writes it (its GPU entries are "not run
here"). One [[verdict]] table per (mutant, GPU model, vLLM version), the latest kept:

    mutant           the catalogue entry (mutants/catalogue.toml)
    status           "caught" or "survived"; "invalid" for a run that judged nothing (its control
                     failed, or it did not finish), kept by hand with why in `detail` until a
                     judged verdict of the same mutant, GPU model and vLLM replaces it
    gpu              the runner's GPU model, as nvidia-smi names it
    vllm             the vLLM version the cell ran
    date             YYYY-MM-DD (UTC)
    caught_by        the tests that failed (empty when it survived)
    seconds          the mutant's run, wall
    control_seconds  its cell's control run (the unpatched copy, the same tests), wall
    how              "nox -s mutants", or "by hand" with what was done
    detail           what the run showed, one line
    source           where it was recorded (a commit, a results folder)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec

KEPT_FILE = Path("mutants") / "gpu-verdicts.toml"
STATUSES = ("caught", "survived", "invalid")
JUDGED = ("caught", "survived")


def _text(doc: str, required: bool = True) -> Spec:
    return Spec("str", doc, required=required, nonempty=required)


VERDICT = contracts.table(
    {
        "mutant": _text("the catalogue entry (mutants/catalogue.toml) judged"),
        "status": Spec(
            "str",
            "what the run judged (invalid: nothing, its control failed or it did not finish)",
            required=True,
            choices=STATUSES,
        ),
        "gpu": _text("the runner's GPU model, as nvidia-smi names it"),
        "vllm": _text("the vLLM version the cell ran"),
        "date": Spec(
            "str",
            "when (UTC)",
            required=True,
            pattern=r"\d{4}-\d{2}-\d{2}",
            pattern_says="YYYY-MM-DD",
        ),
        "caught_by": contracts.strings("the tests that failed (empty when it survived)"),
        "seconds": Spec("number", "the mutant's run, wall seconds", minimum=0),
        "control_seconds": Spec(
            "number", "its cell's control run (the unpatched copy), wall seconds", minimum=0
        ),
        "how": _text("`nox -s mutants` and its arguments, or `by hand` and what was done"),
        "detail": _text("what the run showed, one line", required=False),
        "source": _text("where it was recorded: a commit, a results folder"),
    },
    "one kept GPU verdict",
    rules=(
        lambda v: (
            [("caught_by", "a caught mutant names the tests that caught it")]
            if v.get("status") == "caught" and not v.get("caught_by")
            else []
        ),
        lambda v: (
            [("detail", "an invalid run says why it judged nothing")]
            if v.get("status") == "invalid" and not v.get("detail")
            else []
        ),
    ),
    rules_say=(
        "a caught verdict names the tests that caught it",
        "an invalid verdict says in detail why nothing was judged",
    ),
)
GPU_VERDICTS = contracts.table(
    {"verdict": Spec("list", "[[verdict]] entries", items=VERDICT)},
    "mutants/gpu-verdicts.toml: the GPU verdicts of `nox -s mutants`, kept",
)

HEADER = """# The GPU half of the mutant catalogue, judged and kept (glm5_matrix.results.gpu_verdicts):
# written by `nox -s mutants` on a GPU box (never by a CPU run), read by the mutants report and
# the catalogue's table on the docs site (glm5_matrix.docs.tables). Commit it after a GPU run.
"""


@dataclass(frozen=True)
class KeptVerdict:
    mutant: str
    status: str
    gpu: str
    vllm: str
    date: str
    how: str
    detail: str
    source: str
    caught_by: tuple[str, ...] = ()
    seconds: float | None = None
    control_seconds: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.mutant, self.gpu, self.vllm)

    @property
    def judged(self) -> bool:
        return self.status in JUDGED

    def describe(self) -> str:
        """One line for a table cell: where, when, what caught it, the walls."""
        walls = []
        if self.seconds is not None:
            walls.append(f"{self.seconds:.0f} s")
        if self.control_seconds is not None:
            walls.append(f"control green, {self.control_seconds:.0f} s")
        if self.status == "caught":
            verdict = "caught by " + ", ".join(f"`{t}`" for t in self.caught_by)
        elif self.status == "survived":
            verdict = "**survived**"
        else:
            verdict = "not judged"
        text = f"{self.gpu}, vLLM {self.vllm}, {self.date} ({self.how}): {verdict}"
        if self.detail:
            text += f" ({self.detail})"
        return text + (f"; {', '.join(walls)}" if walls else "")


def load(path: Path) -> list[KeptVerdict]:
    """The kept verdicts (none when the file is absent), read through the contracts reader
    (GPU_VERDICTS): each defect is a line of one UserError naming the file, the entry and the
    key."""
    if not path.is_file():
        return []
    data = contracts.read(path, GPU_VERDICTS, "kept GPU verdicts")
    found = [
        KeptVerdict(
            mutant=entry["mutant"],
            status=entry["status"],
            gpu=entry["gpu"],
            vllm=entry["vllm"],
            date=entry["date"],
            how=entry["how"],
            detail=entry.get("detail", ""),
            source=entry["source"],
            caught_by=tuple(entry.get("caught_by", ())),
            seconds=None if entry.get("seconds") is None else float(entry["seconds"]),
            control_seconds=(
                None if entry.get("control_seconds") is None else float(entry["control_seconds"])
            ),
        )
        for entry in data.get("verdict", [])
    ]
    seen: set[tuple[str, str, str]] = set()
    twice = []
    for number, verdict in enumerate(found, 1):
        if verdict.key in seen:
            twice.append(
                contracts.Problem(
                    f"verdict #{number}", f"kept twice for {verdict.gpu}, vLLM {verdict.vllm}"
                )
            )
        seen.add(verdict.key)
    contracts.raise_for(path, twice)
    return found


def updated(kept: Sequence[KeptVerdict], new: Iterable[KeptVerdict]) -> list[KeptVerdict]:
    """`kept` with each new verdict in place of the one for the same mutant, GPU model and vLLM
    version (appended when there is none): a verdict of another GPU or version stays."""
    merged = list(kept)
    for verdict in new:
        for i, old in enumerate(merged):
            if old.key == verdict.key:
                merged[i] = verdict
                break
        else:
            merged.append(verdict)
    return merged


def _value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(float(value)) if isinstance(value, float) else str(value)


def dumps(verdicts: Sequence[KeptVerdict]) -> str:
    lines = [HEADER]
    for v in verdicts:
        lines.append("[[verdict]]")
        for key in ("mutant", "status", "gpu", "vllm", "date", "caught_by", "seconds"):
            value = getattr(v, key)
            if value is not None:
                lines.append(f"{key} = {_value(value)}")
        for key in ("control_seconds", "how", "detail", "source"):
            value = getattr(v, key)
            if value is not None:
                lines.append(f"{key} = {_value(value)}")
        lines.append("")
    return "\n".join(lines)


def by_mutant(verdicts: Iterable[KeptVerdict]) -> dict[str, list[KeptVerdict]]:
    found: dict[str, list[KeptVerdict]] = {}
    for verdict in verdicts:
        found.setdefault(verdict.mutant, []).append(verdict)
    return found
