"""glm5_matrix.cache: where generated folders go, and writing one exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix import cache


def test_cache_dirs_follow_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cache.CACHE_VARIABLE, str(tmp_path))
    assert cache.models_dir() == tmp_path / "models"
    monkeypatch.delenv(cache.CACHE_VARIABLE)
    assert cache.models_dir() == Path.home() / ".cache" / "glm5-matrix" / "models"


def test_ensure_folder_writes_once_and_leaves_no_staging(tmp_path: Path) -> None:
    calls = []

    def write(staging: Path) -> None:
        calls.append(staging)
        (staging / "data").write_text("x")
        (staging / "done").write_text("")

    target = tmp_path / "models" / "thing"
    assert cache.ensure_folder(target, write, "done") == target
    assert cache.ensure_folder(target, write, "done") == target
    assert len(calls) == 1 and (target / "data").read_text() == "x"
    assert [p.name for p in target.parent.iterdir()] == ["thing"]


def test_ensure_folder_cleans_up_after_a_failed_write(tmp_path: Path) -> None:
    def write(staging: Path) -> None:
        (staging / "partial").write_text("")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cache.ensure_folder(tmp_path / "thing", write, "done")
    assert list(tmp_path.iterdir()) == []


def test_ensure_folder_accepts_a_racing_writer(tmp_path: Path) -> None:
    target = tmp_path / "thing"

    def write(staging: Path) -> None:
        (staging / "done").write_text("mine")
        # Another process finishes first while this one is still writing.
        target.mkdir()
        (target / "done").write_text("theirs")

    assert cache.ensure_folder(target, write, "done") == target
    assert (target / "done").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]
