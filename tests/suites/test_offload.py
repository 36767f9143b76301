"""KV offload round trip (offload-tp1, per connector): cold greedy generate (the profile's
reference_repeats times: the noise as a distribution; its prefill ends a chunk at the first
block boundary, so from there it takes the warm run's path), the GPU prefix-cache repeat (as
many times), wait (bounded) until the asynchronous offload stores are done and
reset_prefix_cache() succeeds, then warm generate: the prompt must come back from the CPU side
(external prefix-cache hits), the restored pages must be the stored ones byte for byte, and the
output must agree with the GPU repeat and with the cold runs (checked to split where the warm
run resumes), each at the prefill step by its logprobs and over the whole run by its tokens
(equal wherever the reference is decisive by its own noise up to each step; the whole run's
logprob differences recorded, docs/verdicts.md), while a prompt whose restored block holds
other tokens is rejected by the same rule with at least the profile's min_power at the prefill
step (over the whole run, by its tokens, it is recorded). Both
connectors need a CUDA GPU (their worker side refuses the CPU platform)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from glm5_matrix.engines.client import Engine, groups_of, resolve_class
from glm5_matrix.engines.engine_configs import offload_cpu_bytes, offload_spec
from glm5_matrix.engines.prompts import with_other_tokens
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.models.layout import LayoutPlan, plan_layout
from glm5_matrix.results.recorder import record_figure
from glm5_matrix.verdicts import chunks, compare, judging, transfers

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


def _tables(engine: Engine, requests: int) -> list[list[list[int]]]:
    """The final block tables of the `requests` requests the engine ran since the recorder was
    last read (which it clears)."""
    recorded = engine.recorded_block_tables(clear=True)
    assert len(recorded) == requests, f"{len(recorded)} requests recorded, not {requests}"
    return [history[-1] for history in recorded.values()]


def _pages(
    engine: Engine, layout: dict[str, Any], table: list[list[int]], whole_blocks: int
) -> dict[transfers.PageKey, tuple[str, ...]]:
    """Digests of a request's first `whole_blocks` blocks in every prefix-cacheable group (what
    the offload connectors store), per layer and state."""
    groups = [i for i, g in enumerate(layout["groups"]) if g["prefix_cacheable"]]
    layers = [g["layer_names"] for g in layout["groups"]]
    keys, reads = transfers.table_pages(table, whole_blocks, groups, layers)
    return transfers.keyed_reads(keys, engine.page_digests(reads))


def test_offload_round_trip(engine: Engine, profile: Profile, plan: LayoutPlan) -> None:
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
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
    # noise. Its prefill ends a chunk at the first block boundary (the profile's
    # prefill_chunk_blocks), so that from there on it takes the warm run's path.
    engine.record_block_tables()  # and the chunks each request computes
    engine.recorded_chunks(clear=True)
    colds = judging.reference_runs(
        engine,
        prompt,
        max_tokens,
        tolerances,
        reset=lambda: _reset_when_stored(engine, store_wait, reset_connector=True),
    )
    cold_chunks = chunks.prompt_runs(engine.recorded_chunks(), length)
    assert len(cold_chunks) == len(colds), f"{len(cold_chunks)} cold requests recorded"
    cold = colds[0]
    cold_floor = judging.repeated("offload_cold", colds, "cold", tolerances)
    cold_prefill = judging.prefill_step(
        "offload_cold_prefill", colds, "cold", tolerances, cold_floor.floor.step
    )
    # The same prompt again from the GPU prefix cache, as many times: what a faithful CPU round
    # trip must give, and the noise of that path.
    # Each request's final table (the recorder keeps one per step where it changed).
    cold_tables = [history[-1] for history in engine.recorded_block_tables(clear=True).values()]
    repeats = [
        engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        for _ in range(tolerances.reference_repeats)
    ]
    assert all(r.cached_tokens for r in repeats), "the GPU repeats reused nothing"
    # The GPU pages of the cached blocks (the last cold run's, which the CPU store copied):
    # what a restore must bring back byte for byte.
    cached_blocks = int(repeats[0].cached_tokens or 0) // block
    repeat_tables = _tables(engine, len(repeats))
    stored = _pages(engine, layout, repeat_tables[0], cached_blocks)
    for table in repeat_tables[1:]:  # every repeat hit the same blocks
        assert _pages(engine, layout, table, cached_blocks) == stored, (
            "the repeats hit other blocks"
        )
    cold_located = _cold_located_pages(engine, layout, cold_tables, length, block)
    repeat_floor = judging.repeated("offload_repeat", repeats, "GPU repeat", tolerances)
    # The GPU repeats' first step alone: where a wrong restore acts before any decode step adds
    # noise of its own, so the stale block's power is judged there (as e2e's repeat does).
    repeat_prefill = judging.prefill_step(
        "offload_repeat_prefill", repeats, "GPU repeat", tolerances, repeat_floor.floor.step
    )
    waited = _reset_when_stored(engine, store_wait)
    engine.recorded_block_tables(clear=True)  # what the reset's polling requests left
    # The GPU prefix cache was just reset, so every cached token of the warm run came back
    # from the CPU side.
    engine.recorded_chunks(clear=True)
    warm = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    (warm_table,) = _tables(engine, 1)
    (warm_chunks,) = chunks.prompt_runs(engine.recorded_chunks(), length)
    hits = int(warm.cached_tokens or 0)
    print(f"stores done after {waited:.1f} s; warm run: {hits} prompt tokens from the CPU side")
    record_figure("offload.cpu_hit_tokens", hits, unit="tokens")
    record_figure("offload.store_wait", round(waited, 2), unit="s")
    assert hits > 0, "the warm run got nothing back from the CPU side"
    # Only whole blocks of prefix-cacheable groups come back (never the tail ring's slots).
    assert hits % block == 0 and hits <= length, f"{hits} hit tokens at block {block}"
    assert warm.cached_tokens == repeats[0].cached_tokens, (warm.cached_tokens, repeats)
    # First the check that trusts none of vLLM's counts or tables (issue 35): a planted wrong
    # restore is reported by it, not only by the copy check below, which locates the pages
    # through the GPU repeat's table and hit count.
    _check_restored_where_the_harness_says(
        engine, layout, cold_located, warm_table, hits, length, block
    )
    # A restore is a copy: every restored page (each prefix-cacheable group, each state) has the
    # bytes the GPU held before; two restored blocks exchanged must fail.
    restored = _pages(engine, layout, warm_table, cached_blocks)
    copied = transfers.check_copied(stored, restored, ("GPU pages stored", "restored from CPU"))
    print(f"restore from CPU: {copied.describe()}")
    record_figure("offload.pages_equal", copied.pages, limit=0, relation=">", unit="pages")
    with pytest.raises(AssertionError, match="differ"):
        transfers.check_copied(stored, transfers.swapped(restored))
    # The restored blocks are the GPU's bytes: the warm run resumes from the same state along
    # the same path as the GPU prefix-cache repeat, judged by the repeats' noise; and, since the
    # cold prefill ended a chunk at the same boundary (checked on the chunks the worker
    # computed), along the cold run's path from there: judged by the cold runs' noise, at the
    # prefill's own output (logprobs) and over the whole run (tokens).
    # The warm path done again (the GPU cache reset, the blocks restored from the CPU each
    # time): its own distribution, compared with the GPU repeats' and the cold runs'. A warm
    # path with a heavier tail than its reference (a restore racing the compute would look like
    # this) is a finding, shown, never a wider tolerance.
    more_warm = []
    for _ in range(tolerances.compared_runs - 1):
        _reset_when_stored(engine, store_wait)
        again = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        assert again.cached_tokens == hits, f"a warm run got {again.cached_tokens}, not {hits}"
        more_warm.append(again)
    engine.recorded_block_tables(clear=True)
    # What the output comparisons add to the byte checks above: the pages are the stored bytes,
    # but only the output shows the engine resuming from them as from its own (the right blocks
    # in the table, the computed-token count, the kpool tail it rebuilds, the Mamba state it
    # starts from); judged at the budget's share each (docs/verdicts.md).
    repeat_prefill.agrees(
        judging.first_step(repeats[0]),
        judging.first_step(warm),
        ("GPU repeat", "warm"),
        path_runs=[judging.first_step(r) for r in more_warm],
    )
    repeat_floor.agrees(repeats[0], warm, ("GPU repeat", "warm from CPU"), path_runs=more_warm)
    for cold_run in cold_chunks:
        chunks.check_repeat_path(cold_run, warm_chunks, length, block)
    record_figure("offload.cold_chunks", [list(c) for c in cold_chunks[0]])
    record_figure("offload.warm_chunks", [list(c) for c in warm_chunks])
    record_figure(
        "offload.cold_vs_warm_step_deltas",
        [round(d, 6) for d in compare.step_deltas(cold, warm, len(cold.token_ids))],
        unit="nats",
    )
    cold_prefill.agrees(
        judging.first_step(cold),
        judging.first_step(warm),
        ("cold", "warm"),
        path_runs=[judging.first_step(r) for r in more_warm],
    )
    cold_floor.agrees(cold, warm, ("cold", "warm from CPU"), path_runs=more_warm)
    # What a restore of wrong or stale bytes amounts to: the prompt whose restored block holds
    # other tokens. The comparison must reject it with at least min_power.
    changed = round(tolerances.needed("control_changed_blocks") * block)
    stale_prompt = with_other_tokens(
        prompt, block - changed, block, engine.vocab_size(), int(prompts["seed"]) + 1
    )
    stale = engine.generate_scored(stale_prompt, max_tokens, TOP_LOGPROBS)
    # The power is judged at the step that decides, the prefill's output (issue 48: on the H100
    # the whole run's rejection rested on a parting after step 0, where the stale block cleared
    # the tolerance by 4%); over the whole run it is recorded.
    repeat_prefill.rejects(
        judging.first_step(repeats[0]), judging.first_step(stale), ("GPU repeat", "stale")
    )
    cold_prefill.rejects(judging.first_step(cold), judging.first_step(stale), ("cold", "stale"))
    try:
        repeat_floor.rejects(repeats[0], stale, ("GPU repeat", "stale block"))
    except AssertionError as weak:  # the prefill step carries the power; recorded, not judged
        record_figure("offload_repeat.whole_run_control", str(weak).splitlines()[0][:300])
        print(
            f"offload_repeat: over the whole run the stale block is not rejected with power: {weak}"
        )


def _located(
    layout: dict[str, Any], length: int, block: int
) -> tuple[int, list[int], list[int], list[list[str]]]:
    """(whole blocks a hit must restore: the prompt's last boundary below its end, the
    offloaded groups, the Mamba ones among them, each group's layers)."""
    groups = [i for i, g in enumerate(layout["groups"]) if g["prefix_cacheable"]]
    mamba = [i for i in groups if "state_shapes" in layout["groups"][i]]
    return (length - 1) // block, groups, mamba, [g["layer_names"] for g in layout["groups"]]


def _cold_located_pages(
    engine: Engine,
    layout: dict[str, Any],
    cold_tables: list[list[list[int]]],
    length: int,
    block: int,
) -> dict[transfers.PageKey, tuple[str, ...]]:
    """The last cold run's pages where the harness says a restore must land (every block before
    the boundary in attention groups, each Mamba group's checkpoint at it:
    transfers.boundary_pages), read from its own table before any reset frees its blocks. The
    reset's one-token polls are recorded too, with fewer blocks: they are left out."""
    whole, groups, mamba, layers = _located(layout, length, block)
    colds = [t for t in cold_tables if all(len(t[i]) > whole for i in groups)]
    assert colds, f"no cold run's table among {len(cold_tables)} recorded"
    keys, reads = transfers.boundary_pages(colds[-1], whole, groups, mamba, layers)
    return transfers.keyed_reads(keys, engine.page_digests(reads))


def _check_restored_where_the_harness_says(
    engine: Engine,
    layout: dict[str, Any],
    cold: dict[transfers.PageKey, tuple[str, ...]],
    warm_table: list[list[int]],
    hits: int,
    length: int,
    block: int,
) -> None:
    """The restore judged without vLLM's counts or the repeat's table: the hit must end at the
    prompt's last block boundary below its end, and the warm run's pages at the harness's places
    must equal the last cold run's (_cold_located_pages). A connector that restores a wrong
    block consistently (the previous checkpoint into the slot, and counts it so) fails here."""
    whole, groups, mamba, layers = _located(layout, length, block)
    assert hits == whole * block, (
        f"the warm run got {hits} tokens back; the prompt's last boundary is {whole * block}"
    )
    keys, reads = transfers.boundary_pages(warm_table, whole, groups, mamba, layers)
    warm = transfers.keyed_reads(keys, engine.page_digests(reads))
    located = transfers.check_copied(cold, warm, ("cold run's pages", "restored, located"))
    print(f"restore at the harness's places: {located.describe()}; Mamba groups {mamba}")
    record_figure("offload.located_pages_equal", located.pages, limit=0, relation=">", unit="pages")
