"""The synthetic trace is reproducible and mixed; its replay leaks nothing and hits no better than an infinite cache."""

from __future__ import annotations

import numpy as np

from radixkv import KVCache
from radixkv.planning.workload import make_trace, replay, working_set


def test_a_seed_gives_the_same_trace_and_the_trace_mixes_every_kind() -> None:
    a, b = make_trace(60_000, seed=3), make_trace(60_000, seed=3)
    assert [r.kind for r in a] == [r.kind for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    assert {r.kind for r in a} == {"chat", "turn", "samples", "unrelated"}
    assert sum(r.num_tokens for r in a) >= 60_000
    assert all(len(r.outputs) >= 4 for r in a if r.kind == "samples")


def test_replay_leaks_nothing_and_a_small_cache_hits_no_more_than_an_infinite_one() -> None:
    trace = make_trace(40_000, seed=1)
    best = working_set(trace, block_size=16, release_after=4)
    num_blocks = 2 * best.peak_in_use_blocks
    assert num_blocks < best.num_blocks  # the working set does not fit: the replay must evict
    cache = KVCache(num_blocks=num_blocks, block_size=16)
    result = replay(cache, trace, release_after=4)
    assert result.num_requests == len(trace) and result.num_evicted_blocks > 0
    assert 0 < result.hit_ratio <= best.hit_ratio
    stats = cache.stats()
    assert stats.num_live_sequences == 0 and stats.num_blocks_in_use == 0  # every sequence was released
    cache.check_invariants()
