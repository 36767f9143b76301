"""The GLM-5.3-Flash config.json: what names one, and where its decoder fields are. The one
reader of it, for the model side (the layout planner, the drafters) and the checkpoint tools
(checkpoints/config.py, whose load_glm_config also checks the file and its layer count).

How strict, and why: `text_config` refuses what is not a GLM-5.3-Flash config and a multimodal
config (model_type glm5_next, or any config with a `text_config` key) whose `text_config` is no
object, because every caller then reads decoder fields that such a config does not have where
it looks; vLLM's Glm5NextForConditionalGeneration reads them from `text_config` too. It does
not check fields: each caller needs different ones, and `required` reads one field, a missing
or mistyped one being one line naming it. What it accepts leniently, because callers rely on
it: a text-only config (the decoder fields at the top level, as a checkpoint of
Glm5NextForCausalLM has them), and a config named by its model_type or its architectures, either
one (load_glm_config asks a checkpoint for both, and that they agree).
"""

from __future__ import annotations

from typing import Any

from glm5_matrix.errors import UserError

# The published architectures and the model_type each one carries.
GLM_MODEL_TYPES = {
    "Glm5NextForConditionalGeneration": "glm5_next",
    "Glm5NextForCausalLM": "glm5_next_text",
}
ARCHITECTURES = tuple(GLM_MODEL_TYPES)
MODEL_TYPES = tuple(GLM_MODEL_TYPES.values())
MULTIMODAL_MODEL_TYPE = "glm5_next"


def text_config(config: Any) -> dict[str, Any]:
    """The dict holding the decoder fields of a GLM-5.3-Flash config: its `text_config`
    (multimodal) or the top level (text-only); the very dict, so that edits land in `config`.
    UserError of one line when `config` is not a GLM-5.3-Flash config or a multimodal one lacks
    its `text_config` object."""
    if not isinstance(config, dict):
        raise UserError("config is not a JSON object")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES and not set(architectures) & set(ARCHITECTURES):
        raise UserError(
            f"not a GLM-5.3-Flash config (model_type {model_type!r}, architectures "
            f"{architectures}; expected {' or '.join(ARCHITECTURES)})"
        )
    if model_type == MULTIMODAL_MODEL_TYPE or "text_config" in config:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UserError("multimodal GLM-5.3-Flash config without a text_config object")
        return text
    return config


def required(fields: dict[str, Any], name: str, kind: type = int) -> Any:
    """`fields[name]`, which must be there and a `kind` (a bool is no int); UserError of one
    line naming the field otherwise."""
    value = fields.get(name)
    if value is None:
        raise UserError(f"config is missing {name}")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UserError(f"config field {name} must be {kind.__name__}, got {value!r}")
    return value
