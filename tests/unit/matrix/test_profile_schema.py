"""Profiles are checked when loaded: an unknown key, a wrong type or a missing table is one line
naming the file, before any environment is built or engine started."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.matrix import profile_schema
from glm5_matrix.matrix.profiles import load_profile, profile_names, profiles_dir


def _data(name: str) -> dict:
    return tomllib.loads((profiles_dir() / name / "profile.toml").read_text())


@pytest.mark.parametrize("name", profile_names())
def test_every_bundled_profile_is_well_formed(name: str) -> None:
    # as loaded: a profile that extends another is checked with its base's tables under it
    # (its own keys among them, so a typo in it is still named)
    assert profile_schema.problems(load_profile(name).data) == []


def test_a_typo_is_named_with_the_keys_known_there() -> None:
    data = _data("glm-5.3-flash-4l")
    data["tolerances"]["min_powr"] = 2.0
    assert profile_schema.problems(data) == [
        "tolerances.min_powr: unknown key; did you mean 'min_power'?"
    ]
    data["tolerances"]["colour"] = 1  # near to nothing: the keys known there are listed
    assert profile_schema.problems(data)[1] == (
        "tolerances.colour: unknown key (known: checkpoint_page_rel, compared_runs, "
        "comparisons_per_cell, control_changed_blocks, false_red_per_cell, "
        "min_distinct_tokens, min_median_margin_steps, min_power, reference_repeats)"
    )


def test_wrong_types_missing_tables_and_keys_are_each_a_line() -> None:
    data = copy.deepcopy(_data("tiny-hybrid-cpu"))
    data["prompts"]["max_tokens"] = "24"  # a string where an int is read
    data["tolerances"]["min_power"] = True  # TOML's true is no number
    data["pd"]["tolerances"].pop("reference_repeats")
    data["noise"] = 3
    del data["weights"]
    data["pd"]["request_timeout_s"] = 0
    data["weights"] = {"default": "randm"}
    assert profile_schema.problems(data) == [
        "prompts.max_tokens: must be an integer, not a string ('24')",
        "tolerances.min_power: must be a number, not a boolean (true)",
        "noise: must be a table, not an integer (3)",
        "pd.request_timeout_s: must be > 0, not 0",
        "pd.tolerances.reference_repeats: missing (required)",
        "weights.default: 'randm' is not one of random, generated, dummy; did you mean 'random'?",
    ]
    del data["weights"]
    assert "weights: missing (a required table)" in profile_schema.problems(data)


def test_open_tables_take_any_key() -> None:
    data = _data("glm-5.3-flash-4l")
    data["engine"]["some_future_vllm_argument"] = 1
    data["dflash"]["config"]["anything"] = [1]
    assert profile_schema.problems(data) == []


def test_load_profile_refuses_a_bad_profile_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "profiles" / "bad"
    folder.mkdir(parents=True)
    text = (profiles_dir() / "tiny-hybrid-cpu" / "profile.toml").read_text()
    (folder / "profile.toml").write_text(text.replace("max_tokens = 24", "max_tokens = 2.5", 1))
    monkeypatch.setenv("GLM5_MATRIX_ROOT", str(tmp_path))
    with pytest.raises(UserError) as raised:
        load_profile("bad")
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        f"{folder / 'profile.toml'}: prompts.max_tokens: must be an integer, not a float (2.5)"
    )


def _profile(root: Path, name: str, text: str) -> Path:
    folder = root / "profiles" / name
    folder.mkdir(parents=True)
    (folder / "profile.toml").write_text(text)
    return folder / "profile.toml"


def test_a_profile_extends_another_table_by_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = (profiles_dir() / "tiny-hybrid-cpu" / "profile.toml").read_text()
    _profile(tmp_path, "base", base)
    _profile(
        tmp_path,
        "variant",
        'extends = "base"\n[model.config]\nnum_attention_heads = 8\n[tolerances]\nmin_power = 3.0\n',
    )
    monkeypatch.setenv("GLM5_MATRIX_ROOT", str(tmp_path))
    own, parent = load_profile("variant").data, tomllib.loads(base)
    assert "extends" not in own
    assert own["model"]["config"]["num_attention_heads"] == 8
    assert own["tolerances"]["min_power"] == 3.0
    # everything else is the base's, down to the keys beside an overridden one
    assert own["model"]["config"]["hidden_size"] == parent["model"]["config"]["hidden_size"]
    assert (
        own["tolerances"]["min_median_margin_steps"]
        == parent["tolerances"]["min_median_margin_steps"]
    )
    assert own["prompts"] == parent["prompts"]


def test_the_tp_profile_is_the_tiny_hybrid_with_its_head_counts() -> None:
    tp, base = load_profile("tiny-hybrid-cpu-tp").data, load_profile("tiny-hybrid-cpu").data
    assert tp["tolerances"] == base["tolerances"] and tp["engine"] == base["engine"]
    differ = {
        k for k in base["model"]["config"] if tp["model"]["config"][k] != base["model"]["config"][k]
    }
    assert differ == {"num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"}


def test_extends_refuses_a_chain_and_an_unknown_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = (profiles_dir() / "tiny-hybrid-cpu" / "profile.toml").read_text()
    _profile(tmp_path, "base", base)
    _profile(tmp_path, "middle", 'extends = "base"\n')
    chained = _profile(tmp_path, "chained", 'extends = "middle"\n')
    _profile(tmp_path, "orphan", 'extends = "nowhere"\n')
    monkeypatch.setenv("GLM5_MATRIX_ROOT", str(tmp_path))
    with pytest.raises(UserError, match="one level only") as raised:
        load_profile("chained")
    assert str(raised.value).startswith(str(chained))
    with pytest.raises(UserError, match="unknown profile 'nowhere'"):
        load_profile("orphan")
