"""Admission by token budget: reserved growth, the watermark, refusals that change nothing, pressure bands."""

import pytest

from radixkv import KVCache
from radixkv.errors import InvalidArgument, LimitExceeded, NotAdmitted, OutOfBlocks
from radixkv.kv_cache import Limits
from radixkv.stats import pressure_band


def snapshot(cache):
    s = cache.stats()
    return (s.num_blocks_free, s.num_blocks_evictable, s.num_blocks_reserved, s.num_live_sequences,
            list(cache.pool.ref_counts), sorted(cache.tree.roots))  # fmt: skip


def cached(cache, token_ids, namespace="default"):
    r = cache.open(token_ids, namespace)
    cache.commit([r.seq_id], [len(token_ids)])
    cache.release(r.seq_id)


@pytest.fixture
def cache():
    c = KVCache(num_blocks=8, block_size=4, watermark_fraction=0.0)
    yield c
    c.check_invariants()


def test_admission_reserves_the_growth_past_the_prompt(cache):
    r = cache.open(list(range(6)), max_new_tokens=10)  # 16 tokens in all: 4 blocks, 2 of them now
    assert len(r.block_table) == 2
    assert cache.stats().num_blocks_reserved == 2
    cache.append(r.seq_id, [1, 2])  # 8 tokens: still 2 blocks
    assert cache.stats().num_blocks_reserved == 2
    cache.append(r.seq_id, [3])  # the third block comes out of the reservation
    assert cache.stats().num_blocks_reserved == 1
    cache.append(r.seq_id, [4, 5, 6, 7, 8])  # 14 tokens: 4 blocks, reservation spent
    assert cache.stats().num_blocks_reserved == 0
    cache.append(r.seq_id, [9, 10, 11])  # past its budget: an ordinary allocation (block 5)
    assert cache.stats().num_blocks_reserved == 0 and len(cache.block_table(r.seq_id)) == 5


def test_a_reserving_sequence_appends_into_a_pool_others_filled(cache):
    a = cache.open([1, 2, 3, 4], max_new_tokens=12)  # 1 block + 3 reserved
    b = cache.open(list(range(100, 116)))  # 4 blocks: exactly what the reservation leaves
    with pytest.raises(OutOfBlocks) as refused:
        cache.open([7])
    assert (refused.value.needed, refused.value.free) == (1, 0)
    for token in range(12):
        cache.append(a.seq_id, [token])  # never fails: its growth was reserved
        cache.check_invariants()
    assert len(cache.block_table(a.seq_id)) == 4
    with pytest.raises(OutOfBlocks) as refused:  # b reserved nothing
        cache.append(b.seq_id, [1])
    assert refused.value.needed == 1
    assert not cache.can_append([b.seq_id], [1])


def test_reserved_blocks_count_as_used_for_later_admissions(cache):
    cache.open([1, 2, 3, 4], max_new_tokens=12)  # 4 of 8 taken: 1 used, 3 reserved
    before = snapshot(cache)
    with pytest.raises(NotAdmitted) as refused:
        cache.open(list(range(10, 22)), max_new_tokens=5)  # 3 prompt blocks + 2 reserved
    assert (refused.value.blocks_needed, refused.value.blocks_available) == (5, 4)
    assert refused.value.metadata == {"blocks_needed": "5", "blocks_available": "4"}
    assert snapshot(cache) == before, "a refused admission changed the cache"
    assert cache.stats().num_admission_refusals == 1
    cache.open(list(range(10, 22)), max_new_tokens=4)  # 3 + 1: fits exactly
    assert cache.stats().num_blocks_reserved == 4


def test_the_watermark_holds_back_budgeted_admissions_only():
    cache = KVCache(num_blocks=100, block_size=4)  # default watermark: 1% of the pool, one block
    assert cache.budget.watermark_blocks == 1
    with pytest.raises(NotAdmitted) as refused:
        cache.open(list(range(4 * 99)), max_new_tokens=4)  # 99 + 1 blocks
    assert (refused.value.blocks_needed, refused.value.blocks_available) == (100, 99)
    r = cache.open(list(range(4 * 98)), max_new_tokens=4)  # 98 + 1 blocks: fits under the watermark
    cache.release(r.seq_id, cache=False)
    cache.open(list(range(4 * 100)))  # no budget stated: the whole pool, as before
    cache.check_invariants()


def test_evictable_blocks_count_as_available_and_locked_ones_as_taken(cache):
    cached(cache, list(range(16)))  # 4 evictable blocks
    r = cache.open(list(range(16)) + [99], max_new_tokens=11)  # hit 16; 1 new block + 2 reserved; 4 locked
    assert r.num_cached_tokens == 16
    s = cache.stats()
    assert (s.num_blocks_in_use, s.num_blocks_reserved) == (5, 2)
    with pytest.raises(NotAdmitted) as refused:
        cache.open([5, 6, 7, 8], max_new_tokens=5)  # 1 + 2 reserved > 1 left
    assert (refused.value.blocks_needed, refused.value.blocks_available) == (3, 1)


