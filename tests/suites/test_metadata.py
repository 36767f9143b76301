"""GDN metadata reuse across sibling Mamba groups (the `metadata` cell).

vLLM builds the KDA (GDN backend) metadata once for the first Mamba group and hands every
sibling group `update_block_table(metadata, its_block_table, ...)` (cross-group metadata reuse).
A per-group field that update_block_table() does not rewrite stays pointed at the first group:
vLLM #59536 let every group write its prefill checkpoint into the first group's page. Here, for
each batch, the reused metadata must equal a fresh build() on the sibling group's block table
in every field, compared recursively (glm5_matrix.verdicts.equivalence), so a per-group field added to
vLLM later is covered without being named.

Everything is real vLLM of the cell's environment on a CPU device: the GLM-5.3-Flash ModelConfig
from the profile's config.json, MTP through SpeculativeConfig, the block size from vLLM's hybrid
aligner, the KDA state spec from the model class, hash/alignment sizes from vLLM's resolvers,
and the builder class from vLLM's Mamba backend selector. Widths are the real ones: the builder
allocates no state, so nothing needed scaling down. One stand-in, in align mode only: see
`_set_aligned_state_indices`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.verdicts.equivalence import compare, describe
from glm5_matrix.verdicts.vllm_layout import gpu_less_vllm_config

DEVICE = torch.device("cpu")
# The KDA prefill kernel GLM-5.3-Flash resolves on an H200 (SM90, bf16, head_dim 128, bounded
# gate: vllm.models.glm5next.common.kda._resolve_kda_prefill_backend). On this CPU machine the
# platform is not CUDA, so the layer itself would pick "triton", which exports no prefill
# checkpoints; the spec is therefore built for the GPU target's backend. Overridable in the
# profile's [metadata] table.
DEFAULT_KDA_PREFILL_BACKEND = "flashkda"
DEFAULT_NUM_SPECULATIVE_TOKENS = 2
DEFAULT_MAX_MODEL_LEN = 32768
# Block ids of the two sibling groups never overlap, so any value taken from the wrong group's
# table shows up as a difference.
GROUP_BLOCK_ID_BASE = (1, 100_001)


# --- the GLM-5.3-Flash config, once per module ------------------------------------------------


@dataclass
class Glm:
    settings: dict[str, Any]
    model_config: Any
    model_cls: Any
    vllm_version: str


@pytest.fixture(scope="module")
def glm(profile: Profile) -> Glm:
    import vllm
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry

    settings = profile.section("metadata")
    profile.config()  # a missing or broken config.json is one clear UserError
    model_config = ModelConfig(
        model=str(profile.directory),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=int(settings.get("max_model_len", DEFAULT_MAX_MODEL_LEN)),
    )
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    return Glm(settings, model_config, model_cls, vllm.__version__)


@pytest.fixture(scope="module", autouse=True)
def no_pinned_memory_without_a_driver() -> Any:
    """vLLM's metadata builders stage host lists through pinned memory (async_tensor_h2d) when
    the platform says pinning is available. With the CUDA build on a machine without a GPU the
    platform is UnspecifiedPlatform, whose answer is the base-class default True, and pinning
    then fails ("Found no NVIDIA driver"). Pinning changes where the staging copy lives, never a
    value, so without a CUDA device the flag is turned off for this module."""
    import vllm.utils.torch_utils as torch_utils

    saved = torch_utils.PIN_MEMORY
    if not torch.cuda.is_available():
        torch_utils.PIN_MEMORY = False
    yield
    torch_utils.PIN_MEMORY = saved


# --- vLLM configs and the KDA spec, per variant -----------------------------------------------


@dataclass(frozen=True)
class Variant:
    cache_mode: str  # "align" (prefix caching on) or "none"
    num_spec: int  # MTP draft tokens, 0 = no speculative decoding
    full_graphs: bool  # FULL cudagraph mode: the builder stages into persistent buffers

    @property
    def id(self) -> str:
        graphs = "fullgraph" if self.full_graphs else "nograph"
        return f"{self.cache_mode}-{graphs}-mtp{self.num_spec}"


@dataclass
class Groups:
    variant: Variant
    vllm_config: Any
    spec: Any  # MambaSpec of a GLM-5.3-Flash KDA layer
    builder_cls: type
    block_size: int  # the KV-cache block (4352 at TP1): the unit the batches are drawn in


_GROUPS_CACHE: dict[Variant, Groups] = {}


def _groups(glm: Glm, variant: Variant) -> Groups:
    if variant not in _GROUPS_CACHE:
        _GROUPS_CACHE[variant] = _make_groups(glm, variant)
    return _GROUPS_CACHE[variant]


def _make_groups(glm: Glm, variant: Variant) -> Groups:
    from vllm.config import CacheConfig, ParallelConfig, SpeculativeConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.vllm import set_current_vllm_config
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.indexer import Glm5NextIndexerBackend
    from vllm.v1.attention.selector import get_mamba_attn_backend

    align = variant.cache_mode == "align"
    # A VllmConfig runs the model's config hooks (mamba block size, cache mode) once per
    # ModelConfig and marks it done, so each variant gets its own copy of the pristine one.
    model_config = copy.deepcopy(glm.model_config)
    parallel_config = ParallelConfig()
    speculative_config = None
    if variant.num_spec:
        speculative_config = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=variant.num_spec,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )
    cache_config = (
        CacheConfig(enable_prefix_caching=True, mamba_cache_mode="align")
        if align
        else CacheConfig(enable_prefix_caching=False)
    )
    vllm_config = gpu_less_vllm_config(
        model_config, cache_config, parallel_config, speculative_config
    )
    assert vllm_config.cache_config.mamba_cache_mode == variant.cache_mode
    if variant.full_graphs:
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    # The hybrid block size as vLLM sets it on a GPU platform (the CUDA platform inherits this
    # classmethod unchanged); it fixes where the block boundaries of the batches below lie.
    with set_current_vllm_config(vllm_config):
        Platform._align_hybrid_block_size(vllm_config, Glm5NextIndexerBackend)
    spec = _kda_spec(glm, vllm_config)
    if align:
        _resolve_hash_sizes(vllm_config, spec)
    backend = get_mamba_attn_backend(spec.mamba_type)
    # In align mode the Mamba block is the KV-cache block; in mode none it is max_model_len,
    # so the batches are drawn in KV-cache blocks either way.
    block_size = vllm_config.cache_config.block_size
    return Groups(variant, vllm_config, spec, backend.get_builder_cls(), block_size)


def _kda_spec(glm: Glm, vllm_config: Any) -> Any:
    """The MambaSpec a GLM-5.3-Flash KDA layer reports, built as the layer builds it.

    MambaBase.get_kv_cache_spec + Glm5NextLinearAttention.get_kv_cache_spec, with the state
    shapes and dtypes from the model class's own classmethods (real widths: 64 heads x 128).
    """
    from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    from vllm.models.glm5next.common.kda import Glm5NextLinearAttention
    from vllm.v1.kv_cache_interface import MambaSpec

    cache_config = vllm_config.cache_config
    backend = str(glm.settings.get("kda_prefill_backend", DEFAULT_KDA_PREFILL_BACKEND))
    alignment = kda_prefill_checkpoint_alignment(backend)
    spec = MambaSpec(
        shapes=tuple(glm.model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(glm.model_cls.get_mamba_state_dtype_from_config(vllm_config)),
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
        # A property that returns a constant (GatedDeltaNetAttention: GDN_ATTN); read from
        # the class so that a change of backend for GLM's KDA layers is followed here.
        mamba_type=Glm5NextLinearAttention.mamba_type.fget(None),
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_speculative_blocks=(
            0
            if getattr(cache_config, "use_replayssm", False)
            else vllm_config.num_speculative_tokens
        ),
    )
    return dataclasses.replace(
        spec,
        num_prefill_checkpoint_blocks=int(alignment is not None),
        prefill_checkpoint_alignment=alignment,
    )


def _resolve_hash_sizes(vllm_config: Any, spec: Any) -> None:
    """hash_block_size and cache_hit_alignment_tokens, as the engine resolves them and the
    worker copies them into cache_config. Resolved over the three KDA groups: the MLA+indexer
    group has the same block size and the kpool tail is not prefix-cacheable, so they change
    neither the GCD nor the LCM."""
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"kda.{i}"], spec) for i in range(3)]
    kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    vllm_config.cache_config.hash_block_size = hash_block_size
    vllm_config.cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )


# --- batches ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    name: str
    seq_lens: list[int]  # after this step
    query_lens: list[int]
    is_prefilling: list[bool]
    # num_decode_draft_tokens_cpu as MRV2 passes it: drafts of each decode row, -1 for the
    # other rows; and num_accepted_tokens of the previous step (1 for rows without drafts).
    draft_tokens: list[int] | None = None
    accepted: list[int] | None = None
    checkpoints: bool = False  # rows cross a block boundary: checkpoints in align mode
    spec: bool = False  # rows take the spec-decode path


def _batches(block: int, num_spec: int) -> list[Batch]:
    """Rows ordered as vLLM reorders them: decodes (and spec decodes) first, then prefills."""
    b = block
    if num_spec == 0:
        return [
            Batch("decode_only", [b + 7, 300, 2 * b + 1], [1, 1, 1], [False] * 3),
            Batch("prefill_only", [500, 1200], [500, 1200], [True, True]),
            Batch(
                "mixed",
                [b + 7, 40, 3000, 700],
                [1, 1, 1000, 700],  # row 2: a later chunk of a chunked prefill
                [False, False, True, True],
            ),
            Batch(
                "prefill_across_block",  # one cold prefill, one chunk from a block boundary
                [b + 7, b + 300, 3 * b + 5],
                [1, b + 300, 2 * b + 5],
                [False, True, True],
                checkpoints=True,
            ),
        ]
    k = num_spec
    return [
        Batch(
            "spec_decode",
            [b + 7, 300, 2 * b + 1],
            [k + 1] * 3,
            [False] * 3,
            draft_tokens=[k] * 3,
            accepted=[1, k + 1, 2],
            spec=True,
        ),
        Batch(
            "spec_decode_ragged",  # a row with fewer drafts, and one with none
            [b + 7, 300, 2 * b + 1],
            [k + 1, k, 1],
            [False] * 3,
            draft_tokens=[k, k - 1, 0],
            accepted=[2, 1, k + 1],
            spec=True,
        ),
        Batch(
            "spec_decode_with_prefill_across_block",
            [b + 9, 2 * b + 50, b + 300],
            [k + 1, k + 1, b + 300],
            [False, False, True],
            draft_tokens=[k, k, -1],
            accepted=[1, 2, 1],
            checkpoints=True,
            spec=True,
        ),
        Batch(
            "prefill_only_with_mtp",  # no decode row: the non-spec path under an MTP config
            [b + 300, 1200],
            [b + 300, 1200],
            [True, True],
            draft_tokens=[-1, -1],
            accepted=[1, 1],
            checkpoints=True,
        ),
    ]


def _block_table(groups: Groups, batch: Batch, group: int) -> torch.Tensor:
    """A group's block table: align mode holds every block of the request (the Mamba state
    sits at the block of the last token), mode none holds 1 + num_spec state slots."""
    if groups.variant.cache_mode == "align":
        max_model_len = groups.vllm_config.model_config.max_model_len
        columns = -(-max_model_len // groups.spec.block_size) + groups.variant.num_spec
    else:
        columns = 1 + groups.spec.num_speculative_blocks
    rows = len(batch.seq_lens)
    ids = torch.arange(rows * columns, dtype=torch.int32).reshape(rows, columns)
    return ids + GROUP_BLOCK_ID_BASE[group]


def _common_metadata(groups: Groups, batch: Batch, group: int) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = torch.tensor(batch.query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, dim=0)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    block_table = _block_table(groups, batch, group)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(DEVICE),
        num_reqs=len(batch.seq_lens),
        num_actual_tokens=int(query_lens.sum()),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=_slot_mapping(groups, batch, block_table),
        is_prefilling=torch.tensor(batch.is_prefilling, dtype=torch.bool),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


def _slot_mapping(groups: Groups, batch: Batch, block_table: torch.Tensor) -> torch.Tensor:
    if groups.variant.cache_mode != "align":
        # Mode none keeps one state per request, no per-token slots; GDN never reads them.
        return torch.zeros(sum(batch.query_lens), dtype=torch.int64)
    slots = []
    for row, (seq_len, query_len) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        positions = torch.arange(seq_len - query_len, seq_len)
        block_size = groups.spec.block_size
        blocks = block_table[row, positions // block_size].to(torch.int64)
        slots.append(blocks * block_size + positions % block_size)
    return torch.cat(slots)


def _build_kwargs(batch: Batch) -> dict[str, Any]:
    if batch.draft_tokens is None:
        return {}
    assert batch.accepted is not None
    return {
        "num_accepted_tokens": torch.tensor(batch.accepted, dtype=torch.int32, device=DEVICE),
        "num_decode_draft_tokens_cpu": torch.tensor(batch.draft_tokens, dtype=torch.int32),
    }


def _set_aligned_state_indices(groups: Groups, builder: Any, common: Any) -> None:
    """The one stand-in (align mode): MRV2 gives every Mamba builder its group's aligned state
    ids before building (`builder.mamba_aligned_state_indices = ...` in
    vllm/v1/worker/gpu/model_states/mamba_hybrid.py), computed by a CUDA-only Triton kernel
    (MambaSpecDecodeGPUContext.compute_aligned_state_indices asserts seq_lens.is_cuda).
    update_block_table() reads it in align mode. Here it comes from vLLM's own
    mamba_get_block_table_tensor on the group's block table, which is what build() falls back
    to without it; both the reused and the fresh metadata then read the same ids."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    if groups.variant.cache_mode == "align":
        builder.mamba_aligned_state_indices = mamba_get_block_table_tensor(
            common.block_table_tensor, common.seq_lens, groups.spec, "align"
        )


