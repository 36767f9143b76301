"""report.html in real headless Chromium (glm5_matrix.report.browser): it loads without a console
error or a request, every cell and test of the results is on it with its outcome, the filter
works, its first screen (1280 x 1000) shows the verdict and the first failure, every judged
comparison is drawn and drawn right, each collapsed section opens and closes, a screenshot lands
beside it; and each of those checks fails on a page with that defect planted. The results are
the results tree's, with two real H100 cells (tests/unit/data/h100-2026-12-06) among them.

Chromium is Debian's package: found on PATH (or GLM5_MATRIX_CHROMIUM), else installed with
apt-get where this runs as root; the tests skip, saying why, only where neither works.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import results_tree

from glm5_matrix.files import repo_root
from glm5_matrix.matrix.matrix import Matrix
from glm5_matrix.report import browser, command, model

INSTALL_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def chromium() -> str:
    found = browser.find_chromium()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"Chromium not found, and apt-get cannot run here: {browser.INSTALL_HINT}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # One installer at a time (pytest-xdist workers, other checkouts on this machine).
    with open("/tmp/glm5-matrix-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = browser.find_chromium()
        if not found:
            steps = (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"])
            for step in steps:
                done = subprocess.run(
                    step, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
                )
                if done.returncode != 0:
                    pytest.skip(f"{' '.join(step)} failed: {done.stderr.strip()[-300:]}")
            found = browser.find_chromium()
    if not found:
        pytest.skip("apt-get installed chromium, but no chromium executable is on PATH")
    return found


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, matrix: Matrix
) -> tuple[model.MatrixReport, Path]:
    base = tmp_path_factory.mktemp("browser")
    tree = results_tree.build(base / "results", base / "work", matrix)
    h100 = repo_root() / "tests" / "unit" / "data" / "h100-2026-12-06"
    # The passing e2e cell in the flashinfer variant's folder (the tree's deep_gemm variant is
    # its preflight skip).
    for source, folder in (
        ("e2e-tp1-deep_gemm", "e2e-tp1-flashinfer"),
        ("offload-tp1-offloading", "offload-tp1-offloading"),
    ):
        (tree / folder).mkdir()
        for name in ("results.json", "junit.xml"):
            shutil.copy(h100 / source / name, tree / folder / name)
    made = model.collect(matrix, tree)
    out = base / "results" / "report"
    command.write(made, out)
    return made, out / "report.html"


def test_a_control_short_of_its_bar_is_drawn_short_and_checked_against_its_data(
    chromium, tmp_path, matrix
):
    """A real NoPower failure (the second H100 run's e2e-tp1(flashinfer): moe_agree's control at
    power 1.44 against a bar of 2) is drawn short of its bar and the check accepts that; drawn
    past its bar, the check says so."""
    tree = tmp_path / "results"
    tree.mkdir()
    h100 = (
        repo_root() / "tests" / "unit" / "data" / "h100-2026-12-06-nopower" / "e2e-tp1-flashinfer"
    )
    shutil.copytree(h100, tree / "e2e-tp1-flashinfer")
    made, page = _report_of(tree, matrix)
    checked = browser.check_report(page, made)
    assert not [p for p in checked.problems if "its bar" in p], checked.problems

    def past_the_bar(text: str) -> str:
        return _redrawn(text, "moe_agree", 'path class="control"', "d", "M[0-9.]+,", "M560,")

    planted = _plant(page, tmp_path, past_the_bar)
    checked = browser.check_report(planted, made)
    assert any("drawn past its bar" in p for p in checked.problems), checked.problems


def test_noise_past_its_tolerance_is_drawn_past_and_checked_against_its_data(
    chromium, tmp_path, matrix
):
    """A reference whose own largest pair reaches past its tolerance (an outlying run, what the
    self-check reports; CI met it when a unit test's synthetic comparison leaked into the unit
    cell's results) is drawn so, and the check accepts that; drawn short, the check says so."""
    tree = tmp_path / "results"
    source = repo_root() / "tests" / "unit" / "data" / "h100-2026-12-06" / "e2e-tp1-deep_gemm"
    shutil.copytree(source, tree / "e2e-tp1-flashinfer")
    found = tree / "e2e-tp1-flashinfer" / "results.json"
    data = json.loads(found.read_text())
    for figure in data["figures"]:
        if figure["name"] == "repeat_prefill.noise_max":
            figure["value"] = 0.4  # past its tolerance of 0.101545
    found.write_text(json.dumps(data))
    made, page = _report_of(tree, matrix)
    checked = browser.check_report(page, made)
    assert not [p for p in checked.problems if "noise band" in p], checked.problems

    def short(text: str) -> str:
        return _redrawn(text, "repeat_prefill", 'rect class="noise"', "width", '[0-9.]+"', '4"')

    checked = browser.check_report(_plant(page, tmp_path, short), made)
    assert any(
        "repeat_prefill: the noise band stops short of the tolerance, the noise measured does" in p
        for p in checked.problems
    ), checked.problems


def test_the_report_loads_cleanly_with_every_cell_and_test(chromium, built, matrix):
    made, page = built
    shot = page.with_name("report.png")
    checked = browser.check_report(page, made, shot)
    assert checked.ok, checked.describe()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a real screenshot, beside the page
    facts = checked.load.facts
    assert len(facts["cells"]) == len(made.cells) == len(matrix.variants) + 1
    assert facts["rows"] == len({(t.file, t.name) for c in made.cells for t in c.tests})
    assert checked.load.errors == [] and checked.load.requests == []
    # the filter leaves only the rows that failed somewhere
    assert set(checked.load.filtered) == {
        "tests/suites/test_demo.py::test_greedy_repeat",
        "tests/suites/test_offload.py::test_offload_round_trip",
        "command: mypy",
    }
    # what the checks saw: the first screen, the charts, the collapsed sections
    seen = checked.load.first_screen
    assert seen["width"] == 1280 and seen["height"] == 1000
    assert seen["verdict"] < 200 and seen["failure_why"] < 1000
    charts = {(c["cell"], c["name"]) for c in checked.load.charts}
    assert ("offload-tp1(offloading)", "offload_repeat") in charts and len(charts) == 8
    # closed: the cells not run, and the one suite file none of whose tests failed
    assert [s["name"] for s in checked.load.collapsed] == ["not-run", "tests/suites/test_e2e.py"]


def _plant(page: Path, tmp_path: Path, edit) -> Path:
    text = page.read_text()
    changed = edit(text)
    assert changed != text, "the defect was not planted"
    planted = tmp_path / "report.html"
    planted.write_text(changed)
    return planted


def _redrawn(text: str, name: str, mark: str, attribute: str, old: str, new: str) -> str:
    """The page with one mark of e2e-tp1(flashinfer)'s chart `name` redrawn: the first `mark`
    element's `attribute`, from what matches `old`, set to `new`; in the charts under
    #comparisons, the ones the check reads (a failure's copy comes before them)."""
    head, section, charts = text.partition('id="comparisons"')
    assert section, "no comparisons section"
    chart = (
        rf'(<svg class="comparison" role="img" data-cell="e2e-tp1\(flashinfer\)" '
        rf'data-name="{name}".*?<{mark}[^>]*?) {attribute}="{old}'
    )
    return head + section + re.sub(chart, rf'\1 {attribute}="{new}', charts, count=1, flags=re.S)


def _report_of(tree: Path, matrix: Matrix) -> tuple[model.MatrixReport, Path]:
    """The report of the results folder `tree`, written under it."""
    made = model.collect(matrix, tree)
    command.write(made, tree / "report")
    return made, tree / "report" / "report.html"


PLANTED = {
    "a cell missing": (
        lambda t: re.sub(r'<tr data-cell="unit" .*?</tr>', "", t, count=1, flags=re.S),
        "cell unit is not on the page",
    ),
    "a test missing": (
        lambda t: re.sub(
            r'<tr data-test="tests/suites/test_demo.py::test_param\[c\]">.*?</tr>',
            "",
            t,
            flags=re.S,
        ),
        "test tests/suites/test_demo.py::test_param[c] is not on the page",
    ),
    "a JS error": (
        lambda t: t.replace("</body>", "<script>window.noSuchThing.call();</script></body>"),
        "console: exception: TypeError",
    ),
    "an external style": (
        lambda t: t.replace(
            "</head>", '<link rel="stylesheet" href="https://fonts.example.invalid/a.css"></head>'
        ),
        "fonts.example.invalid",
    ),
    "a failure shown as a pass": (
        lambda t: re.sub(
            r'(<tr data-test="tests/suites/test_demo.py::test_greedy_repeat">.*?'
            r'data-outcome="failed"[^>]*>)FAIL</td>',
            r"\1pass</td>",
            t,
            count=1,
            flags=re.S,
        ),
        "test_greedy_repeat shows 'pass', not 'FAIL'",
    ),
    "a filter that does nothing": (
        lambda t: t.replace('row.classList.toggle("hidden", box.checked && !bad);', ""),
        "the 'only failed' filter leaves",
    ),
    "the verdict pushed off the first screen": (
        lambda t: t.replace(
            '<div id="verdict"', '<div style="height:1100px"></div><div id="verdict"'
        ),
        "first screen: the verdict ends at",
    ),
    "the failures below the cells": (
        lambda t: t.replace(
            '<div id="failures">', '<div style="height:1000px"></div><div id="failures">'
        ),
        "first screen: the first failure's line ends at",
    ),
    "a verdict that says passed": (
        lambda t: t.replace('<span class="word">FAILED</span>', '<span class="word">PASSED</span>'),
        "the verdict reads 'PASSED",
    ),
    "a section that will not open": (
        lambda t: t.replace(
            "</body>",
            "<script>document.querySelectorAll('details.suite summary').forEach((s) => "
            "s.addEventListener('click', (e) => e.preventDefault()));</script></body>",
        ),
        "does not show its table when opened",
    ),
    "a chart that is not rendered": (
        lambda t: t.replace(
            '<svg class="comparison"', '<svg style="display:none" class="comparison"'
        ),
        "is not rendered",
    ),
    "a chart left out": (
        lambda t: re.sub(
            r'<div class="cmp" data-cell="e2e-tp1\(flashinfer\)" data-name="mtp".*?</svg>',
            "",
            t,
            count=1,
            flags=re.S,
        ),
        "comparison mtp of e2e-tp1(flashinfer) is not drawn",
    ),
    "a run within the tolerance drawn beyond it": (
        lambda t: _redrawn(t, "last_token", 'circle class="run"', "cx", '[0-9.]+"', '560"'),
        "run served (0.085933 nats, tolerance 0.617964) is drawn right of the tolerance",
    ),
    "a noise band drawn past the tolerance": (
        lambda t: _redrawn(t, "repeat_prefill", 'rect class="noise"', "width", '[0-9.]+"', '520"'),
        "repeat_prefill: the noise band reaches past the tolerance, the noise measured does not",
    ),
    "a control drawn short of its bar": (
        lambda t: _redrawn(t, "repeat_prefill", 'path class="control"', "d", "M[0-9.]+,", "M20,"),
        "control stale_block is drawn short of its bar",
    ),
}


@pytest.mark.parametrize("defect", list(PLANTED))
def test_each_check_fails_on_its_planted_defect(chromium, built, tmp_path, defect):
    made, page = built
    edit, expected = PLANTED[defect]
    checked = browser.check_report(_plant(page, tmp_path, edit), made)
    assert not checked.ok
    assert any(expected in problem for problem in checked.problems), checked.problems
