"""Stats: the block gauges partition the pool at every point, the counters count what happened."""

from __future__ import annotations

from radixkv import KVCache
from radixkv.stats import Stats


def _partitions(stats: Stats) -> bool:
    return stats.num_blocks_free + stats.num_blocks_evictable + stats.num_blocks_in_use == stats.num_blocks_total


def test_gauges_partition_the_pool_and_counters_count_a_second_turn_hit() -> None:
    cache = KVCache(num_blocks=16, block_size=4)
    first = cache.open(list(range(9)))  # 3 blocks, nothing cached yet
    cache.commit([first.seq_id], [9])
    stats = cache.stats()
    assert _partitions(stats) and (stats.num_blocks_in_use, stats.num_live_sequences) == (3, 1)
    cache.release(first.seq_id)  # its two full blocks stay cached, unlocked
    stats = cache.stats()
    assert _partitions(stats)
    assert (stats.num_blocks_cached, stats.num_blocks_evictable, stats.num_blocks_in_use) == (2, 2, 0)
    second = cache.open(list(range(9)) + [42])  # the next turn hits both cached blocks
    stats = cache.stats()
    assert _partitions(stats) and stats.num_blocks_evictable == 0 and stats.num_blocks_in_use == 3
    assert (stats.num_requested_tokens, stats.num_hit_tokens) == (19, 8)
    assert stats.hit_ratio == 8 / 19 and stats.usage_ratio == 3 / 16
    assert (stats.num_opened_sequences, stats.num_released_sequences, stats.num_namespaces) == (2, 1, 1)
    cache.release(second.seq_id, cache=False)


def test_a_fresh_cache_reports_zero_ratios() -> None:
    stats = KVCache(num_blocks=8, block_size=4).stats()
    assert stats.hit_ratio == 0.0 and stats.usage_ratio == 0.0 and stats.num_blocks_free == 8
