"""glm5_matrix.engines.client without vLLM: reading the KV layout the workers report (block
size, spec classes and names, per-layer specs)."""

from __future__ import annotations

import pytest

from glm5_matrix.engines import client

# worker_kv_layout's data, as 0.33 gives it (members wrapped) and as a plain group; stdlib classes
# stand in for vLLM's spec classes (resolution and identity are what is tested).
LAYOUT = {
    "groups": [
        {
            "spec_class": "collections.ChainMap",
            "block_size": 64,
            "page_size_bytes": 300,
            "layer_names": ["latent", "indexer"],
            "member_specs": {
                "latent": {"spec_class": "collections.OrderedDict", "page_size_bytes": 200},
                "indexer": {"spec_class": "collections.OrderedDict", "page_size_bytes": 100},
            },
        },
        {
            "spec_class": "collections.Counter",
            "block_size": 4,
            "page_size_bytes": 8,
            "layer_names": ["tail"],
        },
    ]
}


def test_block_size_of_reads_the_prefix_cacheable_groups() -> None:
    """GLM's tail ring (block 4, not prefix-cacheable) has its own block size; the others must
    agree."""
    groups = [
        {"block_size": 4352, "prefix_cacheable": True},
        {"block_size": 4, "prefix_cacheable": False},
        {"block_size": 4352, "prefix_cacheable": True},
    ]
    assert client.block_size_of({"groups": groups}) == 4352
    groups[2]["block_size"] = 2176
    with pytest.raises(AssertionError, match=r"disagree on the block size: \[2176, 4352\]"):
        client.block_size_of({"groups": groups})


def test_spec_classes_read_members_and_plain_groups() -> None:
    from collections import Counter, OrderedDict

    assert client.spec_classes(LAYOUT["groups"][0]) == {OrderedDict}
    assert client.spec_classes(LAYOUT["groups"][1]) == {Counter}
    assert client.groups_of(LAYOUT, OrderedDict) == [LAYOUT["groups"][0]]
    assert client.groups_of(LAYOUT, dict) == []  # identity: OrderedDict is a dict subclass


def test_spec_names_name_the_members_not_the_wrapper() -> None:
    assert client.spec_names(LAYOUT["groups"][0]) == "OrderedDict"
    assert client.spec_names(LAYOUT["groups"][1]) == "Counter"
    mixed = {
        "member_specs": {
            "a": {"spec_class": "collections.OrderedDict"},
            "b": {"spec_class": "collections.Counter"},
        }
    }
    assert client.spec_names(mixed) == "Counter+OrderedDict"


def test_layer_specs_per_layer() -> None:
    from collections import Counter, OrderedDict

    assert client.layer_specs(LAYOUT) == {
        "latent": (OrderedDict, 200, 64),
        "indexer": (OrderedDict, 100, 64),
        "tail": (Counter, 8, 4),
    }
