"""The matrix report's data: every cell of the matrix and what its results folder says, read
into a MatrixReport that the writers (markdown, junit, page) and the browser check share.

Reads only matrix data and results folders (results/SLUG/{context.json, results.json,
junit.xml}). A cell is passed, failed, skipped (with the reason: preflight's, or every test's),
not run (no results folder) or interrupted (results.json says "complete": false, or the folder
has none). Keys that later runs add (complete, ended, engine_starts[].compile, figures) are read
where present. The command that writes the report is glm5_matrix.report.command.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.guards import EXECUTED_FILE
from glm5_matrix.matrix.matrix import Matrix, Variant
from glm5_matrix.report.comparisons import Comparison, comparisons
from glm5_matrix.results.schema import CONTEXT_FILE, JUNIT_FILE, RESULTS_FILE, first_line

STATUSES = ("passed", "failed", "skipped", "not run", "interrupted")
FAILED_OUTCOMES = ("failed", "error", "xpassed")
# pytest's exit status when it collected no test: a cell that tested nothing did not pass.
NO_TESTS_COLLECTED = 5


@dataclass
class TestResult:
    nodeid: str
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed
    seconds: float = 0.0
    message: str = ""  # the first line of a failure, a skip's or xfail's reason
    detail: str = ""  # a failure's full text, from junit.xml

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0] if "::" in self.nodeid else ""

    @property
    def name(self) -> str:
        return self.nodeid.split("::", 1)[1] if "::" in self.nodeid else self.nodeid


@dataclass
class CellReport:
    id: str
    slug: str
    status: str  # one of STATUSES
    reason: str = ""  # why skipped / interrupted / failed without a failing test
    in_matrix: bool = True
    tags: list[str] = field(default_factory=list)
    tests: list[TestResult] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    engine_starts: list[dict[str, Any]] = field(default_factory=list)
    figures: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float | None = None
    exit_status: int | None = None
    context: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    folder: Path | None = None

    @property
    def failures(self) -> list[TestResult]:
        return [t for t in self.tests if t.outcome in FAILED_OUTCOMES]

    @property
    def comparisons(self) -> list[Comparison]:
        """The judged comparisons its figures record (glm5_matrix.report.comparisons)."""
        return comparisons(self.figures, {t.nodeid: t.message for t in self.failures})

    @property
    def label(self) -> str:
        """The outcome as one line: "passed", "skipped: e2e-tp1 needs 1 GPU(s) ..."."""
        return f"{self.status}: {self.reason}" if self.reason else self.status

    def describe_tests(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items())) or "no tests"

    def describe_wall(self) -> str:
        if not isinstance(self.wall_seconds, int | float) or self.status == "skipped":
            return ""
        return f"{self.wall_seconds:.0f} s"

    def describe_starts(self) -> str:
        """ "2 (84 s), 0 s torch.compile, kernel files compiled per start: 9 (under the guard),
        0": the starts and their seconds, vLLM's torch.compile seconds where recorded (0 in
        eager mode), and the kernel files each start compiled where recorded ("?" for a start
        that did not record them), marking a start that compiled with the kernel guard on."""
        if not self.engine_starts:
            return "none"
        total = sum(float(s.get("seconds") or 0.0) for s in self.engine_starts)
        text = f"{len(self.engine_starts)} ({total:.0f} s)"
        compiled = [
            float(s["compile"]["seconds"])
            for s in self.engine_starts
            if isinstance(s.get("compile"), dict) and s["compile"].get("seconds") is not None
        ]
        if compiled:
            text += f", {sum(compiled):.0f} s torch.compile"
        counts = [kernel_files(s) for s in self.engine_starts]
        if any(n is not None for n in counts):
            shown = [
                "?"
                if n is None
                else f"{n} (under the guard)"
                if compiled_under_guard(s)
                else str(n)
                for s, n in zip(self.engine_starts, counts, strict=True)
            ]
            shown = [
                text + (f" (+{left} not the cell's)" if left else "")
                for text, left in zip(shown, map(not_counted, self.engine_starts), strict=True)
            ]
            text += ", kernel files compiled per start: " + ", ".join(shown)
        return text


def kernel_files(start: dict[str, Any]) -> int | None:
    """How many kernel files an engine start compiled (all libraries), None when not recorded."""
    record = start.get("compile")
    added = record.get("entries_added") if isinstance(record, dict) else None
    if not isinstance(added, dict):
        return None
    return sum(n for n in added.values() if isinstance(n, int))


def not_counted(start: dict[str, Any]) -> int:
    """How many kernel files were written during an engine start but not counted against it:
    another process wrote them, or nobody was seen writing them while another process wrote
    the cache (glm5_matrix.kernels.writers); 0 when not recorded."""
    record = start.get("compile")
    left = record.get("not_counted") if isinstance(record, dict) else None
    return sum(n for n in left.values() if isinstance(n, int)) if isinstance(left, dict) else 0


def written_files(start: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernel files written during an engine start, each with its writer ("cell", "other"
    or "unseen"), the pids seen writing it and whether it counted; [] when not recorded."""
    record = start.get("compile")
    files = record.get("written") if isinstance(record, dict) else None
    return [f for f in files if isinstance(f, dict)] if isinstance(files, list) else []


