"""`glm5-matrix verify`: a fresh prune and the full source pass; each kind of tampering (a flipped
byte, a wrong manifest line, a stray or missing file, an index that lists too much or too little, a
misnumbered layer) fails naming it; a hasher that skips a piece while pruning is caught."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from checkpoint_readback import edit_json, first_shard, run_cli
from safetensors import safe_open

from glm5_matrix.checkpoints import copying


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
    shard = first_shard(directory)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    return f"{shard.name}: sha256 differs"


def _flip_a_renamed_tensor_byte(directory: Path) -> str:
    # One byte in the middle of the MTP layer's eh_proj (renamed 45 -> 4), found by the
    # safetensors library, not by the pruner's plan.
    for shard in sorted(directory.glob("model-*.safetensors")):
        with safe_open(shard, "numpy") as f:
            names = [n for n in f.keys() if n.endswith(".layers.4.eh_proj.weight")]  # noqa: SIM118
        if names:
            break
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8 : 8 + length])[names[0]]["data_offsets"]
    data[8 + length + (start + end) // 2] ^= 0x10
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
    file = first_shard(directory).name
    index["weight_map"]["model.missing.weight"] = file
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"model.missing.weight is mapped to {file} but is not in it"


@pytest.mark.parametrize(
    "tamper",
    [
        _flip_last_byte,
        _flip_a_renamed_tensor_byte,
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

    edit_json(dst / "config.json", claim_five)
    assert run_cli("verify", dst)[0] == 1
    assert "layer 4 (kda) has no self_attn.A_log" in capsys.readouterr().err


def test_verify_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    code, message = run_cli("verify", tmp_path)
    assert code == 2 and "no config.json" in message


# --- a planted defect: verify fails on a hash the copier got wrong --------------------------


def test_verify_catches_a_hasher_that_skips_a_piece(full_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(copying, "_PIECE_BYTES", 4099)
    real_hash = copying.HashingCopier._hash
    skipped = []

    def skipping_hash(self, file, offset, length):
        if not skipped and offset > 0 and file.path.suffix == ".safetensors":
            skipped.append(file.path.name)
            return None
        return real_hash(self, file, offset, length)

    monkeypatch.setattr(copying.HashingCopier, "_hash", skipping_hash)
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    capsys.readouterr()
    assert run_cli("verify", dst)[0] == 1
    assert f"{skipped[0]}: sha256 differs from the manifest" in capsys.readouterr().err
