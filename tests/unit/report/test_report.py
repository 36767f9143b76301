"""glm5_matrix.report on a results folder made by the real writers (results_tree): every
outcome a cell can have, report.md, the merged junit.xml, atomic writing, bad input."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import results_tree
from junitparser import JUnitXml
from scaffold import environ_without, run_nox

from glm5_matrix.files import repo_root
from glm5_matrix.matrix.matrix import Matrix
from glm5_matrix.report import command, junit, markdown, model, page

ROOT = repo_root()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, matrix: Matrix) -> Path:
    base = tmp_path_factory.mktemp("run")
    return results_tree.build(base / "results", base / "work", matrix)


@pytest.fixture(scope="module")
def built(tree: Path, matrix: Matrix) -> model.MatrixReport:
    return model.collect(matrix, tree)


def _cell(built: model.MatrixReport, cell_id: str) -> model.CellReport:
    (cell,) = [c for c in built.cells if c.id == cell_id]
    return cell


def test_every_outcome_a_cell_can_have(built, matrix):
    status = {c.id: c.label for c in built.cells}
    assert status["e2e-cpu"] == "failed"
    assert status["unit"] == "passed"
    assert status["lint"] == "failed"
    assert status["e2e-tp1(deep_gemm)"] == (
        "skipped: e2e-tp1 needs 1 GPU(s) with compute capability >= 9.0; found no GPU"
    )
    assert status["pd-nixl-cpu"] == "interrupted: no results.json (the run ended early)"
    assert status["offload-tp1(simple)"] == "interrupted: signal SIGTERM"
    assert status["e2e-tp2(flashinfer)"] == "not run"
    # The cell a lent runner cannot finish (fused_moe_90, docs/kernel-cache.md): never shown as verified.
    assert status["e2e-tp1(flashinfer)"] == "not run"
    row = next(x for x in markdown.markdown(built).splitlines() if "`e2e-tp1(flashinfer)`" in x)
    assert "| not run |" in row and "passed" not in row
    # Every variant of the matrix is there, in matrix order, then what the matrix lost.
    ids = [c.id for c in built.cells]
    assert ids[:-1] == [v.id for v in matrix.variants]
    assert ids[-1] == "old-cell" and not built.cells[-1].in_matrix
    # The five cells the tree made results for (one lost from the matrix), the rest not run.
    cells = len(matrix.variants) + 1
    assert built.headline() == (
        f"{cells} cells: 2 passed, 2 failed, 1 skipped, {cells - 7} not run, 2 interrupted"
    )
    assert not built.ok


def test_failures_carry_their_first_line_and_full_text(built):
    e2e = _cell(built, "e2e-cpu")
    (failure,) = e2e.failures
    assert failure.nodeid == "tests/suites/test_demo.py::test_greedy_repeat"
    assert failure.message.startswith("AssertionError: cold vs repeat: |logprob delta| 0.25")
    assert "assert 0.25 <= 0.094" in failure.detail  # from junit.xml
    by_id = {t.nodeid: t for t in e2e.tests}
    assert by_id["tests/suites/test_demo.py::test_needs_gpu"].message == "needs a CUDA GPU"
    assert by_id["tests/suites/test_demo.py::test_known_upstream"].outcome == "xfailed"
    assert "tests/suites/test_demo.py::test_param[a/b]" in by_id
    (mypy,) = _cell(built, "lint").failures
    assert (mypy.nodeid, mypy.message) == ("command: mypy", "Returned code 1")


def test_engine_starts_and_figures(built):
    e2e = _cell(built, "e2e-cpu")
    assert e2e.describe_starts() == "1 (22 s)"
    figures = {f["name"]: f for f in e2e.figures}
    assert model.figure_verdict(figures["layout.block_size"]) == "within"
    assert model.figure_verdict(figures["repeat.logprob_delta"]) == "outside"
    assert model.figure_verdict(figures["layout.kv_groups"]) == ""
    # issue 13's optional torch.compile seconds, issue 26's kernel files per start and the
    # guard, each read where present ("?": a start that did not record its files)
    assert _cell(built, "offload-tp1(simple)").describe_starts() == (
        "3 (114 s), 12 s torch.compile, kernel files compiled per start: ?, 9 (under the guard), 2"
    )
    html = page.render(built)
    assert (
        '<td class="o-failed">9 (deep_gemm 8, flashinfer 1): compiled under the kernel guard</td>'
        in html
    )
    assert "<td>2 (triton 2)</td>" in html


def test_markdown_is_short_and_escaped(built):
    text = markdown.markdown(built)
    assert len(text.encode()) < 64 * 1024  # GitHub's step summary takes 1 MiB, annotate 1 MiB
    lines = text.splitlines()
    assert f"{built.headline()}." in lines
    row = next(line for line in lines if line.startswith("| `e2e-tp1(deep_gemm)`"))
    assert "skipped: e2e-tp1 needs 1 GPU(s)" in row
    failure = next(line for line in lines if "test_greedy_repeat" in line)
    # a pipe in a message does not split the table; HTML in it is not rendered
    assert "\\| at step 3 &lt;b&gt;" in failure
    assert len(re.findall(r"(?<!\\)\|", failure)) == 4  # three columns
    assert any("repeat.logprob_delta" in line and "outside" in line for line in lines)
    # a test skipped inside a cell that ran, with its reason; a cell skipped whole only in its row
    skipped = lines[lines.index("### Skipped tests") :]
    assert (
        "| `e2e-cpu` | `tests/suites/test_demo.py::test_needs_gpu` | needs a CUDA GPU |" in skipped
    )
    assert not any("e2e-tp1(deep_gemm)" in line for line in skipped)
    for cell in built.cells:
        assert any(line.startswith(f"| `{cell.id}") for line in lines), cell.id


def test_markdown_caps_each_table_and_says_how_many_more(built):
    lines = markdown.markdown(built, max_rows=0).splitlines()
    failures = sum(len(c.failures) for c in built.cells)
    skips = sum(
        t.outcome == "skipped" for c in built.cells if c.status != "skipped" for t in c.tests
    )
    assert failures and skips
    assert f"{failures} more failures in report.html." in lines
    assert f"{skips} more skipped tests in report.html." in lines
    assert not any(line.startswith("| `e2e-cpu` | `tests/") for line in lines)


def test_merged_junit_names_every_test_with_its_cell(built, tmp_path):
    path = tmp_path / "junit.xml"
    junit.merged_junit(built).write(str(path))
    xml = JUnitXml.fromfile(str(path))
    suites = {suite.name: suite for suite in xml}
    assert "e2e-tp2(flashinfer)" not in suites  # not run: nothing to report
    assert "e2e-tp1(flashinfer)" not in suites
    cases = [(suite.name, case) for suite in xml for case in suite]
    assert all(case.classname.startswith(name) for name, case in cases)
    names = [(case.classname, case.name) for _, case in cases]
    assert len(names) == len(set(names))
    e2e = {case.name: case for case in suites["e2e-cpu"]}
    assert e2e["test_greedy_repeat"].classname == "e2e-cpu.tests.suites.test_demo"
    assert e2e["test_greedy_repeat"].is_failure
    assert e2e["test_needs_gpu"].is_skipped
    assert suites["unit"].tests == 2 and suites["unit"].failures == 0
    assert [c.name for c in suites["lint"] if c.is_failure] == ["command: mypy"]
    (preflight,) = suites["e2e-tp1(deep_gemm)"]
    assert preflight.is_skipped and "needs 1 GPU(s)" in preflight.result[0].message
    assert any(c.is_error for c in suites["pd-nixl-cpu"])
    offload = {c.name: c for c in suites["offload-tp1(simple)"]}
    assert offload["results complete"].is_error
    # The test SIGTERM stopped is no pass in the merged file, the one before it is.
    assert offload["test_b"].is_error and offload["test_a"].is_passed


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_write_is_atomic_and_never_touches_the_results(tree, tmp_path, matrix):
    before = _digest(tree)
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.png").write_bytes(b"a screenshot of an earlier report")
    written = command.write(model.collect(matrix, tree), out)
    assert [p.name for p in written] == list(command.FILES)
    assert sorted(p.name for p in out.iterdir()) == sorted([*command.FILES, "report.png"])
    assert _digest(tree) == before


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "glm5_matrix.cli", "report", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )


def test_cli_writes_into_results_report_and_leaves_it_out_of_the_cells(tree, tmp_path, matrix):
    copy = tmp_path / "results"
    subprocess.run(["cp", "-r", str(tree), str(copy)], check=True)
    first = _cli(str(copy))
    assert first.returncode == 0, first.stderr
    second = _cli(str(copy))  # the report folder from the first run is not a cell
    assert f"{len(matrix.variants) + 1} cells:" in second.stdout, second.stdout
    assert (copy / "report" / "report.html").is_file()
    assert json.loads((copy / "unit" / "results.json").read_text())["exit_status"] == 0


def test_cli_refuses_a_missing_folder_in_one_line(tmp_path):
    result = _cli(str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "results folder not found" in result.stderr


@pytest.mark.parametrize(
    ("data", "label"),
    [
        ({"exit_status": 5, "tests": {}, "outcomes": {}}, "failed: no tests ran (pytest exit 5)"),
        ({"exit_status": 2, "tests": {}, "outcomes": {}}, "failed: exit status 2"),
        (
            {"exit_status": 0, "tests": {"t.py::a": {"outcome": "skipped", "reason": "r"}}},
            "skipped: r",
        ),
        ({"exit_status": 0, "complete": True, "tests": {}}, "passed"),
    ],
)
def test_status_rules(tmp_path, data, label, matrix):
    folder = tmp_path / "unit"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(data))
    built = model.collect(matrix, tmp_path)
    assert _cell(built, "unit").label == label


def test_an_unreadable_results_json_is_interrupted_not_a_crash(tmp_path, matrix):
    folder = tmp_path / "unit"
    folder.mkdir()
    (folder / "results.json").write_text('{"cell": ')
    built = model.collect(matrix, tmp_path)
    assert _cell(built, "unit").label.startswith("interrupted: results.json unreadable")


def test_nox_session_builds_the_report(tree, tmp_path, matrix):
    """`nox -s report -- RESULTS --output DIR` for real: the tool runs in the harness env."""
    out = tmp_path / "out"
    result = run_nox(
        ROOT,
        ("-s", "report", "--", str(tree), "--output", str(out)),
        environ_without(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    cells = len(matrix.variants) + 1
    assert f"{cells} cells: 2 passed, 2 failed" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(command.FILES)


def test_a_start_names_its_files_and_their_writers():
    """Issue 40: the files a start's count is made of, and those another process wrote."""
    start = {
        "label": "engine:e2e",
        "seconds": 40.0,
        "compile": {
            "seconds": 0.0,
            "entries_added": {"flashinfer": 0, "triton": 1},
            "not_counted": {"flashinfer": 5},
            "guard": True,
            "written": [
                {
                    "library": "triton",
                    "path": "H/k.cubin",
                    "writer": "cell",
                    "counted": True,
                    "pids": [41],
                    "command": "VLLM::Worker",
                },
                {
                    "library": "flashinfer",
                    "path": "cached_ops/fused_moe_90/a.cuda.o",
                    "writer": "other",
                    "counted": False,
                    "pids": [77],
                    "command": "nvcc -o a.cuda.o",
                },
            ],
        },
    }
    cell = model.CellReport("e2e", "e2e", "failed", engine_starts=[start])
    assert cell.describe_starts() == (
        "1 (40 s), 0 s torch.compile, kernel files compiled per start: "
        "1 (under the guard) (+5 not the cell's)"
    )
    html = page._kernel_files_cell(start)
    assert html.startswith('<td class="o-failed">1 (triton 1); not the cell&#x27;s: 5: compiled')
    assert (
        "<code>triton/H/k.cubin</code>: the cell&#x27;s process 41 (VLLM::Worker), counted" in html
    )
    assert (
        "fused_moe_90/a.cuda.o</code>: another process 77 (nvcc -o a.cuda.o), not counted" in html
    )
    # Only another's files: nothing compiled, nothing marked.
    start["compile"]["entries_added"] = {"flashinfer": 0}
    start["compile"]["written"] = start["compile"]["written"][1:]
    assert page._kernel_files_cell(start).startswith("<td>0; not the cell&#x27;s: 5<details>")
    # A record lists at most kernel_cache.FILES_LISTED files: the page counts the rest from
    # written_total, not from the list it was given.
    start["compile"]["written_total"] = 250
    assert "<li>... 249 more</li>" in page._kernel_files_cell(start)


