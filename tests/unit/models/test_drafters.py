"""glm5_matrix.models.drafters and the planner with a DFlash2 drafter, on the GLM profile (no vLLM)."""

from __future__ import annotations

import copy
import functools
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import Profile, load_profile
from glm5_matrix.models import drafters
from glm5_matrix.models.glm_config import text_config
from glm5_matrix.models.layout import plan_layout

PROFILE = "glm-5.3-flash-4l"


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def test_synthesized_config_takes_widths_from_the_target(profile: Profile) -> None:
    table = drafters.dflash_table(profile)
    config = drafters.synthesize_config(profile.config(), table)
    target = text_config(profile.config())
    assert config["hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"]
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == table["target_layer_ids"]
    assert 0 <= config["dflash_config"]["mask_token_id"] < target["vocab_size"]
    # The drafter's fc input is len(taps) x hidden: one tap per target boundary, no more.
    assert len(config["dflash_config"]["target_layer_ids"]) == target["num_hidden_layers"] + 1


def test_taps_beyond_the_last_layer_are_an_error(profile: Profile) -> None:
    table = copy.deepcopy(drafters.dflash_table(profile))
    table["target_layer_ids"] = [-1, 0, 1, 2, 4]  # the 4-layer target has layers 0-3
    with pytest.raises(UserError, match=r"\[4\] beyond the target's layers \(it has 4"):
        drafters.synthesize_config(profile.config(), table)
    for bad, message in (
        ([-2, 0], r"\[-2\] beyond"),
        ([], "non-empty list"),
        ([0, 0], "repeat a layer"),
        ([0, True], "list of integers"),
    ):
        with pytest.raises(UserError, match=message):
            drafters.check_taps(bad, 4, "[dflash]")


def test_profile_cannot_override_the_target_widths(profile: Profile) -> None:
    table = copy.deepcopy(drafters.dflash_table(profile))
    table["config"]["hidden_size"] = 1024
    with pytest.raises(UserError, match="'hidden_size' comes from the target"):
        drafters.synthesize_config(profile.config(), table)


def test_retarget_taps_changes_a_drafter_and_leaves_the_target(profile: Profile) -> None:
    drafter = SimpleNamespace(
        dflash_config={"target_layer_ids": [1, 10, 20, 30, 40], "mask_token_id": 5},
        eagle_aux_hidden_state_layer_ids=[2, 11, 21, 31, 41],
    )
    out = drafters.retarget_taps(drafter, taps=(-1, 0, 1, 2, 3))
    assert out.dflash_config == {"target_layer_ids": [-1, 0, 1, 2, 3], "mask_token_id": 5}
    assert out.eagle_aux_hidden_state_layer_ids == [0, 1, 2, 3, 4]  # vLLM's +1 convention
    target = SimpleNamespace(num_hidden_layers=4)
    assert drafters.retarget_taps(target, taps=(0,)) is target
    assert vars(target) == {"num_hidden_layers": 4}


def test_hf_overrides_pickle_for_the_workers(profile: Profile, tmp_path: Path) -> None:
    drafter = drafters.resolve_drafter(profile, tmp_path, environ={})
    override = pickle.loads(pickle.dumps(drafter.hf_overrides()))
    assert isinstance(override, functools.partial)
    assert override.keywords == {"taps": (-1, 0, 1, 2, 3)}


def test_synthesized_drafter_is_written_once(profile: Profile, tmp_path: Path) -> None:
    first = drafters.resolve_drafter(profile, tmp_path, environ={})
    assert first.source == "synthesized"
    written = Path(first.path) / "config.json"
    stamp = written.stat().st_mtime_ns
    again = drafters.resolve_drafter(profile, tmp_path, environ={})
    assert again.path == first.path and written.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [Path(first.path).name]  # no staging left
    spec = first.speculative_config()
    assert spec == {"method": "dflash", "model": first.path, "num_speculative_tokens": 7}


def test_a_named_drafter_is_checked(profile: Profile, tmp_path: Path) -> None:
    env = {drafters.DRAFT_VARIABLE: str(tmp_path / "missing")}
    with pytest.raises(UserError, match=r"GLM5_DFLASH2_DRAFT=.*no DFlash2 drafter there"):
        drafters.resolve_drafter(profile, tmp_path, environ=env)
    folder = tmp_path / "real"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(UserError, match="is not \\['DFlash2DraftModel'\\]"):
        drafters.resolve_drafter(profile, tmp_path, environ={drafters.DRAFT_VARIABLE: str(folder)})
    trained = {
        "architectures": ["DFlash2DraftModel"],
        "dflash_config": {"target_layer_ids": [1, 2]},
    }
    (folder / "config.json").write_text(json.dumps(trained))
    with pytest.raises(UserError, match="reads 2 taps"):
        drafters.resolve_drafter(profile, tmp_path, environ={drafters.DRAFT_VARIABLE: str(folder)})
    trained["dflash_config"]["target_layer_ids"] = [1, 10, 20, 30, 40]
    (folder / "config.json").write_text(json.dumps(trained))
    real = drafters.resolve_drafter(
        profile, tmp_path, environ={drafters.DRAFT_VARIABLE: str(folder)}
    )
    assert (real.source, real.path, real.taps) == (
        drafters.DRAFT_VARIABLE,
        str(folder.resolve()),
        (-1, 0, 1, 2, 3),
    )
    assert json.loads((folder / "config.json").read_text()) == trained  # the input is untouched


@pytest.mark.parametrize(("tp", "block"), [(1, 4608), (2, 2304), (4, 1152)])
def test_planner_with_the_drafter_at_k_tokens(profile: Profile, tp: int, block: int) -> None:
    """Published sensitivity (reference table): 7 speculative tokens give 4608 / 2304 / 1152."""
    table = drafters.dflash_table(profile)
    draft = drafters.synthesize_config(profile.config(), table)
    plan = plan_layout(
        profile.config(), tp=tp, spec_tokens=table["num_speculative_tokens"], drafter=draft
    )
    assert plan.block_size == block
    (group,) = [g for g in plan.groups if g.kind == "draft"]
    assert group.spec == "FullAttentionSpec" and len(group.layers) == 5
    kv_heads = max(1, draft["num_key_value_heads"] // tp)
    assert group.page_bytes == block * 2 * kv_heads * draft["head_dim"] * 2
    # The target's groups are unchanged by the drafter, but for the wider conv state.
    without = plan_layout(profile.config(), tp=tp, spec_tokens=table["num_speculative_tokens"])
    assert [g for g in plan.groups if g.kind != "draft"] == without.groups
