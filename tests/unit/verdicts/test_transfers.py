"""glm5_matrix.verdicts.transfers: a transfer is checked page by page, by the bytes' digests."""

from __future__ import annotations

import pytest

from glm5_matrix.verdicts import transfers

LAYERS = [["attn.0"], ["gdn.0"], ["gdn.1"]]


def _pages(pairs: list[transfers.BlockPair], side: str) -> dict[transfers.PageKey, tuple[str, ...]]:
    """Digests as a faithful copy would give them: named after the sent block, so that both
    sides of a pair read alike (and two blocks of a group read apart)."""
    reads = transfers.page_reads(pairs, LAYERS, side)
    digests = []
    for pair in pairs:
        for layer in LAYERS[pair.group]:
            digests.append([f"{layer}@{pair.sent}#{state}" for state in range(2)])
    assert len(reads) == len(digests)
    return transfers.keyed(pairs, LAYERS, digests)


def _pairs() -> list[transfers.BlockPair]:
    # As vLLM's NIXL connector lists them for 2 whole blocks (seen on the CPU build): attention
    # sends every block, a Mamba group only the block holding the state after the last token;
    # D's table has a third block for the tokens it computes itself.
    sent = [[5, 6], [9], [11]]
    received = [[20, 21, 22], [0, 30, 40], [0, 31, 41]]
    return transfers.paired_blocks(sent, received, covered_blocks=2, whole_blocks=2)


def test_paired_blocks_places_a_short_list_at_the_end() -> None:
    pairs = _pairs()
    assert [(p.group, p.position, p.sent, p.received) for p in pairs] == [
        (0, 0, 5, 20),
        (0, 1, 6, 21),
        (1, 1, 9, 30),
        (2, 1, 11, 31),
    ]


def test_paired_blocks_leaves_out_the_partial_block_and_null_pairs() -> None:
    # 2.5 blocks of tokens: the third block is partial (D writes into it), so it is not paired;
    # a null block on both sides is skipped, on one side only kept.
    pairs = transfers.paired_blocks([[0, 6, 7], [8]], [[0, 21, 22], [0, 0, 30]], 3, 2)
    assert [(p.group, p.position) for p in pairs] == [(0, 1)]
    pairs = transfers.paired_blocks([[0, 9]], [[4, 30]], 2, 2)
    assert [(p.sent, p.received) for p in pairs] == [(0, 4), (9, 30)]


def test_paired_blocks_refuses_tables_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        transfers.paired_blocks([[1, 2, 3]], [[3, 4, 5]], 2, 2)
    with pytest.raises(ValueError, match="do not fit"):
        transfers.paired_blocks([[1, 2]], [[3]], 2, 2)
    with pytest.raises(ValueError, match="group"):
        transfers.paired_blocks([[1]], [[3], [4]], 1, 1)
    with pytest.raises(ValueError, match="outside"):
        transfers.paired_blocks([[1]], [[3]], 1, 2)


def test_page_reads_name_each_sides_blocks() -> None:
    pairs = _pairs()
    assert transfers.page_reads(pairs, LAYERS, "sent") == [
        ("attn.0", 5),
        ("attn.0", 6),
        ("gdn.0", 9),
        ("gdn.1", 11),
    ]
    assert [b for _, b in transfers.page_reads(pairs, LAYERS, "received")] == [20, 21, 30, 31]
    with pytest.raises(ValueError):
        transfers.page_reads(pairs, LAYERS, "both")


def test_a_faithful_copy_passes() -> None:
    pairs = _pairs()
    copied = transfers.check_copied(_pages(pairs, "sent"), _pages(pairs, "received"))
    assert (copied.pages, copied.states, copied.groups) == (4, 8, (0, 1, 2))
    assert "byte-for-byte" in copied.describe()


def test_one_state_tensor_off_fails_naming_it() -> None:
    pairs = _pairs()
    received = _pages(pairs, "received")
    key = (1, 1, "gdn.0")
    received[key] = (received[key][0], "flipped")
    with pytest.raises(
        AssertionError,
        match=r"1 of 4 page\(s\) differ: group 1 block 1 layer gdn.0 state\(s\) \[1\]",
    ):
        transfers.check_copied(_pages(pairs, "sent"), received)


def test_a_withheld_page_fails() -> None:
    pairs = _pairs()
    received = _pages(pairs, "received")
    del received[(2, 1, "gdn.1")]
    with pytest.raises(AssertionError, match="never received"):
        transfers.check_copied(_pages(pairs, "sent"), received)


def test_nothing_sent_proves_nothing() -> None:
    with pytest.raises(AssertionError, match="proves nothing"):
        transfers.check_copied({}, {})


