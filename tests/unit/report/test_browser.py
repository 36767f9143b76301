"""report.html in real headless Chromium (glm5_matrix.report.browser): it loads without a console
error or a request, every cell and test of the results is on it with its outcome, the filter
works, a screenshot lands beside it; and each of those checks fails on a page with that
defect planted.

Chromium is Debian's package: found on PATH (or GLM5_MATRIX_CHROMIUM), else installed with
apt-get where this runs as root; the tests skip, saying why, only where neither works.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import results_tree

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
    made = model.collect(matrix, tree)
    out = base / "results" / "report"
    command.write(made, out)
    return made, out / "report.html"


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
        "command: mypy",
    }


def _plant(page: Path, tmp_path: Path, edit) -> Path:
    text = page.read_text()
    changed = edit(text)
    assert changed != text, "the defect was not planted"
    planted = tmp_path / "report.html"
    planted.write_text(changed)
    return planted


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
        lambda t: re.sub(r'(data-outcome="failed"[^>]*>)FAIL</td>', r"\1pass</td>", t, count=1),
        "test_greedy_repeat shows 'pass', not 'FAIL'",
    ),
    "a filter that does nothing": (
        lambda t: t.replace('row.classList.toggle("hidden", box.checked && !bad);', ""),
        "the 'only failed' filter leaves",
    ),
}


@pytest.mark.parametrize("defect", list(PLANTED))
def test_each_check_fails_on_its_planted_defect(chromium, built, tmp_path, defect):
    made, page = built
    edit, expected = PLANTED[defect]
    checked = browser.check_report(_plant(page, tmp_path, edit), made)
    assert not checked.ok
    assert any(expected in problem for problem in checked.problems), checked.problems
