"""Shared by the unit tests: no test writes into the machine's kernel cache or leaves library
cache variables behind (engines and servers point them at the kernel cache when they start);
no test leaves figures in the recorder the unit cell's results come from; `matrix`, the
checkout's matrix.toml loaded once per test module, its cells' environments checked against
envs/ as the runner loads it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from glm5_matrix.envs import environments
from glm5_matrix.files import repo_root
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, load_matrix
from glm5_matrix.results import recorder


@pytest.fixture(autouse=True)
def private_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ["GLM5_MATRIX_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernel-cache"))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def recorder_put_back() -> Iterator[None]:
    """No test leaves its own figures in the recorder the unit cell writes its results.json
    from (replace the state with monkeypatch.setattr, which puts it back): a synthetic
    comparison left there is read by the report as one the cell measured."""
    state, seen = recorder._STATE, len(recorder._STATE.figures)
    yield
    assert recorder._STATE is state, "the test replaced the recorder's state and left it"
    added = [f.name for f in recorder._STATE.figures[seen:]]
    assert not added, f"the test recorded figures into the unit cell's results: {added[:5]}"


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    root = repo_root()
    return load_matrix(root / MATRIX_FILE, known_envs=set(environments.load_envs(root)))
