"""The server's event hub in-process: hashes beside block ids, the snapshot in hash form, epochs."""

from __future__ import annotations

import random

import numpy as np

from radixkv.errors import OutOfBlocks
from radixkv.kv_cache import KVCache
from radixkv.server.events.hub import EventHub, EventKind, Tombstones
from radixkv.tree.block_hash import chain_hashes, digest_of, mix64, wire_hash


def _written_workload(cache: KVCache, seed: int) -> None:
    """Prompts written in full (committed) then released cached, in two namespaces, until blocks run short."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(60) for _ in range(rng.randrange(4, 28))] for _ in range(6)]
    live: list[int] = []
    for _ in range(150):
        if rng.random() < 0.55 or not live:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 29)] + [rng.randrange(60) for _ in range(rng.randrange(6))]
            try:
                seq_id = cache.open(tokens or [3], rng.choice(["default", "chat"])).seq_id
            except OutOfBlocks:
                continue
            cache.commit([seq_id], [len(tokens or [3])])
            live.append(seq_id)
        else:
            cache.release(live.pop(rng.randrange(len(live))))


def _expected_snapshot_hashes(cache: KVCache, only: str | None = None) -> set[int]:
    expected = set()
    for namespace, node in cache.tree.nodes():
        if only is not None and namespace != only:
            continue
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        tokens = np.frombuffer(b"".join(p.token_bytes for p in reversed(path)), dtype="<i4").tolist()
        expected.update(wire_hash(h) for h in chain_hashes(tokens, cache.block_size, namespace))
    return expected


def test_an_unwatched_hub_keeps_hashes_and_a_late_snapshot_is_the_tree_in_hash_form() -> None:
    cache = KVCache(40, 4)
    hub = EventHub(cache, 100)
    _written_workload(cache, 0)  # nobody watching: no events built, but every block hashed as it is cached
    assert cache.tree.num_cached_blocks > 0, "the workload caches something"
    hub.hashes.check_against(cache.tree.tree_block_ids())
    snapshot = hub.snapshot(lambda namespace: True)
    assert {h for e in snapshot for h in e.block_hashes} == _expected_snapshot_hashes(cache)
    for event in snapshot:
        assert event.pool_sequence_number == hub.num_events and len(event.block_hashes) == len(event.block_ids)


def test_watched_events_carry_hashes_parents_and_pool_wide_numbers() -> None:
    cache = KVCache(40, 4)
    hub = EventHub(cache, 10_000)
    watcher = hub.watch(lambda namespace: True)
    _written_workload(cache, 1)
    events, _ = watcher.take(0)
    assert any(e.kind is EventKind.BLOCKS_REMOVED for e in events), "the workload evicts"
    assert [e.pool_sequence_number for e in events] == list(range(1, hub.num_events + 1))
    held: set[int] = set()
    for e in events:
        assert len(e.block_hashes) == len(e.block_ids)
        if e.kind is EventKind.BLOCKS_STORED:
            assert e.parent_block_hash is None or e.parent_block_hash in held, "parent before child"
            held.update(e.block_hashes)
        else:
            assert set(e.block_hashes) <= held
            held.difference_update(e.block_hashes)
    assert held == _expected_snapshot_hashes(cache)
    assert EventHub(KVCache(8, 4), 1).epoch != hub.epoch, "each incarnation draws its own epoch"


def test_the_digest_moves_in_step_with_the_tree_and_each_event_carries_it() -> None:
    """After a workload with evictions, each namespace's digest equals a recount of its cached hashes;
    every event carries its namespace's digest after it, and a watcher's digest sums its namespaces."""
    cache = KVCache(24, 4)  # small: the workload evicts
    hub = EventHub(cache, 10_000)
    chat = hub.watch(lambda namespace: namespace == "chat")
    everything = hub.watch(lambda namespace: True)
    _written_workload(cache, 4)
    events, digest = everything.take(0)
    assert any(e.kind is EventKind.BLOCKS_REMOVED for e in events), "the workload must evict"
    for namespace in ("default", "chat"):
        assert hub.digests.get(namespace, 0) == digest_of(_expected_snapshot_hashes(cache, namespace))
        assert hub.num_blocks.get(namespace, 0) == len(_expected_snapshot_hashes(cache, namespace))
    assert digest == digest_of(_expected_snapshot_hashes(cache)) == hub.digest(lambda namespace: True)
    assert chat.take(0)[1] == hub.digests.get("chat", 0)
    assert sum(hub.num_blocks.values()) > 0
    running: dict[str, int] = {}
    for e in events:  # replaying the events term by term reproduces every digest they carry
        sign = 1 if e.kind is EventKind.BLOCKS_STORED else -1
        running[e.namespace] = (running.get(e.namespace, 0) + sign * sum(mix64(h) for h in e.block_hashes)) % 2**64
        assert e.namespace_digest == running[e.namespace]
    assert digest_of([1, 2, 3]) == digest_of([3, 1, 2]) != digest_of([1, 2])


def test_tombstones_keep_the_newest_evictions_per_namespace() -> None:
    tombstones = Tombstones(3)
    tombstones.bury("a", (1, 2))
    tombstones.bury("b", (3, 4))  # 1, the oldest, is forgotten
    assert len(tombstones) == 3 and tombstones.num_bytes == 3 * Tombstones.ENTRY_BYTES
    assert tombstones.evicted_at(1, "a") is None
    evicted_at = tombstones.evicted_at(2, "a")
    assert evicted_at is not None and evicted_at > 0
    assert tombstones.evicted_at(2, "b") is None  # buried under another namespace: not for this one
    assert tombstones.evicted_at(4, "b") is not None
    nothing = Tombstones(0)
    nothing.bury("a", (1,))
    assert len(nothing) == 0 and nothing.evicted_at(1, "a") is None


def test_hub_buries_every_evicted_block_hash() -> None:
    cache = KVCache(4, 2)
    hub = EventHub(cache, 100, max_tombstones=16)
    first = cache.open(np.arange(4, dtype=np.int32))
    cache.commit([first.seq_id], [4])
    cache.release(first.seq_id)
    cache.open(np.arange(100, 108, dtype=np.int32))  # needs all 4 blocks: evicts both cached
    for wire in (wire_hash(h) for h in chain_hashes(list(range(4)), 2)):
        assert hub.tombstones.evicted_at(wire, "default") is not None
