"""`glm5-matrix prune` / `verify` on a synthetic full GLM-5.3-Flash checkpoint (45 layers + MTP).

The source is written by glm5_matrix.synthetic at tiny widths with the published tensor names
and dtypes; every expectation below is derived here from the source itself, read back with
the `safetensors` library, never from the pruner's own plan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import deserialize, safe_open

from glm5_matrix import checkpoints, synthetic
from glm5_matrix.errors import UserError

SRC_DIR = Path(__file__).resolve().parents[2] / "src"
LAYER = re.compile(r"^(model\.language_model\.layers|model\.layers)\.(\d+)\.(.+)$")
FULL_LAYERS, MTP_LAYER = 45, 45


# --- helpers --------------------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str]:
    """Run the prune/verify subcommands in-process as cli.main does; (exit code, error line)."""
    parser = argparse.ArgumentParser(prog="glm5-matrix")
    checkpoints.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    try:
        return int(args.func(args) or 0), ""
    except UserError as exc:
        return 2, str(exc)


def read_tensors(directory: Path) -> dict[str, dict]:
    """Every tensor of a checkpoint, read by the safetensors library: name -> dtype/shape/data."""
    out: dict[str, dict] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, info in deserialize(path.read_bytes()):
            assert name not in out, f"{name} in two shards"
            out[name] = {
                "dtype": info["dtype"],
                "shape": list(info["shape"]),
                "data": bytes(info["data"]),
            }
    return out


def file_hashes(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        p.relative_to(directory).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def expected_name(name: str, layers: int) -> str | None:
    """Where a source tensor must end up after keeping `layers` layers (None: dropped)."""
    match = LAYER.match(name)
    if match is None:
        return name
    index = int(match[2])
    if index < layers:
        return name
    if index == MTP_LAYER:
        return f"{match[1]}.{layers}.{match[3]}"
    return None


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.fixture(scope="session", params=["multimodal", "text"])
def full_checkpoint(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"full-{request.param}")
    synthetic.write_checkpoint(directory, synthetic.full_config(request.param), num_shards=6)
    (directory / "original").mkdir()
    (directory / "original" / "notes.txt").write_text("a side file in a subdirectory\n")
    (directory / ".cache").mkdir()
    (directory / ".cache" / "download.lock").write_text("hub cache bookkeeping\n")
    return directory


@pytest.fixture
def mm_source(tmp_path_factory) -> Path:
    """A private multimodal copy that a test may damage."""
    directory = tmp_path_factory.mktemp("damaged")
    synthetic.write_checkpoint(directory, num_shards=6)
    return directory


# --- the synthetic source is the real model's structure --------------------------------------


def test_synthetic_structure_matches_the_published_index():
    # At real widths the synthetic tensor list must be the published checkpoint's: the
    # index of zai-org/GLM-5.3-Flash@04c4e9e9 lists 76,108 tensors, 328,326,771,576 bytes,
    # and its sorted key list hashes to 7baf28d0... (pinned in the public fixture
    # jinhuang12/vllm-neuron test/vllm_neuron/model/glm5_next/fixtures/weight_index.py).
    config = synthetic.full_config(text_widths={}, vision_widths={}, weight_block_size=[128, 128])
    tensors = synthetic.tensor_plan(config)
    names = sorted(t.name for t in tensors)
    assert len(names) == 76_108
    assert sum(t.nbytes for t in tensors) == 328_326_771_576
    assert hashlib.sha256("\n".join(names).encode()).hexdigest() == (
        "7baf28d0d672c695e66ac4c68f3a8bcf054e52b2f364a566e6f30fcfaa4cef2d"
    )


def test_synthetic_shards_are_valid_safetensors(full_checkpoint):
    tensors = read_tensors(full_checkpoint)
    dtypes = {t["dtype"] for t in tensors.values()}
    assert dtypes == {"F8_E4M3", "BF16", "F32"}
    index = json.loads((full_checkpoint / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert len(set(index["weight_map"].values())) == 6
    scales = [n for n in tensors if n.endswith(".weight_scale_inv")]
    assert scales and all(
        tensors[n.replace("_scale_inv", "")]["dtype"] == "F8_E4M3" for n in scales
    )


# --- prune -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "buffer_bytes"),
    [(4, None), (8, None), (4, 4099)],  # 4099: many tensors straddle buffer refills
)
def test_prune_keeps_layers_and_mtp_byte_for_byte(
    full_checkpoint, tmp_path, monkeypatch, layers, buffer_bytes
):
    if buffer_bytes:
        monkeypatch.setattr(checkpoints.writer, "_COPY_BUFFER_BYTES", buffer_bytes)
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst, "--layers", str(layers)) == (0, "")

    source = read_tensors(full_checkpoint)
    pruned = read_tensors(dst)
    expected = {expected_name(n, layers): n for n in source if expected_name(n, layers)}
    assert set(pruned) == set(expected)
    renamed = [n for n in expected if expected[n] != n]
    assert renamed and all(f".layers.{layers}." in n for n in renamed)
    assert any(n.endswith(f".layers.{layers}.eh_proj.weight") for n in renamed)
    # The data varies, so byte equality below cannot pass by accident.
    assert len({t["data"] for t in pruned.values()}) > 0.9 * len(pruned)
    for name, tensor in pruned.items():
        original = source[expected[name]]
        assert tensor["dtype"] == original["dtype"], name
        assert tensor["shape"] == original["shape"], name
        assert tensor["data"] == original["data"], name
    kept_dtypes = {t["dtype"] for t in pruned.values()}
    assert kept_dtypes == {"F8_E4M3", "BF16", "F32"}
    for name in pruned:
        if name.endswith(".weight") and pruned[name]["dtype"] == "F8_E4M3":
            assert f"{name}_scale_inv" in pruned, f"{name} lost its scale"

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(pruned)
    for name, file in index["weight_map"].items():
        with safe_open(dst / file, "numpy") as shard:
            assert name in set(shard.keys())  # safe_open validates the shard's header
    assert index["metadata"]["total_size"] == sum(len(t["data"]) for t in pruned.values())


@pytest.mark.parametrize("layers", [4, 8])
def test_prune_config_edits(full_checkpoint, tmp_path, layers):
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst, "--layers", str(layers))[0] == 0
    before = json.loads((full_checkpoint / "config.json").read_text())
    after = json.loads((dst / "config.json").read_text())
    text_before = before.get("text_config", before)
    text_after = after.get("text_config", after)

    assert text_after["num_hidden_layers"] == layers
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        assert text_after[key] == text_before[key][:layers], key
    lac = text_after["linear_attn_config"]
    assert lac["kda_layers"] == [i for i in range(layers) if i % 4 != 3]
    assert lac["full_attn_layers"] == [i for i in range(layers) if i % 4 == 3]
    assert text_after["num_nextn_predict_layers"] == 1
    # Nothing else changes: widths, MoE, MLA, indexer, mHC, vision.
    changed = {
        "num_hidden_layers", "layer_types", "mlp_layer_types", "indexer_types",
        "linear_attn_config", "quantization_config",
    }  # fmt: skip
    assert {k: v for k, v in text_after.items() if k not in changed} == {
        k: v for k, v in text_before.items() if k not in changed
    }
    assert after.get("vision_config") == before.get("vision_config")

    skip_before = before["quantization_config"]["modules_to_not_convert"]
    skip_after = after["quantization_config"]["modules_to_not_convert"]
    assert skip_after == [expected_name(e, layers) for e in skip_before if expected_name(e, layers)]
    assert len(skip_after) < len(skip_before)
    weights = set(read_tensors(dst))
    assert all(f"{entry}.weight" in weights for entry in skip_after)
    assert any(f".layers.{layers}." in entry for entry in skip_after)  # the MTP's own entries


def test_prune_copies_side_files_and_writes_card_and_manifest(full_checkpoint, tmp_path):
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    for name in [*synthetic.SIDE_FILES, "original/notes.txt"]:
        assert (dst / name).read_bytes() == (full_checkpoint / name).read_bytes(), name
    assert not (dst / ".cache").exists()
    manifest = (dst / "SHA256SUMS").read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in manifest}
    on_disk = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()} - {
        "SHA256SUMS"
    }
    assert set(listed) == on_disk
    for name, digest in listed.items():
        assert hashlib.sha256((dst / name).read_bytes()).hexdigest() == digest, name
    card = (dst / "README.md").read_text()
    assert "45 (MTP) | 4" in card and "num_hidden_layers`: 45 -> 4" in card
    provenance = json.loads((dst / "glm5-matrix-prune.json").read_text())
    assert provenance["layers_kept"] == [0, 1, 2, 3]
    assert provenance["layers_renamed"] == {"45": 4}
    assert oct((dst).stat().st_mode & 0o777) == "0o755"


def test_prune_never_modifies_the_source(full_checkpoint, tmp_path):
    before = file_hashes(full_checkpoint)
    assert run_cli("prune", full_checkpoint, tmp_path / "a")[0] == 0
    assert run_cli("prune", full_checkpoint, tmp_path / "a", "--layers", "8", "--force")[0] == 0
    assert file_hashes(full_checkpoint) == before


def test_dry_run_prints_the_plan_and_writes_nothing(full_checkpoint, tmp_path, capsys):
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst, "--dry-run") == (0, "")
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    names = list(read_tensors(full_checkpoint))
    fates = [expected_name(n, 4) for n in names]
    kept = sum(1 for n, f in zip(names, fates, strict=True) if f == n)
    renamed = sum(1 for n, f in zip(names, fates, strict=True) if f and f != n)
    dropped = fates.count(None)
    assert f"tensors: {kept} kept, {renamed} renamed, {dropped} dropped" in out
    assert "MTP layer 45 -> 4" in out
    assert "output size:" in out


def test_existing_dst_is_refused_without_force_and_replaced_with_it(full_checkpoint, tmp_path):
    dst = tmp_path / "pruned"
    dst.mkdir()
    (dst / "keep-me").write_text("x")
    code, message = run_cli("prune", full_checkpoint, dst)
    assert code == 2 and "already exists" in message and "--force" in message
    assert (dst / "keep-me").read_text() == "x"
    assert run_cli("prune", full_checkpoint, dst, "--force")[0] == 0
    assert not (dst / "keep-me").exists() and (dst / "config.json").is_file()
    assert leftovers(tmp_path, "pruned") == []


@pytest.mark.parametrize("interruption", [OSError("disk gone"), KeyboardInterrupt()])
def test_interrupted_prune_leaves_no_dst_and_no_temporary(
    full_checkpoint, tmp_path, monkeypatch, interruption
):
    real_copy = checkpoints.writer._HashedStream.copy_from
    calls = []

    def failing_copy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 12:  # mid-way through the shards
            raise interruption
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(checkpoints.writer._HashedStream, "copy_from", failing_copy)
    dst = tmp_path / "pruned"
    with pytest.raises(type(interruption)):
        run_cli("prune", full_checkpoint, dst)
    assert len(calls) == 12
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []


def test_interrupted_force_keeps_the_old_dst(full_checkpoint, tmp_path, monkeypatch):
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    old = file_hashes(dst)

    def failing_copy(*args, **kwargs):
        raise OSError("interrupted")

    monkeypatch.setattr(checkpoints.writer._HashedStream, "copy_from", failing_copy)
    with pytest.raises(OSError):
        run_cli("prune", full_checkpoint, dst, "--layers", "8", "--force")
    assert file_hashes(dst) == old
    assert leftovers(tmp_path, "pruned") == []


# --- refusals --------------------------------------------------------------------------------


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _first_shard(source: Path) -> Path:
    return sorted(source.glob("model-*.safetensors"))[0]


DAMAGE = {
    "not_glm": (
        lambda s: _edit_json(s / "config.json", lambda c: c.update(model_type="deepseek_v3")),
        "not a GLM-5.3-Flash config",
    ),
    "no_config": (lambda s: (s / "config.json").unlink(), "no config.json"),
    "missing_shard": (lambda s: _first_shard(s).unlink(), "missing shard model-00001-of-00006"),
    "index_lists_absent_tensor": (
        lambda s: _edit_json(
            s / "model.safetensors.index.json",
            lambda i: i["weight_map"].update(
                {"model.language_model.layers.0.extra.weight": _first_shard(s).name}
            ),
        ),
        "model.language_model.layers.0.extra.weight is mapped to model-00001-of-00006.safetensors but is not in it",
    ),
    "shard_has_unlisted_tensor": (
        lambda s: _edit_json(
            s / "model.safetensors.index.json", lambda i: i["weight_map"].pop("lm_head.weight")
        ),
        "lm_head.weight is in model-00001-of-00006.safetensors but the index does not list it",
    ),
    "truncated_shard": (
        lambda s: os.truncate(_first_shard(s), _first_shard(s).stat().st_size - 10),
        "truncated or padded shard",
    ),
    "unknown_per_layer_field": (
        lambda s: _edit_json(
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


def test_one_based_linear_attention_lists_are_cut_as_one_based():
    config = synthetic.full_config()
    lac = config["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [i + 1 for i in lac["kda_layers"]]
    lac["full_attn_layers"] = [i + 1 for i in lac["full_attn_layers"]]
    pruned, _ = checkpoints.pruned_config(config, 4)
    assert pruned["text_config"]["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert pruned["text_config"]["linear_attn_config"]["full_attn_layers"] == [4]
    assert config["text_config"]["num_hidden_layers"] == 45  # the input is not modified


def test_cli_refusal_exit_code_and_single_stderr_line(full_checkpoint, tmp_path):
    # The real console entry point, in a child process.
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    result = subprocess.run(
        [sys.executable, "-m", "glm5_matrix.cli", "prune", str(full_checkpoint), str(tmp_path / "x"), "--layers", "3"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "glm5-matrix prune: error: --layers 3 keeps no DSA/MLA"
    )
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


# --- load_glm_config -------------------------------------------------------------------------


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


# --- verify ----------------------------------------------------------------------------------


@pytest.fixture
def pruned(full_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    return dst


def test_verify_accepts_a_fresh_prune_and_the_full_source(pruned, full_checkpoint, capsys):
    assert run_cli("verify", pruned) == (0, "")
    out = capsys.readouterr().out
    assert "4 decoder layers + 1 MTP" in out
    assert "3:deepseek_sparse_attention/sparse 4:MTP/sparse" in out
    assert "manifest: SHA256SUMS checked" in out
    assert run_cli("verify", full_checkpoint) == (0, "")
    assert "manifest: none" in capsys.readouterr().out


def _flip_last_byte(directory: Path) -> str:
    shard = _first_shard(directory)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    return f"{shard.name}: sha256 differs"


def _zero_config_hash(directory: Path) -> str:
    manifest = directory / "SHA256SUMS"
    text = re.sub(r"^[0-9a-f]{64}(?=  config\.json$)", "0" * 64, manifest.read_text(), flags=re.M)
    manifest.write_text(text)
    return "config.json: sha256 differs"


def _add_stray_file(directory: Path) -> str:
    (directory / "stray.bin").write_bytes(b"x")
    return "stray.bin is not in the manifest"


def _remove_tokenizer(directory: Path) -> str:
    (directory / "tokenizer.json").unlink()
    return "manifest lists tokenizer.json, which is missing"


def _unlist_mtp_tensor(directory: Path) -> str:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if ".layers.4." in n)
    file = index["weight_map"].pop(name)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"{name} is in {file} but the index does not list it"


def _list_absent_tensor(directory: Path) -> str:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = _first_shard(directory).name
    index["weight_map"]["model.missing.weight"] = file
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"model.missing.weight is mapped to {file} but is not in it"


@pytest.mark.parametrize(
    "tamper",
    [
        _flip_last_byte,
        _zero_config_hash,
        _add_stray_file,
        _remove_tokenizer,
        _unlist_mtp_tensor,
        _list_absent_tensor,
    ],
)
def test_verify_detects_tampering(pruned, tamper, capsys):
    assert run_cli("verify", pruned) == (0, "")
    capsys.readouterr()
    expected = tamper(pruned)
    code, _ = run_cli("verify", pruned)
    assert code == 1
    assert expected in capsys.readouterr().err


def test_verify_detects_a_misnumbered_layer(mm_source, tmp_path, capsys):
    # A config claiming 5 decoder layers on a 4-layer prune: layer 4 is the MTP's tensors.
    dst = tmp_path / "pruned"
    assert run_cli("prune", mm_source, dst)[0] == 0
    (dst / "SHA256SUMS").unlink()

    def claim_five(config):
        text = config["text_config"]
        text["num_hidden_layers"] = 5
        text["layer_types"].append("linear_attention")
        text["mlp_layer_types"].append("sparse")
        text["linear_attn_config"]["kda_layers"].append(4)

    _edit_json(dst / "config.json", claim_five)
    assert run_cli("verify", dst)[0] == 1
    assert "layer 4 (kda) has no self_attn.A_log" in capsys.readouterr().err


def test_verify_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    code, message = run_cli("verify", tmp_path)
    assert code == 2 and "no config.json" in message
