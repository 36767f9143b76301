"""Shared by every suite: the cell's context, read from the one place the runner writes it."""

from __future__ import annotations

import pytest

from glm5_matrix.context import CellContext, current
from glm5_matrix.profiles import Profile, load_profile


@pytest.fixture(scope="session")
def cell() -> CellContext:
    return current()


@pytest.fixture(scope="session")
def profile(cell: CellContext) -> Profile:
    if cell.profile is None:
        pytest.fail(f"cell {cell.id} names no profile, but its suite needs one")
    return load_profile(cell.profile)
