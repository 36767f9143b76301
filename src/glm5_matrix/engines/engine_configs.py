"""The engine configurations the suites start, in one place.

Each suite builds its engines (or API servers) with these functions, and the warm step
(tests/suites/test_warm.py, `nox -s warm`) enumerates the same ones per cell (for_cell), so what
the warm-up compiles is what the cells will start. Two cells whose configurations are equal
(model, engine arguments, environment and kernel cache: config_key, the label aside) are warmed
once per warm run (WarmLedger). warm_prompts() reads the profile's [warm] table: the request
shapes the warm-up sends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.engines.specs import EngineSpec, canonical, engine_spec
from glm5_matrix.errors import UserError
from glm5_matrix.files import write_json_atomic
from glm5_matrix.kernels import kernel_cache
from glm5_matrix.matrix.context import LEDGER_VARIABLE, CellContext
from glm5_matrix.matrix.profiles import Profile

SERVED_MODEL = "pd-model"  # one name on every PD server, so requests read the same on P and D
OFFLOAD_CONNECTORS = {"simple": "SimpleCPUOffloadConnector", "offloading": "OffloadingConnector"}
PD_CONNECTORS = {"nixl": "NixlConnector"}
PD_WORKER_EXTENSION = "glm5_matrix.engines.workers.PageReader"


@dataclass(frozen=True)
class ServerSpec:
    """An API server of the pd suite: model, api_server flags after --model, environment."""

    label: str
    model: str
    args: tuple[str, ...]
    environment: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0


Config = EngineSpec | ServerSpec


# --- e2e ------------------------------------------------------------------------------------------


def mtp_speculative_config(profile: Profile) -> dict[str, Any] | None:
    mtp = profile.section("mtp")
    if not mtp:
        return None
    return {"method": "mtp", "num_speculative_tokens": int(mtp["num_speculative_tokens"])}


def prefill_chunk_args(cell: CellContext, profile: Profile) -> dict[str, Any]:
    """`max_num_batched_tokens` of [prompts] prefill_chunk_blocks blocks, where the profile asks
    for it: the engines whose cold reference is compared with a prefix-cache repeat (test_e2e's
    shared engine, test_offload's, and test_noise_source's plain one, which is e2e's), so that
    the cold prefill ends a chunk at the first block boundary and its second chunk has the
    repeat's shapes (glm5_matrix.verdicts.chunks, which the suites check on the chunks the
    worker computed). vLLM's align-mode scheduler ends a chunk at the last cacheable boundary by
    itself unless the Mamba backend saves the checkpoint inside the chunk (GLM-5.3-Flash's
    flashkda KDA does: the whole prompt then runs in one pass); a chunk budget of one block
    makes it end there (v1/core/sched/scheduler.py _mamba_block_aligned_split, 0.32 and 0.33).
    The block is the layout planner's for the cell's TP (no speculative tokens, bf16 KV), which
    test_kv_layout checks against the engine's. A side effect: the in-chunk checkpoint store
    (store_cache_checkpoints_kernel) no longer runs, so compiled mode under the guard no longer
    meets upstream/jit-monitor-checkpoint-store (H200, 2026-12-03)."""
    blocks = profile.section("prompts").get("prefill_chunk_blocks")
    if blocks is None:
        return {}
    if "layout" not in profile.data:
        raise UserError(
            f"profile {profile.name}: [prompts] prefill_chunk_blocks needs the layout planner's "
            "[layout] table to know the block size before the engine starts"
        )
    from glm5_matrix.models.layout import plan_layout

    plan = plan_layout(profile.config(), tp=cell.tp or 1)
    return {"max_num_batched_tokens": int(blocks) * plan.block_size}


def e2e_specs(cell: CellContext, profile: Profile) -> list[EngineSpec]:
    """The shared engine of test_e2e (its prefill chunked at the block where the profile asks:
    prefill_chunk_args), then its MTP engine where the profile has a drafter."""
    specs = [engine_spec(cell, profile, **prefill_chunk_args(cell, profile))]
    speculative = mtp_speculative_config(profile)
    if speculative is not None:
        specs.append(engine_spec(cell, profile, speculative_config=speculative))
    return specs


def moe_reference_spec(cell: CellContext, profile: Profile) -> EngineSpec | None:
    """test_e2e's shared engine with the profile's reference MoE backend ([moe_agreement]
    reference, a value of the cell's moe_backend axis): what the cells of the axis's other values
    are judged against (test_moe_backends_agree). None for a cell without the axis or of the
    reference backend itself."""
    asked = cell.setting("moe_backend")
    reference = profile.section("moe_agreement").get("reference")
    if asked is None or reference is None or asked == reference:
        return None
    other = dataclasses.replace(cell, settings={**cell.settings, "moe_backend": reference})
    spec = engine_spec(other, profile, **prefill_chunk_args(other, profile))
    return dataclasses.replace(spec, label=f"{spec.label}[moe_backend={reference}]")


# The TP sizes test_e2e's prefix scenarios run at: they judge the scheduler's retention and the
# state one rank starts from (the harness reads rank 0), which TP does not change; the TP cells
# judge the split itself (layout, checkpoint pages per rank, greedy tokens against TP1).
PREFIX_SCENARIOS_TP = (1,)


def prefix_table(profile: Profile) -> dict[str, Any]:
    """The profile's [prefix] table (test_e2e's prefix-caching scenarios); {} without one."""
    return dict(profile.section("prefix") or {})


def retention_spec(cell: CellContext, profile: Profile, interval: int | None) -> EngineSpec:
    """test_e2e's engine in another prefix-cache retention mode: the shared engine's arguments
    with vLLM's prefix_cache_retention_interval (None dense, 0 semantic, > 0 periodic)."""
    return engine_spec(
        cell,
        profile,
        prefix_cache_retention_interval=interval,
        **prefill_chunk_args(cell, profile),
    )


