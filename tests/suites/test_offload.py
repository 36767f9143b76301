"""KV offload round trip (offload-tp1, per connector): cold greedy generate, wait (bounded) until
the asynchronous offload stores are done and reset_prefix_cache() succeeds, then warm generate:
the prompt must come back from the CPU side (external prefix-cache hits), and the tokens must
not change. Both connectors need a CUDA GPU (their worker side refuses the CPU platform)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from glm5_matrix import compare
from glm5_matrix.context import CellContext
from glm5_matrix.engines import Engine, engine_spec
from glm5_matrix.layout import LayoutPlan, plan_layout
from glm5_matrix.profiles import Profile

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

CONNECTORS = {"simple": "SimpleCPUOffloadConnector", "offloading": "OffloadingConnector"}


@pytest.fixture(scope="module")
def plan(cell: CellContext, profile: Profile) -> LayoutPlan:
    return plan_layout(profile.config(), tp=cell.tp or 1)


def cpu_bytes_for(plan: LayoutPlan, blocks: int) -> int:
    """Room for `blocks` KV blocks of every prefix-cacheable group, from the planner's pages
    (the tail ring is not prefix-cacheable and is never offloaded)."""
    per_block = sum(g.page_bytes for g in plan.groups if g.prefix_cacheable)
    return blocks * per_block


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile, plan: LayoutPlan) -> Iterator[Engine]:
    connector = CONNECTORS[cell.setting("kv_connector")]
    cpu_bytes = cpu_bytes_for(plan, int(profile.section("offload")["cpu_blocks"]))
    print(f"{connector}: cpu_bytes_to_use {cpu_bytes:,} B")
    transfer = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
    spec = engine_spec(cell, profile, kv_transfer_config=transfer)
    with Engine(spec) as running:
        yield running


def _generate_counting_cached(
    engine: Engine, prompt: list[int], max_tokens: int
) -> tuple[list[int], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


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
    block = engine.kv_layout()["groups"][0]["block_size"]
    assert block == plan.block_size, f"engine block {block} != planned {plan.block_size}"
    length = int(prompts["long_blocks"] * block)
    vocab = int(engine.llm.llm_engine.model_config.get_vocab_size())
    rng = random.Random(int(prompts["seed"]))
    prompt = [rng.randrange(vocab) for _ in range(length)]
    max_tokens = int(prompts["max_tokens"])

    cold, _ = engine.generate_greedy(prompt, max_tokens)
    compare.assert_varies(cold, int(tolerances["min_distinct_tokens"]), "cold output")
    waited = _reset_when_stored(engine, float(profile.section("offload")["store_wait_s"]))
    # The GPU prefix cache was just reset, so every cached token of the warm run came back
    # from the CPU side.
    warm, hits = _generate_counting_cached(engine, prompt, max_tokens)
    print(f"stores done after {waited:.1f} s; warm run: {hits} prompt tokens from the CPU side")
    assert hits > 0, "the warm run got nothing back from the CPU side"
    # Only whole blocks of prefix-cacheable groups come back (never the tail ring's slots).
    assert hits % block == 0 and hits <= length, f"{hits} hit tokens at block {block}"
    assert warm == cold, f"warm output differs from cold:\n{cold}\n{warm}"