def test_swapped_control_is_rejected() -> None:
    pairs = _pairs()
    sent, received = _pages(pairs, "sent"), _pages(pairs, "received")
    control = transfers.swapped(received)
    assert control[(0, 0, "attn.0")] == received[(0, 1, "attn.0")]
    with pytest.raises(AssertionError, match="2 of 4 page"):
        transfers.check_copied(sent, control)


def test_swapped_needs_two_distinct_blocks() -> None:
    same = {(0, 0, "a"): ("x",), (0, 1, "a"): ("x",), (1, 1, "b"): ("y",)}
    with pytest.raises(AssertionError, match="nothing to swap"):
        transfers.swapped(same)


def test_keyed_refuses_a_short_read() -> None:
    with pytest.raises(ValueError, match="4 pages read but 3"):
        transfers.keyed(_pairs(), LAYERS, [["a"], ["b"], ["c"]])


def test_table_pages_read_one_sides_table() -> None:
    table = [[5, 6, 7], [0, 9, 10], [3]]
    keys, reads = transfers.table_pages(table, 2, [0, 1], LAYERS)
    assert keys == [(0, 0, "attn.0"), (0, 1, "attn.0"), (1, 1, "gdn.0")]
    assert reads == [("attn.0", 5), ("attn.0", 6), ("gdn.0", 9)]
    with pytest.raises(ValueError, match="2 blocks asked, 1 in table"):
        transfers.table_pages(table, 2, [2], LAYERS)


def test_table_pages_of_two_moments_compare() -> None:
    # The GPU pages of the cold run's blocks, then the restored blocks of the warm run: other
    # block ids, the same bytes where the restore is faithful.
    before_keys, _ = transfers.table_pages([[5, 6], [0, 9]], 2, [0, 1], LAYERS)
    after_keys, _ = transfers.table_pages([[15, 16], [0, 19]], 2, [0, 1], LAYERS)
    assert before_keys == after_keys
    digests = [["x"], ["y"], ["z", "w"]]
    sent = dict(zip(before_keys, map(tuple, digests), strict=True))
    received = dict(zip(after_keys, map(tuple, digests), strict=True))
    assert transfers.check_copied(sent, received).states == 4
    received[(1, 1, "gdn.0")] = ("z", "stale")
    with pytest.raises(AssertionError, match=r"state\(s\) \[1\]"):
        transfers.check_copied(sent, received)


def test_a_group_sent_nothing_pairs_nothing() -> None:
    # A group left out by the caller (another block size) pairs nothing, whatever its table.
    pairs = transfers.paired_blocks([[5, 6], []], [[20, 21, 22], [1]], 2, 2)
    assert [(p.group, p.position) for p in pairs] == [(0, 0), (0, 1)]


def test_checkpoint_column_is_the_block_of_the_last_token() -> None:
    assert transfers.checkpoint_column(256, 128, boundary=True) == 1  # state after 2 blocks
    assert transfers.checkpoint_column(128, 128, boundary=True) == 0
    assert transfers.checkpoint_column(129, 128) == 1  # a running state in the block of token 129
    assert transfers.checkpoint_column(1, 128) == 0
    with pytest.raises(ValueError, match="do not end"):
        transfers.checkpoint_column(320, 128, boundary=True)
    with pytest.raises(ValueError, match="no state"):
        transfers.checkpoint_column(0, 128)
    with pytest.raises(ValueError, match="positive"):
        transfers.checkpoint_column(5, 0)


def test_located_pages_reads_one_column_of_the_mamba_groups() -> None:
    table = [[20, 21, 22], [0, 30, 40], [0, 31, 41]]
    keys, reads = transfers.located_pages(table, 1, [1, 2], LAYERS)
    assert keys == [(1, 1, "gdn.0"), (2, 1, "gdn.1")]
    assert reads == [("gdn.0", 30), ("gdn.1", 31)]
    with pytest.raises(ValueError, match="null block"):
        transfers.located_pages(table, 0, [1], LAYERS)
    with pytest.raises(ValueError, match="outside"):
        transfers.located_pages(table, 3, [1], LAYERS)
    with pytest.raises(ValueError, match="no groups"):
        transfers.located_pages(table, 1, [], LAYERS)


