"""glm5_matrix.verdicts.served: a prefix hit's starting Mamba state against its checkpoint."""

from __future__ import annotations

from typing import Any

import pytest

from glm5_matrix.verdicts import served

SIZES = {"1": 128, "2": 128}


def _entry(**changes: Any) -> dict[str, Any]:
    # A hit at 256 of a 320-token prompt: the state runs in column (256 + 64 - 1) // 128 = 2.
    entry: dict[str, Any] = {
        "request": "r",
        "start": 256,
        "tokens": 64,
        "batch": 1,
        "columns": {"1": 2, "2": 2},
        "blocks": {"gdn.0": 40, "gdn.1": 41},
        "kernel_blocks": {"gdn.0": 40, "gdn.1": 41},
        "digests": {"gdn.0": ["c0", "s0"], "gdn.1": ["c1", "s1"]},
    }
    entry.update(changes)
    return entry


CHECKPOINT = {"gdn.0": ("c0", "s0"), "gdn.1": ("c1", "s1")}


def test_start_column_is_the_block_of_the_steps_last_token() -> None:
    assert served.start_column(256, 64, 128) == 2
    assert served.start_column(128, 128, 128) == 1
    assert served.start_column(0, 1, 128) == 0
    with pytest.raises(ValueError):
        served.start_column(128, 0, 128)


def test_a_hit_served_from_the_checkpoint_passes() -> None:
    result = served.check_served(_entry(), CHECKPOINT, 256, SIZES)
    assert (result.layers, result.states, result.start) == (2, 4, 256)
    assert "bit for bit" in result.describe()
    # A metadata that names no kernel index is no difference.
    served.check_served(_entry(kernel_blocks={"gdn.0": None}), CHECKPOINT, 256, SIZES)


def test_a_hit_served_from_other_bytes_fails_and_names_the_state() -> None:
    wrong = _entry(digests={"gdn.0": ["c0", "older"], "gdn.1": ["c1", "s1"]})
    with pytest.raises(AssertionError, match=r"1 of 2 layer\(s\).*gdn.0 state\(s\) \[1\]"):
        served.check_served(wrong, CHECKPOINT, 256, SIZES)
    # The control: another layer's checkpoint is told apart.
    shifted = {"gdn.0": CHECKPOINT["gdn.1"], "gdn.1": CHECKPOINT["gdn.0"]}
    with pytest.raises(AssertionError, match="other bytes"):
        served.check_served(_entry(), shifted, 256, SIZES)


def test_a_hit_elsewhere_or_read_elsewhere_fails() -> None:
    with pytest.raises(AssertionError, match="not the boundary 256"):
        served.check_served(_entry(start=128, tokens=192), CHECKPOINT, 256, SIZES)
    with pytest.raises(AssertionError, match="read column 1, the state runs in 2"):
        served.check_served(_entry(columns={"1": 1, "2": 2}), CHECKPOINT, 256, SIZES)
    with pytest.raises(AssertionError, match="kernel reads block 39"):
        served.check_served(_entry(kernel_blocks={"gdn.0": 39}), CHECKPOINT, 256, SIZES)
    with pytest.raises(AssertionError, match="not read at the step"):
        served.check_served(_entry(digests={"gdn.0": ["c0", "s0"]}), CHECKPOINT, 256, SIZES)
    with pytest.raises(AssertionError, match="proves nothing"):
        served.check_served(_entry(), {}, 256, SIZES)
