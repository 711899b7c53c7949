"""Snapshots of a cache with a host tier: the host tier survives a restart exactly, or the snapshot is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule

from radixkv import KVCache, PoolLayout
from radixkv.errors import SnapshotRefused
from radixkv.pressure.swap import SwappedBlocks
from radixkv.state.host_state import host_only_nodes
from radixkv.state.snapshot import PoolIdentity, dump, load
from tests.core.test_host_tier_machine import BASES, BLOCK_SIZE, NUM_BLOCKS, NUM_HOST_BLOCKS, HostTierMachine
from tests.core.test_snapshot import _resealed, fingerprint
from tests.examples import examples


def identity(num_host_blocks: int | None = NUM_HOST_BLOCKS, memory_id: str = "mem-1") -> PoolIdentity:
    layout = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    host = dataclasses.replace(layout, num_blocks=num_host_blocks) if num_host_blocks else None
    return PoolIdentity(pool="default", layout=layout, memory_id=memory_id, host_layout=host)


def _path(node) -> tuple[str, bytes]:
    runs = []
    while node.parent is not None:
        runs.append(bytes(node.token_bytes))
        node = node.parent
    return node.namespace, b"".join(reversed(runs))


def host_fingerprint(cache: KVCache) -> dict[str, object]:
    """Everything observable about both tiers, by content, and the relative order of every node id."""
    host = cache.host
    assert host.enabled
    device = [n for _, n in cache.tree.nodes()]
    hosted = host_only_nodes([*cache.tree.roots.values(), *device])
    everyone = device + hosted
    leaves, copies, fresh, deferred = host.listed()
    matches = {(tuple(b[:cut]), ns): cache.match_tiers(b[:cut], ns) for b in BASES for cut in (4, 8, 10) for ns in
               cache.tree.roots}  # fmt: skip
    return {
        **fingerprint(cache),
        "preempted": {
            p.seq_id: dataclasses.astuple(dataclasses.replace(p, host=None))
            for p in cache._sequences.preempted.values()
        },  # fmt: skip
        "host_nodes": sorted((_path(n), n.host_block_ids.tolist(), n.last_access) for n in hosted),
        "host_copies": [(_path(n), n.host_block_ids.tolist()) for n in copies],
        "host_lru": [_path(n) for n in leaves],
        "in_flight": (fresh, deferred),
        "host_free": host.pool.free_block_ids(),
        "host_ref_counts": host.pool.ref_counts.tolist(),
        "swapped": {
            p.seq_id: (p.host.num_path_blocks, p.host.host_block_ids.tolist())
            for p in cache._sequences.preempted.values()
            if isinstance(p.host, SwappedBlocks)
        },
        "pending": [pair for pairs in host._pending for pair in pairs.tolist()],
        "host_counts": (host.num_cached_blocks, host.num_swapped_blocks, host.num_swapped_sequences),
        "id_order": [_path(n) + (n in hosted,) for n in sorted(everyone, key=lambda n: n.node_id)],
        "matches": matches,
    }


class RestartingHostTierMachine(HostTierMachine):
    """The host tier machine, plus restarts through a snapshot. The worker's memory stays as it is (the keeper
    keeps both tiers' memory), so every later step checks that the restored index still points at the right
    K/V on both tiers, including swapped sequences resumed and offloads still pending at the restart."""

    @rule()
    def restart(self):
        before = host_fingerprint(self.cache)
        adopted = load(dump(self.cache, identity()), identity())
        assert host_fingerprint(adopted.cache) == before
        adopted.cache.check_invariants()
        self.cache = adopted.cache


RestartingHostTierMachine.TestCase.settings = settings(
    max_examples=examples(120), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_restart_host_tier_state_machine = RestartingHostTierMachine.TestCase


BUSY_HOST_BLOCKS = 16  # room for every prefix evicted, and a swapped sequence


def host_busy_cache() -> KVCache:
    """Prefixes on the device, on the host only, loaded back with a host copy, and a sequence swapped out."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=BUSY_HOST_BLOCKS)
    for base in BASES:
        opened = cache.open(base)
        cache.commit([opened.seq_id], [len(base)])
        cache.release(opened.seq_id)
    swapped = cache.open([9, 9, 9])
    cache.commit([swapped.seq_id], [3])
    cache.preempt([swapped.seq_id], "swap")
    cache.evict(NUM_BLOCKS)  # everything cached moves to the host tier (as much as it holds)
    assert cache.match_tiers(BASES[2])[1] > 0
    reopened = cache.open(BASES[2][:4])  # loaded back: a device node keeping its host copy
    cache.commit([reopened.seq_id], [4])
    cache.release(reopened.seq_id)
    return cache


