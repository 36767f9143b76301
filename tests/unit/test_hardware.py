"""Hardware preflight through the GLM5_MATRIX_GPUS override."""

from __future__ import annotations

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.hardware import check, detect, strict
from glm5_matrix.matrix import load_matrix
from glm5_matrix.profiles import repo_root


@pytest.fixture(scope="module")
def matrix():
    return load_matrix(repo_root() / "matrix.toml")


@pytest.mark.parametrize(
    ("gpus", "cell", "runnable"),
    [
        ("", "e2e-tp1", False),
        ("9.0", "e2e-tp1", True),
        ("8.9", "e2e-tp1", False),  # an L4 is too old for the sparse MLA kernels
        ("10.0", "e2e-tp1", True),
        ("9.0", "pd-nixl", False),
        ("9.0,9.0", "pd-nixl", True),
        ("9.0,8.0", "e2e-tp2", False),  # only GPUs that qualify count
        ("9.0,9.0", "e2e-tp4", False),
        ("9.0,9.0,9.0,9.0", "e2e-tp4", True),
        ("", "e2e-cpu", True),
        ("", "layout", True),
    ],
)
def test_override_decides(matrix, gpus, cell, runnable):
    found = detect({"GLM5_MATRIX_GPUS": gpus})
    verdict = check(matrix.cell(cell), found)
    assert verdict.runnable is runnable, verdict.reason


def test_skip_reason_names_need_and_finding(matrix):
    verdict = check(matrix.cell("pd-nixl"), detect({"GLM5_MATRIX_GPUS": "9.0"}))
    assert "pd-nixl needs 2 GPU(s) with compute capability >= 9.0" in verdict.reason
    assert "found 1 GPU(s) with compute capability 9.0" in verdict.reason
    verdict = check(matrix.cell("e2e-tp1"), detect({"GLM5_MATRIX_GPUS": ""}))
    assert "found no GPU (GLM5_MATRIX_GPUS='')" in verdict.reason


def test_malformed_override_is_an_error():
    with pytest.raises(UserError, match="GLM5_MATRIX_GPUS='nine'"):
        detect({"GLM5_MATRIX_GPUS": "nine"})


def test_detection_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    found = detect({})
    assert found.capabilities == ()
    assert "nvidia-smi not found" in found.describe()


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("true", True), ("", False), ("0", False)]
)
def test_strict(value, expected):
    assert strict({"GLM5_MATRIX_STRICT": value}) is expected
    assert strict({}) is False
