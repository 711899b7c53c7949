"""Behaviour of the core by name: each test is one case a scheduler runs into."""

import tracemalloc

import numpy as np
import pytest

from radixkv import KVCache
from radixkv.errors import FailedPrecondition, InvalidArgument, LimitExceeded, NotPinned, OutOfBlocks, UnknownSequence
from radixkv.kv_cache import Limits
from radixkv.tree.radix_tree import RadixTree


def counts(cache):
    s = cache.stats()
    return (
        s.num_blocks_free,
        s.num_blocks_cached,
        s.num_blocks_evictable,
        s.num_live_sequences,
        list(cache.pool.ref_counts),
    )


def cache_written(cache, token_ids, namespace="default"):
    """Open `token_ids`, write all their K/V (commit), release with caching: the prefix is now cached."""
    r = cache.open(token_ids, namespace)
    cache.commit([r.seq_id], [len(token_ids)])
    cache.release(r.seq_id)


def opened_written(cache, token_ids, namespace="default"):
    """Open `token_ids` and commit them all: a prefill whose K/V is written."""
    r = cache.open(token_ids, namespace)
    cache.commit([r.seq_id], [len(token_ids)])
    return r


@pytest.fixture
def cache():
    c = KVCache(num_blocks=32, block_size=4)
    yield c
    c.check_invariants()


