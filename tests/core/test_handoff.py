"""The worker hand-off in numpy: one step's slots, copies, padded block tables and lengths, as the kernels take them."""

from __future__ import annotations

import pickle

import numpy as np

from radixkv import KVCache
from radixkv.sequences.handoff import StepArrays, copy_pairs, padded_block_tables

NUM_BLOCKS, BLOCK_SIZE = 32, 4


def test_opens_and_an_append_make_one_step_with_the_kernels_dtypes() -> None:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    a, b = cache.open_many([(list(range(9)), "default"), (list(range(50, 53)), "default")])
    opens = StepArrays.from_opens([a, b])
    assert opens.seq_ids.dtype == np.int64 and opens.seq_ids.tolist() == [a.seq_id, b.seq_id]
    assert opens.slots.dtype == np.int64 and opens.slots.tolist() == [*a.slots.tolist(), *b.slots.tolist()]
    assert opens.block_tables.dtype == np.int32 and opens.block_tables.shape == (2, 3)
    assert opens.block_tables[1].tolist() == [*b.block_table, 0, 0], "short rows padded with zeros"
    assert opens.seq_lens.dtype == np.int32 and opens.seq_lens.tolist() == [9, 3]
    assert opens.query_starts.tolist() == [0, 9, 12] and opens.num_new_tokens.tolist() == [9, 3]
    assert opens.copies.dtype == np.int64 and opens.copies.shape == (0, 2)
    assert a.step_arrays().slots.tolist() == a.slots.tolist()

    batch = cache.append_batch([b.seq_id], [2], [53, 54])
    decode = batch.step_arrays(cache.block_table)
    both = StepArrays.concat([opens, decode])
    assert both.block_tables.shape == (3, 3) and both.query_starts.tolist() == [0, 9, 12, 14]
    assert both.seq_lens.tolist() == [9, 3, 5]
    again = pickle.loads(pickle.dumps(both))  # an orchestrator sends it to a worker process as it is
    assert again.slots.tolist() == both.slots.tolist() and again.block_tables.tolist() == both.block_tables.tolist()


def test_a_fork_then_append_hands_over_its_copy_on_write_pair() -> None:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE)
    parent = cache.open([1, 2, 3, 4, 5, 6])  # the second block is partial
    cache.commit([parent.seq_id], [6])
    (child,) = cache.fork(parent.seq_id)
    batch = cache.append_batch([child], [1], [7])
    step = batch.step_arrays(cache.block_table)
    assert step.copies.shape == (1, 2)
    src, dst = step.copies[0].tolist()
    assert src == parent.block_table[1] and dst == cache.block_table(child)[1] and src != dst
    assert step.slots.tolist() == [dst * BLOCK_SIZE + 2]  # the child's 7th token lands in its own copy


def test_padding_and_pairs_of_nothing_keep_their_shapes() -> None:
    assert padded_block_tables([]).shape == (0, 0)
    assert padded_block_tables([[5], [], [1, 2]]).tolist() == [[5, 0], [0, 0], [1, 2]]
    assert copy_pairs([]).shape == (0, 2) and copy_pairs([(3, 4, 9)]).tolist() == [[3, 4]]
    assert StepArrays.concat([]).seq_ids.shape == (0,)
