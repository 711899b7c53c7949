"""The append path's two steps on hand-built sequences: `plan_batch` then `apply_plan`."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.errors import InvalidArgument, LimitExceeded, UnknownSequence
from radixkv.kv_cache import KVCache
from radixkv.memory.block_pool import NO_BLOCKS, BlockPool
from radixkv.sequences import append as append_module
from radixkv.sequences.append import apply_plan, plan_batch
from radixkv.sequences.sequence import BlockTable, LiveSequence, Sequences
from radixkv.tree.radix_tree import Node, TokenKey
from tests.examples import examples

BLOCK_SIZE = 4


@pytest.fixture(autouse=True, params=["per sequence", "in columns"])
def shape(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs both shapes of the one path: the small batch's loop and the large batch's columns."""
    monkeypatch.setattr(append_module, "SMALL_BATCH", 8 if request.param == "per sequence" else 0)


def sequence(registry: Sequences, block_table: list[int], num_tokens: int) -> LiveSequence:
    """A registered sequence holding `block_table` (its own, by count) for `num_tokens` tokens."""
    tail = bytearray(TokenKey.of(list(range(num_tokens))).data)
    root = Node(b"", NO_BLOCKS, None, namespace="default")
    table = BlockTable.of([np.array(block_table, dtype=np.int32)])
    seq = LiveSequence(
        registry.next_id(),
        namespace="default",
        tail=tail,
        block_table=table,
        lock_node=root,
        num_tree_blocks=0,
        private_prefix=NO_BLOCKS,
        num_tokens=num_tokens,
        num_computed_tokens=num_tokens,
    )
    registry.add(seq)
    return seq


def test_a_shared_partial_last_block_is_copied_by_all_but_its_last_holder():
    pool = BlockPool(8)
    table = pool.allocate(2)  # 6 tokens: the second block is partial
    pool.incref([table[1]])  # a fork sibling shares it
    registry = Sequences(1)
    first, second = sequence(registry, list(table), 6), sequence(registry, list(table), 6)
    plan = plan_batch(registry, [first.seq_id, second.seq_id], [3, 3], BLOCK_SIZE, 100, pool.ref_counts)
    assert list(plan.copies) == [1, 0]  # the last holder writes in place
    assert list(plan.num_new) == [1, 1] and plan.num_blocks == 3
    assert pool.ref_counts[table[1]] == 2, "planning changes nothing"
    alone = plan_batch(registry, [first.seq_id], [3], BLOCK_SIZE, 100, pool.ref_counts)
    assert list(alone.copies) == [1], "a holder left outside the batch: the writer copies"


def test_a_full_last_block_needs_no_copy_and_apply_follows_the_plan():
    pool = BlockPool(8)
    table = pool.allocate(2)
    registry = Sequences(1)
    seq = sequence(registry, list(table), 8)  # both blocks full
    plan = plan_batch(registry, [seq.seq_id], [5], BLOCK_SIZE, 100, pool.ref_counts)
    assert (list(plan.num_new), list(plan.copies)) == ([2], [0])
    new_blocks = pool.allocate(plan.num_blocks)
    key = TokenKey.of([7] * 5).data
    batch = apply_plan(registry, [seq.seq_id], [5], plan, new_blocks, key, pool, BLOCK_SIZE)
    assert batch.table_offsets == [2] and len(seq.block_table) == 4
    assert (seq.num_tokens, seq.num_computed_tokens) == (13, 8)  # appending marks the earlier tokens computed
    assert batch.slots.tolist() == [int(b) * BLOCK_SIZE + o for b in new_blocks for o in range(4)][:5]


