"""glm5_matrix.verdicts.tp_split: what part of a TP1 page a rank holds, from the config alone."""

from __future__ import annotations

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.verdicts import tp_split

# tiny-hybrid-cpu-tp's head counts; head dims of their own, so that q/k and v differ in size
CONFIG = {
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 64,
    "num_key_value_heads": 1,
}


def test_gdn_conv_splits_q_k_v_and_recurrent_splits_heads():
    assert tp_split.gdn_split(CONFIG, 2) == [[128, 128, 256], [4]]
    assert tp_split.flat_split(tp_split.gdn_split(CONFIG, 2)) == [[512], [4]]


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(UserError, match="does not split the GDN heads"):
        tp_split.gdn_split(CONFIG, 3)


def test_a_replicated_attention_page_is_whole_and_a_split_one_refused():
    assert tp_split.attention_split(CONFIG, 2) == [None]
    with pytest.raises(UserError, match="split over TP2"):
        tp_split.attention_split({**CONFIG, "num_key_value_heads": 2}, 2)


def test_layer_splits_by_group():
    splits = tp_split.layer_splits(CONFIG, [["gdn0"], ["attn3"]], [0], 2)
    assert splits == {"gdn0": [[128, 128, 256], [4]], "attn3": [None]}


def test_next_rank_keys_is_the_next_ranks_page():
    pages = {
        (0, 1, tp_split.rank_key(0, "gdn0")): ("a",),
        (0, 1, tp_split.rank_key(1, "gdn0")): ("b",),
    }
    shifted = tp_split.next_rank_keys(pages, 2)
    assert shifted == {(0, 1, "rank0/gdn0"): ("b",), (0, 1, "rank1/gdn0"): ("a",)}
    assert tp_split.rank_of("rank1/gdn0") == 1
