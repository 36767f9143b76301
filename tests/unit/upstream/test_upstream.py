"""The reproductions of vLLM defects (upstream/, glm5_matrix.upstream): their data, the verdict
lines of `nox -s upstream`, the patched copy of an environment, and the ties between the
harness's workarounds and the reproductions they name."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from scaffold import ROOT

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.known_failures import load_registry
from glm5_matrix.matrix.profiles import load_profile
from glm5_matrix.upstream import findings, outcome, patching, session

REFERENCE = re.compile(r"upstream/([a-z0-9]+(?:-[a-z0-9]+)+)")
# Where the harness names a reproduction: its workarounds' code and data.
SCANNED = ("src/glm5_matrix", "tests/suites", "profiles", "known-failures.toml", "matrix.toml")


def _referenced(root: Path) -> dict[str, set[str]]:
    """upstream/NAME references in the scanned files: NAME -> the files naming it."""
    found: dict[str, set[str]] = {}
    for part in SCANNED:
        base = root / part
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if (
                path.suffix not in (".py", ".toml")
                or "upstream" in path.relative_to(root).parts[:3]
            ):
                continue
            for name in REFERENCE.findall(path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def _missing(root: Path) -> list[str]:
    """Named reproductions whose folder (finding.toml and its script) is not there."""
    problems = []
    for name, where in sorted(_referenced(root).items()):
        folder = root / findings.FOLDER / name
        if not (folder / findings.FINDING_FILE).is_file() or not any(folder.glob("*.py")):
            problems.append(f"upstream/{name} (named in {', '.join(sorted(where))})")
    return problems


# --- the ties ------------------------------------------------------------------------------------


def test_every_named_reproduction_folder_exists() -> None:
    assert _missing(ROOT) == []


def test_a_named_reproduction_without_its_folder_is_caught(tmp_path: Path) -> None:
    (tmp_path / "src" / "glm5_matrix").mkdir(parents=True)
    (tmp_path / "src" / "glm5_matrix" / "x.py").write_text('R = "upstream/gone-away"\n')
    (tmp_path / "upstream" / "here-now").mkdir(parents=True)
    (tmp_path / "upstream" / "here-now" / "finding.toml").write_text("")
    (tmp_path / "upstream" / "here-now" / "repro.py").write_text("")
    (tmp_path / "known-failures.toml").write_text('reproduction = "upstream/here-now"\n')
    assert _missing(tmp_path) == ["upstream/gone-away (named in src/glm5_matrix/x.py)"]


def test_the_workarounds_name_their_reproductions_in_their_data() -> None:
    from glm5_matrix.engines import startup_interrupts

    assert startup_interrupts.REPRODUCTION == "upstream/ctrl-c-during-start"
    text = (ROOT / "src/glm5_matrix/engines/client.py").read_text()
    assert 'REPR_REPRODUCTION = "upstream/llm-repr-after-engine-death"' in text
    for profile in ("tiny-hybrid-cpu", "glm-5.3-flash-4l"):
        pd = load_profile(profile).section("pd")
        assert pd["connect_retry_reproduction"] == "upstream/nixl-handshake-timeout"
    named = {f.reproduction for f in load_registry(ROOT / "known-failures.toml")} - {None}
    assert all((ROOT / name / "finding.toml").is_file() for name in named), named
    text = (ROOT / "src/glm5_matrix/engines/engine_configs.py").read_text()
    assert "upstream/jit-monitor-checkpoint-store" in text


def test_every_finding_is_named_by_a_workaround_and_names_its_own() -> None:
    referenced = _referenced(ROOT)
    every = findings.load_findings(ROOT)
    assert {f.name for f in every} == {
        "ctrl-c-during-start",
        "llm-repr-after-engine-death",
        "nixl-handshake-timeout",
        "jit-monitor-checkpoint-store",
        "nixl-read-after-lease-expiry",
        "nixl-block-size-one-way",
    }
    for finding in every:
        assert finding.name in referenced, f"no workaround names upstream/{finding.name}"
        assert finding.workaround is not None
        path = finding.workaround.split(" ", 1)[0].split("::", 1)[0]
        assert (ROOT / path).is_file(), f"{finding.name}: workaround {path} not found"
        drafts = [p for p in ("ISSUE.md", "COMMENT.md") if (finding.folder / p).is_file()]
        assert drafts, f"{finding.name}: no draft issue (or comment)"


def test_every_cpu_finding_has_a_control_and_the_gpu_one_is_not_run_here() -> None:
    every = findings.load_findings(ROOT)
    assert [f.name for f in every if f.platform == "gpu"] == ["jit-monitor-checkpoint-store"]
    for finding in every:
        if finding.platform == "cpu":
            assert finding.controls, finding.name


def test_known_failures_refuse_a_reproduction_that_is_not_a_folder_name(tmp_path: Path) -> None:
    path = tmp_path / "known-failures.toml"
    path.write_text(
        '[[failure]]\ntest = "t.py::x"\nupstream = "u"\nreason = "r"\nreproduction = "elsewhere"\n'
    )
    with pytest.raises(UserError, match="reproduction"):
        load_registry(path)


# --- the findings' data --------------------------------------------------------------------------

GOOD = {
    "title": "t",
    "platform": "cpu",
    "found_by": "tests/suites/test_x.py",
    "control": [
        {"name": "patched", "description": "d", "file": "vllm/a.py", "old": "a", "new": "b"}
    ],
}


def test_a_finding_parses() -> None:
    finding = findings.parse_finding("x", Path("/f/x"), GOOD, "w")
    assert finding.script_path == Path("/f/x/repro.py")
    assert finding.controls[0].patches and finding.timeout_s == 600


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"platform": "tpu"}, "w: platform: 'tpu' is not one of cpu, gpu"),
        ({"platform": "cpus"}, "did you mean 'cpu'"),
        ({"colour": 1}, "w: colour: unknown key"),
        ({"timout_s": 1}, "w: timout_s: unknown key; did you mean 'timeout_s'"),
        ({"control": []}, "needs a defect-absent"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"control": [{"name": "c", "description": "d"}]}, "patches a file"),
        ({"control": [{"name": "c", "description": "d", "file": "f", "old": "a"}]}, "needs file"),
        (
            {"control": [{"name": "c", "description": "d", "file": "f", "old": "a", "new": "a"}]},
            "same",
        ),
        ({"control": [GOOD["control"][0], GOOD["control"][0]]}, "name 'patched' is defined twice"),
        ({"control": [{**GOOD["control"][0], "old": 1}]}, r"control 'patched'\.old: must be a str"),
        ({"title": ""}, "title"),
    ],
)
def test_a_malformed_finding_is_one_clear_error(change: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        findings.parse_finding("x", Path("/f/x"), {**GOOD, **change}, "w")


def test_a_gpu_finding_needs_no_control() -> None:
    raw = {**GOOD, "platform": "gpu"}
    del raw["control"]
    assert findings.parse_finding("x", Path("/f"), raw, "w").controls == ()


def test_reproduction_names() -> None:
    assert findings.reproduction_name("upstream/a-b") == "a-b"
    for bad in ("a-b", "upstream/a/b", "elsewhere/a"):
        with pytest.raises(UserError):
            findings.reproduction_name(bad)


def test_session_options() -> None:
    options = session.parse(["a", "--controls"], ["a", "b"], {})
    assert options == session.Options(("a",), True, "cpu", None)
    assert session.parse(["--vllm", "0.33.0", "--env", "cuda"], ["a"], {}).vllm == "0.33.0"
    assert session.parse([], ["a"], {"GLM5_MATRIX_VLLM": "0.31.0"}).vllm == "0.31.0"
    assert session.parse(["--vllm", "0.33.0"], ["a"], {"GLM5_MATRIX_VLLM": "x"}).vllm == "0.33.0"
    with pytest.raises(UserError, match="unknown finding"):
        session.parse(["c"], ["a", "b"], {})


def test_each_vllm_gets_a_venv_of_its_own() -> None:
    assert session.venv_name("cpu", None) == "upstream"
    assert session.venv_name("cpu", "0.31.0") == "upstream-vllm-0.31.0"
    assert session.venv_name("cuda", None) == "upstream-cuda"
    wheel = "/w/vllm-0.33.0+cu130-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert session.venv_name("cuda", wheel).startswith("upstream-cuda-vllm-vllm-0.33.0-cu130")
    assert "/" not in session.venv_name("cpu", "/src/vllm/")


def test_the_runner_runs_the_script_as_a_maintainer_would() -> None:
    every = {f.name: f for f in findings.load_findings(ROOT)}
    python = Path("/venv/bin/python")
    late = every["nixl-read-after-lease-expiry"]
    assert session.command(late, None, python) == [str(python), str(late.script_path)]
    control = late.controls[0]
    assert session.command(late, control, python)[2:] == ["--within-lease"]
    gpu = every["jit-monitor-checkpoint-store"]
    argv = session.command(gpu, None, python)
    assert argv[2:4] == ["--model", str(ROOT / "profiles/glm-5.3-flash-4l")]
    assert (Path(argv[3]) / "config.json").is_file()


def test_a_gpu_finding_runs_only_where_a_gpu_is() -> None:
    from glm5_matrix.machine.hardware import Hardware

    every = {f.name: f for f in findings.load_findings(ROOT)}
    none, h200 = Hardware((), "test"), Hardware(((9, 0),), "test")
    assert not session.runs_here(every["jit-monitor-checkpoint-store"], none)
    assert session.runs_here(every["jit-monitor-checkpoint-store"], h200)
    assert session.runs_here(every["ctrl-c-during-start"], none)
    assert session.runs_here(every["ctrl-c-during-start"], h200)


# --- verdicts ------------------------------------------------------------------------------------


def test_the_verdict_is_the_last_line() -> None:
    text = 'noise\n{"reproduced": true, "vllm": "0.32.0", "detail": "d"}\n\n'
    assert outcome.parse_verdict(text) == outcome.Verdict(True, "0.32.0", "d")
    full = '{"reproduced": false, "vllm": "0.32.0", "detail": "", "expected": "E", "actual": "A"}'
    assert outcome.parse_verdict(full) == outcome.Verdict(False, "0.32.0", "", "E", "A")
    assert outcome.parse_verdict('{"reproduced": null}').reproduced is None  # type: ignore[union-attr]
    for bad in ("", "not json", '{"reproduced": "yes"}', "[1]", '{"detail": 1}\nend'):
        assert outcome.parse_verdict(bad) is None


def _run(reproduced: bool | None, control: str | None = None, **kw: object) -> outcome.Run:
    verdict = outcome.Verdict(reproduced, "0.32.0", "why")
    fields = {"exit_status": outcome.EXIT_STATUS[reproduced], "seconds": 12.4, "leftovers": 0}
    fields.update(kw)
    return outcome.Run("f", control, verdict, **fields)  # type: ignore[arg-type]


def test_lines_say_reproduced_or_not_on_which_vllm() -> None:
    assert _run(True).line(None) == "f: reproduced on vLLM 0.32.0 (12 s): why"
    assert _run(False).line(None) == "f: not reproduced on vLLM 0.32.0 (12 s): why"
    assert _run(True).ok and _run(False).ok  # today's state of vLLM either way


def test_a_control_must_not_reproduce() -> None:
    assert _run(False, "patched").ok
    assert "check can fail" in _run(False, "patched").line(None)
    assert not _run(True, "patched").ok
    assert "FAIL" in _run(True, "patched").line(None)


def test_no_check_or_leftovers_fail_the_run() -> None:
    assert not _run(None).ok
    assert "ERROR" in _run(None).line(None)
    assert not _run(True, exit_status=2).ok
    assert not _run(True, exit_status=0).ok  # the exit status must say what the line says
    assert not _run(False, exit_status=1).ok
    assert "ERROR" in _run(False, exit_status=1).line(None)
    assert not _run(True, leftovers=1).ok
    assert "left and killed" in _run(True, leftovers=1).line(None)
    assert not outcome.Run("f", None, None, 0, 1.0, 0).ok


# --- the patched copy ----------------------------------------------------------------------------


def test_apply_needs_exactly_one_match() -> None:
    assert patching.apply("a b c", "b", "x", "w") == "a x c"
    for text in ("a c", "b b"):
        with pytest.raises(UserError, match="occurs"):
            patching.apply(text, "b", "x", "w")


def _venv(root: Path) -> Path:
    site = root / "venv" / "lib" / "python3.11" / "site-packages" / "vllm"
    (site / "__pycache__").mkdir(parents=True)
    (site / "mod.py").write_text("KEEP = 1\nTIMEOUT = 5000\n")
    (site / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"old bytecode")
    (site / "other.py").write_text("x = 1\n")
    (root / "venv" / "bin").mkdir()
    (root / "venv" / "bin" / "python").write_text("")
    return root / "venv"


def test_the_patched_copy_leaves_the_original_alone(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    python = patching.patched_copy(
        venv, tmp_path / "copy", [("vllm/mod.py", "TIMEOUT = 5000", "TIMEOUT = 60000")]
    )
    assert python == tmp_path / "copy" / "bin" / "python"
    original = venv / "lib/python3.11/site-packages/vllm"
    copy = tmp_path / "copy/lib/python3.11/site-packages/vllm"
    assert (original / "mod.py").read_text() == "KEEP = 1\nTIMEOUT = 5000\n"
    assert (copy / "mod.py").read_text() == "KEEP = 1\nTIMEOUT = 60000\n"
    assert not os.path.samefile(original / "mod.py", copy / "mod.py")
    assert os.path.samefile(original / "other.py", copy / "other.py")  # linked, not copied
    assert not (copy / "__pycache__" / "mod.cpython-311.pyc").exists()
    assert (original / "__pycache__" / "mod.cpython-311.pyc").read_bytes() == b"old bytecode"


def test_a_patch_that_no_longer_matches_is_refused(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    with pytest.raises(UserError, match="occurs 0 times"):
        patching.patched_copy(venv, tmp_path / "copy", [("vllm/mod.py", "RCVTIMEO", "x")])
    with pytest.raises(UserError, match="does not exist"):
        patching.patched_copy(venv, tmp_path / "copy", [("vllm/gone.py", "a", "b")])
    assert (venv / "lib/python3.11/site-packages/vllm/mod.py").read_text().endswith("5000\n")
