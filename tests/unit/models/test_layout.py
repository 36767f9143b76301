"""The layout planner without vLLM: published numbers, structure, bad input, the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from glm5_matrix.cli import main
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.profiles import load_profile
from glm5_matrix.models.layout import plan_layout

PROFILE = "glm-5.3-flash-4l"


@pytest.fixture
def config() -> dict:
    return load_profile(PROFILE).config()


# Published in the model's reference (glm53-flash.md), computed there from vLLM 0.33's aligner.
@pytest.mark.parametrize(
    ("tp", "spec", "kv", "user_block", "block"),
    [
        (1, 0, "auto", None, 4352),
        (2, 0, "auto", None, 2176),
        (4, 0, "auto", None, 1152),
        (8, 0, "auto", None, 640),
        (1, 3, "auto", None, 4480),
        (2, 3, "auto", None, 2304),
        (4, 3, "auto", None, 1152),
        (1, 7, "auto", None, 4608),
        (1, 16, "auto", None, 5120),
        (2, 16, "auto", None, 2560),
        (4, 16, "auto", None, 1280),
        (1, 0, "fp8", None, 8576),
        (1, 0, "auto", 256, 4352),
        (2, 0, "auto", 256, 2304),
        (4, 0, "auto", 256, 1280),
    ],
)
def test_published_block_sizes(config, tp, spec, kv, user_block, block) -> None:
    assert plan_layout(config, tp, spec, kv, user_block).block_size == block


def test_published_state_bytes(config) -> None:
    # Reference table: conv / recurrent bytes per TP.
    for tp, conv, recurrent in [(1, 147_456, 4_194_304), (2, 73_728, 2_097_152)]:
        plan = plan_layout(config, tp)
        assert (plan.conv_state_bytes, plan.recurrent_state_bytes) == (conv, recurrent)


def test_groups_structure(config) -> None:
    plan = plan_layout(config, 1)
    kinds = [g.kind for g in plan.groups]
    assert kinds.count("mla") == 1 and kinds.count("tail") == 1 and kinds.count("mamba") == 3
    mamba = [g for g in plan.groups if g.kind == "mamba"]
    latent = plan.latent_page_bytes
    # The hybrid allocator's rule: Mamba pages padded to exactly one latent page.
    assert all(g.page_bytes == latent and g.page_bytes > g.unpadded_page_bytes for g in mamba)
    assert plan.block_size % 128 == 0 and plan.block_size * 1024 == latent
    tail = next(g for g in plan.groups if g.kind == "tail")
    assert not tail.prefix_cacheable and plan.block_size % tail.block_size == 0


def test_tail_ring_grows_with_speculation(config) -> None:
    # Reference: ring 4 without speculation, 8 with 1-4 speculative tokens.
    assert [plan_layout(config, 1, k).tail_ring for k in (0, 1, 4)] == [4, 8, 8]


def test_text_only_config_gives_the_same_layout(config) -> None:
    text = dict(config["text_config"], architectures=["Glm5NextForCausalLM"])
    assert plan_layout(text, 2).to_dict() == plan_layout(config, 2).to_dict()


def test_class_default_kpool_changes_the_block(config) -> None:
    # The reference's trap: transformers' default index_kpool 16 gives TP1 4608.
    trap = copy.deepcopy(config)
    trap["text_config"]["index_kpool"] = 16
    assert plan_layout(trap, 1).block_size == 4608


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), "not a GLM"),
        (lambda c: c["text_config"].pop("kv_lora_rank"), "missing kv_lora_rank"),
        (lambda c: c["text_config"].pop("linear_attn_config"), "missing linear_attn_config"),
        (
            lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3]),
            "disagrees with layer_types",
        ),
        (lambda c: c["text_config"].update(index_kpool="4"), "index_kpool must be int"),
    ],
)
def test_bad_configs(config, edit, message) -> None:
    edit(config)
    with pytest.raises(UserError, match=message):
        plan_layout(config, 1)


def test_tp_must_divide_kda_heads(config) -> None:
    with pytest.raises(UserError, match="does not divide the 64 KDA heads"):
        plan_layout(config, 3)


def test_does_not_modify_its_input(config) -> None:
    before = copy.deepcopy(config)
    plan_layout(config, 2, 3, "fp8", 256)
    assert config == before


def test_cli_json(capsys) -> None:
    assert main(["layout", "--profile", PROFILE, "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["block_size"], int) and data["block_size"] == 2176
    assert {g["kind"] for g in data["groups"]} == {"mla", "tail", "mamba"}


def test_cli_human_output_explains_the_arithmetic(capsys) -> None:
    assert main(["layout", "--profile", PROFILE, "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "4352" in out and "4,341,760" in out and "ceil(" in out


def test_cli_config_path_and_errors(tmp_path: Path, capsys) -> None:
    good = tmp_path / "config.json"
    good.write_text(json.dumps(load_profile(PROFILE).config()))
    assert main(["layout", "--config", str(tmp_path), "--tp", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 1152
    for argv, needle in [
        (["--config", str(tmp_path / "missing.json"), "--tp", "1"], "not found"),
        (["--profile", PROFILE, "--tp", "3"], "does not divide"),
        (["--profile", "no-such-profile", "--tp", "1"], "unknown profile"),
    ]:
        assert main(["layout", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["layout", "--config", str(bad), "--tp", "1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_offload_bytes_count_the_prefix_cacheable_groups_only(config) -> None:
    """The offload cells size the CPU side from this: at TP1, one block holds the MLA latent +
    indexer page and three KDA pages padded to the latent page; the tail ring is left out."""
    plan = plan_layout(config, 1)
    # Page bytes vLLM 0.33 allocated on an H200 (reference h200-host.md): latent 4,456,448,
    # indexer 143,616, KDA pages padded to 4,456,448, tail 2,048.
    assert plan.offload_bytes(1) == 4_456_448 + 143_616 + 3 * 4_456_448
    assert plan.offload_bytes(8) == 8 * plan.offload_bytes(1)
