"""glm5_matrix.engines without vLLM: the block-table recorder's rule, the MoE backend mapping and
the engine arguments a cell gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from glm5_matrix.engines import client, prompts, specs, workers
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.context import CellContext, Weights
from glm5_matrix.matrix.profiles import load_profile


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


def _cell(**settings) -> CellContext:
    return CellContext(
        cell="e2e-tp2",
        id="e2e-tp2(deep_gemm)",
        slug="e2e-tp2-deep_gemm",
        suite="e2e",
        env="cuda",
        profile="glm-5.3-flash-4l",
        tp=2,
        gpus=2,
        settings=settings,
        weights=Weights(kind="random"),
    )


def test_cell_engine_args_map_the_backend_axis_per_gpu_family(monkeypatch) -> None:
    profile = load_profile("glm-5.3-flash-4l")
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm100")
    args = specs.cell_engine_args(_cell(moe_backend="flashinfer"), profile)
    assert args == {"tensor_parallel_size": 2, "moe_backend": "flashinfer_trtllm"}
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm90")
    assert specs.cell_engine_args(_cell(moe_backend="flashinfer"), profile)["moe_backend"] == (
        "flashinfer_cutlass"
    )
    with pytest.raises(UserError, match="names no backend for sm80"):
        specs.moe_backend_for(profile, "deep_gemm", "sm80")
    with pytest.raises(UserError, match="has no 'cutlass'"):
        specs.moe_backend_for(profile, "cutlass", "sm90")


def test_engine_spec_uses_random_weights_and_refuses_harness_args(monkeypatch) -> None:
    profile = load_profile("glm-5.3-flash-4l")
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm90")
    spec = specs.engine_spec(_cell(moe_backend="deep_gemm"), profile, max_num_seqs=8)
    assert spec.model == str(profile.directory)
    assert spec.args["load_format"] == "glm5-random"
    assert spec.args["max_num_seqs"] == 8 and spec.args["moe_backend"] == "deep_gemm"
    assert spec.label.endswith("[max_num_seqs=8]")
    profile.data["engine"]["load_format"] = "auto"
    with pytest.raises(UserError, match="'load_format' is set by the harness"):
        specs.engine_spec(_cell(), profile)


# worker_kv_layout's data, as 0.33 gives it (members wrapped) and as a plain group; stdlib classes
# stand in for vLLM's spec classes (resolution and identity are what is tested).
LAYOUT = {
    "groups": [
        {
            "spec_class": "collections.ChainMap",
            "block_size": 64,
            "page_size_bytes": 300,
            "layer_names": ["latent", "indexer"],
            "member_specs": {
                "latent": {"spec_class": "collections.OrderedDict", "page_size_bytes": 200},
                "indexer": {"spec_class": "collections.OrderedDict", "page_size_bytes": 100},
            },
        },
        {
            "spec_class": "collections.Counter",
            "block_size": 4,
            "page_size_bytes": 8,
            "layer_names": ["tail"],
        },
    ]
}


def test_block_size_of_reads_the_prefix_cacheable_groups() -> None:
    """GLM's tail ring (block 4, not prefix-cacheable) has its own block size; the others must
    agree."""
    groups = [
        {"block_size": 4352, "prefix_cacheable": True},
        {"block_size": 4, "prefix_cacheable": False},
        {"block_size": 4352, "prefix_cacheable": True},
    ]
    assert client.block_size_of({"groups": groups}) == 4352
    groups[2]["block_size"] = 2176
    with pytest.raises(AssertionError, match=r"disagree on the block size: \[2176, 4352\]"):
        client.block_size_of({"groups": groups})


def test_spec_classes_read_members_and_plain_groups() -> None:
    from collections import Counter, OrderedDict

    assert client.spec_classes(LAYOUT["groups"][0]) == {OrderedDict}
    assert client.spec_classes(LAYOUT["groups"][1]) == {Counter}
    assert client.groups_of(LAYOUT, OrderedDict) == [LAYOUT["groups"][0]]
    assert client.groups_of(LAYOUT, dict) == []  # identity: OrderedDict is a dict subclass


def test_spec_names_name_the_members_not_the_wrapper() -> None:
    assert client.spec_names(LAYOUT["groups"][0]) == "OrderedDict"
    assert client.spec_names(LAYOUT["groups"][1]) == "Counter"
    mixed = {
        "member_specs": {
            "a": {"spec_class": "collections.OrderedDict"},
            "b": {"spec_class": "collections.Counter"},
        }
    }
    assert client.spec_names(mixed) == "Counter+OrderedDict"


def test_layer_specs_per_layer() -> None:
    from collections import Counter, OrderedDict

    assert client.layer_specs(LAYOUT) == {
        "latent": (OrderedDict, 200, 64),
        "indexer": (OrderedDict, 100, 64),
        "tail": (Counter, 8, 4),
    }


def test_random_prompt_is_reproducible_and_in_the_vocabulary() -> None:
    prompt = prompts.random_prompt(1000, 500, seed=7)
    assert prompt == prompts.random_prompt(1000, 500, seed=7)
    assert prompt != prompts.random_prompt(1000, 500, seed=8)
    assert len(prompt) == 500 and min(prompt) >= 0 and max(prompt) < 1000
    assert len(set(prompt)) > 300  # drawn, not a constant


def test_jit_monitor_joins_only_where_the_guard_asks_and_the_spec_is_silent(monkeypatch) -> None:
    from glm5_matrix.kernels import kernel_cache

    asked: list[bool] = []

    def mode(enforce_eager: bool) -> str | None:
        asked.append(enforce_eager)
        return None if enforce_eager else "error"

    monkeypatch.setattr(kernel_cache, "jit_monitor_mode", mode)
    compiled = specs.EngineSpec("c", "m", {"enforce_eager": False})
    assert specs.jit_monitor_args(compiled) == {"jit_monitor_mode": "error"}
    assert specs.jit_monitor_args(specs.EngineSpec("e", "m", {"enforce_eager": True})) == {}
    mine = specs.EngineSpec("u", "m", {"enforce_eager": False, "jit_monitor_mode": "warn"})
    assert specs.jit_monitor_args(mine) == {}
    assert asked == [False, True]


def test_jit_monitor_mode_needs_the_guard(monkeypatch) -> None:
    from glm5_matrix.kernels import kernel_cache

    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "0")
    assert kernel_cache.jit_monitor_mode(False) is None
    monkeypatch.setenv(kernel_cache.GUARD_VARIABLE, "1")
    assert kernel_cache.jit_monitor_mode(True) is None  # vLLM disables it under enforce_eager
    try:
        import vllm.engine.arg_utils  # noqa: F401
    except ImportError:  # the harness environment: no vLLM, so no monitor to ask for
        assert kernel_cache.jit_monitor_mode(False) is None
    else:
        assert kernel_cache.jit_monitor_mode(False) == "error"
