"""What `glm5-matrix prune` refuses, in one line and exit 2, writing nothing: a damaged or foreign
source, a layer count out of range or keeping no DSA/MLA layer, a missing source, an MTP layer
behind a dense one; through the real console entry point too."""

from __future__ import annotations

import os

import pytest
import scaffold
import synthetic_checkpoint as synthetic
from checkpoint_readback import edit_json, file_hashes, first_shard, run_cli

DAMAGE = {
    "not_glm": (
        lambda s: edit_json(s / "config.json", lambda c: c.update(model_type="deepseek_v3")),
        "not a GLM-5.3-Flash config",
    ),
    "no_config": (lambda s: (s / "config.json").unlink(), "no config.json"),
    "missing_shard": (lambda s: first_shard(s).unlink(), "missing shard model-00001-of-00006"),
    "index_lists_absent_tensor": (
        lambda s: edit_json(
            s / "model.safetensors.index.json",
            lambda i: i["weight_map"].update(
                {"model.language_model.layers.0.extra.weight": first_shard(s).name}
            ),
        ),
        "model.language_model.layers.0.extra.weight is mapped to model-00001-of-00006.safetensors but is not in it",
    ),
    "shard_has_unlisted_tensor": (
        lambda s: edit_json(
            s / "model.safetensors.index.json", lambda i: i["weight_map"].pop("lm_head.weight")
        ),
        "lm_head.weight is in model-00001-of-00006.safetensors but the index does not list it",
    ),
    "truncated_shard": (
        lambda s: os.truncate(first_shard(s), first_shard(s).stat().st_size - 10),
        "truncated or padded shard",
    ),
    "unknown_per_layer_field": (
        lambda s: edit_json(
            s / "config.json", lambda c: c["text_config"].update(foo_layers=[0] * 45)
        ),
        "foo_layers",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_bad_source_is_refused_with_one_line(mm_source, tmp_path, damage):
    apply, expected = DAMAGE[damage]
    apply(mm_source)
    before = file_hashes(mm_source)
    dst = tmp_path / "pruned"
    code, message = run_cli("prune", mm_source, dst)
    assert code == 2
    assert expected in message and "\n" not in message
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    assert file_hashes(mm_source) == before


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ("0", "--layers 0: out of range"),
        ("46", "--layers 46: out of range"),
        ("3", "--layers 3 keeps no DSA/MLA layer"),
        ("1", "keeps no DSA/MLA layer"),
    ],
)
def test_bad_layer_count_is_refused(full_checkpoint, tmp_path, layers, expected):
    code, message = run_cli("prune", full_checkpoint, tmp_path / "x", "--layers", layers)
    assert code == 2 and expected in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_missing_source_is_refused(tmp_path):
    code, message = run_cli("prune", tmp_path / "nowhere", tmp_path / "x")
    assert code == 2 and "SRC directory not found" in message


def test_mtp_behind_a_dense_layer_is_refused(tmp_path):
    # A schedule where N keeps a DSA layer but ends on a dense MLP: vLLM would build the MoE
    # MTP layer dense.
    config = synthetic.full_config()
    text = config["text_config"]
    text["layer_types"][1] = synthetic.DSA
    text["linear_attn_config"]["kda_layers"].remove(1)
    text["linear_attn_config"]["full_attn_layers"] = sorted(
        [1, *text["linear_attn_config"]["full_attn_layers"]]
    )
    source = tmp_path / "src"
    synthetic.write_checkpoint(source, config, num_shards=2)
    code, message = run_cli("prune", source, tmp_path / "x", "--layers", "2")
    assert code == 2 and "dense MLP" in message
    assert run_cli("prune", source, tmp_path / "y", "--layers", "4")[0] == 0


def test_cli_refusal_exit_code_and_single_stderr_line(full_checkpoint, tmp_path):
    # The real console entry point, in a child process.
    result = scaffold.run_cli(
        "prune",
        str(full_checkpoint),
        str(tmp_path / "x"),
        "--layers",
        "3",
        env=os.environ,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "glm5-matrix prune: error: --layers 3 keeps no DSA/MLA"
    )
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []
