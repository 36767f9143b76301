"""glm5_matrix.sessions.runner's own steps that need no environment: a cell starts with an empty results
folder, and its command line runs under the supervisor."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import synthetic_checkpoint

from glm5_matrix.machine import supervision
from glm5_matrix.matrix.matrix import Variant
from glm5_matrix.matrix.profiles import Profile, load_profile
from glm5_matrix.sessions import runner


def test_a_cell_starts_with_an_empty_results_folder(tmp_path: Path) -> None:
    out = tmp_path / "results" / "e2e-cpu"
    (out / "site").mkdir(parents=True)
    (out / "results.json").write_text('{"outcomes": {"passed": 6}}')  # an earlier run's
    runner.empty_results_dir(out)
    assert out.is_dir() and list(out.iterdir()) == []
    runner.empty_results_dir(tmp_path / "new")  # a first run: made
    assert (tmp_path / "new").is_dir()


def test_the_command_runs_under_the_supervisor(tmp_path: Path) -> None:
    line = supervision.supervised(["python", "-m", "pytest", "-x"], "/venv/bin/python", tmp_path, 2)
    assert line == [
        "/venv/bin/python",
        "-m",
        "glm5_matrix.machine.supervision",
        "--parent",
        str(os.getpid()),
        "--results",
        str(tmp_path),
        "--gpus",
        "2",
        "--",
        "python",
        "-m",
        "pytest",
        "-x",
    ]
    # nox waits for the supervisor's whole teardown before it gives up on it.
    waited = supervision.NOX_TIMEOUTS["interrupt_timeout"]
    assert waited > supervision.GRACE_S + 2 * supervision.KILL_AFTER_S


def _profile(variant: Variant) -> Profile:
    """The variant's profile, as preflight loads it once for the run (the runner's CellPlan)."""
    assert variant.cell.profile is not None
    return load_profile(variant.cell.profile)


def _checkpoint(folder: Path) -> Path:
    """A folder with a GLM-5.3-Flash config.json: what resolve_weights accepts as a checkpoint."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(synthetic_checkpoint.full_config("text")))
    return folder


def test_a_bare_model_variable_is_not_read_as_the_checkpoint(tmp_path: Path, matrix) -> None:
    """Issue 49: a bare MODEL, which CI environments set for their own purposes, was read as the
    GLM-5.3-Flash checkpoint. Only GLM5_PRUNED_MODEL (or -- --model) is, and a run says that it
    left MODEL unread."""
    variant = matrix.variant("e2e-tp1(deep_gemm)")
    theirs = str(_checkpoint(tmp_path / "their-model"))
    weights = runner.resolve_weights(variant, _profile(variant), None, {"MODEL": theirs})
    assert (weights.kind, weights.source) == ("random", "profile")
    assert runner.unread_model_variables(variant, _profile(variant), {"MODEL": theirs}) == (
        f"weights: MODEL={theirs} is not read as the checkpoint "
        "(it is named by GLM5_PRUNED_MODEL or -- --model)"
    )
    ours = str(_checkpoint(tmp_path / "ours"))
    environ = {"MODEL": theirs, "GLM5_PRUNED_MODEL": ours}
    weights = runner.resolve_weights(variant, _profile(variant), None, environ)
    assert (weights.kind, weights.path, weights.source) == ("checkpoint", ours, "GLM5_PRUNED_MODEL")
    assert runner.unread_model_variables(variant, _profile(variant), {}) == ""
    # cells that load no weights say nothing of it
    layout = matrix.variant("layout")
    assert runner.unread_model_variables(layout, _profile(layout), {"MODEL": theirs}) == ""


def test_a_profile_may_opt_in_to_a_bare_model_variable(tmp_path: Path, monkeypatch) -> None:
    """The documented opt-in: a profile that lists MODEL in [weights] checkpoint_variables."""
    from glm5_matrix.files import repo_root
    from glm5_matrix.matrix.matrix import load_matrix

    for name in ("matrix.toml", "profiles"):
        source = repo_root() / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    profile = tmp_path / "profiles" / "glm-5.3-flash-4l" / "profile.toml"
    text = profile.read_text()
    listed = 'checkpoint_variables = ["GLM5_PRUNED_MODEL"]'
    assert listed in text
    profile.write_text(
        text.replace(listed, 'checkpoint_variables = ["GLM5_PRUNED_MODEL", "MODEL"]')
    )
    monkeypatch.setenv("GLM5_MATRIX_ROOT", str(tmp_path))
    variant = load_matrix(tmp_path / "matrix.toml").variant("e2e-tp1(deep_gemm)")
    theirs = str(_checkpoint(tmp_path / "model"))
    weights = runner.resolve_weights(variant, _profile(variant), None, {"MODEL": theirs})
    assert (weights.kind, weights.source) == ("checkpoint", "MODEL")
    assert runner.unread_model_variables(variant, _profile(variant), {"MODEL": theirs}) == ""
