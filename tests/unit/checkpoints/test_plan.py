"""The prune plan's copy runs (glm5_matrix.checkpoints.plan): each output shard copied from its
source in maximal byte ranges, split only at dropped tensors, and the renamed MTP tensors given
new header entries over the same bytes."""

from __future__ import annotations

import itertools
import json

import pytest
from checkpoint_readback import run_cli

from glm5_matrix import checkpoints


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
