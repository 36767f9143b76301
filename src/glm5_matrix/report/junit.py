"""junit.xml merged over the cells, for a CI's test view: each test named with its cell id."""

from __future__ import annotations

from typing import Any

from glm5_matrix.report.model import FAILED_OUTCOMES, MatrixReport, junit_cases
from glm5_matrix.results.schema import JUNIT_FILE


def merged_junit(report: MatrixReport) -> Any:
    """One <testsuite> per cell that has results, named by its id; every test's classname is
    prefixed with the cell id, so the same test of two cells stays two tests."""
    from junitparser import Error, Failure, JUnitXml, Skipped, TestCase, TestSuite

    merged = JUnitXml(name="glm5-matrix")
    for cell in report.cells:
        if cell.status == "not run":
            continue
        suite = TestSuite(f"{cell.id}")
        suite.add_property("cell", cell.id)
        for dist, version in sorted(cell.versions.items()):
            suite.add_property(dist, version)
        cases = junit_cases(cell.folder / JUNIT_FILE) if cell.folder else {}
        if cases:
            for case in cases.values():
                case.classname = f"{cell.id}.{case.classname}" if case.classname else cell.id
                suite.add_testcase(case)
        else:  # a commands cell (lint) or a preflight skip: from results.json
            for test in cell.tests:
                case = TestCase(test.name, f"{cell.id}.{test.file}" if test.file else cell.id)
                case.time = test.seconds
                if test.outcome in FAILED_OUTCOMES:
                    case.result = [Failure(test.message or test.outcome)]
                elif test.outcome in ("skipped", "xfailed"):
                    case.result = [Skipped(test.message or test.outcome)]
                elif test.outcome in ("interrupted", "running"):  # never a pass
                    case.result = [Error(f"{test.outcome}: the run ended during this test")]
                suite.add_testcase(case)
            if cell.status == "skipped" and not cell.tests:
                case = TestCase("preflight", cell.id)
                case.result = [Skipped(cell.reason)]
                suite.add_testcase(case)
        if cell.status == "interrupted":
            case = TestCase("results complete", cell.id)
            case.result = [Error(f"interrupted: {cell.reason}")]
            suite.add_testcase(case)
        elif cell.status == "failed" and not cell.failures:
            case = TestCase("exit status", cell.id)
            case.result = [Failure(cell.reason or "failed")]
            suite.add_testcase(case)
        suite.update_statistics()
        merged.add_testsuite(suite)
    merged.update_statistics()
    return merged
