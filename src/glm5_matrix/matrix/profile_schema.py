"""What a profile.toml may hold (PROFILE, a contract read by glm5_matrix.contracts): every table
and key the suites and the harness read, with its type and range. `check_profile` runs when a
profile is loaded (the runner loads it before it builds an environment), so a typo, a wrong type
or a value out of range is one clear line before any engine starts, not a KeyError after
minutes of reference runs on a GPU.

An open table (contracts.open_table) holds keys that belong to someone else (vLLM's engine
arguments, a model config, environment variables): only its being a table is checked there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from glm5_matrix import contracts
from glm5_matrix.contracts import Spec, open_table, table
from glm5_matrix.matrix.tolerances import TOLERANCES

# The tables read into glm5_matrix.matrix.tolerances.Tolerances when a profile is loaded.
TOLERANCE_TABLES = ("tolerances", "pd.tolerances", "dflash.tolerances")
# What a profile's weights may be without a checkpoint (glm5_matrix.matrix.context.Weights).
WEIGHT_KINDS = ("random", "generated", "dummy")
# The prefix-cache retention modes a profile may run (glm5_matrix.verdicts.retention.MODES).
RETENTION_MODES = ("semantic", "dense", "periodic")


def _positive(doc: str, type_name: str = "number") -> Spec:
    return Spec(type_name, doc, above=0)


def _count(doc: str, least: int = 1) -> Spec:
    return Spec("int", doc, minimum=least)


def _needed(doc: str, type_name: str = "number", least: float = 1, above: float = 0) -> Spec:
    """A required key of a scenario table: a count (int, at least `least`) or a size (a number
    above `above`)."""
    if type_name == "int":
        return Spec("int", doc, required=True, minimum=least)
    return Spec(type_name, doc, required=True, above=above)


PROFILE = table(
    {
        "description": Spec("str", "what the profile is"),
        "architecture": Spec("str", "the model family the suites branch on (glm5_next, ...)"),
        "model": table(
            {
                "name": Spec("str", "the generated model's name"),
                "architecture": Spec("str", "the generated model's architecture class"),
                "model_type": Spec("str", "its config's model_type"),
                "dtype": Spec("str", "its weights' dtype"),
                "seed": Spec("int", "the generated weights' seed"),
                "init_gain": _positive("the generated weights' scale"),
                "embedding_std": _positive("the generated embeddings' standard deviation"),
                "config": open_table("the model config (config.json's keys)"),
            },
            "the generated model (tiny profiles)",
        ),
        "layout": table(
            {
                "group_kinds": Spec(
                    "list", "the planner's group kinds (mla, tail, mamba)", items=Spec("str")
                ),
                "group_specs": open_table("KV cache spec class per group kind"),
                "kda_layers": Spec(
                    "list", "the KDA (Mamba-state) layers", items=Spec("int", minimum=0)
                ),
                "dsa_layers": Spec("list", "the DSA/MLA layers", items=Spec("int", minimum=0)),
                "tail_prefix_cacheable": Spec(
                    "bool", "whether the kpool tail ring is prefix-cacheable"
                ),
            },
            "the KV cache layout the layout suite expects",
        ),
        "expect": table(
            {
                "block_size": open_table("the block size per TP (tp1, tp2, ...)"),
                "mamba_spec": Spec("str", "vLLM's KV spec class of the Mamba groups"),
                "mla_spec": Spec("str", "of the MLA group"),
                "tail_spec": Spec("str", "of the kpool tail ring"),
                "attention_spec": Spec("str", "of the attention group"),
                "mamba_groups": _count("the KV cache groups of Mamba state", 0),
                "attention_groups": _count("the KV cache groups of attention", 0),
                "mamba_shares_attention_storage": Spec(
                    "bool", "whether Mamba pages are padded into the attention pages"
                ),
            },
            "what the suites expect of vLLM's KV cache for this model",
            required=True,
        ),
        "metadata": table(
            {
                "kda_prefill_backend": Spec("str", "the KDA prefill kernel the spec is built for"),
                "num_speculative_tokens": _count("MTP draft tokens of the speculative variants"),
                "max_model_len": _count("the model length of the metadata builds"),
            },
            "what the metadata suite expects",
        ),
        "weights": table(
            {
                "checkpoint_variables": Spec(
                    "list", "variables naming a checkpoint directory", items=Spec("str")
                ),
                "default": Spec(
                    "str",
                    "the weights without a checkpoint (dummy where unset)",
                    choices=WEIGHT_KINDS,
                ),
            },
            "which weights the cells use",
            required=True,
        ),
        # vLLM's engine arguments: vLLM itself refuses an unknown one at start
        "engine": open_table("vLLM's engine arguments", required=True),
        "moe_backends": open_table("per MoE backend: its engine arguments"),
        "moe_agreement": table(
            {
                "reference": Spec(
                    "str",
                    "the MoE backend axis value the others are judged against",
                    required=True,
                )
            },
            "test_e2e's test_moe_backends_agree",
        ),
        "prompts": table(
            {
                "long_blocks": Spec(
                    "number",
                    "the long prompt, in blocks (it crosses a block)",
                    required=True,
                    above=1,
                ),
                "checkpoint_blocks": Spec(
                    "number",
                    "the checkpoint prompt, in blocks (it crosses a block boundary)",
                    required=True,
                    above=1,
                ),
                "max_tokens": Spec("int", "tokens generated per request", required=True, minimum=1),
                "seed": Spec("int", "the prompts' seed", required=True),
                "prefill_chunk_blocks": _count("a prefill chunk ends at this many blocks"),
            },
            "the suites' prompts",
            required=True,
        ),
        "warm": table(
            {
                "prompt_tokens": Spec("list", "prompt lengths in tokens", items=_count("")),
                "prompt_blocks": Spec("list", "prompt lengths in blocks", items=_positive("")),
                "max_tokens": _count("greedy tokens per warm request"),
            },
            "what nox -s warm runs to compile the kernels",
        ),
        "tolerances": TOLERANCES,
        "mtp": table({"num_speculative_tokens": _count("its draft tokens")}, "the MTP drafter"),
        "noise": table(
            {
                "prompt_blocks": _positive("its prompt, in blocks"),
                "max_tokens": _count("tokens generated per request"),
                "plant_within": Spec("str", "where the noise suite plants its probe"),
            },
            "the noise suite",
        ),
        "offload": table(
            {
                "cpu_blocks": _count("blocks the CPU store holds"),
                "store_wait_s": _positive("the longest wait for a store (seconds)"),
            },
            "the offload suite",
        ),
        "pd": table(
            {
                "kv_buffer_device": Spec("str", "NIXL's KV buffer: cuda or cpu"),
                "engine": open_table("both servers' engine arguments over [engine]"),
                "environment": open_table("both servers' environment"),
                "prefill_environment": open_table("P's environment"),
                "decode_environment": open_table("D's environment"),
                "other_environment": open_table("the other-weights prefiller's environment"),
                "prompt_whole_blocks": _positive(
                    "the judged prompt: N-1 tokens on a block boundary"
                ),
                "unaligned_prompt_blocks": _positive("the mid-block prompt, in blocks"),
                "max_tokens": _count("tokens generated per request"),
                "kv_groups": _count("the KV groups a transfer carries"),
                "startup_timeout_s": _positive("the longest wait for a server to start (seconds)"),
                "request_timeout_s": _positive("the longest wait for one request (seconds)"),
                "connect_attempts": _count("tries of a first handshake that timed out"),
                "connect_retry_reproduction": Spec(
                    "str",
                    "upstream/NAME: the defect the retry works around",
                    pattern=r"upstream/[a-z0-9-]+",
                    pattern_says="upstream/NAME (a folder of upstream/)",
                ),
                "tolerances": TOLERANCES,
            },
            "prefill/decode disaggregation over NIXL",
        ),
        "prefix": table(
            {
                "retention_modes": Spec(
                    "list",
                    "the prefix_cache_retention_interval modes test_prefix_cache_retention runs, "
                    "one engine each (the shared engine for vLLM's default, semantic)",
                    required=True,
                    items=Spec("str", choices=RETENTION_MODES),
                    unique=True,
                ),
                "periodic_blocks": Spec(
                    "int", "the periodic mode's interval, in blocks of the engine", minimum=2
                ),
                "follow_up": table(
                    {
                        "prompt_blocks": _needed("request 1's prompt, in blocks", above=1),
                        "output_tokens": _needed("request 1's greedy answer (tokens)", "int"),
                        "new_tokens": _needed("the new message request 2 adds (tokens)", "int"),
                    },
                    "the follow-up turn: request 2 = request 1's prompt + its answer + new tokens",
                ),
                "shared": table(
                    {
                        "prefix_blocks": _needed("the system prefix, in blocks", above=1),
                        "tail_blocks": _needed("each prompt's own tail, in blocks"),
                        "requests": _needed("the prompts sent at once under load", "int", 2),
                    },
                    "prompts sharing a system prefix (the junction; the load)",
                ),
                "eviction": table(
                    {
                        "kv_blocks": _needed("the small engine's KV cache, in blocks", "int", 2),
                        "first_blocks": _needed("the request whose blocks get evicted", above=1),
                        "prompt_blocks": _needed("each prompt of the load, in blocks", above=1),
                        "output_tokens": _needed("each load request's greedy tokens", "int"),
                        "requests": _needed("the prompts sent at once", "int", 2),
                    },
                    "the small-cache engine that must evict cached blocks and preempt a request",
                ),
            },
            "test_e2e's prefix-caching scenarios (docs/prefix-caching.md)",
        ),
        "dflash": table(
            {
                "num_speculative_tokens": _count("its draft tokens"),
                "target_layer_ids": Spec(
                    "list",
                    "the target layers it taps (-1: the embeddings)",
                    items=Spec("int", minimum=-1),
                ),
                "config": open_table("the drafter's config"),
                "tolerances": TOLERANCES,
            },
            "the DFlash drafter",
        ),
    },
    "profiles/NAME/profile.toml: what a cell runs on",
)


def problems(data: Mapping[str, Any]) -> list[str]:
    """Every way `data` (a parsed profile.toml, its base merged in) departs from PROFILE, one
    line each (`tolerances.min_powr: unknown key; did you mean 'min_power'?`)."""
    return [f"{p.where}: {p.text}" for p in contracts.problems(data, PROFILE)]


def check_profile(path: Any, data: Mapping[str, Any]) -> None:
    """One UserError naming the file and every problem in it, a line each; nothing when it is
    well formed."""
    contracts.raise_for(path, contracts.problems(data, PROFILE))
