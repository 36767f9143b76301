"""glm5_matrix.engines.workers without vLLM: the block-table and chunk recorders' rules, and
block_rows: which rows of a cache view hold one scheduler block.

The views are numpy arrays behind torch's few accessors (the unit cell has no torch); the
arithmetic is the same on a torch tensor."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from glm5_matrix.engines import workers
from glm5_matrix.engines.workers import block_rows


class View:
    """A numpy array with torch's shape / stride(dim) / element_size() / ndim / slicing."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.ndim = array.ndim

    def stride(self, dim: int) -> int:
        return self.array.strides[dim] // self.array.itemsize

    def element_size(self) -> int:
        return self.array.itemsize

    def __getitem__(self, index: slice) -> np.ndarray:
        return self.array[index]


def test_block_major_view():
    view = View(np.arange(15 * 4, dtype=np.int16).reshape(15, 4))  # ratio 3 over 5 blocks
    assert (block_rows(view, 5, 1) == view.array[3:6]).all()
    with pytest.raises(ValueError):
        block_rows(view, 5, 5)


def test_packed_buffer_view_steps_over_the_other_layers_pages():
    # 5 blocks of 28 bytes; this layer's page is the first 2 rows (4 B each) of each block:
    # the view has 4 * 7 + 2 rows, as vLLM's kpool indexer view on the H200 ((15225 - 1) * 548
    # + 17 rows over 15225 blocks).
    buffer = np.arange(5 * 14, dtype=np.int16)
    packed = View(np.lib.stride_tricks.as_strided(buffer, (4 * 7 + 2, 2), (4, 2)))
    assert (block_rows(packed, 5, 0, block_stride=28) == buffer[0:4].reshape(2, 2)).all()
    assert (block_rows(packed, 5, 4, block_stride=28) == buffer[56:60].reshape(2, 2)).all()
    # A Mamba state in the same buffer: one row per block, row stride = block stride.
    state = View(np.lib.stride_tricks.as_strided(buffer, (5, 3), (28, 2)))
    assert (block_rows(state, 5, 2, block_stride=28) == buffer[28:31]).all()


def test_a_view_that_fits_neither_is_refused():
    odd = View(np.zeros((27, 2), dtype=np.int16))
    with pytest.raises(RuntimeError, match="neither packed nor block-major"):
        block_rows(odd, 5, 0, block_stride=28)


def _step(new=(), cached=(), resumed=()):
    """A SchedulerOutput-shaped step: new requests (id, table), cached (id, new ids or None)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=t) for r, t in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[ids for _, ids in cached],
            resumed_req_ids=set(resumed),
        ),
    )


def test_block_recorder_applies_the_scheduler_rule() -> None:
    records: dict = {}
    workers.record_block_tables(records, _step(new=[("a", ([1, 2], [0, 3]))]))
    workers.record_block_tables(records, _step(cached=[("a", None)]))  # no change, no entry
    workers.record_block_tables(records, _step(cached=[("a", ([4], [5]))]))  # appended
    workers.record_block_tables(records, _step(cached=[("a", ([9], [8]))], resumed=["a"]))
    assert records == {
        "a": [[[1, 2], [0, 3]], [[1, 2, 4], [0, 3, 5]], [[9], [8]]],
    }


def test_block_recorder_keeps_requests_apart() -> None:
    records: dict = {}
    workers.record_block_tables(records, _step(new=[("a", ([1],)), ("b", ([2],))]))
    workers.record_block_tables(records, _step(cached=[("b", ([3],))]))
    assert records == {"a": [[[1]]], "b": [[[2]], [[2, 3]]]}


def _chunk_step(new=(), cached=()):
    """A SchedulerOutput-shaped step for the chunk recorder: (id, computed before, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached]
        ),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
    )


def test_chunk_recorder_keeps_each_requests_chunks() -> None:
    records: dict = {}
    # A cold prefill chunked at the block, and a prefix hit of one block beside it.
    workers.record_chunks(records, _chunk_step(new=[("cold", 0, 4352), ("hit", 4352, 2176)]))
    workers.record_chunks(records, _chunk_step(cached=[("cold", 4352, 2176), ("hit", 6528, 1)]))
    workers.record_chunks(records, _chunk_step(cached=[("cold", 6528, 1)]))
    assert records == {
        "cold": [[0, 4352], [4352, 2176], [6528, 1]],
        "hit": [[4352, 2176], [6528, 1]],
    }
