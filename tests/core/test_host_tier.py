"""The host tier in the core: offload on eviction, load back on a hit, host LRU, swap and resume, ordering."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import KVCache
from radixkv.errors import OutOfBlocks

BS = 4


def cached(cache: KVCache, tokens: list[int]) -> None:
    """Open, commit and release with cache: the full blocks of `tokens` end up cached."""
    opened = cache.open(tokens)
    cache.commit([opened.seq_id], [len(tokens)])
    cache.release(opened.seq_id)


def test_eviction_offloads_in_the_result_that_reuses_the_block():
    cache = KVCache(4, BS, host_num_blocks=8)
    cached(cache, list(range(9)))  # 2 full blocks cached: 0, 1; 2 and 3 free
    assert cache.match_tiers(list(range(9))) == (8, 0)
    other = cache.open(list(range(100, 112)))  # 3 blocks: takes the 2 free and evicts block 1 (the LRU tail)
    assert other.offloads.tolist() == [[1, 0]]  # block 1 goes to host block 0 before this result writes it
    assert 1 in other.block_table
    assert cache.match_tiers(list(range(9))) == (4, 4)
    assert cache.match(list(range(9))) == 4, "match stays the device tier's count"
    stats = cache.stats()
    assert (stats.num_offloaded_blocks, stats.num_host_blocks_cached, stats.num_host_blocks_free) == (1, 1, 7)
    cache.check_invariants()


def test_a_hit_on_the_host_tier_loads_back_and_keeps_a_copy():
    cache = KVCache(4, BS, host_num_blocks=8)
    cached(cache, list(range(9)))
    b = cache.open(list(range(100, 112)))
    cache.release(b.seq_id, cache=False)
    again = cache.open(list(range(9)))
    assert again.num_cached_tokens == 8 and again.num_host_hit_tokens == 4
    ((host_block, device_block),) = again.loads.tolist()
    assert host_block == 0 and again.block_table[1] == device_block
    assert again.slots.tolist() == [again.block_table[2] * BS]  # only the last token is computed
    stats = cache.stats()
    assert (stats.num_loaded_blocks, stats.num_host_hit_tokens, stats.num_hit_tokens) == (1, 4, 8)
    assert stats.num_host_blocks_cached == 1, "the loaded block keeps its host copy"
    cache.check_invariants()
    cache.release(again.seq_id, cache=False)
    offloaded = cache.stats().num_offloaded_blocks
    cache.evict(4)  # the whole prefix leaves the device again
    assert cache.stats().num_offloaded_blocks == offloaded + 1, "only the block without a host copy moves"
    assert cache.match_tiers(list(range(9))) == (0, 8)
    cache.check_invariants()


def test_the_host_tier_evicts_its_least_recently_used_prefix():
    cache = KVCache(2, BS, host_num_blocks=2)
    prompts = [[p] * 5 for p in (1, 2, 3)]  # one full block each
    for tokens in prompts:
        cached(cache, tokens)
        cache.evict(2)
    assert [cache.match_tiers(t) for t in prompts] == [(0, 0), (0, 4), (0, 4)]
    assert cache.stats().num_host_evicted_blocks == 1
    cache.check_invariants()


def test_a_full_host_tier_drops_what_it_cannot_take():
    cache = KVCache(8, BS, host_num_blocks=1)
    swapped = cache.open([5] * 3)  # 1 block of its own ...
    cache.preempt([swapped.seq_id], "swap")  # ... holding the host tier's only block
    cached(cache, list(range(9)))  # 2 blocks
    assert cache.evict(8) == 2
    assert cache.match_tiers(list(range(9))) == (0, 0), "no host room: the prefix leaves both tiers"
    stats = cache.stats()
    assert (stats.num_offloaded_blocks, stats.num_host_evicted_blocks, stats.num_host_blocks_swapped) == (1, 0, 1)
    cache.check_invariants()


def test_swap_moves_the_sequences_own_blocks_and_brings_them_back():
    cache = KVCache(8, BS, host_num_blocks=8)
    cached(cache, list(range(8)))  # a cached prefix of 2 blocks
    seq = cache.open(list(range(14)))  # hits 8 tokens; its own blocks: the 2 after
    cache.commit([seq.seq_id], [14])
    table = cache.block_table(seq.seq_id)
    free = cache.stats().num_blocks_free
    preempted = cache.preempt([seq.seq_id], "swap")
    assert preempted.offloads[:, 0].tolist() == list(table[2:]), "only the blocks past its cached prefix move"
    assert cache.stats().num_blocks_free == free + 2 and cache.stats().num_host_blocks_swapped == 2
    assert cache.stats().num_swapped_sequences == 1
    cache.check_invariants()
    resumed = cache.resume(seq.seq_id)
    assert resumed.seq_id == seq.seq_id and resumed.num_cached_tokens == 14 and len(resumed.slots) == 0
    assert resumed.loads[:, 0].tolist() == preempted.offloads[:, 1].tolist()
    assert resumed.loads[:, 1].tolist() == list(resumed.block_table[2:])
    assert list(resumed.block_table[:2]) == list(table[:2]), "the prefix is the tree's, still on the device"
    assert cache.num_computed_tokens(seq.seq_id) == 14
    stats = cache.stats()
    assert (stats.num_host_blocks_swapped, stats.num_swapped_sequences) == (0, 0)
    cache.check_invariants()
    assert stats.num_host_blocks_free == 8, "its host blocks are free once the result is built"


def test_swap_resume_recomputes_when_the_prefix_is_gone():
    cache = KVCache(8, BS, host_num_blocks=8)
    cached(cache, list(range(8)))
    seq = cache.open(list(range(14)))
    cache.commit([seq.seq_id], [14])
    cache.preempt([seq.seq_id], "swap")
    cache.evict(8)  # the prefix moves to the host tier ...
    assert cache.host.enabled
    cache.host.evict(cache.host.num_cached_blocks)  # ... and leaves it
    resumed = cache.resume(seq.seq_id)
    assert resumed.num_cached_tokens == 0 and len(resumed.slots) == 14 and not len(resumed.loads)
    assert cache.num_computed_tokens(seq.seq_id) == 0
    assert cache.stats().num_host_blocks_swapped == 0, "the swapped blocks were freed unused"
    cache.check_invariants()


def test_swap_refused_when_the_host_tier_cannot_take_it():
    cache = KVCache(8, BS, host_num_blocks=1)
    seq = cache.open(list(range(10)))  # 3 own blocks
    with pytest.raises(OutOfBlocks) as refused:
        cache.preempt([seq.seq_id], "swap")
    assert refused.value.metadata["tier"] == "host" and refused.value.needed == 3
    assert not cache.is_preempted(seq.seq_id) and len(cache.block_table(seq.seq_id)) == 3
    cache.check_invariants()


def test_resume_refused_when_the_device_is_full_changes_nothing():
    cache = KVCache(4, BS, host_num_blocks=8)
    seq = cache.open(list(range(10)))
    cache.commit([seq.seq_id], [10])
    cache.preempt([seq.seq_id], "swap")
    hog = cache.open(list(range(100, 113)))  # every device block
    with pytest.raises(OutOfBlocks):
        cache.resume(seq.seq_id)
    assert cache.is_preempted(seq.seq_id) and cache.stats().num_host_blocks_swapped == 3
    cache.check_invariants()
    cache.release(hog.seq_id, cache=False)
    assert cache.resume(seq.seq_id).num_cached_tokens == 10
    cache.check_invariants()


def test_releasing_a_swapped_sequence_frees_its_host_blocks():
    cache = KVCache(8, BS, host_num_blocks=8)
    seq = cache.open(list(range(10)))
    cache.preempt([seq.seq_id], "swap")
    cache.release(seq.seq_id)
    stats = cache.stats()
    assert (stats.num_host_blocks_free, stats.num_swapped_sequences) == (8, 0)
    cache.check_invariants()


def test_no_host_block_a_load_reads_is_overwritten_within_one_result():
    """Offloads are applied before loads: inside one result a loaded block's host copy must not be reused."""
    cache = KVCache(2, BS, host_num_blocks=1)
    cached(cache, [1] * 5)
    cache.evict(2)  # prefix A on host block 0
    with cache.one_result():
        a = cache.open([1] * 5)  # loads host 0 -> device
        assert a.loads[:, 0].tolist() == [0]
        cache.release(a.seq_id)  # A's device block becomes evictable again, its host copy is fresh
        b = cache.open([2] * 8)  # needs both device blocks: evicts A's, cannot offload into host 0
        assert 0 not in b.offloads[:, 1].tolist()
    cache.check_invariants()
    assert cache.match_tiers([1] * 5) == (0, 4), "A's host copy survived"


def test_pending_offloads_come_with_the_next_allocating_result():
    cache = KVCache(4, BS, host_num_blocks=4)
    cached(cache, list(range(9)))
    assert cache.evict(2) == 2  # offloads wait: no result carried them yet
    opened = cache.open(list(range(100, 112)))
    assert sorted(opened.offloads[:, 0].tolist()) == [0, 1]
    assert set(opened.block_table) & {0, 1}, "the offloaded blocks are handed out in the same result"
    assert not len(cache.open([7] * 3).offloads), "each offload is handed out once"
    cache.check_invariants()


def test_without_a_host_tier_nothing_moves():
    cache = KVCache(4, BS)
    cached(cache, list(range(9)))
    opened = cache.open(list(range(100, 112)))
    assert not len(opened.offloads) and not len(opened.loads)
    assert cache.match_tiers(list(range(9))) == (4, 0)
    stats = cache.stats()
    assert (stats.num_host_blocks_total, stats.num_offloaded_blocks) == (0, 0)
    assert isinstance(opened.offloads, np.ndarray) and opened.offloads.shape == (0, 2)
