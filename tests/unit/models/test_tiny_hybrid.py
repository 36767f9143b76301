"""The tiny hybrid model's definition (the parts that need neither torch nor vLLM)."""

from __future__ import annotations

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import Profile, load_profile
from glm5_matrix.models import tiny_hybrid


def _spec(**model_changes: object) -> tiny_hybrid.TinyHybridSpec:
    profile = load_profile(tiny_hybrid.PROFILE)
    model = {**profile.section("model"), **model_changes}
    return tiny_hybrid.TinyHybridSpec.from_profile(
        Profile(profile.name, profile.directory, {**profile.data, "model": model})
    )


def test_folder_name_follows_every_input() -> None:
    base = _spec()
    assert base.folder_name == _spec().folder_name
    assert base.folder_name.startswith(f"{base.name}-")
    assert _spec(seed=base.seed + 1).folder_name != base.folder_name
    assert _spec(init_gain=2.0).folder_name != base.folder_name
    config = dict(base.config, vocab_size=base.config["vocab_size"] * 2)
    assert _spec(config=config).folder_name != base.folder_name


def test_hf_config_counts_layers_from_layer_types() -> None:
    spec = _spec()
    config = spec.hf_config()
    assert config["num_hidden_layers"] == len(config["layer_types"])
    assert config["architectures"] == [spec.architecture]


def test_weight_shapes_cover_each_layer_kind() -> None:
    config = _spec().hf_config()
    shapes = tiny_hybrid.weight_shapes(config)
    for i, kind in enumerate(config["layer_types"]):
        mixer = "linear_attn.in_proj_qkvz" if kind == "linear_attention" else "self_attn.q_proj"
        assert f"model.layers.{i}.{mixer}.weight" in shapes
        experts = [n for n in shapes if n.startswith(f"model.layers.{i}.mlp.experts.")]
        assert len(experts) == 3 * config["num_experts"]
    # The conv state covers q, k and v of the linear attention.
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    assert shapes["model.layers.0.linear_attn.conv1d.weight"][0] == 2 * key + value


def test_bad_profile_data_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="layer_types"):
        _spec(config={"layer_types": ["sliding_window"]})
    with pytest.raises(UserError, match="dtype"):
        _spec(dtype="int8")
    profile = load_profile(tiny_hybrid.PROFILE)
    model = dict(profile.section("model"))
    del model["seed"]
    with pytest.raises(UserError, match="missing 'seed'"):
        tiny_hybrid.TinyHybridSpec.from_profile(
            Profile(profile.name, profile.directory, {**profile.data, "model": model})
        )