def test_a_consistent_wrong_block_passes_the_copy_check_and_fails_the_located_one() -> None:
    """P's Mamba table holds the checkpoint after one block in column 0 and the state after two
    (N-1) in column 1. A connector that sends column 0 and D writes it where it starts from:
    what D received is a copy of what P sent, but not P's state after N-1."""
    p_table = [[5, 6], [8, 9], [10, 11]]
    d_table = [[20, 21, 22], [0, 30, 40], [0, 31, 41]]
    bytes_of = {  # block id -> what its page holds
        8: "gdn.0 after 128",
        9: "gdn.0 after 256",
        10: "gdn.1 after 128",
        11: "gdn.1 after 256",
    }
    # The wrong-but-consistent transfer: D's column 1 got P's column 0.
    bytes_of.update({30: bytes_of[8], 31: bytes_of[10]})
    sent = [[5, 6], [8], [10]]  # what the connector says it sent (the previous block)
    pairs = transfers.paired_blocks(sent, d_table, covered_blocks=2, whole_blocks=2)
    mamba_pairs = [p for p in pairs if p.group]
    digests = {
        side: [[bytes_of[getattr(p, side)]] for p in mamba_pairs] for side in ("sent", "received")
    }
    transfers.check_copied(
        transfers.keyed(mamba_pairs, LAYERS, digests["sent"]),
        transfers.keyed(mamba_pairs, LAYERS, digests["received"]),
    )  # green: a copy
    column = transfers.checkpoint_column(256, 128, boundary=True)

    def located(table: list[list[int]], at: int) -> dict[transfers.PageKey, tuple[str, ...]]:
        keys, reads = transfers.located_pages(table, at, [1, 2], LAYERS)
        return transfers.keyed_reads(keys, [[bytes_of[block]] for _, block in reads])

    with pytest.raises(AssertionError, match="2 of 2 page"):
        transfers.check_copied(located(p_table, column), located(d_table, column))
    # ... and a faithful transfer passes it, while another layer's state is told apart.
    bytes_of.update({30: bytes_of[9], 31: bytes_of[11]})
    transfers.check_copied(located(p_table, column), located(d_table, column))
    with pytest.raises(AssertionError, match="2 of 2 page"):
        transfers.check_copied(
            transfers.other_layers(located(p_table, column)), located(d_table, column)
        )


def test_other_layers_rotates_the_pages_and_needs_two_distinct() -> None:
    pages = {(1, 1, "gdn.0"): ("a",), (2, 1, "gdn.1"): ("b",), (3, 1, "gdn.2"): ("c",)}
    assert transfers.other_layers(pages) == {
        (1, 1, "gdn.0"): ("b",),
        (2, 1, "gdn.1"): ("c",),
        (3, 1, "gdn.2"): ("a",),
    }
    with pytest.raises(AssertionError, match="fewer than two"):
        transfers.other_layers({(1, 1, "gdn.0"): ("a",), (2, 1, "gdn.1"): ("a",)})


def test_boundary_pages_asks_every_attention_block_and_each_mamba_checkpoint() -> None:
    # 2 whole blocks restored: attention blocks 0 and 1; the Mamba groups' checkpoint after
    # 2 blocks, column 1 (their column 0 may be retired: the null block there is no error).
    table = [[20, 21, 22], [0, 30, 40], [0, 31, 41]]
    keys, reads = transfers.boundary_pages(table, 2, [0, 1, 2], [1, 2], LAYERS)
    assert keys == [(0, 0, "attn.0"), (0, 1, "attn.0"), (1, 1, "gdn.0"), (2, 1, "gdn.1")]
    assert reads == [("attn.0", 20), ("attn.0", 21), ("gdn.0", 30), ("gdn.1", 31)]
    # A Mamba checkpoint that did not come back, or an attention block, is an error.
    with pytest.raises(ValueError, match="null block"):
        transfers.boundary_pages([[20, 21], [0, 0], [0, 31]], 2, [0, 1, 2], [1, 2], LAYERS)
    with pytest.raises(ValueError, match="null block"):
        transfers.boundary_pages([[0, 21], [0, 30], [0, 31]], 2, [0, 1, 2], [1, 2], LAYERS)
    with pytest.raises(ValueError, match="restores nothing"):
        transfers.boundary_pages(table, 0, [0], [], LAYERS)


def test_a_restore_of_the_previous_checkpoint_fails_at_the_harness_places() -> None:
    """The warm table's Mamba column 1 got the state after one block (a consistent shift):
    the cold run's checkpoint at the harness's column tells it."""
    cold_table = [[20, 21, 22], [29, 30, 40], [0, 31, 41]]
    warm_table = [[50, 51, 52], [0, 60, 70], [0, 61, 71]]
    bytes_of = {20: "a0", 21: "a1", 29: "g0@128", 30: "g0@256", 31: "g1@256"}
    bytes_of.update({50: "a0", 51: "a1", 60: "g0@128", 61: "g1@256"})  # group 1 shifted

    def pages(table: list[list[int]]) -> dict[transfers.PageKey, tuple[str, ...]]:
        keys, reads = transfers.boundary_pages(table, 2, [0, 1, 2], [1, 2], LAYERS)
        return transfers.keyed_reads(keys, [[bytes_of[b]] for _, b in reads])

    with pytest.raises(AssertionError, match=r"1 of 4 page\(s\) differ: group 1 block 1"):
        transfers.check_copied(pages(cold_table), pages(warm_table))
    bytes_of[60] = "g0@256"
    transfers.check_copied(pages(cold_table), pages(warm_table))
