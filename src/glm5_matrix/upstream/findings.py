"""The findings: upstream/NAME/finding.toml, one folder per vLLM defect (data, read here).

A finding names its reproduction script (one self-contained file: vLLM and the standard library
only, the file a maintainer pastes; `nox -s upstream` runs it as it is), the platform it needs
(`cpu`: any vLLM, the CPU build included; `gpu`: a GPU), the arguments the runner adds (`{root}`
is the checkout: a GPU runner without the Hub reads a config folder of profiles/), the matrix
test that found it, the vLLM sources that cause it, the harness's workaround, and its
defect-absent controls: runs in which the reproduction must report "not reproduced", so that
its check is shown able to fail. A control either patches one file of vLLM in a copy of the
environment (`file`, `old`, `new`: `old` must occur exactly once) or passes the script
arguments that remove the defect's condition (`args`), or both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.errors import UserError, load_toml

FOLDER = "upstream"
FINDING_FILE = "finding.toml"
PLATFORMS = ("cpu", "gpu")


def _control_rules(raw: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    patch = [raw.get(key) for key in ("file", "old", "new")]
    if any(p is not None for p in patch) and not all(p is not None for p in patch):
        yield "", "a patch needs file, old and new"
    elif patch[0] is None and not raw.get("args"):
        yield "", "a control patches a file (file, old, new) or passes args"
    elif patch[1] is not None and patch[1] == patch[2]:
        yield "new", "old and new are the same text"


def _finding_rules(raw: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if raw["platform"] == "cpu" and not raw.get("control"):
        yield "control", "a CPU reproduction needs a defect-absent [[control]]"


def _text(doc: str, required: bool = False, default: Any = contracts.MISSING) -> Spec:
    return Spec("str", doc, required=required, nonempty=True, default=default)


CONTROL = contracts.table(
    {
        "name": _text("the control's name", required=True),
        "description": _text("what it changes", required=True),
        "file": _text("a path under site-packages, e.g. vllm/utils/network_utils.py"),
        "old": _text("the text replaced (it must occur exactly once)"),
        "new": _text("what replaces it"),
        "args": contracts.strings("the script's arguments that remove the defect's condition"),
    },
    "a defect-absent run: the reproduction must report 'not reproduced'",
    rules=(_control_rules,),
    rules_say=("It patches a file (file, old and new, old != new) or passes args, or both.",),
)
FINDING = contracts.table(
    {
        "title": _text("the defect, in one line", required=True),
        "platform": Spec(
            "str",
            "what the reproduction needs (cpu: any vLLM, the CPU build included; gpu: a GPU)",
            required=True,
            choices=PLATFORMS,
        ),
        "script": _text("the reproduction, in the finding's folder", default="repro.py"),
        "args": contracts.strings(
            "the arguments the runner adds ({root}: the checkout, e.g. a config folder of profiles/)"
        ),
        "timeout_s": Spec("number", "the longest a run may take (seconds)", default=600, above=0),
        "found_by": _text("the matrix test that found it", required=True),
        "vllm": contracts.strings("the vLLM versions it was seen on"),
        "sources": contracts.strings("the vLLM sources that cause it"),
        "workaround": _text("the harness's workaround"),
        "upstream": _text("the vLLM issue or PR"),
        "control": Spec("list", "[[control]] entries", items=CONTROL, unique_by="name", default=[]),
    },
    "upstream/NAME/finding.toml: one vLLM defect the matrix found",
    rules=(_finding_rules,),
    rules_say=("A cpu finding needs a [[control]].",),
)


@dataclass(frozen=True)
class Control:
    name: str
    description: str
    file: str | None = None  # a path under site-packages, e.g. vllm/utils/network_utils.py
    old: str | None = None
    new: str | None = None
    args: tuple[str, ...] = ()

    @property
    def patches(self) -> bool:
        return self.file is not None


@dataclass(frozen=True)
class Finding:
    name: str  # the folder's name
    folder: Path
    title: str
    platform: str
    script: str
    args: tuple[str, ...]
    timeout_s: float
    found_by: str
    vllm: tuple[str, ...]
    sources: tuple[str, ...]
    workaround: str | None
    upstream: str | None
    controls: tuple[Control, ...]

    @property
    def script_path(self) -> Path:
        return self.folder / self.script


def parse_finding(name: str, folder: Path, raw: dict[str, Any], where: str) -> Finding:
    """A finding from its parsed finding.toml (FINDING); `where` names it in errors."""
    contracts.raise_for(where, contracts.problems(raw, FINDING))
    raw = contracts.with_defaults(dict(raw), FINDING)
    return Finding(
        name=name,
        folder=folder,
        title=raw["title"],
        platform=raw["platform"],
        script=raw["script"],
        args=tuple(raw.get("args", ())),
        timeout_s=float(raw["timeout_s"]),
        found_by=raw["found_by"],
        vllm=tuple(raw.get("vllm", ())),
        sources=tuple(raw.get("sources", ())),
        workaround=raw.get("workaround"),
        upstream=raw.get("upstream"),
        controls=tuple(
            Control(
                name=c["name"],
                description=c["description"],
                file=c.get("file"),
                old=c.get("old"),
                new=c.get("new"),
                args=tuple(c.get("args", ())),
            )
            for c in raw["control"]
        ),
    )


def load_findings(root: Path) -> list[Finding]:
    """Every root/upstream/NAME/finding.toml, by name; a malformed one is a UserError."""
    base = root / FOLDER
    found = []
    for path in sorted(base.glob(f"*/{FINDING_FILE}")):
        raw = load_toml(path, "finding")
        finding = parse_finding(path.parent.name, path.parent, raw, str(path))
        if not finding.script_path.is_file():
            raise UserError(f"{path}: script {finding.script} not found")
        found.append(finding)
    return found


def reproduction_name(reference: str) -> str:
    """`upstream/NAME` (as the harness's workarounds name their reproduction) -> NAME."""
    prefix = FOLDER + "/"
    if not reference.startswith(prefix) or "/" in reference[len(prefix) :].strip("/"):
        raise UserError(f"{reference!r}: not {prefix}NAME")
    return reference[len(prefix) :].strip("/")
