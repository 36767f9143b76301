"""glm5_matrix.models.glm_config, the one reader of the GLM-5.3-Flash config (the layout planner,
the drafters and the checkpoint tools use it): what it refuses in one line, and the lenient
cases its callers rely on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from glm5_matrix.checkpoints.config import load_glm_config, mtp_count, pruned_config
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import load_profile
from glm5_matrix.models import drafters
from glm5_matrix.models.glm_config import required, text_config


@pytest.fixture
def config() -> dict[str, Any]:
    """The bundled GLM-5.3-Flash-4L config: multimodal, the decoder fields in text_config."""
    return load_profile("glm-5.3-flash-4l").config()


def _text_only(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        copy.deepcopy(config["text_config"]),
        architectures=["Glm5NextForCausalLM"],
        model_type="glm5_next_text",
    )


# --- strict: one line, before any field is read ---------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [1, 2], "config is not a JSON object"),
        (
            lambda c: {**c, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            r"not a GLM-5\.3-Flash config \(model_type 'llama'",
        ),
        (
            lambda c: {k: v for k, v in c.items() if k != "text_config"},
            "multimodal GLM-5.3-Flash config without a text_config object",
        ),
        # A text_config that is no object, even on a text-only config: the reader that
        # checkpoints/ had fell back to the top level here and read fields that are not there.
        (
            lambda c: {**_text_only(c), "text_config": None},
            "multimodal GLM-5.3-Flash config without a text_config object",
        ),
    ],
)
def test_what_is_not_a_glm_config_is_one_line(config, edit, message) -> None:
    with pytest.raises(UserError, match=message) as raised:
        text_config(edit(config))
    assert "\n" not in str(raised.value)


def test_a_missing_or_mistyped_field_is_one_line_naming_it(config) -> None:
    text = text_config(config)
    with pytest.raises(UserError, match=r"^config is missing hidden_sizes$"):
        required(text, "hidden_sizes")
    with pytest.raises(UserError, match=r"^config field layer_types must be int, got"):
        required(text, "layer_types")
    text["num_hidden_layers"] = True  # TOML/JSON true is no count
    with pytest.raises(UserError, match=r"^config field num_hidden_layers must be int, got True$"):
        required(text, "num_hidden_layers")


def test_the_drafter_names_a_missing_target_field(config) -> None:
    """synthesize_config read config["hidden_size"] (a KeyError); now one line naming it."""
    del config["text_config"]["hidden_size"]
    table = drafters.dflash_table(load_profile("glm-5.3-flash-4l"))
    with pytest.raises(UserError, match=r"^config is missing hidden_size$"):
        drafters.synthesize_config(config, table)


def test_a_checkpoint_without_its_text_config_is_one_line_naming_the_file(
    config, tmp_path: Path
) -> None:
    del config["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as raised:
        load_glm_config(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / 'config.json'}: multimodal GLM-5.3-Flash config without a text_config object"
    )


# --- lenient: what the callers rely on ------------------------------------------------------


def test_multimodal_gives_the_nested_dict_itself(config) -> None:
    """pruned_config edits the decoder fields in place through it."""
    assert text_config(config) is config["text_config"]
    pruned, _ = pruned_config(config, 2)
    assert pruned["text_config"]["num_hidden_layers"] == 2
    assert config["text_config"]["num_hidden_layers"] == 4  # the input is not modified


def test_text_only_gives_the_top_level(config) -> None:
    text = _text_only(config)
    assert text_config(text) is text
    pruned, _ = pruned_config(text, 2)
    assert pruned["num_hidden_layers"] == 2 and "text_config" not in pruned


@pytest.mark.parametrize("drop", ["architectures", "model_type"])
def test_either_the_architecture_or_the_model_type_names_it(config, drop) -> None:
    text = _text_only(config)
    del text[drop]
    assert text_config(text) is text
    multimodal = {k: v for k, v in config.items() if k != drop}
    assert text_config(multimodal) is config["text_config"]


def test_fields_are_the_callers_to_check(config) -> None:
    """The reader checks no field: a config without the MTP count has none (mtp_count 0)."""
    text = _text_only(config)
    text.pop("num_nextn_predict_layers", None)
    assert mtp_count(text) == 0
    assert (
        required(text_config(config), "layer_types", list) == config["text_config"]["layer_types"]
    )
