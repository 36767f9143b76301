"""`glm5-matrix prune` on a synthetic full GLM-5.3-Flash checkpoint (45 layers + MTP): the layers
kept and the MTP layer byte for byte, the config's edits, the side files, card and manifest, the
source never modified, --dry-run, --force, and an interrupted prune that leaves nothing behind.

Every expectation is derived from the source read back with the `safetensors` library
(checkpoint_readback), never from the pruner's own plan; a copy that corrupts one byte is caught."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest
import synthetic_checkpoint as synthetic
from checkpoint_readback import (
    FULL_LAYERS,
    expected_name,
    file_hashes,
    hasher_threads,
    leftovers,
    read_tensors,
    run_cli,
)
from safetensors import safe_open

from glm5_matrix.checkpoints import copying


def refuse_kernel_copy(monkeypatch) -> None:
    """copy_file_range failing as between two filesystems: the copier must fall back."""

    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)


@pytest.mark.parametrize(
    ("layers", "piece_bytes", "kernel_copy"),
    [
        (4, None, True),
        (8, None, True),
        (45, None, True),
        # 4099-byte pieces and a 1021-byte buffer: tensors straddle pieces and buffer refills,
        # and the hasher is handed hundreds of pieces per shard while the copy goes on.
        (4, 4099, True),
        (4, 4099, False),  # pread/pwrite instead of copy_file_range
    ],
)
def test_prune_keeps_layers_and_mtp_byte_for_byte(
    full_checkpoint, tmp_path, monkeypatch, layers, piece_bytes, kernel_copy
):
    if piece_bytes:
        monkeypatch.setattr(copying, "_PIECE_BYTES", piece_bytes)
        monkeypatch.setattr(copying, "_BUFFER_BYTES", 1021)
    if not kernel_copy:
        refuse_kernel_copy(monkeypatch)
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst, "--layers", str(layers)) == (0, "")

    source = read_tensors(full_checkpoint)
    pruned = read_tensors(dst)
    expected = {expected_name(n, layers): n for n in source if expected_name(n, layers)}
    assert set(pruned) == set(expected)
    renamed = [n for n in expected if expected[n] != n]
    if layers < FULL_LAYERS:
        assert renamed and all(f".layers.{layers}." in n for n in renamed)
        assert any(n.endswith(f".layers.{layers}.eh_proj.weight") for n in renamed)
    else:  # every layer kept: the MTP layer keeps its number
        assert renamed == [] and len(pruned) == len(source)
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
    # The manifest is the hash of each file as it lies on disk.
    for line in (dst / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((dst / name).read_bytes()).hexdigest() == digest, name


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
    real_copy = copying.HashingCopier._copy
    calls = []

    def failing_copy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 12:  # mid-way through the shards
            raise interruption
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(copying.HashingCopier, "_copy", failing_copy)
    dst = tmp_path / "pruned"
    with pytest.raises(type(interruption)):
        run_cli("prune", full_checkpoint, dst)
    assert len(calls) == 12
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []
    assert hasher_threads() == []


def test_interrupted_force_keeps_the_old_dst(full_checkpoint, tmp_path, monkeypatch):
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    old = file_hashes(dst)

    def failing_copy(*args, **kwargs):
        raise OSError("interrupted")

    monkeypatch.setattr(copying.HashingCopier, "_copy", failing_copy)
    with pytest.raises(OSError):
        run_cli("prune", full_checkpoint, dst, "--layers", "8", "--force")
    assert file_hashes(dst) == old
    assert leftovers(tmp_path, "pruned") == []
    assert hasher_threads() == []


# --- a planted defect: the byte-for-byte check above fails on a broken copy ---------------


def test_byte_for_byte_comparison_catches_a_copy_that_corrupts_one_byte(
    full_checkpoint, tmp_path, monkeypatch
):
    real_copy = copying.HashingCopier._copy
    corrupted = []

    def corrupting_copy(self, src, out, offset, position, length):
        copied = real_copy(self, src, out, offset, position, length)
        if not corrupted and copied > 100:
            byte = os.pread(src, 1, offset + 50)
            os.pwrite(out, bytes([byte[0] ^ 0x01]), position + 50)
            corrupted.append(position + 50)
        return copied

    monkeypatch.setattr(copying.HashingCopier, "_copy", corrupting_copy)
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    assert corrupted
    source, pruned = read_tensors(full_checkpoint), read_tensors(dst)
    origin = {expected_name(n, 4): n for n in source if expected_name(n, 4)}
    differing = [n for n in pruned if pruned[n]["data"] != source[origin[n]]["data"]]
    assert len(differing) == 1
    # The manifest records the file as written; it guards the copy from here on, not the copy.
    assert run_cli("verify", dst) == (0, "")
