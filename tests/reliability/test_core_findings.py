"""What the reliability work found in the core, pinned: empty namespaces are forgotten, forks share
history. The third finding, sequence ids that repeat across server runs, needs a server restart and
lives in test_restart.py."""

from __future__ import annotations

import tracemalloc

from radixkv.kv_cache import KVCache, Limits


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
