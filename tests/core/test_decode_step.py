"""The decode step's own path (`radixkv.sequences.append.decode_step`) against the general plan-and-apply path."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from radixkv import KVCache
from radixkv.errors import LimitExceeded, OutOfBlocks, RadixKVError
from radixkv.kv_cache import Limits
from radixkv.pressure.preemption import all_token_bytes
from radixkv.sequences import append as append_module
from radixkv.sequences import decode_run
from radixkv.sequences.append import decode_step
from radixkv.sequences.results import AppendBatch

BLOCK_SIZE = 4
COLUMNS = ("seq_ids", "num_appended", "num_tokens", "table_offsets", "num_block_ids", "block_ids", "copies")


def general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(append_module, "decode_step", lambda *args: None)


def state(cache: KVCache) -> list[tuple[int, list[int], int, int, bytes]]:
    """Every live sequence's table, length, watermark and tokens, by id."""
    ids = sorted(s.seq_id for s in cache._sequences)
    return [
        (s, cache.block_table(s), cache.num_tokens(s), cache.num_computed_tokens(s),
         all_token_bytes(cache._sequences.get(s)))
        for s in ids
    ]  # fmt: skip


def same_batches(a: AppendBatch, b: AppendBatch) -> None:
    for name in COLUMNS:
        assert getattr(a, name) == getattr(b, name), name
        assert isinstance(getattr(a, name), list), name
    for name in ("num_appended", "num_tokens", "table_offsets", "num_block_ids", "block_ids"):  # plain ints (JSON)
        assert {type(v) for v in getattr(a, name)} <= {int}, name
    assert a.slots.dtype == b.slots.dtype == np.int64
    assert a.slots.tolist() == b.slots.tolist()


def slots_follow_tables(cache: KVCache, batch: AppendBatch) -> None:
    """Token i of a one-token step lands in its sequence's block for position num_tokens - 1."""
    for seq_id, n, slot in zip(batch.seq_ids, batch.num_tokens, batch.slots.tolist(), strict=True):
        table = cache.block_table(seq_id)
        assert slot == table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE


ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(1, 11), st.integers(0, 3)),  # prompt length, which prompt
        st.tuples(st.just("fork"), st.integers(0, 50), st.integers(1, 2)),
        st.tuples(st.just("decode"), st.lists(st.integers(0, 50), min_size=1, max_size=8, unique=True)),
        st.tuples(st.just("decode"), st.lists(st.integers(0, 50), min_size=1, max_size=8, unique=True)),
        st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("again"), st.integers(1, 6)),  # the last decode batch, a few steps more
        st.just(("check",)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=ops, reserve=st.booleans())
def test_decode_steps_match_the_general_path(history, reserve, monkeypatch):
    """Batches of any size take the decode step's path here (`DECODE_STEP_MIN` lowered to 1).

    Twin caches run the same history; one serves decode steps by the general path. Every result
    column, every slot, every table and the block pool must come out the same, forks' shared last
    blocks and reservations included (the fast path hands those to the general path or draws alike).
    The state is compared at `check` and at the end only: reading it settles the decode run, which
    otherwise carries a batch repeated (`again`) from step to step in its columns."""
    monkeypatch.setattr(append_module, "DECODE_STEP_MIN", 1)
    monkeypatch.setattr(decode_run, "FOLD_STEPS", 5)  # runs of a few steps fold their journals too
    fast, slow = (KVCache(40, BLOCK_SIZE, Limits(max_tokens_per_request=24)) for _ in range(2))
    live: list[int] = []
    last_batch: list[int] = []

    def decode(batch: list[int], step: int) -> None:
        tokens = [(7 * s + step) % 50 for s in batch]
        outcomes = []
        for cache, route in ((fast, None), (slow, general_only)):
            with monkeypatch.context() as m:
                if route is not None:
                    route(m)
                try:
                    outcomes.append(cache.append_batch(list(batch), [1] * len(batch), tokens))
                except (OutOfBlocks, LimitExceeded) as e:
                    outcomes.append(type(e))
        if isinstance(outcomes[0], AppendBatch):
            assert isinstance(outcomes[1], AppendBatch)
            same_batches(*outcomes)
        else:
            assert outcomes[0] == outcomes[1]

    for op in history + [("check",)]:
        if op[0] == "open":
            prompt = [op[2] * 100 + t for t in range(op[1])]
            budget = [6] if reserve else None
            results = []
            for cache in (fast, slow):
                try:
                    results.append(cache.open_many([(prompt, "default")], max_new_tokens=budget)[0].seq_id)
                except RadixKVError as e:  # refused alike on both (out of blocks, not admitted)
                    results.append(type(e))
            assert results[0] == results[1]
            if isinstance(results[0], int):
                live.append(results[0])
        elif op[0] == "fork" and live:
            parent = live[op[1] % len(live)]
            children = []
            for cache in (fast, slow):
                try:
                    children.append(cache.fork(parent, op[2]))
                except OutOfBlocks:
                    children.append(None)
            assert children[0] == children[1]
            live += children[0] or []
        elif op[0] == "decode" and live:
            last_batch = sorted({live[i % len(live)] for i in op[1]})
            decode(last_batch, 0)
        elif op[0] == "again" and last_batch and set(last_batch) <= set(live):
            for step in range(op[1]):
                decode(last_batch, step + 1)
        elif op[0] == "release" and live:
            seq_id = live.pop(op[1] % len(live))
            for cache in (fast, slow):
                cache.release(seq_id, cache=op[2])
        elif op[0] == "check":
            assert state(fast) == state(slow)
            fast.check_invariants()
            slow.check_invariants()
        assert fast.pool.ref_counts.tolist() == slow.pool.ref_counts.tolist()
        assert fast.stats().num_blocks_reserved == slow.stats().num_blocks_reserved


