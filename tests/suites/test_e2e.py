"""End-to-end suite, shared by the CPU and GPU cells: KV layout, greedy reproducibility across a
block boundary, prefill checkpoint pages. Everything expected comes from the cell's profile
([expect], [prompts], [tolerances]) or from vLLM itself; one engine per module, shared.
The `cell` and `profile` fixtures come from tests/suites/conftest.py."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest

from glm5_matrix.engines.client import (
    Engine,
    block_size_of,
    groups_of,
    resolve_class,
    spec_classes,
    spec_names,
)
from glm5_matrix.engines.engine_configs import e2e_specs, moe_reference_spec
from glm5_matrix.engines.prompts import with_other_tokens
from glm5_matrix.engines.specs import engine_spec
from glm5_matrix.kernels import flashinfer_aot
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.results.recorder import record_figure
from glm5_matrix.verdicts import chunks, compare, judging, served

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

TOP_LOGPROBS = judging.TOP_LOGPROBS


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile) -> Iterator[Engine]:
    spec = e2e_specs(cell, profile)[0]
    if spec.args.get("moe_backend") == "flashinfer_cutlass":
        # FlashInfer must take the kernel cache's AOT fused_moe_90 rather than build it.
        flashinfer_aot.refuse_unless_resolved()
    with Engine(spec) as running:
        print(f"engine {running.spec.label} up in {running.start_seconds:.1f} s")
        yield running
    assert not running.leftover_processes, (
        f"engine processes had to be killed after shutdown: {running.leftover_processes}"
    )


@pytest.fixture(scope="module")
def layout(engine: Engine) -> dict[str, Any]:
    return engine.kv_layout()


def _groups_of(layout: dict[str, Any], spec_name: str) -> list[dict[str, Any]]:
    """Groups whose layers' spec class IS vLLM's class `spec_name` (identity, not a name)."""
    from vllm.v1 import kv_cache_interface

    return groups_of(layout, getattr(kv_cache_interface, spec_name))


def _prompt(profile: Profile, engine: Engine, length: int) -> list[int]:
    return engine.random_prompt(length, int(profile.section("prompts")["seed"]))


def _null_block_id() -> int:
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    return int(NULL_BLOCK_ID)


def test_moe_backends_agree(
    request: pytest.FixtureRequest, cell: CellContext, profile: Profile
) -> None:
    """The MoE backend axis judged across its values: the same prompt through an engine of the
    profile's reference backend ([moe_agreement] reference), done reference_repeats times (its
    own noise), and through this cell's engine; this cell's greedy tokens must be the
    reference's at every step the reference wins by more than that noise (two backends compute
    the same fp8 block-scale MoE with other kernels, so logprobs differ by rounding: recorded
    per step as a distribution, not judged). The control, the reference steered off its own
    choice at its first decisive step, must be rejected by its token with the profile's
    min_power. Each engine reports the backend it runs (read from the model, not from what was
    asked). First in the module: the reference's engine runs and stops before the module's
    shared engine exists (two engines of this model do not fit one GPU), then this test starts
    the shared engine (the `engine` fixture, which the tests after it use) for this cell's run,
    all in this run."""
    reference_spec = moe_reference_spec(cell, profile)
    if reference_spec is None:
        pytest.skip(
            f"cell {cell.id} has no MoE backend axis, or runs the reference backend, or profile "
            f"{profile.name} names none ([moe_agreement] reference)"
        )
    asked = cell.setting("moe_backend")
    reference = profile.section("moe_agreement")["reference"]
    selected = profile.section("moe_backends").get("selected", {})
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
    max_tokens = int(prompts["max_tokens"])
    with Engine(reference_spec) as other:
        print(f"engine {other.spec.label} up in {other.start_seconds:.1f} s")
        used = other.moe_backends()
        wanted = selected.get(reference_spec.args["moe_backend"])
        record_figure("moe_agree.reference_backend", sorted(used), limit=wanted, relation="==")
        assert set(used) == {wanted}, f"the reference engine runs {sorted(used)}, not {wanted}"
        block = block_size_of(other.kv_layout())
        prompt = _prompt(profile, other, int(prompts["long_blocks"] * block))
        expected, comparison = judging.reference_repeated(
            other, prompt, max_tokens, "moe_agree", tolerances, names_prefix=reference
        )
        control = judging.runner_up_control(other, prompt, max_tokens, expected, comparison)
    ours: Engine = request.getfixturevalue("engine")
    used = ours.moe_backends()
    wanted = selected.get(ours.spec.args["moe_backend"])
    record_figure("moe_agree.backend", sorted(used), limit=wanted, relation="==")
    assert set(used) == {wanted}, f"this cell's engine runs {sorted(used)}, not {wanted}"
    assert ours.reset_prefix_cache()
    run = ours.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    print(f"\n{reference}   {expected.token_ids}\n{asked}   {run.token_ids}")
    comparison.tokens_agree(expected, run, (reference, asked))
    comparison.rejects_by_token(expected, control, (reference, f"{reference} off its own choice"))


def test_kv_layout(
    engine: Engine, cell: CellContext, profile: Profile, layout: dict[str, Any]
) -> None:
    if "layout" in profile.data:  # GLM-5.3-Flash: the planner predicts every group
        _check_planned_layout(engine, cell, profile, layout)
        return
    expect = profile.section("expect")
    mamba = _groups_of(layout, expect["mamba_spec"])
    attention = _groups_of(layout, expect["attention_spec"])
    kinds = [spec_names(g) for g in layout["groups"]]
    assert len(mamba) == expect["mamba_groups"], f"Mamba groups: {kinds}"
    assert len(attention) == expect["attention_groups"], f"attention groups: {kinds}"
    assert len(layout["groups"]) == len(mamba) + len(attention), f"unexpected groups: {kinds}"
    assert all(g["mamba_cache_mode"] == "align" for g in mamba), (
        "prefix caching is not in align mode"
    )

    # The block size is what vLLM's hybrid aligner computes for this config, run here on a
    # fresh config from the same engine args (not the engine's own state).
    block = block_size_of(layout)
    start_block, expected_block, backend = _aligned_block_size(
        engine, attention[0]["backend_class"]
    )
    record_figure("layout.block_size", block, limit=expected_block, relation="==", unit="tokens")
    record_figure("layout.groups", kinds)
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


def _check_planned_layout(
    engine: Engine, cell: CellContext, profile: Profile, layout: dict[str, Any]
) -> None:
    """GLM-5.3-Flash: {MLA latent + indexer}, the kpool tail ring, one Mamba group per KDA layer
    sharing the MLA tensor; kinds by class identity; sizes as the layout planner predicts."""
    from glm5_matrix.engines.specs import gpu_family
    from glm5_matrix.models.layout import plan_layout

    expect, planned = profile.section("expect"), profile.section("layout")
    limits = engine.scheduler_limits()
    kv_dtype = "fp8" if limits["cache_dtype"].startswith("fp8") else "auto"
    plan = plan_layout(
        profile.config(),
        tp=cell.tp or 1,
        spec_tokens=limits["speculative_tokens"],
        kv_cache_dtype=kv_dtype,
    )
    kinds = [spec_names(g) for g in layout["groups"]]
    mamba = _groups_of(layout, expect["mamba_spec"])
    tail = _groups_of(layout, expect["tail_spec"])
    mla = [g for g in layout["groups"] if g not in mamba and g not in tail]
    assert len(mamba) == len(planned["kda_layers"]), f"Mamba groups: {kinds}"
    assert len(tail) == 1 and len(mla) == 1, f"expected one tail and one MLA group: {kinds}"
    from vllm.v1 import kv_cache_interface

    mla_class = getattr(kv_cache_interface, expect["mla_spec"])
    assert len(mla[0]["layer_names"]) == 2, f"MLA group: latent + indexer keys: {mla[0]}"
    assert spec_classes(mla[0]) == {mla_class}, f"MLA group specs: {mla[0]}"
    planned_groups = {g.kind: g for g in plan.groups}
    block = plan.block_size
    print(f"engine groups {kinds}; planner block {block}, tail {planned_groups['tail'].block_size}")
    record_figure(
        "layout.block_size", mla[0]["block_size"], limit=block, relation="==", unit="tokens"
    )
    record_figure("layout.groups", kinds)
    assert mla[0]["block_size"] == block, f"MLA block {mla[0]['block_size']} != planned {block}"
    assert all(g["block_size"] == block for g in mamba), f"Mamba blocks: {mamba}"
    assert tail[0]["block_size"] == planned_groups["tail"].block_size, f"tail: {tail[0]}"
    assert mla[0]["page_size_bytes"] == planned_groups["mla"].page_bytes
    assert all(g["page_size_bytes"] == planned_groups["mamba"].page_bytes for g in mamba)
    # The published numbers hold where they were measured: SM90, bf16 KV, no speculation.
    if gpu_family() == "sm90" and kv_dtype == "auto" and limits["speculative_tokens"] == 0:
        published = expect.get("block_size") or {}
        key = f"tp{cell.tp or 1}"
        if key in published:
            assert block == published[key], f"planner {block} != published {published[key]}"
    # The KDA pages live in the MLA latent's tensor.
    storage = layout["storage"]
    for group in mamba:
        for name in group["layer_names"]:
            mine = storage[name]
            assert any(storage[a]["storage"] == mine["storage"] for a in mla[0]["layer_names"]), (
                f"{name} does not share the MLA tensor: {storage}"
            )


def test_kv_layout_splits_over_ranks(
    engine: Engine, cell: CellContext, profile: Profile, layout: dict[str, Any]
) -> None:
    """Tensor parallelism (CPU TP cells): every rank holds the same groups and block size; each
    Mamba state per rank is the config's state over TP (the GDN heads split), the attention
    bytes per token are not (one KV head, replicated), so vLLM's aligner picks a smaller block
    than at TP1, the way GLM-5.3-Flash's shrinks (4352/2176/1152)."""
    tp = cell.tp or 1
    if tp == 1 or "layout" in profile.data:
        pytest.skip("the tiny hybrid at TP > 1 (GLM-5.3-Flash: the planner, test_kv_layout)")
    ranks = engine.kv_layouts()
    assert len(ranks) == tp, f"{len(ranks)} workers answered at TP{tp}"
    shape = [
        [(spec_names(g), g["block_size"], g["page_size_bytes"]) for g in r["groups"]] for r in ranks
    ]
    assert all(s == shape[0] for s in shape), f"ranks disagree on the KV groups: {shape}"
    config = profile.section("model")["config"]
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    assert k_heads % tp == 0 and v_heads % tp == 0, f"TP{tp} does not split the GDN heads"
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (config["linear_conv_kernel_dim"] - 1)
    recurrent = v_heads * k_dim * v_dim
    expect = profile.section("expect")
    for group in _groups_of(layout, expect["mamba_spec"]):
        sizes = sorted(math.prod(s) for s in group["state_shapes"])
        assert sizes == sorted([conv // tp, recurrent // tp]), (
            f"Mamba state per rank {group['state_shapes']} is not the config's "
            f"({conv}, {recurrent} elements) over TP{tp}"
        )
    (attention,) = _groups_of(layout, expect["attention_spec"])
    per_token = attention["bytes_per_token"]
    replicated = 2 * max(1, config["num_key_value_heads"] // tp) * config["head_dim"] * 2
    assert per_token == replicated, f"attention {per_token} B/token, expected {replicated}"
    # vLLM's aligner on a fresh TP1 config of the same engine args (no engine started).
    block = block_size_of(layout)
    _, tp1_block, _ = _aligned_block_size(
        engine, attention["backend_class"], tensor_parallel_size=1
    )
    print(f"block at TP{tp}: {block} tokens; vLLM's aligner at TP1: {tp1_block}")
    record_figure("layout.tp1_block_size", tp1_block, unit="tokens")
    record_figure("layout.ranks", len(ranks), limit=tp, relation="==")
    assert block < tp1_block, f"TP{tp} block {block} did not shrink from TP1's {tp1_block}"


def test_greedy_tokens_equal_tp1(engine: Engine, cell: CellContext, profile: Profile) -> None:
    """Tensor parallelism (CPU TP cells): the same prompt on a TP1 engine of the same model,
    done the profile's reference_repeats times (its own noise); this engine's greedy tokens
    must equal TP1's at every step TP1 wins by more than that noise. The all-reduce sums the
    ranks' partial products in another order, so the logprobs differ by rounding: recorded per
    step, not judged by a constant. The control, this engine's run steered off TP1's choice at a
    decisive step, must be rejected by the same rule with the profile's min_power."""
    tp = cell.tp or 1
    if tp == 1:
        pytest.skip("TP1 is the reference")
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
    block = block_size_of(engine.kv_layout())
    prompt = _prompt(profile, engine, int(prompts["long_blocks"] * block))
    max_tokens = int(prompts["max_tokens"])
    spec = engine_spec(cell, profile, tensor_parallel_size=1)
    # The cell's thread binding names one core per rank; the TP1 engine takes both.
    binding = (
        {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        if "VLLM_CPU_OMP_THREADS_BIND" in spec.environment
        else {}
    )
    spec = dataclasses.replace(spec, environment={**spec.environment, **binding})
    with Engine(spec) as tp1:
        print(f"engine {tp1.spec.label} up in {tp1.start_seconds:.1f} s")
        record_figure("tp.tp1_start_s", round(tp1.start_seconds, 1), unit="s")
        reference, comparison = judging.reference_repeated(
            tp1, prompt, max_tokens, "tp", tolerances, names_prefix="TP1"
        )
    assert engine.reset_prefix_cache()
    run = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    print(f"\nTP1   {reference.token_ids}\nTP{tp}   {run.token_ids}")
    comparison.tokens_agree(reference, run, ("TP1", f"TP{tp}"))
    # The control: this engine steered off TP1's choice at TP1's first decisive step (what a
    # rank computing a wrong split amounts to at the output). A prompt whose first block is
    # drawn anew is no control here: on this model it left all 24 greedy tokens unchanged
    # (measured), so the token rule cannot be shown failing with it.
    control = judging.runner_up_control(engine, prompt, max_tokens, reference, comparison)
    comparison.rejects_by_token(reference, control, ("TP1", f"TP{tp} off TP1's choice"))


def test_moe_backend_is_the_one_asked(engine: Engine, cell: CellContext, profile: Profile) -> None:
    """The backend axis means something only if the engine runs the backend the cell asked."""
    asked = engine.spec.args.get("moe_backend")
    if asked is None:
        pytest.skip(f"cell {cell.id} has no MoE backend axis")
    wanted = profile.section("moe_backends").get("selected", {}).get(asked)
    used = engine.moe_backends()
    print(f"moe_backend={asked}: engine runs {sorted(used)}")
    record_figure("moe.backend", sorted(used), limit=wanted, relation="==")
    assert used, "no FP8 MoE layer found in the model"
    assert set(used) == {wanted}, f"asked {asked} (-> {wanted}), engine runs {sorted(used)}"
    if wanted == "FLASHINFER_CUTLASS":
        _check_flashinfer_module(engine)


def _check_flashinfer_module(engine: Engine) -> None:
    """Which build of FlashInfer's CUTLASS MoE module every rank runs, read from the process's
    own mappings: where the kernel cache holds an AOT build (glm5_matrix.kernels.flashinfer_aot),
    it is that file, not one FlashInfer built into its JIT folder."""
    module = flashinfer_aot.MODULE
    mapped = engine.mapped_files(f"{module}.so")
    print(f"{module}: mapped per rank {mapped}")
    record_figure("moe.flashinfer_module", mapped)
    assert all(mapped), f"a rank maps no {module}.so: {mapped}"
    aot = flashinfer_aot.active_module(module)
    if aot is not None:
        assert all(m == [str(aot)] for m in mapped), (
            f"the kernel cache holds {aot}, but the ranks run {mapped}"
        )


def test_default_max_num_seqs(engine: Engine, profile: Profile, layout: dict[str, Any]) -> None:
    """vLLM's default max_num_seqs (1024 on large GPUs at TP1) starts and generates; it once
    overflowed the KDA kernel's grid at 64 heads (vllm-project/vllm#56973)."""
    if "max_num_seqs" in engine.spec.args:
        pytest.skip(f"profile {profile.name} sets max_num_seqs itself")
    from vllm.engine.arg_utils import EngineArgs

    # What vLLM's defaults give for these arguments on this machine, computed in this process.
    from vllm.usage.usage_lib import UsageContext

    # The LLM class's defaults (not the server's), as the engine got them.
    config = EngineArgs(model=engine.spec.model, **engine.spec.args).create_engine_config(
        usage_context=UsageContext.LLM_CLASS
    )
    default = int(config.scheduler_config.max_num_seqs)
    limits = engine.scheduler_limits()
    print(f"max_num_seqs: engine {limits['max_num_seqs']}, vLLM's default here {default}")
    record_figure("scheduler.max_num_seqs", limits["max_num_seqs"], limit=default, relation="==")
    assert limits["max_num_seqs"] == default
    tokens = engine.generate_greedy(_prompt(profile, engine, 64), 4)
    assert len(tokens) == 4


def _aligned_block_size(
    engine: Engine, backend_name: str, **overrides: Any
) -> tuple[int, int, type]:
    """(block size before alignment, after vLLM's hybrid aligner, the attention backend), for
    the engine's arguments with `overrides`."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    backend = resolve_class(backend_name)
    args = {**engine.spec.args, **overrides}
    config = EngineArgs(model=engine.spec.model, **args).create_engine_config()
    start = int(config.cache_config.block_size)
    current_platform._align_hybrid_block_size(config, backend)
    return start, int(config.cache_config.block_size), backend


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name.removeprefix("torch."))


def test_greedy_reproducible_across_block_boundary(
    engine: Engine, profile: Profile, layout: dict[str, Any]
) -> None:
    """A prompt longer than one block, run cold (the profile's reference_repeats times: the
    noise as a distribution) and then again from the cached block-boundary state, must agree
    with the cold run under that noise: at its first step, the prefill's own output, and over
    the whole run. The reference takes the repeat's path: its prefill ends a chunk at the
    boundary (checked on the chunks the worker computed: glm5_matrix.verdicts.chunks), so its
    second chunk has the repeat's shapes and starts from the state the cache then serves; the
    only difference left between the runs is the engine's own noise (on the H200 the sparse
    indexer's top-k order). A prompt whose last tokens before the boundary differ, what a stale
    or wrong cached block amounts to, must be rejected at the first step with at least the
    profile's min_power (there the cached state acts before any decode step adds noise of its
    own); over the whole run its power is recorded. What the cache holds bit for bit, its
    pages, is test_prefill_checkpoint_pages's."""
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
    block = block_size_of(layout)
    length = int(prompts["long_blocks"] * block)
    assert length > block, f"prompt of {length} tokens does not cross a {block}-token block"
    prompt = _prompt(profile, engine, length)
    max_tokens = int(prompts["max_tokens"])
    engine.record_block_tables()  # and the chunks each request computes
    engine.recorded_chunks(clear=True)
    runs = judging.reference_runs(engine, prompt, max_tokens, tolerances)
    cold_chunks = chunks.prompt_runs(engine.recorded_chunks(), length)
    assert len(cold_chunks) == len(runs), f"{len(cold_chunks)} cold requests recorded"
    cold, repeat = runs[0], judging.repeated("repeat", runs, "cold", tolerances)
    prefill = judging.prefill_step("repeat_prefill", runs, "cold", tolerances, repeat.floor.step)
    # The repeat starts from the cached block-boundary state (prefix cache hit).
    again = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    (again_chunks,) = chunks.prompt_runs(engine.recorded_chunks(), length)
    for cold_run in cold_chunks:
        boundary = chunks.check_repeat_path(cold_run, again_chunks, length, block)
    print(f"repeat path: cold chunks {cold_chunks[0]}, repeat chunks {again_chunks}")
    record_figure("repeat.cold_chunks", [list(c) for c in cold_chunks[0]])
    record_figure("repeat.repeat_chunks", [list(c) for c in again_chunks])
    assert again.cached_tokens == boundary, (
        f"the repeat reused {again.cached_tokens} cached tokens; it computed from {boundary}"
    )
    # More repeats from the same cached state: the repeat path's own distribution, compared with
    # the cold runs' (a noisier repeat path is a finding, not a wider tolerance).
    more = _more_runs(engine, prompt, max_tokens, tolerances.compared_runs - 1)
    assert all(r.cached_tokens == boundary for r in more), [r.cached_tokens for r in more]
    prefill.agrees(
        judging.first_step(cold),
        judging.first_step(again),
        ("cold", "repeat"),
        path_runs=[judging.first_step(r) for r in more],
    )
    repeat.agrees(cold, again, ("cold", "repeat"), path_runs=more)
    other = engine.generate_scored(
        _stale_block(profile, engine, prompt, block), max_tokens, TOP_LOGPROBS
    )
    prefill.rejects(judging.first_step(cold), judging.first_step(other), ("cold", "stale block"))
    try:
        repeat.rejects(cold, other, ("cold", "stale block"))
    except AssertionError as weak:  # the first step carries the power; recorded, not judged
        record_figure("repeat.whole_run_control", str(weak).splitlines()[0][:300])
        print(f"repeat: over the whole run the stale block is not rejected with power: {weak}")


def test_prefix_cache_tells_the_last_token_of_a_block(
    engine: Engine, profile: Profile, layout: dict[str, Any]
) -> None:
    """A prompt that differs from a cached one only in the last token of its first block must
    get no cached state covering that token: what it is served covers fewer tokens than the
    first position where the prompts differ, and its output agrees with its own cold runs under
    their noise (first step and whole run). The repeat's stale-block control changes a whole
    block, so a block hash that leaves out a block's last token passes it; this is the check
    that sees one (mutant block-hash-drops-last-token)."""
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
    block = block_size_of(layout)
    cached = _prompt(profile, engine, int(prompts["long_blocks"] * block))
    other = list(cached)
    other[block - 1] = (other[block - 1] + 1) % engine.vocab_size()
    runs = judging.reference_runs(engine, other, int(prompts["max_tokens"]), tolerances)
    whole = judging.repeated("last_token", runs, "cold", tolerances)
    prefill = judging.prefill_step("last_token_prefill", runs, "cold", tolerances, whole.floor.step)

    def serve() -> compare.GreedyOutput:
        assert engine.reset_prefix_cache()
        engine.generate_greedy(cached, 1)  # the prompt it differs from, now in the prefix cache
        return engine.generate_scored(other, int(prompts["max_tokens"]), TOP_LOGPROBS)

    served = serve()
    record_figure(
        "last_token.served_cached_tokens", served.cached_tokens, limit=block - 1, relation="<="
    )
    assert (served.cached_tokens or 0) <= block - 1, (
        f"served {served.cached_tokens} cached tokens of a prompt that differs from the cached "
        f"one at token {block - 1}: the cache did not tell the two prompts apart"
    )
    more = [serve() for _ in range(tolerances.compared_runs - 1)]
    prefill.agrees(
        judging.first_step(runs[0]),
        judging.first_step(served),
        ("cold", "served"),
        path_runs=[judging.first_step(r) for r in more],
    )
    whole.agrees(runs[0], served, ("cold", "served"), path_runs=more)


def _more_runs(
    engine: Engine, prompt: list[int], max_tokens: int, count: int, cold: bool = False
) -> list[compare.GreedyOutput]:
    """`count` more runs of a compared path (the profile's compared_runs less the judged one),
    each from an emptied prefix cache with `cold`."""
    runs = []
    for _ in range(count):
        if cold:
            assert engine.reset_prefix_cache(), "reset_prefix_cache() refused"
        runs.append(engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS))
    return runs


def _stale_block(profile: Profile, engine: Engine, prompt: list[int], block: int) -> list[int]:
    """The prompt with its last tokens before the first block boundary drawn anew (the
    profile's control_changed_blocks, in blocks): the prompt whose cached first block a stale or
    wrong cache would serve."""
    changed = round(profile.tolerances().needed("control_changed_blocks") * block)
    assert 0 < changed <= block, f"control_changed_blocks gives {changed} of {block} tokens"
    seed = int(profile.section("prompts")["seed"]) + 1
    return with_other_tokens(prompt, block - changed, block, engine.vocab_size(), seed)


def test_prefill_checkpoint_pages(
    engine: Engine, cell: CellContext, profile: Profile, layout: dict[str, Any]
) -> None:
    """Every Mamba group's cached checkpoint page at the prompt's last block boundary equals
    the state of a cold prefill ending at that boundary, read from its own group.

    The last boundary below the prompt's end is the replay boundary, which vLLM keeps under
    every retention policy; earlier boundaries are retired under the default one."""
    expect, prompts = profile.section("expect"), profile.section("prompts")
    tolerance = profile.tolerances().needed("checkpoint_page_rel")
    block = block_size_of(layout)
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
    worst = max(e for per_state in errors.values() for e in per_state)
    record_figure("checkpoint.page_rel_error", worst, limit=tolerance, relation="<=")
    # The check tells groups apart on these very pages: another group's reference is rejected.
    if len(mamba) > 1:
        keys = sorted(references)
        shifted = {k: references[keys[(i + 1) % len(keys)]] for i, k in enumerate(keys)}
        with pytest.raises(AssertionError) as wrong_group:
            compare.check_checkpoint_pages(cached, shifted, tolerance)
        print(f"against another group's reference: {wrong_group.value}")
    tp = cell.tp or 1
    if tp > 1:  # every rank's own split checked, and told apart from another rank's
        ranks = sorted({key.split("/", 1)[0] for key in cached})
        assert ranks == [f"rank{r}" for r in range(tp)], f"pages read from {ranks}"
        record_figure("checkpoint.ranks_checked", len(ranks), limit=tp, relation="==")

        def next_rank(key: str) -> str:
            rank, rest = key.split("/", 1)
            return f"rank{(int(rank.removeprefix('rank')) + 1) % tp}/{rest}"

        with pytest.raises(AssertionError) as wrong_rank:
            compare.check_checkpoint_pages(
                cached, {k: references[next_rank(k)] for k in cached}, tolerance
            )
        print(f"against the next rank's reference: {wrong_rank.value}")


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
    ranks = engine.read_pages_per_rank(wanted)
    if len(ranks) == 1:
        return dict(zip(keys, ranks[0], strict=True))
    # Tensor parallelism: every rank's page of its own split of the heads, checked each.
    return {
        f"rank{rank}/{key}": page
        for rank, pages in enumerate(ranks)
        for key, page in zip(keys, pages, strict=True)
    }


def test_prefix_hit_starts_from_the_checkpoint(
    engine: Engine, profile: Profile, layout: dict[str, Any]
) -> None:
    """After a prefix-cache hit at a block boundary, the Mamba state the running request starts
    from is the cached checkpoint, bit for bit, in every Mamba layer: read in the worker as the
    model is about to run the request's first post-hit step, at the block the harness locates
    ((start + tokens - 1) // block: align mode copies the checkpoint there first), against the
    checkpoint page read before the hit from the cold request's own table (column
    boundary // block - 1). Where the output repeat lacks power (the GPU) this still sees a hit
    served from a wrong state. The control, each layer against another group's checkpoint,
    must be rejected."""
    expect, prompts = profile.section("expect"), profile.section("prompts")
    block = block_size_of(layout)
    mamba = _groups_of(layout, expect["mamba_spec"])
    groups = {layout["groups"].index(g): list(g["layer_names"]) for g in mamba}
    assert groups, "no Mamba group: nothing is served from a checkpoint"
    length = int(prompts["checkpoint_blocks"] * block)
    boundary = (length - 1) // block * block
    assert boundary > 0, f"a {length}-token prompt crosses no {block}-token block boundary"
    # A prompt of its own: no other test's cache entries can serve it.
    prompt = engine.random_prompt(length, int(prompts["seed"]) + 11)
    engine.record_block_tables()
    engine.record_served_states(groups)
    assert engine.reset_prefix_cache()
    engine.recorded_block_tables(clear=True)
    engine.served_states(clear=True)
    engine.generate_greedy(prompt, 1)
    (history,) = engine.recorded_block_tables(clear=True).values()
    table = history[-1]
    column = boundary // block - 1
    reads = []
    for index, layers in groups.items():
        block_id = table[index][column]
        assert block_id != _null_block_id(), f"group {index}: no checkpoint at {boundary}"
        reads += [(layer, block_id) for layer in layers]
    checkpoint = {
        layer: tuple(d) for (layer, _), d in zip(reads, engine.page_digests(reads), strict=True)
    }
    assert not engine.served_states(clear=True), "the cold run was served from a cache"
    again = engine.generate_greedy(prompt, 1)
    assert again
    records = engine.served_states(clear=True)
    assert len(records) == 1, f"expected the repeat's post-hit step, got {sorted(records)}"
    (entry,) = records.values()
    print(
        f"\nhit at {entry['start']}: columns {entry['columns']}, blocks {entry['blocks']}, "
        f"kernel blocks {entry.get('kernel_blocks')}; checkpoint column {column}"
    )
    sizes = {str(index): int(layout["groups"][index]["block_size"]) for index in groups}
    result = served.check_served(entry, checkpoint, boundary, sizes)
    print(result.describe())
    record_figure("served.layers_equal", result.layers, limit=0, relation=">", unit="layers")
    record_figure("served.hit_start", entry["start"], limit=boundary, relation="==", unit="tokens")
    named = [b for b in (entry.get("kernel_blocks") or {}).values() if b is not None]
    record_figure("served.kernel_blocks_checked", len(named), unit="layers")
    layers = sorted(checkpoint)
    if len(layers) > 1:
        shifted = {
            layer: checkpoint[layers[(i + 1) % len(layers)]] for i, layer in enumerate(layers)
        }
        with pytest.raises(AssertionError, match="other bytes") as control:
            served.check_served(entry, shifted, boundary, sizes)
        print(f"control (another layer's checkpoint) rejected: {control.value}")


def test_mtp_matches_target_only(engine: Engine, cell: CellContext, profile: Profile) -> None:
    """The MTP drafter loads, and greedy output with it chooses the target-only run's tokens
    (greedy speculative decoding is lossless) at every step until the first one the target-only
    run wins by no more than its own noise (the target alone done reference_repeats times) or
    than the two runs' scores already differed on the same tokens at the steps before (the
    target verifies a drafted token in a two-token pass: other shapes, other rounding, which the
    target alone repeated cannot show; on the H200 the 512-token target alone was bitwise six
    times, and MTP parted at a 2-step margin). MTP's logprob differences are recorded as a
    distribution, not judged. The control accepts the
    target's runner-up at a decisive step, what a broken verification of drafted tokens does,
    and must be rejected by its token. Last in the module: it stops the shared engine first, so
    that two engines are never alive at once in this process."""
    mtp = profile.section("mtp")
    if not mtp:
        pytest.skip(f"profile {profile.name} has no MTP drafter")
    prompts, tolerances = profile.section("prompts"), profile.tolerances()
    prompt = _prompt(profile, engine, 512)
    max_tokens = int(prompts["max_tokens"])
    target, comparison = judging.reference_repeated(
        engine, prompt, max_tokens, "mtp", tolerances, "target-only"
    )
    control = judging.runner_up_control(engine, prompt, max_tokens, target, comparison)
    engine.shutdown()
    mtp_spec = e2e_specs(cell, profile)[1]
    speculative = mtp_spec.args["speculative_config"]
    with Engine(mtp_spec) as drafted:
        assert (
            drafted.scheduler_limits()["speculative_tokens"]
            == speculative["num_speculative_tokens"]
        )
        with_mtp = drafted.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
        # MTP's own runs (each from an empty cache, as the first): compared with the target's.
        more = _more_runs(drafted, prompt, max_tokens, tolerances.compared_runs - 1, cold=True)
    comparison.tokens_agree(
        target, with_mtp, ("target-only", "MTP"), along_path=True, path_runs=more
    )
    comparison.rejects_by_token(target, control, ("target-only", "runner-up accepted"))
