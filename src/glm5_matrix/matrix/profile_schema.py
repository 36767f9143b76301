"""What a profile.toml may hold: every table and key the suites and the harness read, with its
type. `check_profile` runs when a profile is loaded (the runner loads it before it builds an
environment), so a typo or a wrong type is one clear line before any engine starts, not a
KeyError after minutes of reference runs on a GPU.

A table given as a dict lists its keys; `OPEN` marks a table whose keys belong to someone else
(vLLM's engine arguments, a model config, environment variables): only its being a table is
checked there. Types: "str", "int", "number" (int or float), "bool", "list", "table".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from glm5_matrix.errors import UserError

OPEN = "table"

TOLERANCES: dict[str, Any] = {
    "min_distinct_tokens": "int",
    "min_median_margin_steps": "number",
    "reference_repeats": "int",
    "min_power": "number",
    "control_changed_blocks": "number",
    "checkpoint_page_rel": "number",
    # The false-red budget (glm5_matrix.verdicts.false_red.Budget, docs/verdicts.md).
    "false_red_per_cell": "number",
    "comparisons_per_cell": "int",
    "compared_runs": "int",
}
TOLERANCES_REQUIRED = (
    "min_distinct_tokens",
    "min_median_margin_steps",
    "min_power",
    "reference_repeats",
    "false_red_per_cell",
    "comparisons_per_cell",
)

SCHEMA: dict[str, Any] = {
    "description": "str",
    "architecture": "str",
    "model": {
        "name": "str",
        "architecture": "str",
        "model_type": "str",
        "dtype": "str",
        "seed": "int",
        "init_gain": "number",
        "embedding_std": "number",
        "config": OPEN,
    },
    "layout": {
        "group_kinds": "list",
        "group_specs": OPEN,
        "kda_layers": "list",
        "dsa_layers": "list",
        "tail_prefix_cacheable": "bool",
    },
    "expect": {
        "block_size": OPEN,
        "mamba_spec": "str",
        "mla_spec": "str",
        "tail_spec": "str",
        "attention_spec": "str",
        "mamba_groups": "int",
        "attention_groups": "int",
        "mamba_shares_attention_storage": "bool",
    },
    "metadata": {
        "kda_prefill_backend": "str",
        "num_speculative_tokens": "int",
        "max_model_len": "int",
    },
    "weights": {"checkpoint_variables": "list", "default": "str"},
    "engine": OPEN,  # vLLM's engine arguments: vLLM itself refuses an unknown one at start
    "moe_backends": OPEN,
    "prompts": {
        "long_blocks": "number",
        "checkpoint_blocks": "number",
        "max_tokens": "int",
        "seed": "int",
        "prefill_chunk_blocks": "int",
    },
    "warm": {"prompt_tokens": "list", "prompt_blocks": "list", "max_tokens": "int"},
    "tolerances": TOLERANCES,
    "mtp": {"num_speculative_tokens": "int"},
    "noise": {"prompt_blocks": "number", "max_tokens": "int", "plant_within": "str"},
    "offload": {"cpu_blocks": "int", "store_wait_s": "number"},
    "pd": {
        "kv_buffer_device": "str",
        "engine": OPEN,
        "environment": OPEN,
        "prefill_environment": OPEN,
        "decode_environment": OPEN,
        "other_environment": OPEN,
        "prompt_whole_blocks": "number",
        "unaligned_prompt_blocks": "number",
        "max_tokens": "int",
        "kv_groups": "int",
        "startup_timeout_s": "number",
        "request_timeout_s": "number",
        "connect_attempts": "int",
        "connect_retry_reproduction": "str",  # upstream/NAME: the defect the retry works around
        "tolerances": TOLERANCES,
    },
    "dflash": {
        "num_speculative_tokens": "int",
        "target_layer_ids": "list",
        "config": OPEN,
        "tolerances": TOLERANCES,
    },
}

# Tables every profile has (the suites' common ground), and keys a present table must hold.
REQUIRED_TABLES = ("engine", "expect", "prompts", "tolerances", "weights")
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "prompts": ("long_blocks", "checkpoint_blocks", "max_tokens", "seed"),
    "tolerances": TOLERANCES_REQUIRED,
    "pd.tolerances": TOLERANCES_REQUIRED,
    "dflash.tolerances": TOLERANCES_REQUIRED,
}

_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "number": (int, float),
    "bool": (bool,),
    "list": (list,),
    "table": (dict,),
}


def problems(data: Mapping[str, Any]) -> list[str]:
    """Every way `data` (a parsed profile.toml) departs from SCHEMA, one line each."""
    found: list[str] = []
    _walk(data, SCHEMA, "", found)
    found += [f"[{name}] is missing" for name in REQUIRED_TABLES if name not in data]
    for table, keys in REQUIRED_KEYS.items():
        value = _lookup(data, table)
        if isinstance(value, dict):
            found += [f"[{table}] lacks {key!r}" for key in keys if key not in value]
    return found


def check_profile(path: Any, data: Mapping[str, Any]) -> None:
    """One UserError naming the file and every problem in it; nothing when it is well formed."""
    found = problems(data)
    if found:
        raise UserError(f"{path}: " + "; ".join(found))


def _walk(data: Mapping[str, Any], schema: Mapping[str, Any], where: str, found: list[str]) -> None:
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in schema:
            known = ", ".join(sorted(schema))
            found.append(f"unknown key {name!r} (known here: {known})")
            continue
        expected = schema[key]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                found.append(f"{name} must be a table, not {type(value).__name__}")
            else:
                _walk(value, expected, name, found)
        elif not _is(value, expected):
            found.append(f"{name} must be {expected}, not {type(value).__name__} ({value!r})")


def _is(value: Any, expected: str) -> bool:
    if isinstance(value, bool) and expected != "bool":
        return False  # TOML's true is no number
    return isinstance(value, _TYPES[expected])


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value
