"""The disk tier's bookkeeping in the core: `HostTier.adopt` hangs a disk hit under the match as a host-only node
an open loads back, and a pool holding a tenth of a trace's working set over a disk that holds all of it keeps
the hit ratio of an infinite cache (`radixkv simulate --disk-blocks`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cli import main
from radixkv.disk.continuation import continuation
from radixkv.disk.load_cost import LoadCost
from radixkv.disk.simulated import SimulatedDisk
from radixkv.kv_cache import KVCache
from radixkv.planning.workload import make_trace, replay, working_set
from radixkv.tree.block_hash import chain_hashes
from radixkv.tree.radix_tree import to_token_bytes

BS = 4


def test_a_disk_hit_joins_the_host_tier_and_an_open_loads_it() -> None:
    cache = KVCache(16, BS, host_num_blocks=8)
    disk = SimulatedDisk(cache, 100)
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    first = cache.open(prompt)
    cache.commit([first.seq_id], [len(prompt)])
    cache.release(first.seq_id)
    assert cache.evict(3) == 3  # to the host tier
    assert cache.host.enabled and cache.host.evict(3) == 3  # and out of it: on disk only
    assert cache.match_tiers(prompt) == (0, 0)
    assert disk.promote(prompt, "default") == 0, "offloads into the freed host blocks are not handed out yet"
    assert len(cache.host.take_offloads()) == 3  # now they are: the worker applies them before anything later
    assert disk.promote(prompt, "default") == 3
    cache.check_invariants()
    assert cache.match_tiers(prompt) == (0, 12)
    again = cache.open(prompt)
    assert (again.num_cached_tokens, again.num_host_hit_tokens, len(again.loads)) == (12, 12, 3)
    cache.check_invariants()
    assert disk.promote(prompt, "default") == 0  # on the device now


def test_a_disk_hit_past_a_match_ending_inside_a_device_node_hangs_where_the_node_splits() -> None:
    cache = KVCache(16, BS, host_num_blocks=8)
    disk = SimulatedDisk(cache, 100)
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    first = cache.open(prompt)
    cache.commit([first.seq_id], [len(prompt)])
    cache.release(first.seq_id)
    assert cache.evict(3) == 3 and cache.host.enabled and cache.host.evict(3) == 3  # on disk only
    cache.host.take_offloads()
    other = cache.open([*prompt[:8], 50, 51, 52, 53, 54])  # one device node of 3 blocks, the first 2 the prompt's
    cache.commit([other.seq_id], [13])
    cache.release(other.seq_id)
    assert cache.match_tiers(prompt) == (8, 0)
    found = continuation(cache, to_token_bytes(prompt), "default", disk.hashes.get)
    assert found is not None and found.start == 2 and found.hashes == chain_hashes(prompt, BS)[2:3]
    assert disk.promote(prompt, "default") == 1
    cache.check_invariants()
    assert cache.match_tiers(prompt) == (8, 4)
    again = cache.open(prompt)
    assert (again.num_cached_tokens, again.num_host_hit_tokens) == (12, 4)
    cache.check_invariants()


def test_the_continuation_starts_past_the_device_and_host_match_with_the_contract_hashes() -> None:
    cache = KVCache(16, BS, host_num_blocks=8)
    disk = SimulatedDisk(cache, 100)
    prompt = list(range(1, 22))  # 5 full blocks and 1 token
    opened = cache.open(prompt[:9])
    cache.commit([opened.seq_id], [9])
    cache.release(opened.seq_id)  # 2 blocks on the device
    found = continuation(cache, to_token_bytes(prompt), "default", disk.hashes.get)
    assert found is not None and found.start == 2
    assert found.hashes == chain_hashes(prompt, BS)[2:5]
    assert continuation(cache, to_token_bytes(prompt[:8]), "default", disk.hashes.get) is None  # nothing past it
    assert continuation(cache, to_token_bytes(prompt), "other", disk.hashes.get).start == 0  # type: ignore[union-attr]
    assert "other" not in cache.tree.roots, "looking changes nothing"


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(5, 24)), min_size=1, max_size=25))
def test_promotions_keep_every_invariant(requests: list[tuple[int, int]]) -> None:
    """Random prompts over a few shared prefixes through a tiny pool, host tier and disk: whatever is promoted, the
    recounts hold and every open's hit is what the three tiers held."""
    cache = KVCache(12, BS, host_num_blocks=3)
    disk = SimulatedDisk(cache, 20)
    for prefix, length in requests:
        prompt = [100 * prefix + t for t in range(length)]
        disk.promote(prompt, "default")
        cache.check_invariants()
        device, host = cache.match_tiers(prompt)
        opened = cache.open(prompt)
        assert opened.num_cached_tokens == min(device + host, (length - 1) // BS * BS)  # the last token computed
        cache.commit([opened.seq_id], [length])
        cache.release(opened.seq_id)
        cache.check_invariants()


def test_a_tenth_of_the_working_set_over_a_whole_disk_keeps_the_infinite_hit_ratio() -> None:
    trace = make_trace(3_000_000, seed=1)
    infinite = working_set(trace, 16)
    pool = infinite.num_blocks // 10
    assert pool >= infinite.peak_in_use_blocks * 1.2, "the trace is long enough for a tenth to hold its live blocks"
    alone = replay(KVCache(pool, 16), trace)
    cache = KVCache(pool, 16, host_num_blocks=pool // 2)
    disk = SimulatedDisk(cache, infinite.num_blocks)
    tiered = replay(cache, trace, before_open=disk.promote)
    cache.check_invariants()
    assert disk.num_promoted_blocks > 0
    assert tiered.hit_ratio >= infinite.hit_ratio - 0.02 > alone.hit_ratio


def test_simulate_prints_the_disk_tier(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["simulate", "--tokens", "200000", "--pool-fraction", "0.1", "--disk-blocks", "-1"]) == 0
    out = capsys.readouterr().out
    assert "disk tier:" in out and "loaded from disk" in out


def test_a_load_is_planned_only_when_reading_beats_recomputing() -> None:
    cost = LoadCost(bytes_per_block=1 << 20, block_size=16, prefill_tokens_per_s=16_000)  # 1 ms of prefill a block
    assert cost.worth_loading(8), "no bandwidth measured yet: the first load measures it"
    cost.observe(1 << 30, 1.0)  # 1 GiB/s: a block reads in ~1 ms + latency
    assert not cost.worth_loading(1) and cost.num_skipped_loads == 1
    cost.observe(1 << 30, 0.1)  # faster: 10 GiB/s weighs in
    assert cost.worth_loading(64)
    assert LoadCost(1 << 20, 16, None).worth_loading(10**6), "no prefill rate stated: nothing to weigh against"
    assert np.isclose(cost.compute_seconds(1) or 0, 1e-3)
