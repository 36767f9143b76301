"""Whether the fixes known-failures.toml claims are in an installed vLLM's sources.

An entry with `fixed_in` carries `evidence`: lines of the fix as they read in the released
sources (`text` occurs in `file`, a path under site-packages). Against an installed vLLM each
is a check: from `fixed_in` on the text must be there (else the entry would let a test run as
fixed on a vLLM without the fix); before it, it must not be (else `fixed_in` names too late a
release and the test is marked a known failure where it passes). A pointer to a pull request
is only as good as this: the index of vLLM's tracker may show a PR open while the change is in a
release by another route (known-failures.toml says where, entry by entry).

`nox -s upstream` runs this module in the environment under test (it imports the registry's
reader, which needs pytest, and reads the installed vLLM without importing it):
    python -m glm5_matrix.upstream.fix_evidence [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import Version

from glm5_matrix.matrix.known_failures import (
    KnownFailure,
    installed_vllm_version,
    load_registry,
    registry_path,
)


@dataclass(frozen=True)
class FixCheck:
    test: str
    fix: str | None
    fixed_in: str
    file: str
    text: str
    present: bool | None  # None: the file is not in the installed vLLM
    ok: bool | None  # None: nothing to check against (no vLLM, or no such file)
    note: str


def check(
    entries: Sequence[KnownFailure], site: Path | None, version: Version | str | None
) -> list[FixCheck]:
    """One FixCheck per evidence line of every entry, against the vLLM whose package folder
    `site` holds (`site / "vllm" / ...`) and whose release is `version`."""
    installed = Version(str(version)) if version is not None else None
    found = []
    for entry in entries:
        for evidence in entry.evidence:
            assert entry.fixed_in is not None  # the registry's reader requires it
            path = site / evidence.file if site is not None else None
            present = evidence.text in path.read_text() if path and path.is_file() else None
            ok: bool | None
            if installed is None or present is None:
                ok = None
                note = (
                    "no vLLM installed" if installed is None else f"{evidence.file}: no such file"
                )
            elif installed >= entry.fixed_in:
                ok = present
                note = f"vLLM {installed} >= {entry.fixed_in}: the fix " + (
                    "is there" if present else "IS MISSING"
                )
            else:
                ok = not present
                note = f"vLLM {installed} < {entry.fixed_in}: " + (
                    "the fix is not there yet" if not present else "THE FIX IS ALREADY THERE"
                )
            found.append(
                FixCheck(
                    entry.test,
                    entry.fix,
                    str(entry.fixed_in),
                    evidence.file,
                    evidence.text,
                    present,
                    ok,
                    note,
                )
            )
    return found


def lines(checks: Sequence[FixCheck]) -> list[str]:
    """One line per check, `fix evidence: ok|WRONG|not checked`."""
    state = {True: "ok", False: "WRONG", None: "not checked"}
    return [
        f"fix evidence {state[c.ok]}: {c.fix or c.test} (fixed_in {c.fixed_in}) {c.file}: {c.note}"
        for c in checks
    ]


def installed_site() -> Path | None:
    """The folder holding the importable vllm package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_matrix.upstream.fix_evidence")
    parser.add_argument("--json", help="write the checks here as JSON")
    args = parser.parse_args(argv)
    checks = check(load_registry(registry_path()), installed_site(), installed_vllm_version())
    for line in lines(checks):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in checks], indent=2) + "\n")
    return 1 if any(c.ok is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
