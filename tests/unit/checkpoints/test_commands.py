"""`glm5-matrix prune` / `verify` on a synthetic full GLM-5.3-Flash checkpoint (45 layers + MTP).

The source is written by synthetic_checkpoint (tests/unit) at tiny widths with the published
tensor names and dtypes; every expectation below is derived here from the source itself, read back with
the `safetensors` library, never from the pruner's own plan.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import itertools
import json
import os
import re
import struct
import threading
from pathlib import Path

import pytest
import scaffold
import synthetic_checkpoint as synthetic
from safetensors import deserialize, safe_open

from glm5_matrix import checkpoints
from glm5_matrix.checkpoints import copying
from glm5_matrix.errors import UserError

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


def hasher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("glm5-sha256")]


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


# --- copy runs --------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [4, 45])
def test_plan_copies_each_shard_in_maximal_runs(full_checkpoint, layers):
    plan = checkpoints.plan_prune(checkpoints.open_checkpoint(full_checkpoint), layers)
    for shard in plan.shards:
        header = json.loads(shard.header[8:])
        header.pop("__metadata__", None)
        runs = shard.runs
        # Back to back in the output, in source order, and never two that could be one.
        assert [r.offset for r in runs] == [
            sum(r.length for r in runs[:i]) for i in range(len(runs))
        ]
        assert all(
            a.source_offset + a.length < b.source_offset for a, b in itertools.pairwise(runs)
        )
        assert sum(r.length for r in runs) == shard.data_bytes
        # Every kept tensor lies inside one run, at the same place in source and output.
        for tensor in shard.tensors:
            start, end = header[tensor.name]["data_offsets"]
            (run,) = [
                r
                for r in runs
                if r.offset <= start < r.offset + r.length or start == end == r.offset
            ]
            assert tensor.entry.start - run.source_offset == start - run.offset, tensor.name
            assert end - start == tensor.entry.nbytes
        # The gaps between runs are exactly the dropped tensors of that source shard.
        source = plan.source.shards[shard.source_file]
        kept = {t.source_name for t in shard.tensors}
        gaps = sum(e.nbytes for n, e in source.tensors.items() if n not in kept)
        covered = runs[-1].source_offset + runs[-1].length - runs[0].source_offset if runs else 0
        assert covered - shard.data_bytes <= gaps
    if layers == 45:  # everything kept, each source shard is one byte range
        assert all(len(s.runs) == 1 for s in plan.shards)
        assert plan.data_bytes == sum(
            s.file_size - s.data_start for s in plan.source.shards.values()
        )
    else:
        mtp = next(s for s in plan.shards if any(t.name != t.source_name for t in s.tensors))
        assert len(mtp.runs) < len([t for t in mtp.tensors if t.name != t.source_name])


def kept(name: str, start: int, end: int, new_name: str | None = None) -> checkpoints.KeptTensor:
    entry = checkpoints.TensorEntry("U8", (end - start,), start, end)
    return checkpoints.KeptTensor(name, new_name or name, "model-00001.safetensors", entry)


def test_copy_runs_merge_neighbours_split_at_gaps_and_ignore_renames():
    run = checkpoints.CopyRun
    # Consecutive tensors are one run.
    assert checkpoints.copy_runs([kept("a", 0, 10), kept("b", 10, 30)]) == [run(0, 0, 30)]
    # A dropped tensor between them (bytes 30-40) splits the run; the output stays contiguous.
    tensors = [kept("a", 0, 10), kept("b", 10, 30), kept("d", 40, 48), kept("e", 48, 50)]
    assert checkpoints.copy_runs(tensors) == [run(0, 0, 30), run(40, 30, 10)]
    # A renamed tensor (layer 45 -> 4) changes its header entry, not its bytes: no new run.
    renamed = [
        kept("model.layers.44.x", 0, 8),
        kept("model.layers.45.eh_proj.weight", 8, 24, "model.layers.4.eh_proj.weight"),
        kept("model.layers.45.enorm.weight", 24, 28, "model.layers.4.enorm.weight"),
    ]
    assert checkpoints.copy_runs(renamed) == [run(0, 0, 28)]
    # A first tensor that does not start the data section; empty tensors add no run.
    tensors = [kept("a", 16, 20), kept("z", 20, 20), kept("e", 30, 30), kept("f", 40, 41)]
    assert checkpoints.copy_runs(tensors) == [run(16, 0, 4), run(40, 4, 1)]
    assert checkpoints.copy_runs([]) == []


def test_renamed_tensors_get_new_header_entries_over_the_same_bytes(full_checkpoint, tmp_path):
    # The MTP layer's names shrink (45 -> 4), so the header shrinks and every data offset of
    # the file moves; the run copies the bytes unchanged behind the new header.
    dst = tmp_path / "pruned"
    assert run_cli("prune", full_checkpoint, dst)[0] == 0
    plan = checkpoints.plan_prune(checkpoints.open_checkpoint(full_checkpoint), 4)
    shard = next(s for s in plan.shards if any(t.name != t.source_name for t in s.tensors))
    source = plan.source.shards[shard.source_file]
    written = (dst / shard.file).read_bytes()
    original = source.path.read_bytes()
    assert written[: len(shard.header)] == shard.header
    assert len(shard.header) != source.data_start
    for r in shard.runs:
        out = len(shard.header) + r.offset
        src = source.data_start + r.source_offset
        assert written[out : out + r.length] == original[src : src + r.length]
    assert len(written) == len(shard.header) + shard.data_bytes


# --- planted defects: the checks above fail on a broken copy or hash ---------------------------


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
    file = _first_shard(directory).name
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

    _edit_json(dst / "config.json", claim_five)
    assert run_cli("verify", dst)[0] == 1
    assert "layer 4 (kda) has no self_attn.A_log" in capsys.readouterr().err


def test_verify_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    code, message = run_cli("verify", tmp_path)
    assert code == 2 and "no config.json" in message
