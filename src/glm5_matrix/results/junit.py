"""A cell's junit.xml when its run ended early: kept and marked incomplete where pytest wrote one,
written from results.json where it could not (pytest writes its own only at the end of its
session)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from glm5_matrix.files import write_atomic
from glm5_matrix.results.schema import describe_ending

_INCOMPLETE_PROPERTY = "glm5-matrix.complete"


def write_junit(path: Path, data: dict[str, Any]) -> None:
    """A junit.xml from results.json (pytest writes its own only at the end of its session): one
    testcase per test that started, then marked incomplete with how the run ended."""
    cell = data.get("cell") or {}
    suite = ET.Element("testsuite", name=str(cell.get("id") or "glm5-matrix"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total = 0.0
    for nodeid, entry in data.get("tests", {}).items():
        path_part, _, rest = nodeid.partition("::")
        *classes, name = rest.split("::") if rest else [path_part]
        classname = ".".join([path_part.removesuffix(".py").replace("/", "."), *classes])
        case = ET.SubElement(
            suite, "testcase", classname=classname, name=name, time=str(entry.get("seconds", 0))
        )
        outcome = entry.get("outcome")
        counts["tests"] += 1
        total += float(entry.get("seconds", 0))
        if outcome == "failed":
            ET.SubElement(case, "failure", message="failed")
            counts["failures"] += 1
        elif outcome in ("error", "interrupted"):
            message = "the run ended while this test ran" if outcome == "interrupted" else "error"
            ET.SubElement(case, "error", message=message)
            counts["errors"] += 1
        elif outcome in ("skipped", "xfailed"):
            ET.SubElement(case, "skipped", message=str(entry.get("reason") or outcome))
            counts["skipped"] += 1
    suite.attrib.update({k: str(v) for k, v in counts.items()}, time=f"{total:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    _mark_incomplete(root, data["ended"])
    _write_xml(path, root)


def mark_junit_incomplete(path: Path, ended: dict[str, Any]) -> None:
    """Mark each testsuite of junit.xml as from a run that ended early: a property
    glm5-matrix.complete=false and an error testcase saying how it ended (which a CI's JUnit view
    shows as a failure). The tests already in the file are kept as they are."""
    root = ET.parse(path).getroot()
    _mark_incomplete(root, ended)
    _write_xml(path, root)


def _mark_incomplete(root: ET.Element, ended: dict[str, Any]) -> None:
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        properties = suite.find("properties")
        if properties is None:
            properties = ET.Element("properties")
            suite.insert(0, properties)
        if any(p.get("name") == _INCOMPLETE_PROPERTY for p in properties):
            continue
        ET.SubElement(properties, "property", name=_INCOMPLETE_PROPERTY, value="false")
        case = ET.SubElement(suite, "testcase", classname="glm5-matrix", name="run ended early")
        case.set("time", "0")
        error = ET.SubElement(
            case, "error", message=describe_ending(ended), type=str(ended.get("how"))
        )
        error.text = str(ended.get("detail") or "")
        for attribute in ("tests", "errors"):
            suite.set(attribute, str(int(suite.get(attribute, "0")) + 1))


def _write_xml(path: Path, root: ET.Element) -> None:
    write_atomic(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))
