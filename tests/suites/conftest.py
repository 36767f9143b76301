"""Shared by every suite: the cell's context, read from the one place the runner writes it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from glm5_matrix.machine import processes
from glm5_matrix.matrix.context import CellContext, current
from glm5_matrix.matrix.profiles import Profile, load_profile


@pytest.fixture(scope="session")
def cell() -> CellContext:
    return current()


@pytest.fixture(scope="session")
def profile(cell: CellContext) -> Profile:
    if cell.profile is None:
        pytest.fail(f"cell {cell.id} names no profile, but its suite needs one")
    if cell.weights.kind == "random":
        # What the glm5-random weights were (a measurement may override the query gain).
        from glm5_matrix.models.weights import query_gain
        from glm5_matrix.results.recorder import record_figure

        record_figure("weights.query_gain", query_gain())
    # The device the runs are measured on: the false-red figures are kept per GPU model.
    from glm5_matrix.machine.hardware import device_model
    from glm5_matrix.results.recorder import record_figure
    from glm5_matrix.verdicts import judging

    device = device_model()
    judging.set_device(device)
    record_figure("device.model", device)
    return load_profile(cell.profile)


@pytest.fixture(scope="module")
def no_surviving_children() -> Iterator[None]:
    """Used first by suites that start engines or servers, so it is torn down last: once the
    module's engines and servers are stopped, no process they started may be left."""
    before = set(processes.live_descendants())
    yield
    left = sorted(processes.new_descendants(before))
    assert not left, f"processes left behind: {[processes.cmdline(pid) for pid in left]}"
