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
    assert profile_schema.problems(_data(name)) == []
    load_profile(name)


def test_a_typo_is_named_with_the_keys_known_there() -> None:
    data = _data("glm-5.3-flash-4l")
    data["tolerances"]["min_powr"] = 2.0
    (problem,) = profile_schema.problems(data)
    assert problem.startswith("unknown key 'tolerances.min_powr' (known here: ")
    assert "min_power" in problem


def test_wrong_types_missing_tables_and_keys_are_each_a_line() -> None:
    data = copy.deepcopy(_data("tiny-hybrid-cpu"))
    data["prompts"]["max_tokens"] = "24"  # a string where an int is read
    data["tolerances"]["min_power"] = True  # TOML's true is no number
    data["pd"]["tolerances"].pop("reference_repeats")
    data["noise"] = 3
    del data["weights"]
    assert profile_schema.problems(data) == [
        "prompts.max_tokens must be int, not str ('24')",
        "tolerances.min_power must be number, not bool (True)",
        "noise must be a table, not int",
        "[weights] is missing",
        "[pd.tolerances] lacks 'reference_repeats'",
    ]


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
    assert message == f"{folder / 'profile.toml'}: prompts.max_tokens must be int, not float (2.5)"