def test_a_cell_whose_guards_miss_an_executed_file_is_failed(tree, tmp_path, matrix):
    """The runner fails a cell after its tests when it executed a vLLM file none of its guards
    covers (glm5_matrix.results.executed): the report must not call it passed."""
    import shutil

    from glm5_matrix.results import executed

    copy = tmp_path / "results"
    shutil.copytree(tree, copy)
    executed.record(copy / "unit", "unit", ["vllm/a.py", "vllm/b.py"], 3, [])
    assert _cell(model.collect(matrix, copy), "unit").label == "passed"
    left = ["vllm/x.py", "vllm/y.py", "vllm/z.py", "vllm/w.py"]
    executed.record(copy / "unit", "unit", ["vllm/a.py", *left], 3, left)
    assert _cell(model.collect(matrix, copy), "unit").label == (
        "failed: executed 4 vLLM file(s) no guard covers: vllm/x.py, vllm/y.py, vllm/z.py and 1 more"
    )
    executed.record(copy / "unit", "unit", [], 0, [])
    assert _cell(model.collect(matrix, copy), "unit").label == (
        "failed: no process recorded which vLLM files it executed"
    )


# --- judged comparisons, from real results (tests/unit/data/h100-2026-12-06) --------------------

H100 = ROOT / "tests" / "unit" / "data" / "h100-2026-12-06"


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory, matrix: Matrix) -> model.MatrixReport:
    results = tmp_path_factory.mktemp("h100") / "results"
    shutil.copytree(H100, results, ignore=shutil.ignore_patterns("README.md"))
    return model.collect(matrix, results)


