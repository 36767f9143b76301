"""The synthetic GLM-5.3-Flash checkpoints the checkpoint tests prune and verify: the full one
(45 layers + MTP, multimodal and text-only, written once per session by synthetic_checkpoint at
tiny widths with the published tensor names and dtypes), and a private copy a test may damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import synthetic_checkpoint as synthetic


@pytest.fixture(scope="session", params=["multimodal", "text"])
def full_checkpoint(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"full-{request.param}")
    synthetic.write_checkpoint(directory, synthetic.full_config(request.param), num_shards=6)
    (directory / "original").mkdir()
    (directory / "original" / "notes.txt").write_text("a side file in a subdirectory\n")
    (directory / ".cache").mkdir()
    (directory / ".cache" / "download.lock").write_text("hub cache bookkeeping\n")
    return directory


@pytest.fixture
def mm_source(tmp_path_factory) -> Path:
    """A private multimodal copy that a test may damage."""
    directory = tmp_path_factory.mktemp("damaged")
    synthetic.write_checkpoint(directory, num_shards=6)
    return directory
