"""The synthetic source the checkpoint tests prune (tests/unit/synthetic_checkpoint.py) is the real
model's structure: at real widths its tensor list is the published checkpoint's, and its shards
read back as valid safetensors."""

from __future__ import annotations

import hashlib
import json

import synthetic_checkpoint as synthetic
from checkpoint_readback import read_tensors


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