def test_comparisons_are_read_from_the_figures_judging_records(h100):
    by_name = {c.name: c for c in _cell(h100, "e2e-tp1(deep_gemm)").comparisons}
    assert list(by_name) == ["repeat", "repeat_prefill", "last_token", "last_token_prefill", "mtp"]
    prefill = by_name["repeat_prefill"]
    assert (prefill.noise_min, prefill.noise_median, prefill.noise_max) == (0.0, 0.015627, 0.046866)
    assert (prefill.pairs, prefill.repeats, prefill.tolerance) == (15, 6, 0.101545)
    ((run,), (control,)) = prefill.runs, prefill.controls
    assert (run.label, run.value, run.judged) == ("repeat", 0.031243, True)
    assert (control.label, control.value, control.power, control.min_power) == (
        "stale_block",
        1.773338,
        17.464,
        2.0,
    )
    assert prefill.verdict == "within"
    # a control that parts at no near-tie: "inf" in results.json
    assert by_name["repeat"].controls[0].value == math.inf
    # MTP is judged by its tokens: its step deltas are recorded, not judged
    (mtp,) = by_name["mtp"].runs
    assert (mtp.judged, mtp.tokens, by_name["mtp"].verdict) == (False, (4, 24), "within")


def test_a_run_that_failed_before_its_delta_was_recorded_takes_it_from_the_message(h100):
    """The offloading cell's false red: check_agreement raised at step 9, so no worst_delta was
    recorded; the failure's line names the delta and this comparison's tolerance."""
    by_name = {c.name: c for c in _cell(h100, "offload-tp1(offloading)").comparisons}
    repeat = by_name["offload_repeat"]
    (run,) = repeat.runs
    assert (run.label, run.value, run.source) == (
        "warm_from_cpu at step 9",
        0.2814,
        "failure message",
    )
    assert repeat.verdict == "outside"
    # the comparisons the test never reached judged nothing: drawn without a run
    assert by_name["offload_cold"].runs == [] and by_name["offload_cold"].verdict == "no run"


