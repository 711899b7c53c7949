"""The append path's two steps on hand-built sequences: `plan` then `apply`, over the decode columns."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import radixkv.append as append_module
from radixkv.append import apply, plan
from radixkv.block_pool import NO_BLOCKS, BlockPool
from radixkv.block_table import BlockTable
from radixkv.errors import InvalidArgument, LimitExceeded, OutOfBlocks, UnknownSequence
from radixkv.kv_cache import KVCache, Limits
from radixkv.preemption import all_token_bytes
from radixkv.radix_node import Node
from radixkv.sequence import LiveSequence, Sequences
from radixkv.token_ids import TokenKey

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def sequence(sequences: Sequences, block_table: list[int], num_tokens: int, tail: bool = True) -> LiveSequence:
    """A sequence holding `block_table` with tokens 0..num_tokens-1 (`tail=False`: its blocks' rows hold them)."""
    root = Node(b"", NO_BLOCKS, None, "default")
    table = BlockTable.of([np.array(block_table, dtype=np.int32)])
    tokens = TokenKey.of(list(range(num_tokens))).data if tail else None
    seq = LiveSequence(
        sequences.columns, sequences.next_id(), "default", tokens, table, root, 0, NO_BLOCKS, num_tokens, num_tokens
    )
    sequences.add(seq)
    return seq


def tokens_of(seq: LiveSequence) -> list[int]:
    return np.frombuffer(seq.tail_bytes, dtype="<i4").tolist()


def test_a_shared_partial_last_block_is_copied_by_all_but_its_last_holder():
    pool, sequences = BlockPool(NUM_BLOCKS), Sequences(0, NUM_BLOCKS, BLOCK_SIZE)
    table = pool.allocate(2).tolist()  # 6 tokens: the second block is partial
    pool.incref([table[1]])  # a fork sibling shares it
    first, second = sequence(sequences, table, 6), sequence(sequences, table, 6, tail=False)
    rows = sequences.rows([first.seq_id, second.seq_id])
    planned = plan(sequences.columns, rows, [3, 3], 100, pool.ref_counts)
    assert planned.copied == {0: table[1]} and planned.num_new.tolist() == [2, 1]  # a copy + 1 new block; in place
    assert pool.ref_counts[table[1]] == 2, "planning changes nothing"
    assert (first.num_tokens, second.num_tokens) == (6, 6), "planning changes nothing"
    only_second = plan(sequences.columns, rows[1:], [3], 100, pool.ref_counts)
    assert only_second.copied == {0: table[1]}, "a holder outside the batch still reads the block: copy"


def test_a_full_last_block_needs_no_copy_and_apply_follows_the_plan():
    pool, sequences = BlockPool(NUM_BLOCKS), Sequences(0, NUM_BLOCKS, BLOCK_SIZE)
    table = pool.allocate(2).tolist()
    seq = sequence(sequences, table, 8)  # both blocks full
    planned = plan(sequences.columns, sequences.rows([seq.seq_id]), [5], 100, pool.ref_counts)
    assert planned.num_new.tolist() == [2] and not planned.copied and planned.num_drawn == 0
    new_blocks = pool.allocate(planned.num_blocks)
    num_tokens, offsets, copies, slots = apply(sequences.columns, planned, new_blocks, TokenKey.of([7] * 5).data, pool)
    assert (num_tokens, offsets, copies) == ([13], [2], []) and seq.block_table.tolist() == table + new_blocks.tolist()
    assert (seq.num_tokens, seq.num_computed_tokens) == (13, 8)  # appending marks the earlier tokens computed
    first_new = int(new_blocks[0]) * BLOCK_SIZE
    assert slots.tolist() == [*range(first_new, first_new + 4), int(new_blocks[1]) * BLOCK_SIZE]
    assert tokens_of(seq) == [*range(8), 7, 7, 7, 7, 7]


def test_apply_copies_the_shared_block_and_its_tokens_and_drops_its_hold():
    pool, sequences = BlockPool(NUM_BLOCKS), Sequences(0, NUM_BLOCKS, BLOCK_SIZE)
    table = pool.allocate(2).tolist()
    pool.incref([table[1]])
    seq, sibling = sequence(sequences, table, 6), sequence(sequences, table, 6, tail=False)
    planned = plan(sequences.columns, sequences.rows([seq.seq_id]), [1], 100, pool.ref_counts)
    assert planned.copied == {0: table[1]} and planned.num_new.tolist() == [1]
    new_blocks = pool.allocate(planned.num_blocks)
    _, offsets, copies, _ = apply(sequences.columns, planned, new_blocks, TokenKey.of([70]).data, pool)
    assert offsets == [1] and copies == [(table[1], int(new_blocks[0]), 0)]
    assert seq.block_table.tolist() == [table[0], int(new_blocks[0])] and sibling.block_table.tolist() == table
    assert pool.ref_counts[table[1]] == 1  # the sibling's hold is left
    assert tokens_of(seq) == [0, 1, 2, 3, 4, 5, 70], "the copy took the shared block's token ids, then the new one"
    assert tokens_of(sibling) == [0, 1, 2, 3, 4, 5], "the sibling's block is left as it was"


def test_a_reservation_covers_growth_up_to_it_and_no_copy():
    pool, sequences = BlockPool(NUM_BLOCKS), Sequences(0, NUM_BLOCKS, BLOCK_SIZE)
    root = Node(b"", NO_BLOCKS, None, "default")
    table = BlockTable.of([pool.allocate(1)])
    seq = LiveSequence(sequences.columns, 0, "default", b"\0" * 16, table, root, 0, NO_BLOCKS, 4, 4, 0, 3)
    sequences.add(seq)
    planned = plan(sequences.columns, sequences.rows([0]), [13], 100, pool.ref_counts)  # 17 tokens: 5 blocks
    assert planned.num_blocks == 4 and planned.num_drawn == 2  # the reservation reaches table length 3
    with pytest.raises(LimitExceeded):
        plan(sequences.columns, sequences.rows([0]), [97], 100, pool.ref_counts)


def test_rows_are_reused_and_a_batch_may_name_a_sequence_once():
    sequences = Sequences(0, NUM_BLOCKS, BLOCK_SIZE)
    first, second = sequence(sequences, [0], 2), sequence(sequences, [1], 2)
    with pytest.raises(InvalidArgument, match="twice"):
        sequences.rows([first.seq_id, second.seq_id, first.seq_id])
    row = first.row
    sequences.remove(first)
    third = sequence(sequences, [2], 3)
    assert third.row == row and sequences.batch([third.seq_id, second.seq_id]) == [third, second]
    assert sequences.columns.num_rows_used() == 2
    many = [sequence(sequences, [3 + i % 8], 1) for i in range(100)]  # past the first capacity: the columns grow
    assert [s.num_tokens for s in many] == [1] * 100 and (second.num_tokens, third.num_tokens) == (2, 3)


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


def test_a_batch_named_again_finds_the_same_rows_until_a_sequence_comes_or_goes() -> None:
    cache, n = KVCache(256, BLOCK_SIZE), append_module.SMALL_BATCH  # a batch the columns take
    ids = [r.seq_id for r in cache.open_many([([i, i + 1, i + 2], "a") for i in range(n)])]
    cache.append_batch(ids, [1] * n, [7] * n)
    cache.append_batch(list(ids), [1] * n, [9] * n)  # the next decode step, in another list
    with pytest.raises(InvalidArgument):
        cache.append_batch([float(s) for s in ids], [1] * n, [0] * n)  # equal to the batch before, still refused
    cache.release(ids[0])
    with pytest.raises(UnknownSequence):
        cache.append_batch(ids, [1] * n, [0] * n)
    other = cache.open([1, 2, 3, 4, 5, 6]).seq_id  # takes the row the released one left
    cache.append_batch([other, *ids[1:]], [1] * n, list(range(n)))
    assert (cache.num_tokens(other), cache.num_tokens(ids[1])) == (7, 6)
    live = {s: all_token_bytes(cache._sequences.get(s)) for s in (other, ids[1])}
    assert live == {other: TokenKey.of([1, 2, 3, 4, 5, 6, 0]).data, ids[1]: TokenKey.of([1, 2, 3, 7, 9, 1]).data}
    cache.check_invariants()


def _appended(cache: KVCache, ids: list[int], counts: list[int], tokens: list[int], small: int) -> object:
    """`append_batch` with batches below `small` sequences taken one at a time (as `_append_few` does)."""
    kept = append_module.SMALL_BATCH
    append_module.SMALL_BATCH = small
    try:
        return cache.append_batch(ids, counts, tokens)
    except (LimitExceeded, OutOfBlocks) as e:
        return type(e)
    finally:
        append_module.SMALL_BATCH = kept


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 11), min_size=1, max_size=5),
    forks=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), max_size=3),
    steps=st.lists(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=8), max_size=4),
)
def test_a_batch_one_at_a_time_and_by_columns_are_the_same_append(
    prompts: list[int], forks: list[tuple[int, int]], steps: list[list[tuple[int, int]]]
) -> None:
    """Twin caches, the same history: each batch by `_append_few` in one, by the columns in the other."""
    caches = [KVCache(48, BLOCK_SIZE, Limits(max_tokens_per_request=40)) for _ in range(2)]
    for cache in caches:
        ids = [cache.open(list(range(100 * i, 100 * i + n))).seq_id for i, n in enumerate(prompts)]
        for parent, n in forks:  # shared partial last blocks: copy-on-write in the appends below
            ids += cache.fork(ids[parent % len(ids)], n)
    for step in steps:
        batch = list(dict.fromkeys(ids[i % len(ids)] for i, _ in step))  # each sequence once
        counts = [n for _, n in step][: len(batch)]
        tokens = list(range(sum(counts)))
        one_at_a_time = _appended(caches[0], batch, counts, tokens, small=10**6)
        by_columns = _appended(caches[1], batch, counts, tokens, small=0)
        if isinstance(one_at_a_time, type):
            assert one_at_a_time is by_columns, "both refuse alike"
            continue
        assert not isinstance(by_columns, type)
        columns = ("num_tokens", "table_offsets", "num_block_ids", "block_ids", "copies")
        assert [getattr(one_at_a_time, c) for c in columns] == [getattr(by_columns, c) for c in columns]
        assert one_at_a_time.slots.tolist() == by_columns.slots.tolist()  # type: ignore[attr-defined]
    for cache in caches:
        cache.check_invariants()
    states = [
        {s: (c.block_table(s), c.num_computed_tokens(s), all_token_bytes(c._sequences.get(s))) for s in ids}
        for c in caches
    ]
    assert states[0] == states[1]
    assert caches[0].pool.ref_counts.tolist() == caches[1].pool.ref_counts.tolist()