def test_open_allocates_blocks_and_slots(cache):
    r = cache.open(list(range(10)))
    assert r.num_cached_tokens == 0
    assert len(r.block_table) == 3
    assert list(r.slots) == [r.block_table[p // 4] * 4 + p % 4 for p in range(10)]


def test_prompt_shorter_than_a_block(cache):
    r = cache.open([1, 2])
    assert len(r.block_table) == 1
    cache.release(r.seq_id)
    assert cache.stats().num_blocks_cached == 0, "a partial block is never cached"
    assert cache.open([1, 2]).num_cached_tokens == 0


def test_exact_block_multiple_is_cached_whole(cache):
    cache_written(cache, list(range(8)))
    assert cache.match(list(range(8))) == 8


def test_fully_cached_prompt_recomputes_last_token(cache):
    cache_written(cache, list(range(8)))
    r = cache.open(list(range(8)))
    assert r.num_cached_tokens == 4, "the last block is recomputed so the model gets the last logits"
    assert len(r.slots) == 4
    longer = cache.open(list(range(9)))
    assert longer.num_cached_tokens == 8


def test_second_turn_hits_first_turn(cache):
    first = cache.open(list(range(6)))
    cache.append(first.seq_id, [6, 7, 8, 9])
    assert cache.cache(first.seq_id) == 4, "the appended tokens' K/V is not written yet"
    cache.commit([first.seq_id], [10])
    assert cache.cache(first.seq_id) == 8
    second = cache.open(list(range(10)) + [42, 43])
    assert second.num_cached_tokens == 8
    assert second.block_table[:2].tolist() == first.block_table[:2].tolist()


def test_append_allocates_at_block_boundary(cache):
    r = cache.open([1, 2, 3])
    a = cache.append(r.seq_id, [4])
    assert (a.table_offset, a.block_ids, a.copies) == (1, [], [])
    b = cache.append(r.seq_id, [5])
    assert b.table_offset == 1 and len(b.block_ids) == 1
    assert list(b.slots) == [b.block_ids[0] * 4]
    assert cache.num_tokens(r.seq_id) == 5


def test_fork_then_append_into_shared_partial_block_copies_on_write(cache):
    r = cache.open([1, 2, 3, 4, 5, 6])
    [child] = cache.fork(r.seq_id, 1)
    shared_last = r.block_table[-1]
    assert cache.pool.ref_counts[shared_last] == 2
    a = cache.append(child, [7])
    assert len(a.copies) == 1
    src, dst = a.copies[0]
    assert src == shared_last and dst != src
    assert a.table_offset == 1 and a.block_ids == [dst]
    assert cache.block_table(child)[-1] == dst
    assert cache.pool.ref_counts[shared_last] == 1
    b = cache.append(r.seq_id, [8])
    assert b.copies == [], "the parent is now the only holder: it writes in place"
    assert cache.stats().num_cow_copies == 1


def test_fork_shares_full_blocks_through_the_tree(cache):
    r = opened_written(cache, list(range(9)))
    children = cache.fork(r.seq_id, 3)
    assert all(cache.block_table(c) == r.block_table.tolist() for c in children)
    assert cache.stats().num_blocks_cached == 2, "fork publishes the parent's full blocks"
    for seq in [r.seq_id, *children]:
        cache.release(seq, cache=False)
    assert cache.stats().num_blocks_free == 30


def test_beam_style_fork_release_churn_leaks_nothing(cache):
    rng = np.random.default_rng(0)
    beams = [cache.open(list(range(5))).seq_id]
    for _ in range(12):
        candidates = []
        for beam in beams:
            candidates += cache.fork(beam, 2)
        cache.release_many(beams)
        for c in candidates:
            cache.append(c, [int(rng.integers(100))])
        keep = set(rng.choice(candidates, size=min(3, len(candidates)), replace=False).tolist())
        cache.release_many([c for c in candidates if c not in keep], cache=False)
        beams = sorted(keep)
        cache.check_invariants()
    cache.release_many(beams)
    s = cache.stats()
    assert s.num_live_sequences == 0
    assert s.num_blocks_free + s.num_blocks_evictable == 32


def test_duplicate_prefix_keeps_one_copy_and_frees_the_other(cache):
    a = opened_written(cache, list(range(8)) + [1])
    b = opened_written(cache, list(range(8)) + [2])
    assert set(a.block_table[:2]).isdisjoint(b.block_table[:2])
    cache.release(a.seq_id)
    cache.release(b.seq_id)
    s = cache.stats()
    assert s.num_blocks_cached == 2
    assert s.num_blocks_free == 30


def test_allocation_evicts_lru_cached_blocks_before_failing():
    cache = KVCache(num_blocks=4, block_size=4)
    cache_written(cache, list(range(8)))
    cache_written(cache, list(range(100, 108)))
    r = cache.open(list(range(200, 208)))
    assert cache.stats().num_evicted_blocks == 2
    assert cache.match(list(range(8))) == 0, "the older prefix went first"
    assert cache.match(list(range(100, 108))) == 8
    cache.release(r.seq_id)
    cache.check_invariants()


def test_out_of_blocks_changes_nothing():
    cache = KVCache(num_blocks=4, block_size=4)
    keep = cache.open(list(range(8)))
    cache_written(cache, list(range(50, 54)))
    before = counts(cache)
    with pytest.raises(OutOfBlocks) as info:
        cache.open(list(range(100, 113)))
    assert info.value.needed == 4 and info.value.free == 2
    assert counts(cache) == before
    assert cache.stats().num_allocation_failures == 1
    cache.release(keep.seq_id)
    cache.check_invariants()


def test_pool_exhausted_mid_batch_fails_whole():
    cache = KVCache(num_blocks=6, block_size=4)
    before = counts(cache)
    with pytest.raises(OutOfBlocks):
        cache.open_many(
            [(list(range(8)), "default"), (list(range(20, 28)), "default"), (list(range(40, 49)), "default")]
        )
    assert counts(cache) == before
    a = cache.open(list(range(4)))
    b = cache.open(list(range(20, 24)))
    with pytest.raises(OutOfBlocks):
        cache.append_many([(a.seq_id, list(range(10))), (b.seq_id, list(range(10)))])
    assert cache.num_tokens(a.seq_id) == 4 and cache.num_tokens(b.seq_id) == 4
    cache.check_invariants()


def test_batch_does_not_evict_its_own_hits():
    cache = KVCache(num_blocks=6, block_size=4)
    cache_written(cache, list(range(8)) + [9])  # the hit, least recently used
    cache_written(cache, list(range(50, 58)) + [9])  # newer, unrelated
    assert cache.stats().num_blocks_cached == 4
    # The first request must evict; the LRU prefix is the second request's hit, so it must be spared.
    results = cache.open_many([(list(range(20, 32)), "default"), (list(range(8)) + [7], "default")])
    assert results[1].num_cached_tokens == 8
    assert cache.match(list(range(50, 58))) == 0
    cache.check_invariants()


@pytest.mark.parametrize("block_size", [1, 64])
def test_extreme_block_sizes(block_size):
    cache = KVCache(num_blocks=300, block_size=block_size)
    a = opened_written(cache, list(range(130)))
    cache.append(a.seq_id, list(range(5)))
    [child] = cache.fork(a.seq_id, 1)
    cache.append(child, [1])
    cache.release_many([a.seq_id, child])
    b = cache.open(list(range(130)))
    assert b.num_cached_tokens == (129 // block_size) * block_size
    cache.check_invariants()


def test_namespaces_never_share_hits(cache):
    cache_written(cache, list(range(8)), "tenant-a")
    assert cache.open(list(range(8)) + [1], "tenant-b").num_cached_tokens == 0
    assert cache.match(list(range(8)), "tenant-b") == 0
    assert cache.match(list(range(8)), "tenant-a") == 8


def test_match_locks_nothing(cache):
    cache_written(cache, list(range(8)))
    before = counts(cache)
    assert cache.match(list(range(8))) == 8
    assert counts(cache) == before


def test_pin_keeps_prefix_resident_under_pressure():
    cache = KVCache(num_blocks=8, block_size=4, limits=Limits(max_pinned_fraction=0.5))
    cache_written(cache, list(range(8)))
    assert cache.pin(list(range(8))) == 8
    assert cache.stats().num_blocks_pinned == 2
    with pytest.raises(OutOfBlocks):
        cache.open(list(range(100, 125)))
    held = cache.open(list(range(100, 124)))
    assert cache.match(list(range(8))) == 8
    cache.release(held.seq_id, cache=False)
    cache.unpin(list(range(8)))
    assert cache.stats().num_blocks_pinned == 0
    with pytest.raises(NotPinned):
        cache.unpin(list(range(8)))
    cache.check_invariants()


def test_pin_is_bounded_by_its_share_of_the_pool():
    cache = KVCache(num_blocks=8, block_size=4, limits=Limits(max_pinned_fraction=0.25))
    cache_written(cache, list(range(13)))
    with pytest.raises(LimitExceeded) as info:
        cache.pin(list(range(12)))
    assert info.value.limit == "pinned_blocks"
    with pytest.raises(FailedPrecondition):
        cache.pin([77, 78, 79, 80])
    cache.check_invariants()


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda c: c.open([]), InvalidArgument, "token_ids"),
        (lambda c: c.open([1, -2]), InvalidArgument, "token_ids"),
        (lambda c: c.open([1, 2**31]), InvalidArgument, "token_ids"),
        (lambda c: c.open([1.5]), InvalidArgument, "token_ids"),
        (lambda c: c.open([[1, 2]]), InvalidArgument, "token_ids"),
        (lambda c: c.open([1], namespace=""), InvalidArgument, "namespace"),
        (lambda c: c.open([1], namespace="a b"), InvalidArgument, "namespace"),
        (lambda c: c.append(999, [1]), UnknownSequence, None),
        (lambda c: c.append(1, []), InvalidArgument, "token_ids"),
        (lambda c: c.fork(1, 0), InvalidArgument, "num_children"),
        (lambda c: c.fork(1, -3), InvalidArgument, "num_children"),
        (lambda c: c.fork(1, 10**6), LimitExceeded, None),
        (lambda c: c.release(999), UnknownSequence, None),
        (lambda c: c.release_many([1, 1]), InvalidArgument, "seq_ids"),
        (lambda c: c.append_many([(1, [1]), (1, [2])]), InvalidArgument, "seq_ids"),
        (lambda c: c.append_batch([1], [2], [5]), InvalidArgument, "token_ids"),
        (lambda c: c.append_batch([1], [0], []), InvalidArgument, "num_token_ids"),
        (lambda c: c.append_batch([1, 2], [1], [5]), InvalidArgument, "num_token_ids"),
        (lambda c: c.append_batch([1], [1.5], [5]), InvalidArgument, "num_token_ids"),  # not truncated to 1
        (lambda c: c.append_batch([1], ["1"], [5]), InvalidArgument, "num_token_ids"),
        (lambda c: c.append_batch([1], [None], [5]), InvalidArgument, "num_token_ids"),
        (lambda c: c.append_batch([1], [np.array([1, 1])], [5, 6]), InvalidArgument, "num_token_ids"),
        (lambda c: c.append_batch([1, 1], [1, 1], [5, 6]), InvalidArgument, "seq_ids"),  # a decode step's twice
        (lambda c: c.append_batch([1], [1], [-5]), InvalidArgument, "token_ids"),
        (lambda c: c.open_many([([1], "default"), ([], "default")]), InvalidArgument, "requests[1].token_ids"),
        (lambda c: c.cache("1"), InvalidArgument, "seq_id"),
        (lambda c: c.match([1], namespace="bad name"), InvalidArgument, "namespace"),
    ],
)
def test_caller_mistakes_raise_named_errors_and_change_nothing(cache, call, error, field):
    cache.open(list(range(6)))
    before = counts(cache)
    with pytest.raises(error) as info:
        call(cache)
    assert info.value.reason == error.reason
    if field is not None:
        assert info.value.field == field
    assert counts(cache) == before