def eviction_spec(cell: CellContext, profile: Profile) -> EngineSpec:
    """test_e2e's engine for eviction and preemption: the shared engine's arguments with a KV
    cache of [prefix.eviction] kv_blocks blocks (vLLM's num_gpu_blocks_override, "used for
    testing preemption"), and vLLM's stats on, so that its own preemption counter is recorded
    beside what the harness sees."""
    table = prefix_table(profile).get("eviction")
    if not table:
        raise UserError(f"profile {profile.name} has no [prefix.eviction] table")
    return engine_spec(
        cell,
        profile,
        num_gpu_blocks_override=int(table["kv_blocks"]),
        disable_log_stats=False,
        **prefill_chunk_args(cell, profile),
    )


def e2e_extra_specs(cell: CellContext, profile: Profile) -> list[EngineSpec]:
    """The engines test_e2e starts beside the shared one where the profile's [prefix] asks for
    them: dense retention, and the small-cache engine; none at TP > 1, where the prefix
    scenarios do not run (PREFIX_SCENARIOS_TP). The periodic mode's engine is left out: its
    interval is a number of blocks of the engine's own block size, known once an engine runs."""
    table = prefix_table(profile)
    if (cell.tp or 1) not in PREFIX_SCENARIOS_TP:
        return []
    specs = []
    if "dense" in table.get("retention_modes", []):
        specs.append(retention_spec(cell, profile, None))
    if table.get("eviction"):
        specs.append(eviction_spec(cell, profile))
    return specs


# --- offload --------------------------------------------------------------------------------------


