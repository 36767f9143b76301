"""glm5_matrix.matrix.known_failures: the registry's parsing, version rule, and the pytest plugin run
for real (pytester) on a passing and a failing test."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from packaging.version import Version

from glm5_matrix.errors import UserError
from glm5_matrix.files import repo_root
from glm5_matrix.matrix import known_failures
from glm5_matrix.matrix.context import for_variant
from glm5_matrix.matrix.matrix import Matrix

pytest_plugins = ("pytester",)

ENTRY = """
[[failure]]
test = "test_bug.py::test_upstream_bug"
cells = ["e2e-tp1(*)"]
upstream = "https://github.com/vllm-project/vllm/issues/1"
fix = "https://github.com/vllm-project/vllm/pull/2"
fixed_in = "0.34.0"
reason = "the bug"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "known-failures.toml"
    path.write_text(text)
    return path


def test_registry_parses_and_matches(tmp_path: Path) -> None:
    (entry,) = known_failures.load_registry(_write(tmp_path, ENTRY))
    assert entry.fixed_in == Version("0.34.0")
    assert entry.matches("test_bug.py::test_upstream_bug", "e2e-tp1(deep_gemm)")
    assert entry.matches("test_bug.py::test_upstream_bug[x]", "e2e-tp1(flashinfer)")
    assert not entry.matches("test_bug.py::test_upstream_bug", "e2e-tp2(deep_gemm)")
    assert not entry.matches("test_bug.py::test_other", "e2e-tp1(deep_gemm)")
    (module,) = known_failures.load_registry(
        _write(tmp_path, ENTRY.replace("test_bug.py::test_upstream_bug", "test_bug.py::*"))
    )
    assert module.matches("test_bug.py::test_other", "e2e-tp1(deep_gemm)")
    assert not module.matches("test_other.py::test_upstream_bug", "e2e-tp1(deep_gemm)")


def test_a_guard_entry_applies_only_with_the_kernel_guard(tmp_path: Path) -> None:
    (entry,) = known_failures.load_registry(_write(tmp_path, ENTRY + "guard = true\n"))
    assert entry.guard
    assert entry.matches("test_bug.py::test_upstream_bug", "e2e-tp1(deep_gemm)", True)
    assert not entry.matches("test_bug.py::test_upstream_bug", "e2e-tp1(deep_gemm)", False)
    (plain,) = known_failures.load_registry(_write(tmp_path, ENTRY))
    assert plain.matches("test_bug.py::test_upstream_bug", "e2e-tp1(deep_gemm)", False)


def test_xfail_only_while_vllm_predates_the_fix(tmp_path: Path) -> None:
    (entry,) = known_failures.load_registry(_write(tmp_path, ENTRY))
    assert entry.expected_to_fail(Version("0.33.0"))
    assert entry.expected_to_fail(Version("0.34.0rc1"))
    assert not entry.expected_to_fail(Version("0.34.0"))
    assert not entry.expected_to_fail(Version("0.35.1+cpu"))
    unfixed = known_failures.load_registry(
        _write(tmp_path, ENTRY.replace('fixed_in = "0.34.0"\n', ""))
    )
    assert unfixed[0].expected_to_fail(Version("99.0"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[failure]]\ntest = 1\n", "failure #1.test: must be a string, not an integer (1)"),
        (ENTRY.replace('fixed_in = "0.34.0"', 'fixed_in = "soon"'), "'soon' is not a vLLM version"),
        (ENTRY.replace("test_bug.py::", "test_bug.py:"), "must be a pytest node id (path::name)"),
        (ENTRY + "colour = 1\n", "failure #1.colour: unknown key (known: cells, evidence, fix, "),
        (ENTRY + "reasn = 1\n", "failure #1.reasn: unknown key; did you mean 'reason'?"),
        (ENTRY + 'guard = "yes"\n', "failure #1.guard: must be true or false, not a string"),
        ("[other]\n", "other: unknown key (known: failure)"),
        ("[[failure]\n", "not valid TOML"),
        ('[[failure]]\ntest = "a::b"\nupstream = "u"\n', "failure #1.reason: missing (required)"),
        (ENTRY + 'evidence = "grid"\n', "failure #1.evidence: must be a list"),
        (
            ENTRY + 'evidence = [{ file = "x.py", text = "t" }]\n',
            "failure #1.evidence",
        ),
        (ENTRY + 'evidence = [{ file = "vllm/x.py" }]\n', "text: missing (required)"),
        (
            ENTRY.replace('fixed_in = "0.34.0"\n', "")
            + 'evidence = [{ file = "vllm/x.py", text = "t" }]\n',
            "the fix as released needs `fixed_in`",
        ),
    ],
)
def test_malformed_registry_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(UserError) as error:
        known_failures.load_registry(_write(tmp_path, text))
    assert message in str(error.value)
    assert str(tmp_path / "known-failures.toml") in str(error.value)