def test_fork_of_released_sequence_is_unknown(cache):
    r = cache.open([1, 2, 3])
    cache.release(r.seq_id)
    with pytest.raises(UnknownSequence):
        cache.fork(r.seq_id, 2)


def test_limits_refuse_long_requests():
    cache = KVCache(64, 4, limits=Limits(max_tokens_per_request=16))
    with pytest.raises(LimitExceeded):
        cache.open(list(range(17)))
    r = cache.open(list(range(10)))
    with pytest.raises(LimitExceeded):
        cache.append(r.seq_id, list(range(7)))
    cache.check_invariants()


def test_token_ids_accept_lists_arrays_and_packed_bytes(cache):
    tokens = np.arange(9, dtype=np.int32)
    cache_written(cache, tokens)
    assert cache.match(tokens.tolist()) == 8
    assert cache.match(tokens.astype(np.int64)) == 8
    assert cache.match(tokens.tobytes()) == 8


def test_stats_count_hits_and_requests(cache):
    cache_written(cache, list(range(9)))
    cache.open(list(range(9)))
    s = cache.stats()
    assert (s.num_requested_tokens, s.num_hit_tokens) == (18, 8)
    assert s.num_blocks_free + s.num_blocks_in_use + s.num_blocks_evictable == 32
    assert s.hit_ratio == pytest.approx(8 / 18)