@dataclass
class Outcome:
    source: Any  # first group's metadata, from build()
    reused: Any  # second group's, from update_block_table(source, its block table)
    fresh: Any  # second group's, from build() on its block table


def _run(groups: Groups, batch: Batch) -> Outcome:
    def builder(layer: int) -> Any:
        return groups.builder_cls(
            groups.spec, [f"model.layers.{layer}.self_attn"], groups.vllm_config, DEVICE
        )

    # The fresh build gets its own builder: with FULL graphs, build() and update_block_table()
    # write into the builder's persistent buffers, and sharing one would compare a buffer
    # with itself.
    first, sibling, sibling_fresh = builder(0), builder(1), builder(1)
    common_first = _common_metadata(groups, batch, 0)
    common_sibling = _common_metadata(groups, batch, 1)
    _set_aligned_state_indices(groups, first, common_first)
    _set_aligned_state_indices(groups, sibling, common_sibling)
    _set_aligned_state_indices(groups, sibling_fresh, common_sibling)
    source = first.build(0, common_first, **_build_kwargs(batch))
    reused = sibling.update_block_table(
        source, common_sibling.block_table_tensor, common_sibling.slot_mapping
    )
    fresh = sibling_fresh.build(0, common_sibling, **_build_kwargs(batch))
    return Outcome(source, reused, fresh)


