"""The computed watermark and the queries a scheduler asks before it acts."""

import pytest

from radixkv import KVCache
from radixkv.errors import InvalidArgument, OutOfBlocks, UnknownSequence


@pytest.fixture
def cache():
    c = KVCache(num_blocks=16, block_size=4)
    yield c
    c.check_invariants()


# -- the computed watermark -------------------------------------------------------------------


def test_release_of_unwritten_tokens_caches_nothing(cache):
    """The garbage hit: a prompt whose K/V the worker never wrote must not serve a later request."""
    prompt = list(range(12))
    first = cache.open(prompt)
    cache.release(first.seq_id, cache=True)  # the worker died before writing anything
    second = cache.open(prompt + [99])
    assert second.num_cached_tokens == 0, "served K/V that was never written"
    assert cache.stats().num_blocks_cached == 0


def test_release_caches_only_blocks_below_the_watermark(cache):
    first = cache.open(list(range(12)))
    cache.commit([first.seq_id], [9])  # the prefill wrote 9 of 12 tokens
    cache.release(first.seq_id, cache=True)
    assert cache.match(list(range(12))) == 8, "only the two blocks written in full"


def test_append_implies_every_earlier_token_computed(cache):
    r = cache.open(list(range(7)))
    assert cache.num_computed_tokens(r.seq_id) == 0
    cache.append(r.seq_id, [7])
    assert cache.num_computed_tokens(r.seq_id) == 7
    cache.append_batch([r.seq_id], [2], [8, 9])
    assert cache.num_computed_tokens(r.seq_id) == 8
    assert cache.cache(r.seq_id) == 8, "the decode loop's last token is not written yet"
    cache.commit([r.seq_id], [10])
    assert cache.num_computed_tokens(r.seq_id) == 10


def test_open_starts_the_watermark_at_the_hit(cache):
    first = cache.open(list(range(9)))
    cache.commit([first.seq_id], [9])
    cache.release(first.seq_id)
    second = cache.open(list(range(10)))
    assert second.num_cached_tokens == 8
    assert cache.num_computed_tokens(second.seq_id) == 8


def test_commit_is_monotonic_bounded_and_all_or_none(cache):
    a, b = cache.open(list(range(6))).seq_id, cache.open(list(range(10, 16))).seq_id
    cache.commit([a], [4])
    with pytest.raises(InvalidArgument) as back:
        cache.commit([b, a], [6, 3])
    assert back.value.field == "num_tokens[1]"
    assert cache.num_computed_tokens(b) == 0, "a refused batch changes nothing"
    with pytest.raises(InvalidArgument) as past:
        cache.commit([a], [7])
    assert past.value.field == "num_tokens[0]"
    with pytest.raises(InvalidArgument) as length:
        cache.commit([a, b], [5])
    assert length.value.field == "num_tokens"
    with pytest.raises(UnknownSequence):
        cache.commit([a, 999], [5, 1])
    cache.commit([a, b], [4, 6])  # equal to the watermark is fine
    assert (cache.num_computed_tokens(a), cache.num_computed_tokens(b)) == (4, 6)


def test_fork_publishes_only_computed_blocks_and_children_inherit(cache):
    parent = cache.open(list(range(10)))
    cache.commit([parent.seq_id], [5])
    [child] = cache.fork(parent.seq_id)
    assert cache.match(list(range(10))) == 4
    assert cache.num_computed_tokens(child) == 5
    cache.commit([child], [10])
    assert cache.cache(child) == 4, "the second block is still shared with the parent by count"
    cache.release(parent.seq_id, cache=False)
    assert cache.cache(child) == 8, "its last other holder is gone: now it is cached"
    cache.release(child)


# -- scheduling queries ---------------------------------------------------------------------------


def test_num_available_blocks_counts_free_and_evictable(cache):
    r = cache.open(list(range(9)))
    assert cache.num_available_blocks() == 13
    cache.commit([r.seq_id], [9])
    cache.release(r.seq_id)
    assert cache.num_available_blocks() == 16
    assert cache.stats().num_blocks_evictable == 2


def test_can_append_matches_what_append_batch_does(cache):
    r = cache.open(list(range(6)))  # 2 blocks, 14 available
    children = cache.fork(r.seq_id, 2)  # the partial last block is shared three ways
    seqs = [r.seq_id, *children]
    # Each of the first two copies the shared block (1 block each), the last writes in place; 4
    # more tokens cross into one new block each: 2 + 3 = 5 blocks.
    assert cache.can_append(seqs, [4, 4, 4])
    before = cache.stats()
    cache.check_invariants()
    assert cache.stats() == before, "a query changes nothing"
    # 14 available: one sequence growing by 13 blocks plus the two copies (15) cannot fit.
    assert not cache.can_append(seqs, [2 + 4 * 13, 1, 1])
    with pytest.raises(OutOfBlocks):
        cache.append_batch(seqs, [2 + 4 * 13, 1, 1], [0] * 56)
    assert cache.can_append(seqs, [2 + 4 * 12, 1, 1])
    cache.append_batch(seqs, [2 + 4 * 12, 1, 1], [0] * 52)
    assert cache.num_available_blocks() == 0
    with pytest.raises(UnknownSequence):
        cache.can_append([999], [1])
    with pytest.raises(InvalidArgument):
        cache.can_append(seqs, [1])


