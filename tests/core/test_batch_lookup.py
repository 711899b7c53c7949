"""Finding a batch's sequences (`Sequences.batch`): a decode loop's batch, asked for again, is found again.

The last batch found is kept until a sequence comes or goes; a batch equal to it is answered from it.
It must answer exactly what a fresh lookup would: the same sequences, and the same refusals.
"""

import numpy as np
import pytest

from radixkv import KVCache
from radixkv.errors import InvalidArgument, SequencePreempted, UnknownSequence

BLOCK_SIZE = 4


def opened(cache: KVCache, num: int) -> list[int]:
    return [r.seq_id for r in cache.open_many([([100 * i + t for t in range(5)], "default") for i in range(num)])]


def test_the_same_batch_again_appends_to_the_same_sequences_until_one_is_released() -> None:
    cache = KVCache(64, BLOCK_SIZE)
    a, b, c = opened(cache, 3)
    for step in range(3):
        cache.append_batch([a, b], [1, 1], [step, step])
    assert [cache.num_tokens(s) for s in (a, b, c)] == [8, 8, 5]
    cache.release(b, cache=False)
    with pytest.raises(UnknownSequence):
        cache.append_batch([a, b], [1, 1], [9, 9])
    assert cache.num_tokens(a) == 8, "a refused batch changes nothing"
    cache.append_batch([a], [1], [9])
    assert cache.num_tokens(a) == 9
    cache.check_invariants()


def test_a_preempted_sequence_in_the_last_batch_is_refused_as_preempted() -> None:
    cache = KVCache(64, BLOCK_SIZE)
    a, b = opened(cache, 2)
    cache.append_batch([a, b], [1, 1], [1, 1])
    cache.preempt([b], "recompute")
    with pytest.raises(SequencePreempted):
        cache.append_batch([a, b], [1, 1], [2, 2])
    cache.check_invariants()


@pytest.mark.parametrize("as_entry", [float, np.int64, str], ids=["float", "numpy int", "str"])
def test_an_entry_equal_to_the_last_batchs_id_but_not_an_int_is_refused(as_entry) -> None:  # type: ignore[no-untyped-def]
    cache = KVCache(64, BLOCK_SIZE)
    a, b = opened(cache, 2)
    cache.append_batch([a, b], [1, 1], [1, 1])
    with pytest.raises(InvalidArgument) as refused:
        cache.append_batch([as_entry(a), b], [1, 1], [2, 2])
    assert refused.value.metadata["field"] == "seq_ids[0]"
    assert [cache.num_tokens(s) for s in (a, b)] == [6, 6]


def test_a_batch_list_changed_in_place_is_looked_up_again() -> None:
    cache = KVCache(64, BLOCK_SIZE)
    a, b, c = opened(cache, 3)
    batch = [a, b]
    cache.append_batch(batch, [1, 1], [1, 1])
    batch[1] = c  # the same list object, other contents
    cache.append_batch(batch, [1, 1], [2, 2])
    assert [cache.num_tokens(s) for s in (a, b, c)] == [7, 6, 6]
    batch.append(a)  # now a duplicate
    with pytest.raises(InvalidArgument, match="appears twice"):
        cache.append_batch(batch, [1, 1, 1], [3, 3, 3])


def test_the_sequences_found_are_the_callers_to_change() -> None:
    cache = KVCache(64, BLOCK_SIZE)
    a, b = opened(cache, 2)
    sequences = cache._sequences
    found = sequences.batch([a, b])
    found.pop()
    assert [s.seq_id for s in sequences.batch([a, b])] == [a, b]
