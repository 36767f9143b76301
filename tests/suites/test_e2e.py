"""End-to-end suite, shared by the CPU and GPU cells: KV layout, greedy reproducibility across a
block boundary, prefill checkpoint pages. Everything expected comes from the cell's profile
([expect], [prompts], [tolerances]) or from vLLM itself; one engine per module, shared.
The `cell` and `profile` fixtures come from tests/suites/conftest.py."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from glm5_matrix import compare
from glm5_matrix.context import CellContext
from glm5_matrix.engines import Engine, child_pids, engine_spec, resolve_class, stdlib_helper_pids
from glm5_matrix.profiles import Profile

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", autouse=True)
def no_surviving_children() -> Iterator[None]:
    """After the module (engine torn down last but this), no process it started may survive."""
    before = set(child_pids())
    yield
    survivors = set(child_pids()) - before - stdlib_helper_pids()
    assert not survivors, f"child processes survived the suite: {sorted(survivors)}"


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile) -> Iterator[Engine]:
    with Engine(engine_spec(cell, profile)) as running:
        print(f"engine {running.spec.label} up in {running.start_seconds:.1f} s")
        yield running
    assert not running.leftover_processes, (
        f"engine processes had to be killed after shutdown: {running.leftover_processes}"
    )


@pytest.fixture(scope="module")
def layout(engine: Engine) -> dict[str, Any]:
    return engine.kv_layout()


def _groups_of(layout: dict[str, Any], spec_name: str) -> list[dict[str, Any]]:
    """Groups whose spec class IS vLLM's class `spec_name` (identity, not a subclass/name)."""
    from vllm.v1 import kv_cache_interface

    wanted = getattr(kv_cache_interface, spec_name)
    return [g for g in layout["groups"] if resolve_class(g["spec_class"]) is wanted]


def _block_size(layout: dict[str, Any]) -> int:
    sizes = {g["block_size"] for g in layout["groups"]}
    assert len(sizes) == 1, f"KV groups disagree on the block size: {sorted(sizes)}"
    return sizes.pop()


def _prompt(profile: Profile, engine: Engine, length: int) -> list[int]:
    vocab = int(engine.llm.llm_engine.model_config.get_vocab_size())
    rng = random.Random(int(profile.section("prompts")["seed"]))
    return [rng.randrange(vocab) for _ in range(length)]


def _null_block_id() -> int:
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    return int(NULL_BLOCK_ID)


def test_kv_layout(engine: Engine, profile: Profile, layout: dict[str, Any]) -> None:
    expect = profile.section("expect")
    mamba = _groups_of(layout, expect["mamba_spec"])
    attention = _groups_of(layout, expect["attention_spec"])
    kinds = [g["spec_class"] for g in layout["groups"]]
    assert len(mamba) == expect["mamba_groups"], f"Mamba groups: {kinds}"
    assert len(attention) == expect["attention_groups"], f"attention groups: {kinds}"
    assert len(layout["groups"]) == len(mamba) + len(attention), f"unexpected groups: {kinds}"
    assert all(g["mamba_cache_mode"] == "align" for g in mamba), (
        "prefix caching is not in align mode"
    )

    # The block size is what vLLM's hybrid aligner computes for this config, run here on a
    # fresh config from the same engine args (not the engine's own state).
    block = _block_size(layout)
    start_block, expected_block, backend = _aligned_block_size(
        engine, attention[0]["backend_class"]
    )
    assert block == expected_block, f"engine block {block} != vLLM's aligned block {expected_block}"

    # And it is the smallest aligned block whose attention page covers the Mamba state, the
    # alignment being the larger of the backend's smallest kernel block and the block size
    # the platform started from.
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import MambaSpec

    state_page = MambaSpec(
        shapes=tuple(tuple(s) for s in mamba[0]["state_shapes"]),
        dtypes=tuple(_torch_dtype(d) for d in mamba[0]["state_dtypes"]),
        block_size=-1,
    ).page_size_bytes
    per_token = attention[0]["bytes_per_token"]
    kernel = min(
        s.base if isinstance(s, MultipleOf) else s
        for s in backend.get_supported_kernel_block_sizes()
    )
    alignment = max(kernel, start_block)
    assert block % alignment == 0, f"block {block} is not a multiple of {alignment}"
    assert block * per_token >= state_page > (block - alignment) * per_token, (
        f"block {block} is not the smallest multiple of {alignment} covering the Mamba state "
        f"({state_page} B at {per_token} B/token)"
    )
    assert block > start_block, f"the hybrid aligner did not raise the block ({start_block})"
    # One page size for all groups: the Mamba page is padded to the attention page.
    pages = {g["page_size_bytes"] for g in layout["groups"]}
    assert pages == {block * per_token}, f"page sizes {sorted(pages)} != {block * per_token}"

    # Which tensors the Mamba groups share: their layers' views lie in the attention's bytes.
    if expect.get("mamba_shares_attention_storage"):
        storage = layout["storage"]
        attention_layers = [name for g in attention for name in g["layer_names"]]
        for group in mamba:
            for name in group["layer_names"]:
                mine = storage[name]
                partners = [
                    a
                    for a in attention_layers
                    if storage[a]["storage"] == mine["storage"]
                    and storage[a]["first_byte"] < mine["end_byte"]
                    and mine["first_byte"] < storage[a]["end_byte"]
                ]
                assert partners, f"{name} shares no bytes with an attention layer: {storage}"