def test_figures_that_are_missing_leave_their_marks_out(matrix):
    from glm5_matrix.report import comparisons

    figures = [
        {"name": "x.tolerance", "value": 0.1},
        {"name": "x.run.worst_delta", "value": 0.3, "limit": 0.1, "relation": "<="},
        {"name": "x.false_red_rate", "value": 0.01},
        {"name": "y.noise_max", "value": 0.1},  # no tolerance: no comparison
    ]
    (only,) = comparisons.comparisons(figures)
    assert (only.noise_max, only.controls, only.others) == (None, [], [("false_red_rate", 0.01)])
    assert only.verdict == "outside"
    svg = page.chart(only, "cell")
    assert 'class="noise"' not in svg and 'class="control"' not in svg
    assert 'class="run"' in svg and 'data-verdict="outside"' in svg
    block = page._comparison_block(only, model.CellReport("cell", "cell", "failed"))
    assert "false_red_rate 0.01" in block


def test_the_page_leads_with_the_verdict_and_each_failure_drawn(h100):
    html = page.render(h100)
    first = html.index('id="verdict"')
    assert first < html.index('id="failures"') < html.index('id="cells"')
    assert html.index('id="cells"') < html.index('id="comparisons"') < html.index('class="suite"')
    verdict = html[first : html.index("</div>", first)]
    assert "FAILED" in verdict and "1 of the 2 cells that ran failed" in verdict
    failure = html[html.index('<div class="failure"') : html.index('id="cells"')]
    assert (
        "test_offload_round_trip" in failure and "|delta| 0.2814 &gt; tolerance 0.2269" in failure
    )
    assert 'data-name="offload_repeat"' in failure  # the failed comparison drawn beside it
    charts = html.count('<svg class="comparison"')
    assert charts == 5 + 3 + 1  # every comparison once, the failed one again in its failure
    # the test grid collapsed by suite file, open only where a test failed
    suites = re.findall(
        r'<details class="suite" data-file="([^"]+)" data-failed="(\d+)"( open)?', html
    )
    assert suites and all((failed != "0") == bool(opened) for _, failed, opened in suites)


def test_failures_with_one_reason_are_one_item():
    tests = [
        model.TestResult(f"t.py::test_{i}", "error", message="kernel guard: compiled 15 files")
        for i in range(10)
    ]
    cell = model.CellReport("e2e", "e2e", "failed", tests=tests)
    report = model.MatrixReport([cell], Path("r"), Path("m"), "now")
    html = page._failures(report)
    assert html.count('<div class="failure"') == 1
    assert "10 tests (test_0, test_1, test_2, ...)" in html
    assert html.count('<details class="failure-text"') == 10  # each one's full text kept
