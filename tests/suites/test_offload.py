"""KV offload round trip (offload-tp1, per connector): cold greedy generate, wait (bounded) until
the asynchronous offload stores are done and reset_prefix_cache() succeeds, then warm generate:
the prompt must come back from the CPU side (external prefix-cache hits), and the tokens must
not change. Both connectors need a CUDA GPU (their worker side refuses the CPU platform)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from glm5_matrix import compare
from glm5_matrix.context import CellContext
from glm5_matrix.engines import Engine, engine_spec, groups_of, resolve_class
from glm5_matrix.layout import LayoutPlan, plan_layout
from glm5_matrix.profiles import Profile

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

CONNECTORS = {"simple": "SimpleCPUOffloadConnector", "offloading": "OffloadingConnector"}
TOP_LOGPROBS = 5


@pytest.fixture(scope="module")
def plan(cell: CellContext, profile: Profile) -> LayoutPlan:
    return plan_layout(profile.config(), tp=cell.tp or 1)


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile, plan: LayoutPlan) -> Iterator[Engine]:
    connector = CONNECTORS[cell.setting("kv_connector")]
    cpu_bytes = plan.offload_bytes(int(profile.section("offload")["cpu_blocks"]))
    print(f"{connector}: cpu_bytes_to_use {cpu_bytes:,} B")
    transfer = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
    spec = engine_spec(cell, profile, kv_transfer_config=transfer)
    with Engine(spec) as running:
        yield running


def _reset_when_stored(engine: Engine, bound_s: float) -> float:
    """Offload stores complete asynchronously; reset_prefix_cache() refuses while blocks are
    in flight. Poll it (bounded) and return how long it took."""
    started = time.monotonic()
    while not engine.reset_prefix_cache():
        if time.monotonic() - started > bound_s:
            pytest.fail(f"reset_prefix_cache() still refused after {bound_s:.0f} s")
        # An empty step lets the engine collect finished stores.
        engine.generate_greedy([1], 1)
        time.sleep(0.5)
    return time.monotonic() - started


def test_offload_round_trip(engine: Engine, profile: Profile, plan: LayoutPlan) -> None:
    prompts, tolerances = profile.section("prompts"), profile.section("tolerances")
    layout = engine.kv_layout()
    # Both connectors offload exactly vLLM's prefix-cacheable groups (KVCacheConfig.
    # prefix_cacheable_group_ids); the kpool tail ring must not be one of them.
    tail_spec = resolve_class(
        f"vllm.v1.kv_cache_interface.{profile.section('expect')['tail_spec']}"
    )
    tail = groups_of(layout, tail_spec)
    assert len(tail) == 1, f"no single tail group: {[g['spec_class'] for g in layout['groups']]}"
    assert not tail[0]["prefix_cacheable"], f"the tail ring would be offloaded: {tail[0]}"
    offloaded = [g for g in layout["groups"] if g["prefix_cacheable"]]
    assert len(offloaded) == len(layout["groups"]) - 1, layout["groups"]
    blocks = {g["block_size"] for g in offloaded}
    assert blocks == {plan.block_size}, f"engine blocks {blocks} != planned {plan.block_size}"
    block = plan.block_size
    length = int(prompts["long_blocks"] * block)
    prompt = engine.random_prompt(length, int(prompts["seed"]))
    max_tokens = int(prompts["max_tokens"])

    cold = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    compare.assert_varies(cold.token_ids, int(tolerances["min_distinct_tokens"]), "cold output")
    # The same prompt again from the GPU prefix cache: what a faithful CPU round trip must give.
    repeat = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    assert repeat.cached_tokens, "the GPU repeat reused nothing"
    waited = _reset_when_stored(engine, float(profile.section("offload")["store_wait_s"]))
    # The GPU prefix cache was just reset, so every cached token of the warm run came back
    # from the CPU side.
    warm = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    hits = int(warm.cached_tokens or 0)
    print(f"stores done after {waited:.1f} s; warm run: {hits} prompt tokens from the CPU side")
    assert hits > 0, "the warm run got nothing back from the CPU side"
    # Only whole blocks of prefix-cacheable groups come back (never the tail ring's slots).
    assert hits % block == 0 and hits <= length, f"{hits} hit tokens at block {block}"
    # The restored blocks are the GPU's bytes: the warm run resumes from the same state as the
    # GPU prefix-cache repeat, so it matches that repeat far more closely than the cold run.
    assert warm.cached_tokens == repeat.cached_tokens, (warm.cached_tokens, repeat.cached_tokens)
    restored = compare.check_greedy_agreement(
        repeat,
        warm,
        min_matched=int(tolerances["repeat_matching_prefix_tokens"]),
        logprob_abs=float(profile.section("offload")["restore_logprob_abs"]),
        names=("GPU repeat", "warm from CPU"),
    )
    print(f"GPU prefix-cache repeat vs warm from CPU: {restored.describe()}")
    # Against the cold run, the rule of a repeat from a cached boundary applies (the profile's
    # repeat_* tolerances, as in test_greedy_reproducible_across_block_boundary).
    agreement = compare.check_resumed_agreement(cold, warm, tolerances, ("cold", "warm from CPU"))
    print(f"cold vs warm: {agreement.describe()}")