def compiled_under_guard(start: dict[str, Any]) -> bool:
    """The start compiled kernel files while the kernel guard was on (it was refused)."""
    record = start.get("compile")
    return bool((kernel_files(start) or 0) > 0 and isinstance(record, dict) and record.get("guard"))


@dataclass
class MatrixReport:
    cells: list[CellReport]
    results_dir: Path
    matrix_file: Path
    generated: str

    def count(self, status: str) -> int:
        return sum(1 for c in self.cells if c.status == status)

    def headline(self) -> str:
        counts = ", ".join(f"{self.count(s)} {s}" for s in STATUSES)
        return f"{len(self.cells)} cells: {counts}"

    @property
    def ok(self) -> bool:
        return not any(c.status in ("failed", "interrupted") for c in self.cells)


# --- reading ----------------------------------------------------------------------------------


def collect(matrix: Matrix, results_dir: Path, exclude: tuple[Path, ...] = ()) -> MatrixReport:
    """Every variant of the matrix, in matrix order, then any results folder of a cell that the
    matrix no longer has. `exclude`: folders under results_dir that are not cells (the
    report's own output)."""
    if not results_dir.is_dir():
        raise UserError(f"{results_dir}: results folder not found")
    cells = [_read_cell(results_dir / v.slug, v.id, v.slug, v) for v in matrix.variants]
    known = {v.slug for v in matrix.variants}
    skipped = {p.resolve() for p in exclude}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        if folder.name in known or folder.resolve() in skipped:
            continue
        if not any((folder / name).is_file() for name in (RESULTS_FILE, CONTEXT_FILE)):
            continue  # not a cell's folder
        data = _load_json(folder / RESULTS_FILE) or {}
        cell_id = str((data.get("cell") or {}).get("id") or folder.name)
        cells.append(_read_cell(folder, cell_id, folder.name, None))
    return MatrixReport(
        cells=cells,
        results_dir=results_dir,
        matrix_file=matrix.source,
        generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, json.JSONDecodeError) as exc:
        return {"_unreadable": f"{path.name} unreadable: {exc}"}
    return data if isinstance(data, dict) else {"_unreadable": f"{path.name} is not an object"}


def _read_cell(folder: Path, cell_id: str, slug: str, variant: Variant | None) -> CellReport:
    cell = CellReport(
        id=cell_id,
        slug=slug,
        status="not run",
        in_matrix=variant is not None,
        tags=variant.tags if variant is not None else [],
        folder=folder if folder.is_dir() else None,
    )
    if not folder.is_dir():
        return cell
    context = _load_json(folder / CONTEXT_FILE)
    data = _load_json(folder / RESULTS_FILE)
    if data is None:
        cell.status, cell.reason = "interrupted", f"no {RESULTS_FILE} (the run ended early)"
        cell.context = context or {}
        cell.tests = _junit_tests(folder / JUNIT_FILE, [])
        return cell
    if "_unreadable" in data:
        cell.status, cell.reason = "interrupted", str(data["_unreadable"])
        return cell
    cell.context = context if context and "_unreadable" not in context else data.get("cell") or {}
    cell.exit_status = data.get("exit_status")
    cell.wall_seconds = data.get("wall_seconds")
    cell.outcomes = dict(data.get("outcomes") or {})
    cell.engine_starts = [s for s in data.get("engine_starts") or [] if isinstance(s, dict)]
    cell.figures = [f for f in data.get("figures") or [] if isinstance(f, dict)]
    cell.versions = dict(data.get("versions") or {})
    cell.tests = _junit_tests(folder / JUNIT_FILE, _recorded_tests(data))
    cell.status, cell.reason = _status(data, cell)
    if cell.status == "passed":  # the runner's check after the tests (glm5_matrix.results.executed)
        unguarded = _unguarded(folder / EXECUTED_FILE)
        if unguarded:
            cell.status, cell.reason = "failed", unguarded
    return cell


