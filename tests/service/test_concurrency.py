"""Eight clients at once, mixing every operation for a few seconds; afterwards nothing is held and every
count agrees."""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np

from radixkv.client import KVEventKind, RadixKVClient
from radixkv.errors import FailedPrecondition, LimitExceeded, NotPinned, OutOfBlocks
from radixkv.sequences.results import OpenResult
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

NUM_CLIENTS = 8
SECONDS = 3.0
# Refusals a busy shared pool may legitimately give; anything else fails the test.
EXPECTED = (OutOfBlocks, LimitExceeded, FailedPrecondition, NotPinned)
PREFIXES = [list(range(1000 * p, 1000 * p + 8)) for p in range(4)]  # shared system prompts: hits across clients


def _drive(address: str, worker: int, deadline: float, counts: dict[str, int], failures: list[BaseException]) -> None:
    rng = random.Random(worker)
    namespace = f"conc-{worker % 2}"  # pairs of clients share a namespace
    try:
        with RadixKVClient(address) as client:
            live: list[int] = []
            pins: list[list[int]] = []
            while time.monotonic() < deadline:
                op = rng.choice(
                    ["open", "open_many", "append", "fork", "cache", "release", "match", "pin", "unpin", "stats"]
                )
                try:
                    if op in ("open", "open_many") or not live:
                        prompts = [
                            (rng.choice(PREFIXES) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))], namespace)
                            for _ in range(1 if op == "open" else 3)
                        ]
                        opened = client.open_many(prompts)
                        live += [o.seq_id for o in opened]
                        assert all(client.block_table(o.seq_id) == o.block_table.tolist() for o in opened)
                    elif op == "append":
                        batch = rng.sample(live, min(len(live), 4))
                        results = client.append_many([(s, [rng.randrange(50)] * rng.randrange(1, 6)) for s in batch])
                        for r in results:
                            assert client.block_table(r.seq_id)[r.table_offset :] == r.block_ids
                            assert len(np.asarray(r.slots)) >= 1
                    elif op == "fork":
                        live += client.fork(rng.choice(live), rng.randrange(1, 3))
                    elif op == "cache":
                        seq_id = rng.choice(live)
                        client.commit([seq_id], [client.num_tokens(seq_id)])  # as its worker wrote them all
                        client.cache(seq_id)
                    elif op == "release":
                        victims = rng.sample(live, min(len(live), rng.randrange(1, 4)))
                        client.commit(victims, [n for n, _ in client.describe_sequences(victims)])
                        client.release_many(victims, cache=rng.random() < 0.7)
                        live = [s for s in live if s not in victims]
                    elif op == "match":
                        assert client.match(rng.choice(PREFIXES) + [1], namespace) % 4 == 0
                    elif op == "pin":
                        prefix = rng.choice(PREFIXES)
                        client.pin(prefix, namespace)
                        pins.append(prefix)
                    elif op == "unpin" and pins:
                        client.unpin(pins.pop(), namespace)
                    else:
                        stats = client.stats()
                        assert (
                            stats.num_blocks_free + stats.num_blocks_evictable + stats.num_blocks_in_use
                            == stats.num_blocks_total
                        )
                    counts[op] = counts.get(op, 0) + 1
                except EXPECTED as e:
                    counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
                if len(live) > 24:  # keep the pool from filling up with one client's sequences
                    client.release_many(live[:12])
                    live = live[12:]
            # Leave sequences and pins behind on purpose: closing the session must release them.
    except BaseException as e:  # noqa: BLE001 -- reported to the main thread
        failures.append(e)


def _snapshot(address: str, namespaces: list[str]) -> dict[str, set[int]]:
    """The blocks the tree holds now per namespace, from a fresh stream's snapshot message (raw stub)."""
    with grpc.insecure_channel(address) as channel:
        call = kvcache_pb2_grpc.KVCacheStub(channel).WatchEvents(
            pb.WatchEventsRequest(namespaces=namespaces, include_snapshot=True)
        )
        first = next(call)
        call.cancel()
    assert first.snapshot
    held: dict[str, set[int]] = {ns: set() for ns in namespaces}
    for e in first.events:
        held[e.namespace] |= set(e.block_ids)
    return held


# type: ignore[no-untyped-def]
def test_eight_clients_mixing_everything_leave_a_consistent_pool(server, debug, wait_until) -> None:
    namespaces = ["conc-0", "conc-1"]
    baseline = debug.check()
    watcher = RadixKVClient(server.address)
    stream = watcher.watch_events(namespaces, include_snapshot=True)
    events: list = []
    reader = threading.Thread(target=lambda: events.extend(stream), daemon=True)
    reader.start()
    # Store marker blocks until the stream shows one (in its snapshot or live): it is registered.
    marker = 0
    while not wait_until(lambda: events, timeout=0.5):
        marker += 1
        watcher.release(_written(watcher, watcher.open([9000 + marker] * 4 + [1], "conc-0")))

    deadline = time.monotonic() + SECONDS
    counts: list[dict[str, int]] = [{} for _ in range(NUM_CLIENTS)]
    failures: list[BaseException] = []
    threads = [
        threading.Thread(target=_drive, args=(server.address, i, deadline, counts[i], failures))
        for i in range(NUM_CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures[0]
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    assert total.get("open", 0) + total.get("open_many", 0) > 20, total
    assert all(total.get(op, 0) > 0 for op in ("append", "fork", "cache", "release", "match", "pin", "stats")), total

    # Every session closed: no sequence, no pin; every block is free or cached and evictable.
    after = debug.check()
    assert after.num_live_sequences == 0
    assert after.num_sessions == baseline.num_sessions + 1  # only the watcher's
    stats = watcher.stats()
    assert (stats.num_live_sequences, stats.num_blocks_in_use, stats.num_blocks_pinned) == (0, 0, 0)
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total

    final = _snapshot(server.address, namespaces)
    stream.cancel()
    reader.join(timeout=patient(120))
    watcher.close()
    # Replaying the stream (snapshot, then events numbered on from it with no gap) rebuilds exactly
    # the blocks the tree holds now.
    for namespace in namespaces:
        mine = [e for e in events if e.namespace == namespace]
        snapshot = [e for e in mine if e.snapshot]
        live = [e for e in mine if not e.snapshot]
        start = snapshot[0].sequence_number if snapshot else 0
        assert [e.sequence_number for e in live] == list(range(start + 1, start + 1 + len(live)))
        blocks = {b for e in snapshot for b in e.block_ids}
        for e in live:
            if e.kind == KVEventKind.BLOCKS_STORED:
                assert blocks.isdisjoint(e.block_ids)
                blocks |= set(e.block_ids)
            else:
                assert set(e.block_ids) <= blocks
                blocks -= set(e.block_ids)
        assert blocks == final[namespace], namespace


def _written(client: RadixKVClient, opened: OpenResult) -> int:
    """As a worker that wrote every token of `opened` would: commit them (only written blocks are cached)."""
    client.commit([opened.seq_id], [opened.num_cached_tokens + len(opened.slots)])
    return opened.seq_id
