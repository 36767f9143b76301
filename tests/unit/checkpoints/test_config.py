"""glm5_matrix.checkpoints.config: a GLM-5.3-Flash config is recognised in both layouts (multimodal
and text-only) and others are refused; a pruned config cuts one-based layer lists as one-based."""

from __future__ import annotations

import json

import pytest
import synthetic_checkpoint as synthetic

from glm5_matrix import checkpoints
from glm5_matrix.errors import UserError


def test_load_glm_config_accepts_both_layouts_and_rejects_others(full_checkpoint, tmp_path):
    config = checkpoints.load_glm_config(full_checkpoint)
    assert config["architectures"][0] in {"Glm5NextForConditionalGeneration", "Glm5NextForCausalLM"}
    with pytest.raises(UserError, match="checkpoint directory not found"):
        checkpoints.load_glm_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(UserError, match=r"not a GLM-5\.3-Flash config"):
        checkpoints.load_glm_config(tmp_path)
    mixed = {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next"}
    (tmp_path / "config.json").write_text(json.dumps(mixed))
    with pytest.raises(UserError, match=r"not a GLM-5\.3-Flash config"):
        checkpoints.load_glm_config(tmp_path)


def test_one_based_linear_attention_lists_are_cut_as_one_based():
    config = synthetic.full_config()
    lac = config["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [i + 1 for i in lac["kda_layers"]]
    lac["full_attn_layers"] = [i + 1 for i in lac["full_attn_layers"]]
    pruned, _ = checkpoints.pruned_config(config, 4)
    assert pruned["text_config"]["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert pruned["text_config"]["linear_attn_config"]["full_attn_layers"] == [4]
    assert config["text_config"]["num_hidden_layers"] == 45  # the input is not modified