def _unguarded(path: Path) -> str:
    """Why the executed-files check failed a cell whose tests passed, or "" (no record, or none
    uncovered): vLLM files it executed that none of its guards covers, or no data at all."""
    record = _load_json(path)
    if not record or "_unreadable" in record:
        return ""
    left = [str(f) for f in record.get("uncovered") or []]
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        return f"executed {len(left)} vLLM file(s) no guard covers: {', '.join(left[:3])}{more}"
    if record.get("processes") == 0:
        return "no process recorded which vLLM files it executed"
    return ""


def _recorded_tests(data: dict[str, Any]) -> list[TestResult]:
    tests = []
    for nodeid, entry in (data.get("tests") or {}).items():
        if not isinstance(entry, dict):
            continue
        outcome = str(entry.get("outcome", "passed"))
        message = str(entry.get("message") or entry.get("reason") or "")
        message = message.removeprefix("Skipped: ")  # pytest's longrepr of a skip
        tests.append(
            TestResult(nodeid, outcome, float(entry.get("seconds") or 0.0), first_line(message))
        )
    return tests


def _status(data: dict[str, Any], cell: CellReport) -> tuple[str, str]:
    if data.get("complete") is False:  # issue 14's marker; absent means complete
        ended = data.get("ended") or {}
        how = ended.get("how") or "ended early"
        parts = [str(how)]
        if ended.get("signal"):
            parts.append(str(ended["signal"]))
        if ended.get("test"):
            parts.append(f"in {ended['test']}")
        if ended.get("detail"):
            parts.append(first_line(str(ended["detail"])))
        return "interrupted", " ".join(parts)
    if data.get("skipped"):
        return "skipped", first_line(str(data["skipped"]))
    if cell.exit_status == NO_TESTS_COLLECTED and not cell.tests:
        return "failed", "no tests ran (pytest exit 5)"
    if cell.failures or cell.exit_status not in (0, None):
        reason = "" if cell.failures else f"exit status {cell.exit_status}"
        return "failed", reason
    if cell.tests and all(t.outcome == "skipped" for t in cell.tests):
        reasons = sorted({t.message for t in cell.tests if t.message})
        return "skipped", "; ".join(reasons[:3]) or "every test skipped"
    return "passed", ""


def junit_address(nodeid: str) -> tuple[str, str]:
    """(classname, name) pytest's junit.xml gives a node id (its mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def _junit_tests(path: Path, recorded: list[TestResult]) -> list[TestResult]:
    """The recorded tests with each failure's full text from junit.xml; tests that only
    junit.xml has (a run that ended before results.json) are added from it."""
    cases = junit_cases(path)
    by_address = {junit_address(t.nodeid): t for t in recorded}
    for (classname, name), case in cases.items():
        test = by_address.get((classname, name))
        results = list(case.result)
        if test is None:
            test = TestResult(f"{classname}::{name}", _junit_outcome(results), float(case.time))
            recorded.append(test)
            by_address[(classname, name)] = test
        for result in results:
            text = (result.text or "").strip()
            if text and not test.detail:
                test.detail = text
            if result.message and not test.message:
                test.message = first_line(result.message)
    return recorded


def junit_cases(path: Path) -> dict[tuple[str, str], Any]:
    if not path.is_file():
        return {}
    from junitparser import JUnitXml, JUnitXmlError, TestSuite

    try:
        xml = JUnitXml.fromfile(str(path))
    except (JUnitXmlError, OSError, SyntaxError):  # ParseError is a SyntaxError
        return {}
    suites = [xml] if isinstance(xml, TestSuite) else list(xml)
    return {(c.classname or "", c.name or ""): c for suite in suites for c in suite}


def _junit_outcome(results: list[Any]) -> str:
    from junitparser import Error, Failure, Skipped

    for result in results:
        if isinstance(result, Failure):
            return "failed"
        if isinstance(result, Error):
            return "error"
        if isinstance(result, Skipped):
            return "skipped"
    return "passed"


def figure_verdict(figure: dict[str, Any]) -> str:
    """ "within" / "outside" its limit, or "" where the figure has none (or is not a number)."""
    relation, limit, value = figure.get("relation"), figure.get("limit"), figure.get("value")
    if relation is None or limit is None:
        return ""
    try:
        ok = {
            "<=": value <= limit,
            ">=": value >= limit,
            "<": value < limit,
            ">": value > limit,
            "==": value == limit,
        }[relation]
    except (TypeError, KeyError):
        return ""
    return "within" if ok else "outside"


def format_value(value: Any, unit: Any = None) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = ", ".join(str(v) for v in value)
    else:
        text = str(value)
    return f"{text} {unit}" if unit and not isinstance(value, list) else text