# --- tests ------------------------------------------------------------------------------------

VARIANTS = [
    Variant(cache_mode, num_spec, full_graphs)
    for cache_mode in ("align", "none")
    for full_graphs in (False, True)
    for num_spec in (0, DEFAULT_NUM_SPECULATIVE_TOKENS)
]
BATCH_NAMES = {
    0: [b.name for b in _batches(1, 0)],
    DEFAULT_NUM_SPECULATIVE_TOKENS: [b.name for b in _batches(1, DEFAULT_NUM_SPECULATIVE_TOKENS)],
}
CASES = [
    pytest.param(variant, name, id=f"{variant.id}-{name}")
    for variant in VARIANTS
    for name in BATCH_NAMES[variant.num_spec]
]


def _variant_for(glm: Glm, variant: Variant) -> Variant:
    num_spec = int(glm.settings.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS))
    if variant.num_spec and num_spec != variant.num_spec:
        variant = dataclasses.replace(variant, num_spec=num_spec)
    return variant


def _batch(groups: Groups, name: str) -> Batch:
    (batch,) = [b for b in _batches(groups.block_size, groups.variant.num_spec) if b.name == name]
    return batch


@pytest.mark.parametrize(("variant", "batch_name"), CASES)
def test_update_block_table_matches_fresh_build(glm: Glm, variant: Variant, batch_name: str):
    groups = _groups(glm, _variant_for(glm, variant))
    batch = _batch(groups, batch_name)
    outcome = _run(groups, batch)

    differences = compare(outcome.fresh, outcome.reused)
    assert not differences, (
        f"vLLM {glm.vllm_version}, {groups.variant.id}, batch {batch.name}: a sibling group's "
        f"update_block_table() differs from a fresh build() on its block table in:\n"
        + describe(differences)
    )
    _assert_paths_exercised(groups, batch, outcome)


