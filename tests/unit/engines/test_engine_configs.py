"""glm5_matrix.engines.engine_configs without starting anything: which engines each suite's cell starts,
which of them are the same configuration across cells, the warm requests and the ledger."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from glm5_matrix.cache import CACHE_VARIABLE
from glm5_matrix.engines import engine_configs, specs
from glm5_matrix.engines.engine_configs import ServerSpec, WarmLedger, config_key
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.context import CellContext, for_variant
from glm5_matrix.matrix.profiles import load_profile
from glm5_matrix.sessions.runner import load


@pytest.fixture(autouse=True)
def sm90(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm90")
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))  # the synthesized drafter
    monkeypatch.delenv("GLM5_DFLASH2_DRAFT", raising=False)


def _cell(variant_id: str) -> CellContext:
    from glm5_matrix.matrix.context import Weights

    return for_variant(load().variant(variant_id), weights=Weights(kind="random"))


GLM = "glm-5.3-flash-4l"


def test_each_suite_enumerates_what_it_starts() -> None:
    profile = load_profile(GLM)
    e2e = engine_configs.for_cell(_cell("e2e-tp1(deep_gemm)"), profile)
    assert [s.args.get("speculative_config") for s in e2e] == [
        None,
        {"method": "mtp", "num_speculative_tokens": 1},
        None,  # the eviction engine of test_e2e's prefix scenarios
    ]
    assert (
        e2e[2].args["num_gpu_blocks_override"] == profile.section("prefix")["eviction"]["kv_blocks"]
    )
    assert all(s.args["moe_backend"] == "deep_gemm" and s.args["enforce_eager"] for s in e2e)
    (offload,) = engine_configs.for_cell(_cell("offload-tp1(simple)"), profile)
    transfer = offload.args["kv_transfer_config"]
    assert transfer["kv_connector"] == "SimpleCPUOffloadConnector"
    assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] > 0
    target, drafted = engine_configs.for_cell(_cell("dflash-tp1"), profile)
    assert "speculative_config" not in target.args
    assert drafted.args["speculative_config"]["method"] == "dflash"
    assert drafted.args["disable_log_stats"] is False
    (server,) = engine_configs.for_cell(_cell("pd-nixl"), profile)
    assert isinstance(server, ServerSpec)
    assert "--kv-transfer-config" in server.args and "--enforce-eager" in server.args
    assert server.environment["CUDA_VISIBLE_DEVICES"] == "0"  # the prefill server's GPU
    assert server.environment["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"  # the cell's environment
    with pytest.raises(UserError, match="starts no engine"):
        engine_configs.for_cell(_cell("layout"), profile)


def test_pd_servers_end_their_engine_cores_in_order_within_the_stop_grace() -> None:
    """vLLM's default --shutdown-timeout 0 SIGKILLs a server's engine cores at its stop, so they
    wrote no coverage data (pd-nixl-cpu's executed list: 8 processes; with 10 s, 12)."""
    from glm5_matrix.engines.servers import STOP_GRACE_S

    (server,) = engine_configs.for_cell(_cell("pd-nixl"), load_profile(GLM))
    at = server.args.index("--shutdown-timeout")
    assert 0 < int(server.args[at + 1]) < STOP_GRACE_S


def test_the_compiled_cell_runs_without_enforce_eager() -> None:
    profile = load_profile(GLM)
    target, mtp, small = engine_configs.for_cell(_cell("e2e-tp1-graphs"), profile)
    assert not any(s.args["enforce_eager"] for s in (target, mtp, small))
    eager = engine_configs.for_cell(_cell("e2e-tp1(deep_gemm)"), profile)[0]
    assert config_key(target, "k") != config_key(eager, "k")
    cell = _cell("e2e-tp1-graphs")
    bad = CellContext(**{**cell.__dict__, "settings": {**cell.settings, "mode": "fast"}})
    with pytest.raises(UserError, match="mode 'fast' is not one of eager, compiled"):
        specs.cell_engine_args(bad, profile)


def test_equal_configurations_of_two_cells_share_a_key_and_others_do_not() -> None:
    profile = load_profile(GLM)
    e2e_target = engine_configs.for_cell(_cell("e2e-tp1(deep_gemm)"), profile)[0]
    dflash_target = engine_configs.for_cell(_cell("dflash-tp1"), profile)[0]
    noise_target = engine_configs.for_cell(_cell("noise-tp1"), profile)[0]
    assert e2e_target.label != noise_target.label
    assert config_key(e2e_target, "k") == config_key(noise_target, "k")
    # Another kernel cache (other versions or GPU) is another warm-up.
    assert config_key(e2e_target, "k") != config_key(noise_target, "other")
    # DFlash's target alone runs no prefix-cache repeat: vLLM's own chunk budget, another
    # configuration than e2e's (whose prefill is chunked at the block).
    assert config_key(e2e_target, "k") != config_key(dflash_target, "k")
    keys = {
        config_key(spec, "k")
        for variant in (
            "e2e-tp1(deep_gemm)",
            "e2e-tp1(flashinfer)",
            "offload-tp1(simple)",
            "offload-tp1(offloading)",
            "dflash-tp1",
            "pd-nixl",
        )
        for spec in engine_configs.for_cell(_cell(variant), profile)
    }
    # e2e x2 backends x (target, MTP, the small-cache engine) + 2 offload + the dflash target and
    # drafted engine + the PD server.
    assert len(keys) == 6 + 2 + 2 + 1


def test_a_backend_is_judged_against_the_reference_backends_own_engine() -> None:
    """test_moe_backends_agree: the flashinfer cell starts first the profile's reference
    backend's engine, the very configuration of the deep_gemm cell's shared engine (so the warm
    step and the kernel archive of that cell cover it); the reference cell starts no such
    engine."""
    profile = load_profile(GLM)
    reference = engine_configs.for_cell(_cell("e2e-tp1(deep_gemm)"), profile)
    flashinfer = engine_configs.for_cell(_cell("e2e-tp1(flashinfer)"), profile)
    # (target, MTP, the prefix scenarios' small-cache engine), the flashinfer cell's after its
    # reference engine
    assert len(reference) == 3 and len(flashinfer) == 4
    assert engine_configs.moe_reference_spec(_cell("e2e-tp1(deep_gemm)"), profile) is None
    judged_against = flashinfer[0]
    assert judged_against.args["moe_backend"] == "deep_gemm"
    assert {s.args["moe_backend"] for s in flashinfer[1:]} == {"flashinfer_cutlass"}
    assert config_key(judged_against, "k") == config_key(reference[0], "k")
    assert judged_against.label.endswith("[moe_backend=deep_gemm]")
    at_tp2 = engine_configs.moe_reference_spec(_cell("e2e-tp2(flashinfer)"), profile)
    assert at_tp2 is not None and at_tp2.args["tensor_parallel_size"] == 2
    assert engine_configs.moe_reference_spec(_cell("offload-tp1(simple)"), profile) is None


def test_callables_in_arguments_compare_by_what_they_are() -> None:
    def taps(config: object, values: tuple[int, ...]) -> object:
        return config

    one = specs.EngineSpec("a", "m", {"hf_overrides": functools.partial(taps, values=(1, 2))})
    same = specs.EngineSpec("b", "m", {"hf_overrides": functools.partial(taps, values=(1, 2))})
    other = specs.EngineSpec("c", "m", {"hf_overrides": functools.partial(taps, values=(1, 3))})
    assert config_key(one, "k") == config_key(same, "k") != config_key(other, "k")


def test_labels_are_the_same_in_every_process() -> None:
    """The drafted engine's label showed functools.partial's repr, with a memory address: the
    same configuration had another label in each run, so runs could not be compared by it.
    Labels show the canonical form the config keys hash."""
    profile = load_profile(GLM)
    _, drafted = engine_configs.for_cell(_cell("dflash-tp1"), profile)
    assert " at 0x" not in drafted.label
    assert (
        "hf_overrides={'partial': 'glm5_matrix.models.drafters.retarget_taps', 'args': [], "
        "'keywords': {'taps': [-1, 0, 1, 2, 3]}}"
    ) in drafted.label
    mtp = engine_configs.for_cell(_cell("e2e-tp1(deep_gemm)"), profile)[1]
    assert mtp.label.endswith("[speculative_config={'method': 'mtp', 'num_speculative_tokens': 1}]")


def test_warm_prompts_come_from_the_profile() -> None:
    assert engine_configs.warm_prompts(load_profile(GLM), 4352) == [
        (64, 24),
        (512, 24),
        (6528, 24),
        (8704, 24),
        (10880, 24),
    ]
    profile = load_profile(GLM)
    del profile.data["warm"]
    assert engine_configs.warm_prompts(profile, 4352) == [(64, 4)]
    profile.data["warm"] = {"prompt_tokens": [0]}
    with pytest.raises(UserError, match=r"\[warm\]"):
        engine_configs.warm_prompts(profile, 4352)


def test_the_ledger_remembers_across_readers(tmp_path: Path) -> None:
    path = tmp_path / "warm" / "ledger.json"
    first, second = WarmLedger(path), WarmLedger(path)
    assert first.warmed_by("k1") is None
    first.add("k1", "e2e-tp1(deep_gemm) glm:e2e")
    second.add("k1", "dflash-tp1 glm:dflash")  # the first one stays
    assert second.warmed_by("k1") == "e2e-tp1(deep_gemm) glm:e2e"
    assert WarmLedger(path).warmed_by("k2") is None


@pytest.mark.parametrize(("tp", "block"), [("tp1", 4352), ("tp2", 2176)])
def test_the_repeats_references_end_a_chunk_at_the_block(tp: str, block: int) -> None:
    """The engines whose cold reference a prefix-cache repeat is judged against get a chunk
    budget of one planned block (the small-cache engine's prefix scenarios compare with cold
    runs too); the MTP engine and DFlash's keep vLLM's own."""
    profile = load_profile(GLM)
    target, mtp, *small = engine_configs.for_cell(_cell(f"e2e-{tp}(deep_gemm)"), profile)
    assert [s.args["max_num_batched_tokens"] for s in (target, *small)] == [block] * (
        1 + len(small)
    )
    assert "max_num_batched_tokens" not in mtp.args
    assert len(small) == (tp == "tp1")  # the prefix scenarios' small-cache engine: TP1 only


def test_offload_and_noise_chunk_at_the_block_and_dflash_does_not() -> None:
    profile = load_profile(GLM)
    (offload,) = engine_configs.for_cell(_cell("offload-tp1(offloading)"), profile)
    (noise,) = engine_configs.for_cell(_cell("noise-tp1"), profile)
    assert offload.args["max_num_batched_tokens"] == noise.args["max_num_batched_tokens"] == 4352
    for spec in engine_configs.for_cell(_cell("dflash-tp1"), profile):
        assert "max_num_batched_tokens" not in spec.args


def test_a_chunk_budget_needs_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_profile("tiny-hybrid-cpu")
    monkeypatch.setitem(profile.data["prompts"], "prefill_chunk_blocks", 1)
    with pytest.raises(UserError, match="prefill_chunk_blocks needs the layout planner"):
        engine_configs.prefill_chunk_args(_cell("e2e-cpu"), profile)


def _ranks_per_core(cell: CellContext, profile) -> dict[str, int]:
    """How many engine ranks of the pd suite's three servers each core is bound to."""
    per_core: dict[str, int] = {}
    for role in engine_configs.PD_ROLES:
        tp = engine_configs.pd_role_tp(cell, role)
        binding = engine_configs.pd_role_environment(profile, role, cell)
        cores = binding["VLLM_CPU_OMP_THREADS_BIND"].split("|")
        assert len(cores) == tp, f"{cell.id} {role}: {tp} ranks bound to {cores}"
        for core in cores:
            per_core[core] = per_core.get(core, 0) + 1
    return per_core


@pytest.mark.parametrize(
    ("variant", "tps", "per_core"),
    [
        ("pd-nixl-cpu", (1, 1, 1), {"0": 2, "1": 1}),
        ("pd-nixl-cpu-tp1-tp2", (1, 2, 1), {"0": 2, "1": 2}),
        ("pd-nixl-cpu-tp2-tp1", (2, 1, 1), {"0": 2, "1": 2}),
    ],
)
def test_the_refused_prefiller_runs_at_tp1_on_the_less_busy_core(
    variant: str, tps: tuple[int, int, int], per_core: dict[str, int]
) -> None:
    """The negative control's prefiller (other weights, refused by NIXL's compatibility hash
    at any TP) is P's configuration unless the cell says: the TP cells run it at TP1 on the core
    P and D leave less busy, so no core of the 2-core box holds three ranks (P at TP2 beside
    a second TP2 prefiller put three on core 1, and the cell took over 10 minutes)."""
    cell, profile = _cell(variant), load_profile("tiny-hybrid-cpu-tp")
    if variant == "pd-nixl-cpu":
        profile = load_profile("tiny-hybrid-cpu")
    got = tuple(engine_configs.pd_role_tp(cell, r) for r in engine_configs.PD_ROLES)
    assert got == tps
    assert _ranks_per_core(cell, profile) == per_core
    other = engine_configs.pd_role_engine_args(cell, "other")
    prefill = engine_configs.pd_role_engine_args(cell, "prefill")
    if variant == "pd-nixl-cpu":
        assert other == prefill == {}
    else:  # the TP cells name every server's TP, and one block for all
        assert other == {**prefill, "tensor_parallel_size": tps[2]}


def test_an_unknown_pd_role_is_refused() -> None:
    with pytest.raises(UserError, match="PD role 'refused'"):
        engine_configs.pd_role_tp(_cell("pd-nixl-cpu"), "refused")


def test_the_prefix_scenarios_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-hybrid-cpu runs dense retention and the small-cache engine beside the shared one
    (periodic needs the engine's block, so the warm step cannot name it); each is the shared
    engine's arguments with its one change."""
    monkeypatch.setattr(specs, "resolve_model", lambda cell, profile: ("/models/tiny", {}))
    cell, profile = _cell("e2e-cpu"), load_profile("tiny-hybrid-cpu")
    shared, *extra = engine_configs.for_cell(cell, profile)
    dense, small = extra
    assert dense.args == {**shared.args, "prefix_cache_retention_interval": None}
    assert small.args == {
        **shared.args,
        "num_gpu_blocks_override": profile.section("prefix")["eviction"]["kv_blocks"],
        "disable_log_stats": False,
    }
    periodic = engine_configs.retention_spec(cell, profile, 768)
    assert periodic.args["prefix_cache_retention_interval"] == 768
    assert config_key(periodic) != config_key(dense)
    # The TP cells run no prefix scenario; a profile without [prefix] has no eviction engine.
    tp = load_profile("tiny-hybrid-cpu-tp")
    assert engine_configs.e2e_extra_specs(_cell("e2e-cpu-tp2"), tp) == []
    del profile.data["prefix"]
    assert engine_configs.e2e_extra_specs(cell, profile) == []
    with pytest.raises(UserError, match=r"no \[prefix\.eviction\]"):
        engine_configs.eviction_spec(cell, profile)