def offload_spec(cell: CellContext, profile: Profile, cpu_bytes: int) -> EngineSpec:
    """test_offload's engine: the cell's connector with `cpu_bytes` of CPU room."""
    connector = cell.setting("kv_connector")
    if connector not in OFFLOAD_CONNECTORS:
        raise UserError(
            f"cell {cell.id}: kv_connector {connector!r} is not one of {list(OFFLOAD_CONNECTORS)}"
        )
    transfer = {
        "kv_connector": OFFLOAD_CONNECTORS[connector],
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
    return engine_spec(
        cell, profile, kv_transfer_config=transfer, **prefill_chunk_args(cell, profile)
    )


def offload_cpu_bytes(cell: CellContext, profile: Profile) -> int:
    from glm5_matrix.models.layout import plan_layout

    plan = plan_layout(profile.config(), tp=cell.tp or 1)
    return plan.offload_bytes(int(profile.section("offload")["cpu_blocks"]))


# --- dflash ---------------------------------------------------------------------------------------


def dflash_drafted_spec(cell: CellContext, profile: Profile, drafter: Any) -> EngineSpec:
    """test_dflash's engine with the drafter (a glm5_matrix.models.drafters.Drafter); its target-only
    engine is the plain engine_spec(cell, profile)."""
    return engine_spec(
        cell,
        profile,
        speculative_config=drafter.speculative_config(),
        hf_overrides=drafter.hf_overrides(),
        disable_log_stats=False,  # the spec-decode counters
    )


# --- noise ----------------------------------------------------------------------------------------


def noise_specs(cell: CellContext, profile: Profile) -> list[EngineSpec]:
    """test_noise_source's engines: the plain one (equal to test_e2e's shared engine), then the
    same in vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1), which the suite starts only
    where every attention backend of the model declares support for it."""
    plain = engine_spec(cell, profile, **prefill_chunk_args(cell, profile))
    invariant = dataclasses.replace(
        plain,
        label=f"{plain.label}[VLLM_BATCH_INVARIANT=1]",
        environment={**plain.environment, "VLLM_BATCH_INVARIANT": "1"},
    )
    return [plain, invariant]


# --- pd -------------------------------------------------------------------------------------------


PD_SHUTDOWN_TIMEOUT_S = 10


def pd_table(profile: Profile) -> dict[str, Any]:
    table = profile.section("pd")
    if not table:
        raise UserError(f"profile {profile.name} has no [pd] table, which the pd suite needs")
    return table


# "other": the negative control's prefiller (a model with other weights, which D must refuse).
# It is a prefiller like P unless the cell gives it its own `other_tp` / `other_environment`:
# the refusal is NIXL's compatibility hash, at any TP, so a TP cell on a 2-core box runs it at
# TP1 on the core its P and D leave less busy, not as a second set of P's ranks.
PD_ROLES = ("prefill", "decode", "other")


def _settings_of(role: str, cell: CellContext | None = None) -> tuple[str, ...]:
    """Whose settings a PD server in `role` takes, the first that has one winning: its own,
    and for the other prefiller P's after them."""
    if role not in PD_ROLES:
        where = f"cell {cell.id}: " if cell is not None else ""
        raise UserError(f"{where}PD role {role!r} is not one of {list(PD_ROLES)}")
    return (role, "prefill") if role == "other" else (role,)


def _role_setting(cell: CellContext, role: str, name: str) -> Any:
    """The `{role}_{name}` setting of the first of _settings_of(role) that has one, else None."""
    return next(
        (v for r in _settings_of(role, cell) if (v := cell.setting(f"{r}_{name}")) is not None),
        None,
    )


def pd_role_tp(cell: CellContext, role: str) -> int:
    """The tensor-parallel size of a PD server in `role`: the cell's `prefill_tp` / `decode_tp`
    / `other_tp` setting (P and D at other TP sizes, issue 36), else P's for the other
    prefiller, else the cell's tp."""
    tp = _role_setting(cell, role, "tp")
    return int(tp if tp is not None else cell.tp or 1)


def pd_role_engine_args(cell: CellContext, role: str) -> dict[str, Any]:
    """What a PD server in `role` sets beyond the shared arguments: its TP size where the cell
    gives P and D their own, and the cell's `block_size` (one block for both sides: vLLM's NIXL
    handshake needs the local block to be a multiple of the remote one, and the hybrid
    aligner's automatic block depends on TP)."""
    args: dict[str, Any] = {}
    if _role_setting(cell, role, "tp") is not None:
        args["tensor_parallel_size"] = pd_role_tp(cell, role)
    if cell.setting("block_size") is not None:
        args["block_size"] = int(cell.setting("block_size"))
    return args


def pd_server_args(
    cell: CellContext, profile: Profile, role: str = "prefill"
) -> tuple[str, list[str], dict[str, str]]:
    """Model, api_server flags and environment of a server of the pd suite in `role` (the same
    for both roles unless the cell gives them their own TP sizes)."""
    from glm5_matrix.engines.servers import engine_cli_args

    pd = pd_table(profile)
    connector = cell.setting("kv_connector", "nixl")
    if connector not in PD_CONNECTORS:
        raise UserError(
            f"cell {cell.id}: kv_connector {connector!r} is not one of {list(PD_CONNECTORS)}"
        )
    # [pd].engine: what differs from the profile's [engine] when three servers share the GPUs.
    spec = engine_spec(
        cell,
        profile,
        enable_prefix_caching=True,
        **pd.get("engine", {}),
        **pd_role_engine_args(cell, role),
    )
    kv_config = {
        "kv_connector": PD_CONNECTORS[connector],
        "kv_role": "kv_both",
        "kv_buffer_device": pd["kv_buffer_device"],
        # Explicit, although vLLM's default: a failed load must fail the request, never be
        # recomputed silently (the negative control depends on it).
        "kv_load_failure_policy": "fail",
    }
    args = [
        *engine_cli_args(spec.args),
        "--served-model-name",
        SERVED_MODEL,
        "--kv-transfer-config",
        json.dumps(kv_config),
        # The suite reads P's and D's KV pages by name through the dev-mode /collective_rpc
        # endpoint (a transfer is checked byte for byte); a test process only.
        "--worker-extension-cls",
        PD_WORKER_EXTENSION,
        # A stop ends the engine cores in order (vLLM's default 0 SIGKILLs them at once: "force
        # killing remaining process EngineCore"), so their coverage data is written and the
        # cell's executed list holds what they ran; below the server's stop grace (STOP_GRACE_S).
        "--shutdown-timeout",
        str(PD_SHUTDOWN_TIMEOUT_S),
    ]
    return spec.model, args, {**spec.environment, "VLLM_SERVER_DEV_MODE": "1"}


def pd_role_environment(
    profile: Profile, role: str, cell: CellContext | None = None
) -> dict[str, str]:
    """The environment of a PD server in `role` (one of PD_ROLES) beside the shared one: the
    profile's [pd] tables, then the cell's `{role}_environment` setting (a D at TP2 binds one
    core per rank); the other prefiller takes P's first, then its own."""
    pd = pd_table(profile)
    table = dict(pd.get("environment", {}))
    for r in reversed(_settings_of(role, cell)):  # P's tables first, then the other's own
        table.update(pd.get(f"{r}_environment", {}))
        table.update(cell.setting(f"{r}_environment", {}) if cell is not None else {})
    return {str(k): str(v) for k, v in table.items()}


def pd_warm_server(cell: CellContext, profile: Profile) -> ServerSpec:
    """The server configuration of the pd suite (P, D and the negative control's prefiller run
    the same kernels), on the prefill server's GPU."""
    model, args, env = pd_server_args(cell, profile, "prefill")
    return ServerSpec(
        label=f"warm-{cell.slug}",
        model=model,
        args=tuple(args),
        environment={**env, **pd_role_environment(profile, "prefill", cell)},
        startup_timeout_s=float(pd_table(profile)["startup_timeout_s"]),
    )


# --- what a cell starts ---------------------------------------------------------------------------


def for_cell(cell: CellContext, profile: Profile) -> list[Config]:
    """Every engine (or server) configuration the cell's suite starts, in its order."""
    if cell.suite == "e2e":
        reference = moe_reference_spec(cell, profile)  # test_moe_backends_agree, first
        return [
            *([reference] if reference else []),
            *e2e_specs(cell, profile),
            *e2e_extra_specs(cell, profile),
        ]
    if cell.suite == "offload":
        return [offload_spec(cell, profile, offload_cpu_bytes(cell, profile))]
    if cell.suite == "dflash":
        from glm5_matrix.cache import models_dir
        from glm5_matrix.models.drafters import resolve_drafter

        drafter = resolve_drafter(profile, models_dir())
        return [engine_spec(cell, profile), dflash_drafted_spec(cell, profile, drafter)]
    if cell.suite == "pd":
        return [pd_warm_server(cell, profile)]
    if cell.suite == "noise":
        # The batch-invariant engine is left out: vLLM 0.33 refuses the mode for this model (its
        # GDN and sparse-MLA backends declare no support), so the suite never starts it.
        return [noise_specs(cell, profile)[0]]
    raise UserError(f"cell {cell.id}: suite {cell.suite!r} starts no engine, nothing to warm")


def config_key(config: Config, kernel_dir: str | None = None) -> str:
    """A digest equal for configurations that compile the same kernels into the same kernel
    cache: kind, model, arguments and environment, the label aside."""
    kind = "server" if isinstance(config, ServerSpec) else "engine"
    data = {
        "kind": kind,
        "model": config.model,
        "args": canonical(config.args),
        "environment": canonical(config.environment),
        "kernel_cache": kernel_dir or os.environ.get(kernel_cache.ACTIVE_VARIABLE, ""),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def warm_prompts(profile: Profile, block_size: int) -> list[tuple[int, int]]:
    """(prompt tokens, max tokens) of the warm-up's requests, from the profile's [warm] table:
    prompt_tokens (lengths in tokens) and prompt_blocks (in blocks of the engine's block size),
    each with max_tokens. Without the table: one 64-token request of 4 tokens."""
    table = profile.section("warm")
    if not table:
        return [(64, 4)]
    max_tokens = int(table.get("max_tokens", 4))
    lengths = [int(t) for t in table.get("prompt_tokens", [])]
    lengths += [round(float(b) * block_size) for b in table.get("prompt_blocks", [])]
    if not lengths or min(lengths) < 1:
        raise UserError(f"profile {profile.name} [warm]: no prompt lengths, or one below 1")
    return [(length, max_tokens) for length in lengths]


class WarmLedger:
    """Which configurations this warm run warmed already (a JSON file, locked while it is read
    and written, so cells warmed at once share it): {config key: "cell id / label"}."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_environment(cls) -> WarmLedger | None:
        path = os.environ.get(LEDGER_VARIABLE)
        return cls(Path(path)) if path else None

    @contextlib.contextmanager
    def _entries(self) -> Iterator[dict[str, str]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = json.loads(self.path.read_text()) if self.path.is_file() else {}
            before = dict(entries)
            yield entries
            if entries != before:
                write_json_atomic(self.path, entries)

    def warmed_by(self, key: str) -> str | None:
        with self._entries() as entries:
            return entries.get(key)

    def add(self, key: str, by: str) -> None:
        with self._entries() as entries:
            entries.setdefault(key, by)