def test_a_busy_host_tier_restores_exactly_and_serves_the_same_hits() -> None:
    original = host_busy_cache()
    stats = original.stats()
    assert stats.num_host_blocks_cached > 0 and stats.num_swapped_sequences == 1
    restored = load(dump(original, identity(BUSY_HOST_BLOCKS)), identity(BUSY_HOST_BLOCKS)).cache
    assert host_fingerprint(restored) == host_fingerprint(original)
    for cache in (original, restored):
        opened = cache.open(BASES[0])
        assert opened.num_host_hit_tokens > 0 and len(opened.loads)
        cache.resume(cache.preempted_sequence_ids()[0])
    assert host_fingerprint(restored) == host_fingerprint(original)
    assert dataclasses.asdict(restored.stats()) == dataclasses.asdict(original.stats())


@pytest.mark.parametrize(
    ("other", "why"),
    [(identity(BUSY_HOST_BLOCKS + 2), "HOST_LAYOUT"), (identity(None), "HOST_LAYOUT")],
)
def test_a_snapshot_of_another_host_tier_is_refused(other: PoolIdentity, why: str) -> None:
    with pytest.raises(SnapshotRefused) as e:
        load(dump(host_busy_cache(), identity(BUSY_HOST_BLOCKS)), other)
    assert e.value.why == why and "host_layout" in e.value.message


def test_a_snapshot_without_a_host_tier_section_restores_with_an_empty_one() -> None:
    """A snapshot written before the host tier was kept: its device tree is adopted, the host tier starts empty."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=NUM_HOST_BLOCKS)
    opened = cache.open(BASES[0])
    cache.commit([opened.seq_id], [len(BASES[0])])
    cache.release(opened.seq_id)

    def as_before(state):
        del state["host"]

    data = _resealed(dump(cache, identity()), as_before)
    restored = load(data, identity()).cache
    assert restored.match_tiers(BASES[0]) == cache.match_tiers(BASES[0])
    assert restored.host.enabled and restored.stats().num_host_blocks_free == NUM_HOST_BLOCKS


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["host"].update(free=s["host"]["free"][:-4]),  # a host block lost from the free stack
        lambda s: s["host"].update(ref_counts=b"\x00" * len(s["host"]["ref_counts"])),  # holders without counts
        lambda s: s["host"]["nodes"].update(blocks=s["host"]["nodes"]["blocks"][:-4]),  # blocks and tokens disagree
        lambda s: s["host"].update(swapped=[]),  # a swapped sequence without its host blocks
        lambda s: s["host"].update(copies=b""),  # host copies nobody holds
        lambda s: s["host"].update(order=s["host"]["order"][:-4]),  # node ranks that do not cover every node
        lambda s: s["host"].update(num_blocks=BUSY_HOST_BLOCKS + 1),
    ],
)
def test_a_sealed_but_inconsistent_host_tier_is_refused(change) -> None:
    with pytest.raises(SnapshotRefused) as e:
        load(_resealed(dump(host_busy_cache(), identity(BUSY_HOST_BLOCKS)), change), identity(BUSY_HOST_BLOCKS))
    assert e.value.why == "INCONSISTENT"


def test_offloads_pending_at_the_snapshot_are_handed_out_after_it() -> None:
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, host_num_blocks=NUM_HOST_BLOCKS)
    opened = cache.open(BASES[0])
    cache.commit([opened.seq_id], [len(BASES[0])])
    cache.release(opened.seq_id)
    cache.evict(2)  # offloads queued for the next result that hands out blocks
    restored = load(dump(cache, identity()), identity()).cache
    expected = cache.open([42, 43, 44]).offloads
    assert len(expected) and np.array_equal(restored.open([42, 43, 44]).offloads, expected)
