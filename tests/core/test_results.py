"""The core's results: slots follow lazily from a plan and equal block * block_size + offset; per-sequence
views of a batch."""

from __future__ import annotations

import numpy as np

from radixkv import KVCache
from radixkv.sequences.results import SlotPlan, as_slots


def test_slot_plan_is_block_times_block_size_plus_offset() -> None:
    # Two sequences: the first writes 3 tokens from position 2 of blocks [7, 9]; the second 2 tokens
    # from position 1 of block [4] (span positions count within the concatenated span_blocks).
    plan = SlotPlan(block_size=4, span_blocks=[7, 9, 4], span_starts=[2, 9], counts=[3, 2])
    assert plan.computed is None  # nothing is computed until read
    assert plan.slots().tolist() == [7 * 4 + 2, 7 * 4 + 3, 9 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    assert plan.computed is not None and plan.slots() is plan.computed  # computed once, kept


def test_as_slots_passes_an_array_through() -> None:
    array = np.array([5, 6], dtype=np.int64)
    assert as_slots(array) is array


def test_an_append_batch_reads_per_sequence_as_the_single_calls_would() -> None:
    cache = KVCache(num_blocks=16, block_size=4)
    a, b = cache.open([1, 2, 3]), cache.open([10, 11, 12, 13])
    batch = cache.append_batch([a.seq_id, b.seq_id], [2, 1], [4, 5, 14])
    first, second = batch.results()
    assert (first.seq_id, first.num_tokens, second.seq_id, second.num_tokens) == (a.seq_id, 5, b.seq_id, 5)
    assert first.slots.tolist() == [a.block_table[0] * 4 + 3, cache.block_table(a.seq_id)[1] * 4]
    assert second.slots.tolist() == [cache.block_table(b.seq_id)[1] * 4]
    assert batch.slots.tolist() == first.slots.tolist() + second.slots.tolist()
    assert first.block_ids == cache.block_table(a.seq_id)[first.table_offset :]
    assert batch.copy_pairs().shape == (0, 2) and first.copies == [] and second.copies == []