def test_reserve_fraction_reserves_part_of_the_growth():
    cache = KVCache(num_blocks=64, block_size=4, reserve_fraction=0.5, watermark_fraction=0.0)
    cache.open([1, 2, 3, 4], max_new_tokens=16)  # growth 4 blocks, half reserved
    assert cache.stats().num_blocks_reserved == 2
    cache.open([1, 2, 3, 4], max_new_tokens=4)  # growth 1 block: ceil(0.5) = 1
    assert cache.stats().num_blocks_reserved == 3
    seven = KVCache(num_blocks=128, block_size=1, reserve_fraction=0.07, watermark_fraction=0.0)
    seven.open([1], max_new_tokens=100)  # 0.07 * 100 is 7.000000000000001 in floats: still 7 blocks
    assert seven.stats().num_blocks_reserved == 7
    none = KVCache(num_blocks=64, block_size=4, reserve_fraction=0.0)
    none.open([1, 2, 3, 4], max_new_tokens=16)
    assert none.stats().num_blocks_reserved == 0
    none.check_invariants()


def test_the_reservation_returns_at_release(cache):
    a = cache.open([1, 2], max_new_tokens=30)  # 8 blocks in all: the whole pool
    assert cache.stats().num_blocks_reserved == 7
    with pytest.raises(OutOfBlocks):
        cache.open([1])
    cache.release(a.seq_id)
    assert cache.stats().num_blocks_reserved == 0
    cache.open(list(range(32)))


def test_check_open_reports_what_the_batch_takes_from_unreserved_blocks(cache):
    requests = [([1, 2, 3, 4, 5], "default"), ([9, 9], "default")]
    taken = cache.check_open(requests, max_new_tokens=[7, 0])  # 2 blocks + 1 reserved, 1 block
    assert taken == 4
    before = cache._blocks.num_unreserved()
    cache.open_many(requests, max_new_tokens=[7, 0], priorities=[3, 1])
    assert before - cache._blocks.num_unreserved() == taken


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": [-1]}, "max_new_tokens[0]"),
        ({"max_new_tokens": [1, 2]}, "max_new_tokens"),
        ({"priorities": ["high"]}, "priorities[0]"),
        ({"max_new_tokens": [1.5]}, "max_new_tokens[0]"),
        ({"priorities": [True]}, "priorities[0]"),
    ],
)
def test_bad_budgets_name_their_field_and_change_nothing(cache, kwargs, field):
    before = snapshot(cache)
    with pytest.raises(InvalidArgument) as refused:
        cache.open_many([([1, 2, 3], "fresh")], **kwargs)
    assert refused.value.field == field
    assert snapshot(cache) == before


def test_a_budget_past_the_request_limit_is_refused():
    cache = KVCache(num_blocks=64, block_size=4, limits=Limits(max_tokens_per_request=32))
    with pytest.raises(LimitExceeded) as refused:
        cache.open([1] * 20, max_new_tokens=13)
    assert (refused.value.limit, refused.value.requested, refused.value.allowed) == ("max_tokens_per_request", 33, 32)
    cache.check_invariants()


def test_locking_cached_blocks_never_eats_into_reservations(cache):
    cached(cache, list(range(8)))  # 2 evictable blocks
    cache.open([50, 51, 52, 53], max_new_tokens=28)  # 1 + 7 reserved: all 6 free and 2 evictable
    assert cache._blocks.num_unreserved() == 0
    before = snapshot(cache)
    with pytest.raises(OutOfBlocks):
        cache.lock_prefix(list(range(8)))
    with pytest.raises(OutOfBlocks):
        cache.pin(list(range(8)))
    assert snapshot(cache) == before
    cache.check_invariants()


def test_pressure_is_used_plus_reserved_over_total(cache):
    assert (cache.stats().memory_pressure, cache.stats().pressure_band) == (0.0, "normal")
    cache.open([1, 2, 3, 4], max_new_tokens=16)  # 1 used + 4 reserved of 8
    s = cache.stats()
    assert (s.num_blocks_in_use, s.num_blocks_reserved, s.memory_pressure) == (1, 4, 5 / 8)
    cache.open([1])  # 6 of 8
    assert cache.stats().pressure_band == "high"
    cache.open([2, 3, 4, 5, 6])  # 8 of 8
    assert cache.stats().pressure_band == "danger"


@pytest.mark.parametrize(("pressure", "band"), [(0.0, "normal"), (0.69, "normal"), (0.7, "high"), (0.9, "high"),
                                                (0.91, "danger"), (1.0, "danger")])  # fmt: skip
def test_pressure_bands(pressure, band):
    assert pressure_band(pressure) == band


@pytest.mark.parametrize("kwargs", [{"reserve_fraction": 1.5}, {"reserve_fraction": -0.1}, {"watermark_fraction": 1.0}])
def test_fractions_out_of_range_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        KVCache(num_blocks=8, block_size=4, **kwargs)


def test_a_fork_child_inherits_priority_but_reserves_nothing(cache):
    r = cache.open([1, 2, 3, 4, 5], max_new_tokens=7, priority=5)
    cache.commit([r.seq_id], [5])
    assert cache.stats().num_blocks_reserved == 1
    (child,) = cache.fork(r.seq_id)
    assert cache.stats().num_blocks_reserved == 1
    assert cache._sequences.get(child).priority == 5
