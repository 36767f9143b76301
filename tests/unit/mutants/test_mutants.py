"""glm5_matrix.mutants: the catalogue's parsing, the patched copy of an environment (applied,
checked applied, the original untouched), the verdicts (pure), and the report's table."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from scaffold import ROOT

from glm5_matrix.errors import UserError
from glm5_matrix.mutants import catalogue, patching, record, verdicts
from glm5_matrix.mutants.catalogue import Mutant
from glm5_matrix.mutants.run import Outcome
from glm5_matrix.report import mutants as table
from glm5_matrix.sessions import runner

ORIGINAL = "def block_of(position, block):\n    return (position - 1) // block\n"
PATCH = """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 def block_of(position, block):
-    return (position - 1) // block
+    return position // block
"""


def _cells() -> dict[str, str]:
    return {v.id: v.env for v in runner.load(ROOT).variants}


# --- the catalogue -------------------------------------------------------------------------------


def test_the_catalogue_loads_against_the_matrix() -> None:
    mutants = catalogue.load_catalogue(ROOT / catalogue.CATALOGUE_FILE, _cells())
    assert len(mutants) >= 15
    assert len({m.name for m in mutants}) == len(mutants)
    for m in mutants:
        files = patching.patched_files(m.patch.read_text())
        assert all(f.startswith("vllm/") for f in files), (m.name, files)
        assert m.select.strip() and m.expect, m.name
    assert [m for m in mutants if m.ci], "no CI subset"
    # Spread over what the matrix guards: every area named in issue 35 has a mutant.
    areas = " ".join(m.area for m in mutants).lower()
    for word in (
        "aligner",
        "prefix caching",
        "mamba state",
        "gdn",
        "nixl",
        "offload",
        "mtp",
        "dflash2",
    ):
        assert word in areas, word


def _write_catalogue(tmp_path: Path, body: str) -> Path:
    (tmp_path / "patches").mkdir(exist_ok=True)
    (tmp_path / "patches" / "p.patch").write_text(PATCH)
    path = tmp_path / "catalogue.toml"
    path.write_text(body)
    return path


GOOD = """
[[mutant]]
name = "m-one"
patch = "p.patch"
cell = "e2e-cpu"
area = "a"
breaks = "b"
select = "test_x"
expect = ["test_x"]
"""


def test_a_good_entry_loads(tmp_path: Path) -> None:
    (m,) = catalogue.load_catalogue(_write_catalogue(tmp_path, GOOD), {"e2e-cpu": "cpu"})
    assert (m.name, m.env, m.cell, m.ci, m.expect) == (
        "m-one",
        "cpu",
        "e2e-cpu",
        False,
        ("test_x",),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('cell = "e2e-cpu"', 'cell = "nope"'), "cell: 'nope' is not a variant of the matrix"),
        (('cell = "e2e-cpu"', 'cell = "e2e-cpux"'), "matrix; did you mean 'e2e-cpu'"),
        (('patch = "p.patch"', 'patch = "missing.patch"'), "mutant 'm-one'.patch: .* not found"),
        (('area = "a"', 'area = "a"\ncolour = "red"'), "mutant 'm-one'.colour: unknown key"),
        (('area = "a"', 'area = "a"\nselcet = "x"'), "did you mean 'select'"),
        (('name = "m-one"', 'name = "M one"'), "'M one': must be lower-case"),
        (('select = "test_x"', "select = 3"), "select: must be a string, not an integer"),
        (('area = "a"\n', ""), "mutant 'm-one'.area: missing"),
    ],
)
def test_a_bad_entry_is_one_clear_line(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = _write_catalogue(tmp_path, GOOD.replace(*change))
    with pytest.raises(UserError, match=message) as error:
        catalogue.load_catalogue(path, {"e2e-cpu": "cpu"})
    assert "\n" not in str(error.value)


def test_a_name_defined_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="defined twice"):
        catalogue.load_catalogue(_write_catalogue(tmp_path, GOOD + GOOD), {"e2e-cpu": "cpu"})


def test_the_control_selects_every_mutants_tests() -> None:
    def m(select: str) -> Mutant:
        return Mutant("n", Path("p"), "c", "cpu", "a", "b", select)

    assert catalogue.control_selection([m("test_a"), m("test_a")]) == "test_a"
    assert catalogue.control_selection([m("test_b"), m("test_a or test_c")]) == (
        "(test_a or test_c) or (test_b)"
    )


# --- the patched copy ----------------------------------------------------------------------------


def test_patched_files_strips_one_component() -> None:
    assert patching.patched_files(PATCH) == ["pkg/mod.py"]
    with pytest.raises(ValueError, match="not a unified diff"):
        patching.patched_files("just text\n")
    with pytest.raises(ValueError, match="not a/b-relative"):
        patching.patched_files("+++ /abs/path.py\n")


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "orig"
    site = venv / "lib" / "python3.11" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (site / "mod.py").write_text(ORIGINAL)
    (site / "__pycache__").mkdir()
    (site / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"old bytecode")
    (venv / "bin").mkdir()
    (venv / "bin" / "tool").write_text(f"#!{venv}/bin/python\nprint('tool')\n")
    (venv / "bin" / "tool").chmod(0o755)
    return venv


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_patch_lands_in_the_copy_only(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    original = venv / "lib/python3.11/site-packages/pkg/mod.py"
    before = _sha(original)
    patch = tmp_path / "m.patch"
    patch.write_text(PATCH)
    applied = patching.apply_patch(venv, tmp_path / "copy", patch)
    copied = tmp_path / "copy/lib/python3.11/site-packages/pkg/mod.py"
    assert applied.files == ("pkg/mod.py",)
    assert "return position // block" in copied.read_text()
    assert original.read_text() == ORIGINAL and _sha(original) == before
    assert applied.original_digests == {"pkg/mod.py": before}
    assert copied.stat().st_ino != original.stat().st_ino  # its own file, not a link
    assert not (copied.parent / "__pycache__" / "mod.cpython-311.pyc").exists()
    assert (original.parent / "__pycache__" / "mod.cpython-311.pyc").exists()
    # The copy's scripts name the copy's interpreter; the original's still name the original.
    assert (tmp_path / "copy/bin/tool").read_text().startswith(f"#!{tmp_path / 'copy'}/bin/python")
    assert (venv / "bin/tool").read_text().startswith(f"#!{venv}/bin/python")


def test_a_patch_that_does_not_apply_is_refused(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    patch = tmp_path / "m.patch"
    patch.write_text(PATCH.replace("(position - 1) // block", "(position - 2) // block"))
    with pytest.raises(UserError, match="does not apply"):
        patching.apply_patch(venv, tmp_path / "copy", patch)
    assert (venv / "lib/python3.11/site-packages/pkg/mod.py").read_text() == ORIGINAL


def test_a_patch_already_applied_is_refused(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    (venv / "lib/python3.11/site-packages/pkg/mod.py").write_text(
        ORIGINAL.replace("(position - 1) // block", "position // block")
    )
    patch = tmp_path / "m.patch"
    patch.write_text(PATCH)
    with pytest.raises(UserError, match="does not apply"):
        patching.apply_patch(venv, tmp_path / "copy", patch)


def test_an_overlay_of_a_given_interpreter_is_patched_and_imported_first(
    tmp_path: Path,
) -> None:
    """GLM5_MATRIX_PYTHON (a box with vLLM installed, nothing to build): the patched package is
    an overlay put first on PYTHONPATH; the folder the interpreter imports it from is left as
    it is, and the overlay is checked to be what it imports."""
    import sys

    bundle = tmp_path / "site"
    (bundle / "pkg").mkdir(parents=True)
    (bundle / "pkg" / "__init__.py").write_text("")
    (bundle / "pkg" / "mod.py").write_text(ORIGINAL)
    patch = tmp_path / "m.patch"
    patch.write_text(PATCH)
    environ = {"PYTHONPATH": str(bundle), "PATH": "/usr/bin:/bin"}
    site = patching.interpreter_site(sys.executable, environ, package="pkg")
    assert site == bundle
    overlay = tmp_path / "overlay"
    applied = patching.apply_patch_overlay(site, overlay, patch)
    assert applied.files == ("pkg/mod.py",)
    assert "return position // block" in (overlay / "pkg" / "mod.py").read_text()
    assert (bundle / "pkg" / "mod.py").read_text() == ORIGINAL
    patching.check_overlay_imported(sys.executable, environ, overlay, package="pkg")
    with pytest.raises(UserError, match="not from the overlay"):
        patching.check_overlay_imported(sys.executable, environ, tmp_path / "empty", package="pkg")


def test_a_gpu_mutant_asked_for_on_a_cpu_box_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from glm5_matrix.mutants import run

    monkeypatch.setenv("GLM5_MATRIX_GPUS", "")
    monkeypatch.setenv(run.OUT_VARIABLE, str(tmp_path))
    name = "simple-offload-load-block-off-by-one"
    assert run.main(["--only", name, "--", "--kernel-archive", "/x.tar.gz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "not runnable here" in err[0]
    assert not (tmp_path / record.RESULTS_FILE).exists()  # the record is left as it was


def test_not_run_here_leaves_a_verdict_measured_elsewhere() -> None:
    measured = {"name": "m", "status": "caught"}
    assert record.merge([measured], [{"name": "m", "status": "not-run"}], "name") == [measured]
    newer = {"name": "m", "status": "survived"}
    assert record.merge([measured], [newer], "name") == [newer]


def test_the_shipped_patches_are_unified_diffs_of_vllm_files() -> None:
    for patch in sorted((ROOT / catalogue.PATCHES_DIR).glob("*.patch")):
        text = patch.read_text()
        assert text.startswith("--- a/vllm/"), patch.name
        done = subprocess.run(
            ["patch", "--dry-run", "-p1", "-d", "/nonexistent", "-i", str(patch)],
            capture_output=True,
            text=True,
        )
        assert "Only garbage" not in done.stdout + done.stderr, patch.name


# --- verdicts (pure) -----------------------------------------------------------------------------


def _results(outcomes: dict[str, str], how: str = "finished") -> dict:
    return {
        "tests": {f"tests/suites/test_e2e.py::{n}": {"outcome": o} for n, o in outcomes.items()},
        "ended": {"how": how},
    }


GREEN = verdicts.judge_control(_results({"test_a": "passed", "test_b": "passed"}))


def test_a_green_control_judges_its_mutants() -> None:
    assert GREEN.status == verdicts.SURVIVED
    caught = verdicts.judge(_results({"test_a": "passed", "test_b": "failed"}), ["test_b"], GREEN)
    assert (caught.status, caught.caught_by, caught.expected_hit) == ("caught", ("test_b",), True)
    other = verdicts.judge(_results({"test_a": "error", "test_b": "passed"}), ["test_b"], GREEN)
    assert (other.status, other.caught_by, other.expected_hit) == ("caught", ("test_a",), False)
    survived = verdicts.judge(_results({"test_a": "passed", "test_b": "passed"}), ["test_b"], GREEN)
    assert survived.status == verdicts.SURVIVED


def test_runs_that_prove_nothing_are_not_counted() -> None:
    red = verdicts.judge_control(_results({"test_a": "failed"}))
    assert red.status == verdicts.INVALID
    assert verdicts.judge(_results({"test_a": "failed"}), [], red).status == verdicts.INVALID
    assert verdicts.judge(None, [], GREEN).status == verdicts.INVALID
    unfinished = verdicts.judge(_results({"test_a": "passed"}, how="killed"), [], GREEN)
    assert unfinished.status == verdicts.INVALID
    nothing = verdicts.judge(_results({"test_a": "skipped"}), [], GREEN)
    assert nothing.status == verdicts.INVALID
    skipped = verdicts.judge({"skipped": "needs 1 GPU"}, [], GREEN)
    assert skipped.status == verdicts.NOT_RUN
    assert verdicts.judge_control(_results({})).status == verdicts.INVALID
    assert verdicts.judge_control(_results({"test_a": "passed"}, how="signal")).status == "invalid"


def test_a_failure_in_an_unfinished_run_still_catches() -> None:
    v = verdicts.judge(_results({"test_a": "failed"}, how="killed"), ["test_a"], GREEN)
    assert v.status == verdicts.CAUGHT


def test_catch_rates_count_only_judged_mutants() -> None:
    per_cell, overall = verdicts.catch_rates(
        [("a", "caught"), ("a", "survived"), ("b", "caught"), ("b", "not-run"), ("b", "invalid")]
    )
    assert per_cell["a"].describe() == "1/2 (50%)"
    assert per_cell["b"].describe() == "1/1 (100%)"
    assert overall.describe() == "2/3 (67%)"
    assert verdicts.Rate(0, 0).describe() == "0/0"


# --- results.json and the table ------------------------------------------------------------------


def _outcome(name: str, cell: str, verdict: verdicts.Verdict) -> Outcome:
    m = Mutant(
        name,
        Path(f"{name}.patch"),
        cell,
        "cpu",
        "area",
        "breaks it",
        "test_a",
        ("test_a",),
        note="why",
    )
    return Outcome(m, cell, verdict, 12.0, None, ("vllm/x.py",))


def test_record_and_table(tmp_path: Path) -> None:
    caught = verdicts.Verdict("caught", ("test_a",), "failed: test_a", True)
    first = [
        _outcome("m1", "e2e-cpu", caught),
        _outcome("m2", "e2e-cpu", verdicts.Verdict("survived")),
    ]
    control = Outcome(None, "e2e-cpu", GREEN, 30.0, None)
    record.write(tmp_path, [control], first, 60.0, order=["m1", "m2", "m3"])
    data = json.loads((tmp_path / record.RESULTS_FILE).read_text())
    assert data["summary"]["overall"] == "1/2 (50%)" and data["summary"]["survivors"] == ["m2"]
    # A later run of one mutant replaces its row and keeps the others.
    record.write(tmp_path, [control], [_outcome("m2", "e2e-cpu", caught)], 30.0, order=["m1", "m2"])
    data = json.loads((tmp_path / record.RESULTS_FILE).read_text())
    assert [r["name"] for r in data["mutants"]] == ["m1", "m2"]
    assert data["summary"]["overall"] == "2/2 (100%)"
    report = (tmp_path / record.REPORT_FILE).read_text()
    assert "| `m1` | `e2e-cpu` |" in report and "caught by `test_a`" in report
    assert "| **overall** | **2/2 (100%)** |" in report


def test_the_table_says_why_a_mutant_survived_or_was_not_run() -> None:
    rows = [
        {
            "name": "s",
            "cell": "c",
            "area": "a",
            "breaks": "b|c",
            "status": "survived",
            "note": "the code does not run on the CPU build",
        },
        {
            "name": "g",
            "cell": "g",
            "area": "a",
            "breaks": "b",
            "status": "not-run",
            "detail": "needs 1 GPU; nox -s mutants -- --only g",
            "no_power": "noise",
        },
    ]
    text = table.render({"mutants": rows, "summary": {"overall": "0/1 (0%)"}})
    assert "**survived**: the code does not run on the CPU build" in text
    assert "not run here: needs 1 GPU; nox -s mutants -- --only g (no power: noise)" in text
    assert "b\\|c" in text


def test_a_mutant_whose_control_is_not_green_is_not_run(tmp_path: Path) -> None:
    from glm5_matrix.mutants import run

    m = Mutant("m", Path("m.patch"), "e2e-cpu", "cpu", "a", "b", "test_a", ("test_a",))
    red = verdicts.Verdict(verdicts.INVALID, detail="the control run wrote no results.json")
    said: list[str] = []
    outcome = run._attempt(
        runner.load(ROOT), m, "e2e-cpu", "test_a", tmp_path, [], red, said.append, False
    )
    assert outcome.verdict.status == verdicts.INVALID
    assert "the control run wrote no results.json" in outcome.verdict.detail
    assert not (tmp_path / "runs").exists() and not (tmp_path / "work").exists()


def test_only_given_twice_asks_for_both() -> None:
    """`--only A --only B` names two mutants; with nargs="+" alone argparse kept the last."""
    from glm5_matrix.mutants import run

    args = run.parser().parse_args(["--only", "a", "--only", "b", "c"])
    assert args.only == ["a", "b", "c"]