def _assert_paths_exercised(groups: Groups, batch: Batch, outcome: Outcome) -> None:
    """The equality above is not vacuous: the batch took the path it was written for, and the
    two groups' metadata really differ in their per-group state ids."""
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    fresh = outcome.fresh
    rows = len(batch.seq_lens)
    prefills = sum(
        1
        for q, p in zip(batch.query_lens, batch.is_prefilling, strict=True)
        if p or q > 1 + groups.variant.num_spec
    )
    if batch.spec:
        assert fresh.num_spec_decodes > 0 and fresh.spec_state_indices_tensor is not None
        assert fresh.spec_state_indices_tensor.shape[-1] == groups.variant.num_spec + 1
        assert fresh.num_accepted_tokens is not None
    else:
        assert fresh.num_spec_decodes == 0 and fresh.spec_state_indices_tensor is None
    if batch.name.startswith("decode_only"):
        assert (fresh.num_decodes, fresh.num_prefills) == (rows, 0)
    if batch.name.startswith("prefill_only"):
        assert (fresh.num_decodes, fresh.num_prefills) == (0, rows)
    if batch.name == "mixed":
        assert (fresh.num_decodes, fresh.num_prefills) == (2, 2)
    assert (fresh.num_prefills > 0) == (prefills > 0)

    expect_checkpoint = batch.checkpoints and groups.variant.cache_mode == "align"
    if expect_checkpoint:
        assert fresh.checkpoint is not None, "a prefill across a block boundary, no checkpoint"
        assert bool((fresh.checkpoint.state_indices != NULL_BLOCK_ID).any())
    else:
        assert fresh.checkpoint is None

    # The first group's metadata must differ from the sibling's in every per-group field the
    # batch fills, so that keeping the first group's value could not pass the comparison.
    per_group = {d.path.split("[")[0] for d in compare(outcome.source, fresh)}
    filled = {
        name
        for name in (
            "spec_state_indices_tensor",
            "non_spec_state_indices_tensor",
            "prefill_state_indices",
        )
        if getattr(fresh, name) is not None and getattr(fresh, name).numel() > 0
    }
    if expect_checkpoint:
        filled.add("checkpoint.state_indices")
    assert filled, "the batch fills no per-group field"
    assert filled <= per_group, f"groups agree in {sorted(filled - per_group)}"


def test_comparison_rejects_the_59536_checkpoint_bug(glm: Glm, monkeypatch: pytest.MonkeyPatch):
    """Plant #59536: update_block_table() keeps the first group's checkpoint (before the fix it
    did not rewrite `checkpoint`). The comparison must reject it and name the field."""
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    groups = _groups(glm, _variant_for(glm, Variant("align", 0, False)))
    batch = _batch(groups, "prefill_across_block")
    assert "state_indices" in {f.name for f in dataclasses.fields(MambaPrefillCheckpointMetadata)}
    monkeypatch.setattr(
        MambaPrefillCheckpointMetadata,
        "regather_state_indices",
        lambda self, block_table: self,
    )
    outcome = _run(groups, batch)

    assert outcome.reused.checkpoint is not None
    assert torch.equal(
        outcome.reused.checkpoint.state_indices, outcome.source.checkpoint.state_indices
    ), "the planted bug did not keep the first group's checkpoint pages"
    differences = compare(outcome.fresh, outcome.reused)
    assert [d.path for d in differences] == ["checkpoint.state_indices"], describe(differences)
