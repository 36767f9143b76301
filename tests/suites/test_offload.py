"""KV offload round trip (offload-tp1, per connector): cold greedy generate (the profile's
reference_repeats times: the noise as a distribution), the GPU prefix-cache repeat (as many
times), wait (bounded) until the asynchronous offload stores are done and reset_prefix_cache()
succeeds, then warm generate: the prompt must come back from the CPU side (external prefix-cache
hits), and the output must agree with the repeat and the cold run up to the engine's own noise,
while a prompt whose restored block holds other tokens is rejected by the same rule with at
least the profile's min_power. Both connectors need a CUDA GPU (their worker side refuses the
CPU platform)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from glm5_matrix import judging
from glm5_matrix.context import CellContext
from glm5_matrix.engine_configs import offload_cpu_bytes, offload_spec
from glm5_matrix.engines import Engine, groups_of, resolve_class, with_other_tokens
from glm5_matrix.layout import LayoutPlan, plan_layout
from glm5_matrix.profiles import Profile
from glm5_matrix.results import record_figure

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

TOP_LOGPROBS = judging.TOP_LOGPROBS


@pytest.fixture(scope="module")
def plan(cell: CellContext, profile: Profile) -> LayoutPlan:
    return plan_layout(profile.config(), tp=cell.tp or 1)


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile) -> Iterator[Engine]:
    cpu_bytes = offload_cpu_bytes(cell, profile)
    spec = offload_spec(cell, profile, cpu_bytes)
    print(f"{spec.args['kv_transfer_config']['kv_connector']}: cpu_bytes_to_use {cpu_bytes:,} B")
    record_figure("offload.cpu_bytes_to_use", cpu_bytes, unit="bytes")
    with Engine(spec) as running:
        yield running


def _reset_when_stored(engine: Engine, bound_s: float, reset_connector: bool = False) -> float:
    """Offload stores complete asynchronously; reset_prefix_cache() refuses while blocks are
    in flight. Poll it (bounded) and return how long it took."""
    try:
        return engine.reset_prefix_cache_when_stored(bound_s, reset_connector=reset_connector)
    except TimeoutError as exc:
        pytest.fail(str(exc))


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
    record_figure("layout.block_size", sorted(blocks), limit=plan.block_size, relation="==")
    assert blocks == {plan.block_size}, f"engine blocks {blocks} != planned {plan.block_size}"
    block = plan.block_size
    length = int(prompts["long_blocks"] * block)
    prompt = engine.random_prompt(length, int(prompts["seed"]))
    max_tokens = int(prompts["max_tokens"])
    store_wait = float(profile.section("offload")["store_wait_s"])

    # Cold, reference_repeats times, from an empty GPU cache and an empty CPU store: the cold
    # noise.
    cold, cold_floor = judging.reference_repeated(
        engine,
        prompt,
        max_tokens,
        "offload_cold",
        tolerances,
        reset=lambda: _reset_when_stored(engine, store_wait, reset_connector=True),
    )
    # The same prompt again from the GPU prefix cache, as many times: what a faithful CPU round
    # trip must give, and the noise of that path.
    repeats = [
        engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        for _ in range(int(tolerances["reference_repeats"]))
    ]
    assert all(r.cached_tokens for r in repeats), "the GPU repeats reused nothing"
    repeat_floor = judging.repeated("offload_repeat", repeats, "GPU repeat", tolerances)
    waited = _reset_when_stored(engine, store_wait)
    # The GPU prefix cache was just reset, so every cached token of the warm run came back
    # from the CPU side.
    warm = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    hits = int(warm.cached_tokens or 0)
    print(f"stores done after {waited:.1f} s; warm run: {hits} prompt tokens from the CPU side")
    record_figure("offload.cpu_hit_tokens", hits, unit="tokens")
    record_figure("offload.store_wait", round(waited, 2), unit="s")
    assert hits > 0, "the warm run got nothing back from the CPU side"
    # Only whole blocks of prefix-cacheable groups come back (never the tail ring's slots).
    assert hits % block == 0 and hits <= length, f"{hits} hit tokens at block {block}"
    assert warm.cached_tokens == repeats[0].cached_tokens, (warm.cached_tokens, repeats)
    # The restored blocks are the GPU's bytes: the warm run resumes from the same state as the
    # GPU prefix-cache repeat, and agrees with the cold run as that repeat does.
    repeat_floor.agrees(repeats[0], warm, ("GPU repeat", "warm from CPU"))
    cold_floor.agrees(cold, warm, ("cold", "warm from CPU"))
    # What a restore of wrong or stale bytes amounts to: the prompt whose restored block holds
    # other tokens. Both comparisons must reject it.
    changed = round(float(tolerances["control_changed_blocks"]) * block)
    stale_prompt = with_other_tokens(
        prompt, block - changed, block, engine.vocab_size(), int(prompts["seed"]) + 1
    )
    stale = engine.generate_scored(stale_prompt, max_tokens, TOP_LOGPROBS)
    repeat_floor.rejects(repeats[0], stale, ("GPU repeat", "stale block"))
    cold_floor.rejects(cold, stale, ("cold", "stale block"))