def test_evidence_parses(tmp_path: Path) -> None:
    text = ENTRY + 'evidence = [{ file = "vllm/a.py", text = "grid = (N, 1)" }]\n'
    (entry,) = known_failures.load_registry(_write(tmp_path, text))
    assert entry.evidence == (known_failures.Evidence("vllm/a.py", "grid = (N, 1)"),)


def test_every_fixed_entry_says_what_the_fix_reads_like() -> None:
    """`nox -s upstream` checks a fix against the installed sources only through evidence."""
    for entry in known_failures.load_registry(repo_root() / known_failures.REGISTRY_FILE):
        assert entry.fixed_in is None or entry.evidence, f"{entry.test}: fixed_in, no evidence"


def test_the_project_registry_is_valid() -> None:
    """Every entry names an upstream vLLM issue and a test that exists."""
    entries = known_failures.load_registry(repo_root() / known_failures.REGISTRY_FILE)
    assert entries, "known-failures.toml has no entries"
    for entry in entries:
        assert entry.upstream.startswith("https://github.com/vllm-project/vllm/"), entry
        path, _, name = entry.test.partition("::")
        source = (repo_root() / path).read_text()
        if name != "*":
            assert f"def {name}(" in source, f"{entry.test}: no such test"


BUG_TESTS = """
def test_upstream_bug():
    assert FIXED, "the upstream bug"
"""


def _run(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    vllm: str,
    fixed: bool,
    entry: str = ENTRY,
    context: dict | None = None,
):
    root = pytester.path
    (root / "known-failures.toml").write_text(entry)
    pytester.makepyfile(test_bug=f"FIXED = {fixed}\n" + BUG_TESTS)
    monkeypatch.setattr(known_failures, "registry_path", lambda: root / "known-failures.toml")
    monkeypatch.setattr(known_failures, "installed_vllm_version", lambda: Version(vllm))
    monkeypatch.setenv("GLM5_MATRIX_CELL", "e2e-tp1(deep_gemm)")
    monkeypatch.delenv("GLM5_MATRIX_CONTEXT", raising=False)
    if context is not None:  # the context file the runner writes for the cell
        context_file = root / "context.json"
        context_file.write_text(json.dumps(context))
        monkeypatch.setenv("GLM5_MATRIX_CONTEXT", str(context_file))
    monkeypatch.setattr(known_failures, "_MARKED", {})
    monkeypatch.setattr(known_failures, "_STALE", [])
    return pytester.runpytest("-p", "glm5_matrix.matrix.known_failures", "-rA")


def test_plugin_marks_a_known_failure_strict_xfail(pytester, monkeypatch) -> None:
    result = _run(pytester, monkeypatch, "0.33.0", fixed=False)
    result.assert_outcomes(xfailed=1)


def test_plugin_reports_an_unexpected_pass_as_fixed_upstream(pytester, monkeypatch) -> None:
    result = _run(pytester, monkeypatch, "0.33.0", fixed=True)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fixed upstream: remove this entry from known-failures.toml*"])


def _context(matrix: Matrix, kernel_guard: bool) -> dict:
    variant = matrix.variant("e2e-tp1(deep_gemm)")
    return asdict(for_variant(variant, kernel_guard=kernel_guard))


@pytest.mark.parametrize(("kernel_guard", "outcome"), [(True, "xfailed"), (False, "failed")])
def test_plugin_applies_a_guard_entry_only_under_the_guard(
    pytester, monkeypatch, matrix: Matrix, kernel_guard: bool, outcome: str
) -> None:
    """Under the guard the entry marks the failing test xfail; without it the test runs plainly
    and its failure shows (the control)."""
    result = _run(
        pytester,
        monkeypatch,
        "0.33.0",
        fixed=False,
        entry=ENTRY + "guard = true\n",
        context=_context(matrix, kernel_guard),
    )
    result.assert_outcomes(**{outcome: 1})


def test_plugin_runs_the_test_plainly_once_vllm_has_the_fix(pytester, monkeypatch) -> None:
    failing = _run(pytester, monkeypatch, "0.34.0", fixed=False)
    failing.assert_outcomes(failed=1)  # a regression in a fixed release is a plain failure
    failing.stdout.fnmatch_lines(["*carries the fix*Remove the entry*"])