def test_batched_append_lets_the_last_holder_of_a_shared_block_write_in_place(cache):
    r = cache.open([1, 2, 3, 4, 5, 6])
    children = cache.fork(r.seq_id, 3)
    family = [r.seq_id, *children]
    results = cache.append_many([(s, [7]) for s in family])
    assert sum(len(a.copies) for a in results) == 3, "four holders: three copy, the last writes in place"
    assert results[-1].copies == []
    assert cache.block_table(family[-1])[-1] == r.block_table[-1]
    assert len({cache.block_table(s)[-1] for s in family}) == 4


def test_append_batch_reports_columns_that_match_per_sequence_appends():
    batched, single = KVCache(64, 4), KVCache(64, 4)
    for c in (batched, single):
        a = c.open(list(range(6)))
        c.fork(a.seq_id, 1)
        c.open(list(range(100, 104)))
    counts, tokens = [3, 1, 5], list(range(500, 509))
    batch = batched.append_batch([1, 2, 3], counts, tokens)
    expected, pos = [], 0
    for seq_id, n in zip([1, 2, 3], counts, strict=True):
        expected.append(single.append(seq_id, tokens[pos : pos + n]))
        pos += n
    assert batch.num_tokens == [r.num_tokens for r in expected] == [9, 7, 9]
    assert batch.table_offsets == [r.table_offset for r in expected]
    assert batch.block_ids == [b for r in expected for b in r.block_ids]
    assert batch.slots.tolist() == [s for r in expected for s in r.slots.tolist()]
    assert [(src, dst) for src, dst, _ in batch.copies] == [c for r in expected for c in r.copies]
    assert [r.slots.tolist() for r in batch.results()] == [r.slots.tolist() for r in expected]
    batched.check_invariants()


