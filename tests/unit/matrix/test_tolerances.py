"""A profile's tolerances are a frozen value built when the profile is loaded: a value out of its
range is one line naming the file and the table then, before any engine runs, where the judges
used to find it after minutes of reference runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import load_profile, profile_names, profiles_dir
from glm5_matrix.matrix.tolerances import Tolerances

GOOD = {
    "min_distinct_tokens": 4,
    "min_median_margin_steps": 12,
    "reference_repeats": 4,
    "min_power": 2.0,
    "false_red_per_cell": 0.01,
    "comparisons_per_cell": 10,
    "control_changed_blocks": 1.0,
    "checkpoint_page_rel": 1e-3,
}


@pytest.mark.parametrize("name", profile_names())
def test_every_bundled_profile_builds_its_tolerances(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile.tolerances(), Tolerances)
    assert profile.tolerances().table == "tolerances"
    for of in ("pd", "dflash"):
        if "tolerances" in profile.section(of):
            built = profile.tolerances(of)
            assert built.table == f"{of}.tolerances"
            assert built.min_power == profile.section(of)["tolerances"]["min_power"]


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"min_power": 1.0}, "min_power: must be > 1, not 1.0"),
        ({"reference_repeats": 3}, "reference_repeats: must be >= 4, not 3"),
        ({"false_red_per_cell": 0}, "false_red_per_cell: must be > 0, not 0"),
        ({"false_red_per_cell": 0.6}, "false_red_per_cell: must be <= 0.5, not 0.6"),
        ({"comparisons_per_cell": 0}, "comparisons_per_cell: must be >= 1, not 0"),
        ({"compared_runs": 0}, "compared_runs: must be >= 1, not 0"),
        ({"min_distinct_tokens": 1}, "min_distinct_tokens: must be >= 2, not 1"),
        ({"min_median_margin_steps": -1}, "min_median_margin_steps: must be >= 0, not -1"),
        ({"control_changed_blocks": 0.0}, "control_changed_blocks: must be > 0, not 0.0"),
        ({"control_changed_blocks": 1.5}, "control_changed_blocks: must be <= 1, not 1.5"),
        ({"checkpoint_page_rel": 0}, "checkpoint_page_rel: must be > 0, not 0"),
        ({"min_power": "2"}, "min_power: must be a number, not a string"),
    ],
)
def test_a_value_out_of_its_range_is_refused(changed: dict, message: str) -> None:
    # built by hand (a unit test's): the same contract the profile's reader checks at load
    with pytest.raises(ValueError, match=f"^pd.tolerances.{message}"):
        Tolerances.from_table("pd.tolerances", {**GOOD, **changed})


def test_a_missing_tolerance_cannot_be_built() -> None:
    values = {k: v for k, v in GOOD.items() if k != "min_power"}
    with pytest.raises(TypeError, match="min_power"):
        Tolerances.from_table("tolerances", values)


def test_the_value_is_frozen_and_an_optional_one_is_asked_for_by_name() -> None:
    built = Tolerances.from_table("pd.tolerances", {**GOOD, "checkpoint_page_rel": None})
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.min_power = 1.5  # type: ignore[misc]
    assert built.needed("control_changed_blocks") == 1.0
    with pytest.raises(KeyError, match=r"\[pd.tolerances\] lacks 'checkpoint_page_rel'"):
        built.needed("checkpoint_page_rel")


def test_load_profile_refuses_a_range_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "profiles" / "weak"
    folder.mkdir(parents=True)
    text = (profiles_dir() / "tiny-hybrid-cpu" / "profile.toml").read_text()
    (folder / "profile.toml").write_text(text.replace("min_power = 2.0", "min_power = 1.0", 1))
    monkeypatch.setenv("GLM5_MATRIX_ROOT", str(tmp_path))
    with pytest.raises(UserError) as raised:
        load_profile("weak")
    message = str(raised.value)
    assert "\n" not in message
    assert message == f"{folder / 'profile.toml'}: tolerances.min_power: must be > 1, not 1.0"