def _aligned_block_size(engine: Engine, backend_name: str) -> tuple[int, int, type]:
    """(block size before alignment, after vLLM's hybrid aligner, the attention backend)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    backend = resolve_class(backend_name)
    config = EngineArgs(model=engine.spec.model, **engine.spec.args).create_engine_config()
    start = int(config.cache_config.block_size)
    current_platform._align_hybrid_block_size(config, backend)
    return start, int(config.cache_config.block_size), backend


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name.removeprefix("torch."))


def test_greedy_reproducible_across_block_boundary(
    engine: Engine, profile: Profile, layout: dict[str, Any]
) -> None:
    prompts, tolerances = profile.section("prompts"), profile.section("tolerances")
    block = _block_size(layout)
    length = int(prompts["long_blocks"] * block)
    assert length > block, f"prompt of {length} tokens does not cross a {block}-token block"
    prompt = _prompt(profile, engine, length)
    assert engine.reset_prefix_cache()
    cold, _ = engine.generate_greedy(prompt, int(prompts["max_tokens"]))
    compare.assert_varies(cold, int(tolerances["min_distinct_tokens"]), "greedy output")
    # The repeat may start from the cached block-boundary state (prefix cache hit).
    again, _ = engine.generate_greedy(prompt, int(prompts["max_tokens"]))
    assert again == cold, f"greedy output changed on repeat:\n{cold}\n{again}"


def test_prefill_checkpoint_pages(engine: Engine, profile: Profile, layout: dict[str, Any]) -> None:
    """Every Mamba group's cached checkpoint page at the prompt's last block boundary equals
    the state of a cold prefill ending at that boundary, read from its own group.

    The last boundary below the prompt's end is the replay boundary, which vLLM keeps under
    every retention policy; earlier boundaries are retired under the default one."""
    expect, prompts = profile.section("expect"), profile.section("prompts")
    tolerance = float(profile.section("tolerances")["checkpoint_page_rel"])
    block = _block_size(layout)
    mamba = _groups_of(layout, expect["mamba_spec"])
    group_index = {id(g): layout["groups"].index(g) for g in mamba}
    length = int(prompts["checkpoint_blocks"] * block)
    boundaries = [(length - 1) // block * block]
    assert boundaries[0] > 0, f"a {length}-token prompt crosses no {block}-token block boundary"
    prompt = _prompt(profile, engine, length)

    engine.record_block_tables()
    cached = _boundary_pages(engine, prompt, mamba, group_index, boundaries)
    references: dict[str, list[Any]] = {}
    for boundary in boundaries:
        # A prompt ending exactly at the boundary: its last state is the cold reference.
        references.update(
            _boundary_pages(engine, prompt[:boundary], mamba, group_index, [boundary])
        )

    errors = compare.check_checkpoint_pages(cached, references, tolerance)
    print(f"checkpoint page relative errors (per state): {errors}")
    # The check tells groups apart on these very pages: another group's reference is rejected.
    if len(mamba) > 1:
        keys = sorted(references)
        shifted = {k: references[keys[(i + 1) % len(keys)]] for i, k in enumerate(keys)}
        with pytest.raises(AssertionError) as wrong_group:
            compare.check_checkpoint_pages(cached, shifted, tolerance)
        print(f"against another group's reference: {wrong_group.value}")


def _boundary_pages(
    engine: Engine,
    prompt: list[int],
    mamba: list[dict[str, Any]],
    group_index: dict[int, int],
    boundaries: list[int],
) -> dict[str, list[Any]]:
    """Run `prompt` cold (one output token), then read each Mamba group's page holding the state
    after each boundary: block-table column boundary / block - 1 (align mode keeps the state
    after (p + 1) * block tokens in column p)."""
    block = mamba[0]["block_size"]
    assert engine.reset_prefix_cache()
    engine.recorded_block_tables(clear=True)
    engine.generate_greedy(prompt, 1)
    records = engine.recorded_block_tables(clear=True)
    assert len(records) == 1, f"expected one request's block tables, got {sorted(records)}"
    table = next(iter(records.values()))[-1]
    wanted: list[tuple[str, int]] = []
    keys: list[str] = []
    for group in mamba:
        index = group_index[id(group)]
        for boundary in boundaries:
            column = boundary // block - 1
            block_id = table[index][column]
            assert block_id != _null_block_id(), (
                f"group {index}: no checkpoint kept at token {boundary} (column {column} is the "
                f"null block; block table {table[index]}): the prefill did not stop there"
            )
            for layer in group["layer_names"]:
                wanted.append((layer, block_id))
                keys.append(f"group{index}/{layer}@{boundary}")
    pages = engine.read_pages(wanted)
    return dict(zip(keys, pages, strict=True))