def test_apply_swaps_the_copied_block_and_drops_its_hold():
    pool = BlockPool(8)
    table = pool.allocate(2)
    pool.incref([table[1]])
    registry = Sequences(1)
    seq = sequence(registry, list(table), 6)
    plan = plan_batch(registry, [seq.seq_id], [1], BLOCK_SIZE, 100, pool.ref_counts)
    assert (list(plan.num_new), list(plan.copies)) == ([0], [1])
    new_blocks = pool.allocate(plan.num_blocks)
    key = TokenKey.of([7]).data
    batch = apply_plan(registry, [seq.seq_id], [1], plan, new_blocks, key, pool, BLOCK_SIZE)
    assert batch.table_offsets == [1] and seq.block_table.tolist() == [table[0], new_blocks[0]]
    assert batch.copies == [(table[1], new_blocks[0], 0)]
    assert pool.ref_counts[table[1]] == 1  # the sibling's hold is left
    assert batch.slots.tolist() == [int(new_blocks[0]) * BLOCK_SIZE + 2]


def test_a_sequence_past_its_limit_refuses_the_batch_naming_its_length():
    pool = BlockPool(8)
    registry = Sequences(1)
    short, long = sequence(registry, list(pool.allocate(1)), 3), sequence(registry, list(pool.allocate(2)), 6)
    with pytest.raises(LimitExceeded) as refused:
        plan_batch(registry, [short.seq_id, long.seq_id], [2, 2], BLOCK_SIZE, 7, pool.ref_counts)
    assert refused.value.requested == 8


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


def _family_cache(prompts: list[int], forks: list[int], written: list[bool]) -> tuple[KVCache, list[int]]:
    """Groups of sequences as a decode batch holds them: group g opens a prompt of `prompts[g]` tokens and forks
    `forks[g]` children (parallel samples or beams), all sharing its blocks, its partial last one included;
    `written[g]`: its prompt's K/V is committed before the fork, so the full blocks are the tree's."""
    cache = KVCache(512, BLOCK_SIZE)
    seq_ids = []
    for g, (n, k, w) in enumerate(zip(prompts, forks, written, strict=True)):
        opened = cache.open([1000 * g + t for t in range(n)])
        if w:
            cache.commit([opened.seq_id], [n])
        seq_ids += [opened.seq_id, *(cache.fork(opened.seq_id, k) if k else [])]
    return cache, seq_ids


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 14), st.integers(0, 3), st.booleans()), min_size=1, max_size=6),
    st.data(),
    st.booleans(),
)
def test_a_mixed_batch_equals_its_sequences_appended_one_at_a_time(groups, data, in_columns):
    """Plain +1 appends, forked beams sharing a partial block and parallel samples in one batch: the block tables,
    ref counts, copy-on-write pairs and slots are those of appending the sequences one at a time, in batch order
    (the batch's "last holder writes in place" is what the one-at-a-time order gives: the earlier ones copied
    the block away). Both shapes of the one path, whatever the batch's size."""
    prompts, forks, written = (list(c) for c in zip(*groups, strict=True))
    batched, batch_ids = _family_cache(prompts, forks, written)
    single, single_ids = _family_cache(prompts, forks, written)
    assert batch_ids == single_ids
    order = data.draw(st.permutations(batch_ids))
    counts = data.draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, 5]), min_size=len(order), max_size=len(order)))
    if data.draw(st.booleans(), label="a decode step"):  # one token each: its copy or its next block, never both
        counts = [1] * len(order)
    tokens = list(range(7000, 7000 + sum(counts)))
    saved = append_module.SMALL_BATCH
    append_module.SMALL_BATCH = 0 if in_columns else 1 << 20
    try:
        batch = batched.append_batch(order, counts, tokens)
    finally:
        append_module.SMALL_BATCH = saved
    expected, pos = [], 0
    for seq_id, n in zip(order, counts, strict=True):
        expected.append(single.append(seq_id, tokens[pos : pos + n]))
        pos += n
    assert [batched.block_table(s) for s in order] == [single.block_table(s) for s in order]
    assert batched.pool.ref_counts.tolist() == single.pool.ref_counts.tolist()
    assert [(src, dst) for src, dst, _ in batch.copies] == [c for r in expected for c in r.copies]
    assert [i for _, _, i in batch.copies] == [i for i, r in enumerate(expected) for _ in r.copies]
    assert batch.slots.tolist() == [s for r in expected for s in r.slots.tolist()]
    assert batch.num_tokens == [r.num_tokens for r in expected]
    assert batch.table_offsets == [r.table_offset for r in expected]
    batched.check_invariants()
    single.check_invariants()
