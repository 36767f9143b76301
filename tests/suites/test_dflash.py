"""DFlash2 drafter against the hybrid GLM target (cell dflash-tp1).

What vLLM fixed upstream in #56983 must hold: the drafter loads against the hybrid target (its
taps read through mHC), its GQA layers get KV pages beside the target's MLA, indexer, tail and
KDA groups at the block size the planner predicts for K draft tokens, drafts are proposed and
verified, and greedy output chooses the target-only run's tokens at every step the target alone
wins by more than its own noise (the target alone done reference_repeats times; judging), while
a run that accepts the target's runner-up is rejected by its token.
The acceptance rate is printed, not asserted: the synthesized drafter is untrained.

Two engines, one after the other (never two alive at once): the target alone, then with the
drafter. The drafter is the profile's synthesized one unless GLM5_DFLASH2_DRAFT names one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from glm5_matrix.cache import models_dir
from glm5_matrix.engines.client import Engine, layer_specs
from glm5_matrix.engines.engine_configs import dflash_drafted_spec
from glm5_matrix.engines.prompts import random_prompt
from glm5_matrix.engines.specs import engine_spec
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.models.drafters import Drafter, dflash_table, resolve_drafter
from glm5_matrix.models.glm_config import text_config
from glm5_matrix.models.layout import LayoutPlan, plan_layout
from glm5_matrix.results.recorder import record_figure
from glm5_matrix.verdicts import judging
from glm5_matrix.verdicts.compare import GreedyOutput

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

TOP_LOGPROBS = judging.TOP_LOGPROBS
PROMPT_TOKENS = 512
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@pytest.fixture(scope="module")
def drafter(profile: Profile) -> Drafter:
    found = resolve_drafter(profile, models_dir())
    print(f"drafter: {found.path} ({found.source}), taps {list(found.taps)}")
    return found


@pytest.fixture(scope="module")
def plan(cell: CellContext, profile: Profile, drafter: Drafter) -> LayoutPlan:
    draft_config = json.loads((Path(drafter.path) / "config.json").read_text())
    return plan_layout(
        profile.config(),
        tp=cell.tp or 1,
        spec_tokens=drafter.num_speculative_tokens,
        drafter=draft_config,
    )


@pytest.fixture(scope="module")
def prompt(profile: Profile) -> list[int]:
    vocab = int(text_config(profile.config())["vocab_size"])
    return random_prompt(vocab, PROMPT_TOKENS, int(profile.section("prompts")["seed"]))


@dataclass(frozen=True)
class TargetOnly:
    output: GreedyOutput  # the reference
    comparison: judging.Comparison  # its noise: the target alone done reference_repeats times
    control: GreedyOutput  # the target's runner-up accepted at a decisive step


@pytest.fixture(scope="module")
def target_only(cell: CellContext, profile: Profile, prompt: list[int]) -> TargetOnly:
    """The target alone, reference_repeats times, and the control; its engine is stopped before the drafted one
    starts."""
    max_tokens = int(profile.section("prompts")["max_tokens"])
    dflash_table(profile)  # the [dflash] table, or one line saying the profile has none
    tolerances = profile.tolerances("dflash")
    with Engine(engine_spec(cell, profile)) as engine:
        output, comparison = judging.reference_repeated(
            engine, prompt, max_tokens, "dflash", tolerances, "target-only"
        )
        control = judging.runner_up_control(engine, prompt, max_tokens, output, comparison)
    assert not engine.leftover_processes, engine.leftover_processes
    return TargetOnly(output, comparison, control)


@pytest.fixture(scope="module")
def drafted(
    cell: CellContext, profile: Profile, drafter: Drafter, target_only: TargetOnly
) -> Iterator[Engine]:
    with Engine(dflash_drafted_spec(cell, profile, drafter)) as running:
        print(f"drafted engine up in {running.start_seconds:.1f} s")
        yield running
    assert not running.leftover_processes, running.leftover_processes


@dataclass(frozen=True)
class DraftedRun:
    output: GreedyOutput
    counters: dict[str, float]  # spec-decode counters moved by this run
    more: tuple[GreedyOutput, ...] = ()  # the drafted path again: its own distribution


@pytest.fixture(scope="module")
def drafted_run(drafted: Engine, profile: Profile, prompt: list[int]) -> DraftedRun:
    max_tokens = int(profile.section("prompts")["max_tokens"])
    before = drafted.counters()
    output = drafted.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    after = drafted.counters()
    moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_METRICS}
    more = []
    for _ in range(profile.tolerances("dflash").compared_runs - 1):
        assert drafted.reset_prefix_cache(), "reset_prefix_cache() refused"
        more.append(drafted.generate_scored(prompt, max_tokens, TOP_LOGPROBS))
    return DraftedRun(output, moved, tuple(more))


def test_drafter_gets_kv_pages_beside_the_target(
    drafted: Engine, profile: Profile, plan: LayoutPlan
) -> None:
    from vllm.v1 import kv_cache_interface

    layout = drafted.kv_layout()
    specs = layer_specs(layout)
    expect = profile.section("expect")
    classes = {
        k: getattr(kv_cache_interface, expect[f"{k}_spec"]) for k in ("mla", "tail", "mamba")
    }
    full = kv_cache_interface.FullAttentionSpec
    # Exact classes: MLAAttentionSpec is a subclass of FullAttentionSpec.
    by_class: dict[type, list[str]] = {}
    for name, (cls, _, _) in specs.items():
        by_class.setdefault(cls, []).append(name)
    print({c.__name__: sorted(names) for c, names in by_class.items()})
    planned = {g.kind: g for g in plan.groups}
    kda_layers = [layer for g in plan.groups if g.kind == "mamba" for layer in g.layers]
    assert len(by_class.get(classes["mamba"], [])) == len(kda_layers)
    assert len(by_class.get(classes["tail"], [])) == 1
    assert len(by_class.get(classes["mla"], [])) == 2  # latent + indexer keys
    drafter_layers = sorted(by_class.get(full, []))
    assert len(drafter_layers) == len(planned["draft"].layers), (
        f"drafter layers with {full.__name__}: {drafter_layers}"
    )
    for name in drafter_layers:
        _, page, block = specs[name]
        assert block == plan.block_size, f"{name}: block {block} != planned {plan.block_size}"
        assert page == planned["draft"].page_bytes, f"{name}: page {page}"
    # The target's groups keep the planner's block for K draft tokens (4608 at TP1 for K=7).
    for name, (cls, _, block) in specs.items():
        if cls is not classes["tail"]:
            assert block == plan.block_size, f"{name}: block {block} != {plan.block_size}"
    print(f"block {plan.block_size} for {plan.spec_tokens} draft tokens; drafter {drafter_layers}")
    record_figure(
        "layout.drafter_layers",
        len(drafter_layers),
        limit=len(planned["draft"].layers),
        relation="==",
    )


def test_drafts_are_proposed_and_verified(drafted_run: DraftedRun, drafter: Drafter) -> None:
    moved = drafted_run.counters
    drafts, proposed, accepted = (moved[name] for name in SPEC_METRICS)
    rate = accepted / proposed if proposed else 0.0
    print(
        f"spec decode: {drafts:.0f} drafts, {proposed:.0f} draft tokens, {accepted:.0f} "
        f"accepted (acceptance {rate:.1%}, reported only: the drafter is untrained)"
    )
    record_figure("spec_decode.drafts", drafts, limit=0, relation=">")
    record_figure("spec_decode.acceptance", round(rate, 4))
    assert drafts > 0, f"no drafts were proposed: {moved}"
    assert proposed == drafts * drafter.num_speculative_tokens, moved
    assert 0 <= accepted <= proposed, moved


def test_greedy_matches_target_only(target_only: TargetOnly, drafted_run: DraftedRun) -> None:
    """Greedy output with the drafter chooses the target alone's tokens at every step until the
    first one the target alone wins by no more than its own noise (greedy speculative decoding is
    lossless); the target verifies K drafted tokens in one pass, so the logprobs differ by
    rounding, recorded as a distribution and not judged. The control (the target's runner-up
    accepted, what a broken verification does) is rejected by its token."""
    comparison = target_only.comparison
    comparison.tokens_agree(
        target_only.output,
        drafted_run.output,
        ("target-only", "DFlash2"),
        along_path=True,
        path_runs=drafted_run.more,
    )
    comparison.rejects_by_token(
        target_only.output, target_only.control, ("target-only", "runner-up accepted")
    )