def test_can_append_refuses_past_the_token_limit():
    from radixkv.kv_cache import Limits

    cache = KVCache(64, 4, Limits(max_tokens_per_request=8))
    r = cache.open([1, 2, 3, 4, 5, 6])
    assert cache.can_append([r.seq_id], [2])
    assert not cache.can_append([r.seq_id], [3])


@pytest.mark.parametrize("keep", [True, False])
def test_freeable_blocks_is_what_release_frees(cache, keep):
    shared = cache.open(list(range(9)))
    cache.commit([shared.seq_id], [9])
    [sibling] = cache.fork(shared.seq_id)  # two cached blocks locked by both, the partial one shared by count
    other = cache.open(list(range(8)) + [50, 51, 52])  # hits the same two blocks, locks them too
    assert cache.freeable_blocks([shared.seq_id]) == 0, "everything it holds is held by another"
    assert cache.freeable_blocks([shared.seq_id, sibling]) == 1, "the shared partial block"
    assert cache.freeable_blocks([other.seq_id]) == 1
    expected = cache.freeable_blocks([shared.seq_id, sibling, other.seq_id])
    assert expected == 4
    before = cache.num_available_blocks()
    cache.release_many([shared.seq_id, sibling, other.seq_id], cache=keep)
    assert cache.num_available_blocks() - before == expected


# -- the integrator's API ---------------------------------------------------------------------------


def test_evict_frees_least_recently_used_blocks(cache):
    for base in (0, 100):
        r = cache.open(list(range(base, base + 9)))
        cache.commit([r.seq_id], [9])
        cache.release(r.seq_id)
    assert cache.evict(1) == 1
    assert cache.match(list(range(9))) == 4, "the older prefix loses its tail block first"
    assert cache.evict(100) == 3
    assert cache.stats().num_blocks_free == 16
    assert cache.evict(0) == 0
    with pytest.raises(InvalidArgument):
        cache.evict(-1)


def test_lock_prefix_pins_a_hit_without_allocating(cache):
    r = cache.open(list(range(13)))
    cache.commit([r.seq_id], [13])
    cache.release(r.seq_id)
    free = cache.stats().num_blocks_free
    locked = cache.lock_prefix(list(range(10)))
    assert locked.num_cached_tokens == 8 and len(locked.block_table) == 2
    assert cache.stats().num_blocks_free == free, "nothing allocated"
    assert cache.num_tokens(locked.seq_id) == 8 and cache.num_computed_tokens(locked.seq_id) == 8
    assert cache.evict(16) == 1, "only the unlocked third block can go"
    assert cache.match(list(range(12))) == 8
    cache.release(locked.seq_id)
    assert cache.evict(16) == 2
    miss = cache.lock_prefix([77, 78], "other")
    assert (miss.num_cached_tokens, miss.block_table.tolist()) == (0, [])
    cache.append(miss.seq_id, [77, 78, 79])
    cache.release(miss.seq_id)


def test_single_append_slots_are_lazy_and_right(cache):
    r = cache.open([1, 2, 3])
    a = cache.append(r.seq_id, [4, 5])
    from radixkv.sequences.results import SlotPlan

    plan = a.batch.slot_source
    assert isinstance(plan, SlotPlan) and plan.computed is None, "nothing computed before the slots are read"
    table = cache.block_table(r.seq_id)
    assert list(a.slots) == [table[0] * 4 + 3, table[1] * 4]


def test_freeable_blocks_frees_an_upper_node_only_with_every_holder_below_it(cache):
    deep = cache.open(list(range(16)) + [99])
    cache.commit([deep.seq_id], [17])
    cache.cache(deep.seq_id)  # four cached blocks, locked by `deep`
    [twin] = cache.fork(deep.seq_id)  # locks the same node; shares the partial block by count
    upper = cache.open(list(range(8)) + [50])  # locks the first two blocks (the node splits there)
    assert cache.freeable_blocks([deep.seq_id]) == 0, "its twin holds everything it holds"
    assert cache.freeable_blocks([deep.seq_id, twin]) == 3, "the lower node and the partial block"
    assert cache.freeable_blocks([upper.seq_id]) == 1, "its own partial block: the upper node stays locked below"
    assert cache.victims(3) == [upper.seq_id, twin, deep.seq_id], "latest first, until enough is given back"
    expected = cache.freeable_blocks([deep.seq_id, twin, upper.seq_id])
    assert expected == 6
    before = cache.num_available_blocks()
    cache.release_many([deep.seq_id, twin, upper.seq_id])
    assert cache.num_available_blocks() - before == expected