def test_unpin_after_more_of_the_prefix_was_cached():
    cache = KVCache(16, 4, limits=Limits(max_pinned_fraction=0.5))
    cache_written(cache, list(range(9)))
    assert cache.pin(list(range(16))) == 8
    cache_written(cache, list(range(17)))  # the tree now holds more of those tokens
    cache.unpin(list(range(16)))
    assert cache.stats().num_blocks_pinned == 0
    cache.check_invariants()


def test_a_namespace_with_nothing_left_in_it_does_not_count_against_max_namespaces() -> None:
    cache = KVCache(num_blocks=64, block_size=4, limits=Limits(max_namespaces=4))
    for i in range(4):
        cache.release(cache.open([1, 2, 3], f"used-once-{i}").seq_id, cache=False)
    assert cache.stats().num_blocks_free == 64  # nothing of those namespaces is held or cached
    cache.check_invariants()
    cache.open([1, 2, 3], "a-new-namespace")


def test_fork_does_not_copy_the_token_history_into_every_child() -> None:
    cache = KVCache(num_blocks=5000, block_size=16)
    parent = cache.open(list(range(65_536)) + [1])  # 4097 blocks, 256 KiB of int32 tokens
    cache.commit([parent.seq_id], [65_537])  # its K/V is written: fork caches it and shares the tree's copy
    tracemalloc.start()
    try:
        cache.fork(parent.seq_id, 64)
        allocated, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Copies of the history cost 16 MiB here, copies of the tables alone 2 MiB: the history must be shared.
    assert allocated < 4 * 2**20, f"{allocated / 2**20:.1f} MiB for 64 children"


def test_a_cache_built_on_another_tree_evicts_through_it():
    """`KVCache(tree=...)` (how bench_core compares eviction policies): allocation evicts via that tree."""
    calls = []

    class CountingTree(RadixTree):
        def evict(self, num_blocks, owner=None):
            calls.append(num_blocks)
            return super().evict(num_blocks, owner)

    tree = CountingTree(4)
    cache = KVCache(4, 4, tree=tree)
    assert cache.tree is tree
    first = cache.open(list(range(9)))  # 3 blocks
    cache.commit([first.seq_id], [9])
    cache.release(first.seq_id)  # 2 full blocks cached, 2 free
    assert tree.num_cached_blocks == 2
    cache.open(list(range(100, 112)))  # 3 blocks: one must be evicted
    assert calls == [1] and tree.num_cached_blocks == 1
    cache.check_invariants()


def test_a_repeat_pin_that_reaches_deeper_than_the_first_unpins_cleanly():
    cache = KVCache(num_blocks=16, block_size=4, limits=Limits(max_pinned_fraction=1.0))
    prompt = list(range(1, 13))  # three blocks
    short = cache.open(prompt[:5])
    cache.commit([short.seq_id], [5])
    cache.release(short.seq_id)  # one block cached
    assert cache.pin(prompt) == 4
    full = cache.open(prompt + [99])
    cache.commit([full.seq_id], [13])
    cache.release(full.seq_id)  # all three cached now
    assert cache.pin(prompt) == 12  # the same tokens: this pin locks a deeper node than the first
    cache.check_invariants()
    assert cache.stats().num_blocks_pinned == 3
    cache.unpin(prompt)
    cache.check_invariants()
    cache.unpin(prompt)
    cache.check_invariants()
    assert cache.stats().num_blocks_pinned == 0
    with pytest.raises(NotPinned):
        cache.unpin(prompt)
