"""A sequence's block table as a growable int32 buffer: views handed out stay the snapshots they were."""

import numpy as np
import pytest

from radixkv import KVCache
from radixkv.sequences.sequence import BlockTable


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_of_joins_the_parts_and_extend_grows_past_the_room_it_had():
    table = BlockTable.of([ids(4, 5), ids(), ids(6)])
    assert table.tolist() == [4, 5, 6] and len(table) == 3 and table.last == 6
    for block_id in range(100, 140):  # past the initial room of 16: the buffer moves and keeps every entry
        table.extend(ids(block_id))
    assert table.tolist() == [4, 5, 6, *range(100, 140)]
    assert table[1:4].tolist() == [5, 6, 100]


def test_append_adds_one_block_and_moves_the_buffer_when_full_leaving_views_as_they_were():
    table = BlockTable(np.empty(0, dtype=np.int32), 0)  # no room at all: the first append makes some
    assert table.last == -1
    views = []
    for block_id in range(40):
        table.append(block_id)
        views.append(table.array())
        assert table.last == block_id and len(table) == block_id + 1
    assert table.tolist() == list(range(40))
    assert [v.tolist() for v in views] == [list(range(n + 1)) for n in range(40)]


def test_a_view_is_read_only_and_unchanged_by_later_appends_and_copy_on_write():
    table = BlockTable.of([ids(1, 2, 3)])
    view = table.array()
    with pytest.raises(ValueError):
        view[0] = 9
    table.extend(ids(4))
    table.set_last(7)
    table.set_last(8)  # the buffer moved once; a second rewrite stays in the new one
    assert view.tolist() == [1, 2, 3]
    assert table.tolist() == [1, 2, 3, 8]


def test_a_copy_is_independent():
    table = BlockTable.of([ids(1, 2)])
    child = table.copy()
    child.set_last(5)
    child.extend(ids(6))
    assert table.tolist() == [1, 2] and child.tolist() == [1, 5, 6]


def test_an_open_result_keeps_its_table_when_the_sequence_copies_its_last_block_on_write():
    cache = KVCache(16, 4)
    opened = cache.open(list(range(6)))  # 2 blocks, the second partial
    cache.commit([opened.seq_id], [6])
    [child] = cache.fork(opened.seq_id)
    before = opened.block_table.tolist()
    appended = cache.append(opened.seq_id, [9])  # the shared partial block is copied for the parent
    assert appended.copies and cache.block_table(opened.seq_id)[-1] != before[-1]
    assert opened.block_table.tolist() == before, "the result is a snapshot, not a live view"
    assert opened.block_table.dtype == np.int32
    assert cache.block_table(child) == before
    cache.check_invariants()


def test_tree_nodes_hold_int32_arrays_that_eviction_trims_by_slicing():
    cache = KVCache(8, 1)
    opened = cache.open(list(range(6)))
    cache.commit([opened.seq_id], [6])
    cache.release(opened.seq_id)
    [(_, node)] = list(cache.tree.nodes())
    assert node.block_ids.dtype == np.int32 and node.block_ids.tolist() == opened.block_table.tolist()
    assert cache.evict(2) == 2
    assert node.block_ids.tolist() == opened.block_table[:4].tolist(), "the tail went, the head stayed"
    cache.check_invariants()
