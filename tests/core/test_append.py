"""The append path's two steps on hand-built sequences: `plan_append` then `apply_append`."""

import numpy as np
import pytest

from radixkv.errors import InvalidArgument, UnknownSequence
from radixkv.kv_cache import KVCache
from radixkv.memory.block_pool import NO_BLOCKS, BlockPool
from radixkv.memory.block_table import BlockTable
from radixkv.sequences.append import apply_append, plan_append
from radixkv.sequences.sequence import LiveSequence
from radixkv.tree.radix_node import Node
from radixkv.tree.token_ids import TokenKey

BLOCK_SIZE = 4


def sequence(seq_id: int, block_table: list[int], num_tokens: int) -> LiveSequence:
    tail = bytearray(TokenKey.of(list(range(num_tokens))).data)
    root = Node(b"", NO_BLOCKS, None, "default")
    table = BlockTable.of([np.array(block_table, dtype=np.int32)])
    return LiveSequence(seq_id, "default", tail, table, root, 0, NO_BLOCKS, num_tokens, num_tokens)


def test_a_shared_partial_last_block_is_copied_by_all_but_its_last_holder():
    pool = BlockPool(8)
    table = pool.allocate(2)  # 6 tokens: the second block is partial
    pool.incref([table[1]])  # a fork sibling shares it
    first, second = sequence(1, list(table), 6), sequence(2, list(table), 6)
    copied_away: dict[int, int] = {}
    assert plan_append(first, 3, BLOCK_SIZE, pool.ref_counts, copied_away) == (2, table[1])  # a copy + 1 new block
    assert plan_append(second, 3, BLOCK_SIZE, pool.ref_counts, copied_away) == (
        1,
        None,
    )  # the last holder writes in place
    assert pool.ref_counts[table[1]] == 2, "planning changes nothing"


def test_a_full_last_block_needs_no_copy_and_apply_follows_the_plan():
    pool = BlockPool(8)
    table = pool.allocate(2)
    seq = sequence(1, list(table), 8)  # both blocks full
    num_new, cow_src = plan_append(seq, 5, BLOCK_SIZE, pool.ref_counts, {})
    assert (num_new, cow_src) == (2, None)
    offset = apply_append(seq, memoryview(TokenKey.of([7] * 5).data), 5, cow_src, pool.allocate(num_new), pool)
    assert offset == 2 and len(seq.block_table) == 4
    assert (seq.num_tokens, seq.num_computed_tokens) == (13, 8)  # appending marks the earlier tokens computed


def test_apply_swaps_the_copied_block_and_drops_its_hold():
    pool = BlockPool(8)
    table = pool.allocate(2)
    pool.incref([table[1]])
    seq = sequence(1, list(table), 6)
    num_new, cow_src = plan_append(seq, 1, BLOCK_SIZE, pool.ref_counts, {})
    assert (num_new, cow_src) == (1, table[1])
    new_blocks = pool.allocate(num_new)
    offset = apply_append(seq, memoryview(TokenKey.of([7]).data), 1, cow_src, new_blocks, pool)
    assert offset == 1 and seq.block_table.tolist() == [table[0], new_blocks[0]]
    assert pool.ref_counts[table[1]] == 1  # the sibling's hold is left


@pytest.mark.parametrize(
    ("bad", "field", "error"),
    [
        (2.0, "seq_ids[1]", InvalidArgument),  # equal to a live id as a dict key, but not an integer
        (np.int64(0), "seq_ids[1]", InvalidArgument),
        ([0], "seq_ids[1]", InvalidArgument),  # unhashable
        (10**6, None, UnknownSequence),
    ],
)
def test_a_decode_batch_names_its_bad_entry_and_changes_nothing(bad: object, field: str | None, error: type) -> None:
    cache = KVCache(64, BLOCK_SIZE)
    ids = [r.seq_id for r in cache.open_many([([1, 2, 3], "a"), ([4, 5, 6], "b"), ([7, 8, 9], "c")])]
    before = [cache.block_table(s) for s in ids], [cache.num_tokens(s) for s in ids]
    with pytest.raises(error) as refused:
        cache.append_batch([ids[0], bad, ids[2]], [1, 1, 1], [5, 5, 5])  # type: ignore[list-item]
    if field is not None:
        assert refused.value.field == field  # type: ignore[attr-defined]
    assert ([cache.block_table(s) for s in ids], [cache.num_tokens(s) for s in ids]) == before
    cache.check_invariants()
    grown = cache.append_batch(ids, [1, 2, 1], [5, 6, 7, 8])  # the same batch, all entries good
    assert grown.num_tokens == [4, 5, 4] and grown.slots.tolist() == [
        cache.block_table(ids[0])[0] * BLOCK_SIZE + 3,
        cache.block_table(ids[1])[0] * BLOCK_SIZE + 3,
        cache.block_table(ids[1])[1] * BLOCK_SIZE + 0,
        cache.block_table(ids[2])[0] * BLOCK_SIZE + 3,
    ]