def test_a_decode_step_writes_each_token_after_its_sequence(monkeypatch):
    monkeypatch.setattr(append_module, "DECODE_STEP_MIN", 1)
    cache = KVCache(32, BLOCK_SIZE)
    ids = [cache.open([1, 2, 3]).seq_id, cache.open([4, 5, 6, 7]).seq_id]  # one partial block, one full
    batch = cache.append_batch(ids, [1, 1], np.array([8, 9], dtype=np.int32))
    assert batch.num_tokens == [4, 5] and batch.num_block_ids == [0, 1]
    assert batch.table_offsets == [1, 1] and len(batch.block_ids) == 1
    assert cache.block_table(ids[1])[1] == batch.block_ids[0]
    slots_follow_tables(cache, batch)
    assert [cache.num_computed_tokens(s) for s in ids] == [3, 4]  # every earlier token counts as written
    for seq_id, tokens in zip(ids, ([1, 2, 3, 8], [4, 5, 6, 7, 9]), strict=True):  # the tokens, as cached
        cache.commit([seq_id], [len(tokens)])
        cache.release(seq_id)
        assert cache.match(tokens) == BLOCK_SIZE
        assert cache.match(tokens[:3] + [0]) == (BLOCK_SIZE if tokens[3] == 0 else 0)
    cache.check_invariants()


def test_a_forks_shared_last_block_is_copied_once_per_extra_holder(monkeypatch):
    monkeypatch.setattr(append_module, "DECODE_STEP_MIN", 1)
    cache = KVCache(32, BLOCK_SIZE)
    parent = cache.open([1, 2, 3, 4, 5, 6]).seq_id
    (child,) = cache.fork(parent)
    batch = cache.append_batch([parent, child], [1, 1], [7, 8])
    assert len(batch.copies) == 1  # the second holder writes in place
    assert cache.block_table(parent)[-1] != cache.block_table(child)[-1]
    slots_follow_tables(cache, batch)
    cache.check_invariants()


def test_a_sequence_at_its_limit_refuses_the_whole_step(monkeypatch):
    monkeypatch.setattr(append_module, "DECODE_STEP_MIN", 1)
    cache = KVCache(32, BLOCK_SIZE, Limits(max_tokens_per_request=5))
    ids = [cache.open([1, 2, 3]).seq_id, cache.open([1, 2, 3, 4, 5]).seq_id]
    before = state(cache)
    with pytest.raises(LimitExceeded):
        cache.append_batch(ids, [1, 1], [6, 6])
    assert state(cache) == before
    cache.check_invariants()


def test_a_decode_step_that_evicts_offloads_to_the_host_tier(monkeypatch):
    monkeypatch.setattr(append_module, "DECODE_STEP_MIN", 1)
    cache = KVCache(4, BLOCK_SIZE, host_num_blocks=4)
    cached = cache.open([1, 2, 3, 4, 5, 6, 7, 8])
    cache.commit([cached.seq_id], [8])
    cache.release(cached.seq_id)  # two cached blocks, evictable
    seq = cache.open([9, 9, 9, 9]).seq_id  # one block; a full one
    cache.append_batch([seq], [1], [9])  # takes a free block
    batch = cache.append_batch([seq], [1], [9])  # no block needed
    assert len(batch.offloads) == 0
    other = cache.open([5, 5, 5, 5]).seq_id  # the last free block... or an evicted one
    grown = cache.append_batch([seq, other], [1, 1], [9, 9])  # `other` needs a block: evicts a cached one
    assert grown.num_block_ids == [0, 1]
    assert len(grown.offloads) == 1  # the evicted block goes to the host first
    cache.check_invariants()


def test_a_batch_of_decode_size_takes_the_fast_path_and_matches_the_general_one(monkeypatch):
    taken = []
    monkeypatch.setattr(append_module, "decode_step", lambda *a: taken.append(1) or decode_step(*a))
    fast, slow = KVCache(256, BLOCK_SIZE), KVCache(256, BLOCK_SIZE)
    prompts = [([s, *range(s % 7)], "default") for s in range(append_module.DECODE_STEP_MIN + 4)]
    ids = [r.seq_id for r in fast.open_many(prompts)]
    assert ids == [r.seq_id for r in slow.open_many(prompts)]
    for step in range(2 * BLOCK_SIZE + 1):  # across block boundaries, every sequence at its own offset
        tokens = np.arange(len(ids), dtype=np.int32) + step
        batch = fast.append_batch(ids, [1] * len(ids), tokens)
        with monkeypatch.context() as m:
            general_only(m)
            same_batches(batch, slow.append_batch(ids, [1] * len(ids), tokens))
        slots_follow_tables(fast, batch)
    assert len(taken) == 2 * BLOCK_SIZE + 1
    assert state(fast) == state(slow)
    fast.check_invariants()
