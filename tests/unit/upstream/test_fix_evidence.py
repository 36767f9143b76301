"""known-failures.toml's fix claims against an installed vLLM's sources
(glm5_matrix.upstream.fix_evidence): on stand-in source trees, and on the environment's own
vLLM where the unit venv has none (skipped then)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version
from scaffold import ROOT, SRC

from glm5_matrix.matrix.known_failures import Evidence, KnownFailure
from glm5_matrix.upstream import fix_evidence

ENTRY = KnownFailure(
    test="t.py::x",
    upstream="https://github.com/vllm-project/vllm/issues/1",
    reason="r",
    fix="https://github.com/vllm-project/vllm/pull/2",
    fixed_in=Version("0.32.0"),
    evidence=(Evidence("vllm/ops/kda.py", "grid = (N * HV, NV, NK)"),),
)


def _site(tmp_path: Path, line: str) -> Path:
    (tmp_path / "vllm" / "ops").mkdir(parents=True)
    (tmp_path / "vllm" / "ops" / "kda.py").write_text(f"def launch():\n    {line}\n")
    return tmp_path


@pytest.mark.parametrize(
    ("line", "version", "ok"),
    [
        ("grid = (N * HV, NV, NK)", "0.32.0", True),  # fixed where the registry says
        ("grid = (NK, NV, N * HV)", "0.32.0", False),  # the claimed fix is not in the release
        ("grid = (NK, NV, N * HV)", "0.31.0", True),  # an older release without it
        ("grid = (N * HV, NV, NK)", "0.31.0", False),  # fixed_in names too late a release
        ("grid = (N * HV, NV, NK)", "0.33.0.dev5+cpu", True),
    ],
)
def test_a_fix_claim_is_checked_both_ways(
    tmp_path: Path, line: str, version: str, ok: bool
) -> None:
    (found,) = fix_evidence.check([ENTRY], _site(tmp_path, line), version)
    assert found.ok is ok
    assert found.present is (line == "grid = (N * HV, NV, NK)")
    state = "ok" if ok else "WRONG"
    assert fix_evidence.lines([found])[0].startswith(f"fix evidence {state}: {ENTRY.fix}")


def test_nothing_to_check_against_is_said_so(tmp_path: Path) -> None:
    (no_file,) = fix_evidence.check([ENTRY], tmp_path, "0.32.0")
    assert no_file.ok is None and "no such file" in no_file.note
    (no_vllm,) = fix_evidence.check([ENTRY], None, None)
    assert no_vllm.ok is None and "no vLLM installed" in no_vllm.note
    unfixed = KnownFailure(test="t.py::y", upstream="u", reason="r")
    assert fix_evidence.check([unfixed], tmp_path, "0.32.0") == []


def test_the_module_runs_against_the_interpreter_s_vllm(tmp_path: Path) -> None:
    """As `nox -s upstream` runs it: its JSON, and exit 1 only for a wrong claim."""
    out = tmp_path / "checks.json"
    done = subprocess.run(
        [sys.executable, "-m", "glm5_matrix.upstream.fix_evidence", "--json", str(out)],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checks = json.loads(out.read_text())
    assert checks and all(c["ok"] in (True, None) for c in checks)
    assert len(done.stdout.splitlines()) == len(checks)
