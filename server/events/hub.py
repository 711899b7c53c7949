"""Blocks stored into and removed from one pool's prefix tree, numbered per namespace, fanned out to watchers.

Every event names its blocks twice: by block id (this process's memory) and by content hash
(`radixkv.tree.block_hash`, vLLM's scheme, stable across processes). The hub keeps the block_id -> hash
table, so each hash is computed once, when its block enters the tree. `epoch` names this hub's
incarnation (random per server start), so a consumer tells a restart from a gap; `num_events`
counts every event of the pool, `num_events_in` those of each tenant (what a tenant may be told: never
another tenant's count). A namespace's numbers, digest and block count go when its last cached block
does, so names that come and go leave nothing behind. Sinks (the ZMQ publisher) get the events of each
hold of the pool's lock as one unit (`flush`, called as the lock is released: `PoolLock`, here with the flush
it exists for).

`EventHub` is the tree's observer (`RadixTree.observer`): every block the tree takes (cache,
release, fork) and every block it evicts (an allocation running short) is reported to it from
inside core calls, so under the pool's lock: the hub needs no lock of its own for numbering, and
a watcher registered under the same lock sees a snapshot and then exactly the events after it.
The watcher list is replaced, never mutated, under a small lock of its own, so a stream can leave
without the pool's lock.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

from radixkv.kv_cache import KVCache
from radixkv.server.events.block_checksums import BlockChecksums
from radixkv.tree.block_hash import WIRE_MASK, BlockHashes, ExtraKeys, mix64, wire_hash
from radixkv.tree.radix_node import OWNER_SEPARATOR as SCOPE_SEPARATOR  # a tenant's namespaces: tenant/name
from radixkv.tree.radix_tree import Node


class EventKind(enum.Enum):
    BLOCKS_STORED = 1
    BLOCKS_REMOVED = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockEvent:
    sequence_number: int  # per namespace: +1 per event, so a watcher that missed some sees a jump
    namespace: str  # as the core names it (tenant-scoped where auth is on)
    kind: EventKind
    block_ids: tuple[int, ...]
    token_bytes: bytes = b""  # BLOCKS_STORED: int32 tokens of those blocks
    parent_block_id: int | None = None  # BLOCKS_STORED: the block before them; None at the root
    block_hashes: tuple[int, ...] = ()  # low 64 bits of each block's content hash, beside block_ids
    parent_block_hash: int | None = None  # BLOCKS_STORED: hash of the block before them; None at the root
    extra_keys: tuple[ExtraKeys, ...] = ()  # BLOCKS_STORED: per block as events carry them (the untagged salt)
    pool_sequence_number: int = 0  # every event of its tenant (of the pool, auth off), +1 each; a snapshot's: the last
    namespace_digest: int = 0  # the namespace's digest after this event (`radixkv.tree.block_hash.digest_of`)
    digest_delta: int = 0  # what this event added to it, mod 2^64


class DiskTier(Protocol):
    """A pool's disk tier as the hub, the steps and the reads use it (`radixkv.server.rules.disk_tier.PoolDisk`); every
    call but `close` under the pool's lock."""

    def stored(self, node: Node, hashes: list[bytes]) -> None: ...

    def removed(self, block_ids: npt.NDArray[np.int32]) -> None: ...

    def promote(self, key: bytes, namespace: str) -> int: ...

    def num_on_disk_tokens(self, key: bytes, namespace: str) -> int: ...

    def close(self) -> None: ...


class EventSink(Protocol):
    """Told of the events of each hold of the pool's lock, in order, under that lock: must not block (queue and
    return). One unit is one call's work: a block stored and removed within it never existed for anyone else."""

    def publish_unit(self, events: list[BlockEvent]) -> None: ...


WATCH_QUEUE_BYTES = 32 << 20  # a WatchEvents stream's queue at most, besides its count (`watch_queue_size`)
EVENT_BYTES = 360  # a BlockEvent's fixed part; with ID_BYTES, 552 for a 2-block event (tracemalloc: 447)
ID_BYTES = 40  # a block id or hash: an int object and its tuple slot


def event_bytes(event: BlockEvent) -> int:
    """About the memory `event` holds while queued (erring high): its tokens, ids and hashes, the rest."""
    return EVENT_BYTES + len(event.token_bytes) + ID_BYTES * (len(event.block_ids) + len(event.block_hashes))


class Watcher:
    """One stream's queue, bounded in events and in bytes. When full, new events are dropped: the gap shows in
    the numbers, and the consumer resyncs from a snapshot."""

    def __init__(
        self, accepts: Callable[[str], bool], max_events: int, *, digest: int = 0, max_bytes: int = WATCH_QUEUE_BYTES
    ) -> None:
        self.accepts = accepts
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.num_bytes = 0  # of the events queued
        self._events: collections.deque[BlockEvent] = collections.deque()
        self._cond = threading.Condition()
        self.closed = False
        self.digest = digest  # of every namespace it accepts, after every event pushed (dropped ones included)
        self._queued_digest = digest  # the same after the last event queued: what a batch of the queue adds up to

    def push(self, event: BlockEvent) -> None:
        with self._cond:
            self.digest = (self.digest + event.digest_delta) & WIRE_MASK
            size = event_bytes(event)
            if len(self._events) < self._max_events and self.num_bytes + size <= self._max_bytes:
                self._events.append(event)
                self.num_bytes += size
                self._queued_digest = self.digest
                self._cond.notify()

    def take(self, timeout: float) -> tuple[list[BlockEvent], int]:
        """Every queued event and the digest after them, waiting up to `timeout` seconds for the first."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self.closed, timeout)
            events = list(self._events)
            self._events.clear()
            self.num_bytes = 0
            return events, self._queued_digest

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Tombstones:
    """The last `max_size` evicted blocks: wire hash -> (Unix ns, core namespace), oldest dropped first.

    The namespace is kept so a lookup can refuse a hash buried under a namespace the caller may not see
    (the salt already makes hashes namespace-specific; this is belt and braces for tenant isolation).
    """

    ENTRY_BYTES = 180  # an OrderedDict entry (int key, a 2-tuple of int and a shared str, the link): tracemalloc

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: collections.OrderedDict[int, tuple[int, str]] = collections.OrderedDict()

    def bury(self, namespace: str, wires: tuple[int, ...]) -> None:
        if not self.max_size:
            return
        now = time.time_ns()
        for wire in wires:
            self._entries[wire] = (now, namespace)
            self._entries.move_to_end(wire)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def evicted_at(self, wire: int, namespace: str) -> int | None:
        """When the block `wire` of `namespace` was evicted (Unix ns), or None if not remembered."""
        entry = self._entries.get(wire)
        return entry[0] if entry is not None and entry[1] == namespace else None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """An estimate of the table's memory, for Stats and metrics."""
        return len(self._entries) * self.ENTRY_BYTES


class EventHub:
    """Numbers and fans out one pool's tree events. Call `watch`/`unwatch` under the pool's lock."""

    def __init__(self, cache: KVCache, max_events_per_watcher: int, max_tombstones: int = 65_536) -> None:
        self._tree = cache.tree
        self._max_events = max_events_per_watcher
        self._numbers: dict[str, int] = {}  # namespace with cached blocks -> last sequence number issued
        self._watchers: tuple[Watcher, ...] = ()
        self._watchers_lock = threading.Lock()
        self.hashes = BlockHashes(cache.block_size)
        self.epoch = secrets.randbits(63) + 1  # this incarnation; never 0, which reads as "unset" on the wire
        self.num_events = 0  # every event of the pool, all namespaces
        self.tenant_prefixes: frozenset[str] = frozenset()  # auth on: "<tenant>/" of every tenant (set at start)
        self.num_events_in: dict[str, int] = {}  # tenant prefix -> its events (auth on; bounded by the tenants)
        self._unit: list[BlockEvent] = []  # the events of this hold of the pool's lock, for the sinks (`flush`)
        self.digests: dict[str, int] = {}  # namespace -> digest of its cached blocks, O(1) per block
        self.num_blocks: dict[str, int] = {}  # namespace -> cached blocks
        self.sinks: list[EventSink] = []
        self.tombstones = Tombstones(max_tombstones)
        self.checksums = BlockChecksums(cache.pool.num_blocks)  # writers' K/V checksums of tree blocks
        self.disk: DiskTier | None = None  # the pool's disk tier (server/rules/disk_tier.py), told of each block
        self._tree.observer = self

    def adopt(self, cache: KVCache) -> None:
        """Observe `cache` (restored from a snapshot) instead of the empty one: hash its blocks, unannounced.

        Recomputing the hashes (rather than reading them from the snapshot) proves the index still
        names its blocks as the contract says; the digests come out as the previous server's.
        """
        assert not self.num_blocks and not self.num_events, "adopt before anything is cached or watched"
        self._tree.observer = None
        self._tree = cache.tree
        self._tree.observer = self
        for _, node in self._tree.nodes():  # parents before children, as they were stored
            self._add_to_digest(node.namespace, tuple(wire_hash(h) for h in self.hashes.store(node)), 1)

    def _next_number(self, namespace: str) -> int:
        """Count one event of `namespace`: the pool's, its tenant's, its own; returns its own number. Called after
        the digest moved: a namespace left without cached blocks forgets its number (the next event is 1)."""
        self.num_events += 1
        prefix = self._tenant_prefix(namespace)
        if prefix:
            self.num_events_in[prefix] = self.num_events_in.get(prefix, 0) + 1
        number = self._numbers.get(namespace, 0) + 1
        if namespace in self.num_blocks:
            self._numbers[namespace] = number
        else:
            self._numbers.pop(namespace, None)
        return number

    def num_events_seen_by(self, prefix: str) -> int:
        """The event count a caller whose namespaces start with `prefix` may read: its tenant's ("" with auth
        off: the pool's). Never moved by another tenant's activity."""
        return self.num_events_in.get(prefix, 0) if prefix else self.num_events

    def num_events_of(self, accepts: Callable[[str], bool]) -> int:
        """Events of the tenants whose namespaces `accepts` takes (every event, auth off): where a stream that
        publishes only those starts counting."""
        if not self.tenant_prefixes:
            return self.num_events
        return sum(n for prefix, n in self.num_events_in.items() if accepts(prefix))

    @property
    def num_namespaces(self) -> int:
        """Namespaces the hub keeps anything for (numbers, digests, block counts): those with cached blocks."""
        return len(self._numbers.keys() | self.num_blocks.keys())

    def flush(self) -> None:
        """Hand this hold's events to the sinks as one unit (the pool's lock calls it as it is released)."""
        if self._unit:
            unit, self._unit = self._unit, []
            for sink in self.sinks:
                sink.publish_unit(unit)

    def _add_to_digest(self, namespace: str, wires: tuple[int, ...], sign: int) -> int:
        """Move `namespace`'s digest by the blocks `wires` (sign +1 stored, -1 removed); returns the delta."""
        delta = (sign * sum(mix64(h) for h in wires)) & WIRE_MASK
        digest = (self.digests.get(namespace, 0) + delta) & WIRE_MASK
        count = self.num_blocks.get(namespace, 0) + sign * len(wires)
        if count:
            self.digests[namespace], self.num_blocks[namespace] = digest, count
        else:
            self.digests.pop(namespace, None)
            self.num_blocks.pop(namespace, None)
        return delta

    def blocks_stored(self, node: Node) -> None:
        """A new leaf of the tree: all its blocks are newly cached (hashed here, once)."""
        hashes = self.hashes.store(node)
        if self.disk is not None:
            self.disk.stored(node, hashes)
        wires = tuple(wire_hash(h) for h in hashes)
        delta = self._add_to_digest(node.namespace, wires, 1)
        number = self._next_number(node.namespace)
        if self.sinks or self._watchers:  # nobody listening: the table, digest and numbers are all that must move
            self._publish(self._stored_event(number, node, delta))

    def blocks_removed(self, namespace: str, block_ids: npt.NDArray[np.int32]) -> None:
        if self.disk is not None:
            self.disk.removed(block_ids)
        hashes = tuple(wire_hash(h) for h in self.hashes.remove(block_ids))
        self.checksums.forget(block_ids)
        self.tombstones.bury(namespace, hashes)
        delta = self._add_to_digest(namespace, hashes, -1)
        number = self._next_number(namespace)
        if not (self.sinks or self._watchers):
            return
        ids = tuple(block_ids.tolist())
        kind = EventKind.BLOCKS_REMOVED
        self._publish(
            BlockEvent(
                sequence_number=number,
                namespace=namespace,
                kind=kind,
                block_ids=ids,
                block_hashes=hashes,
                pool_sequence_number=self._count_for(namespace),
                namespace_digest=self.digests.get(namespace, 0),
                digest_delta=delta,
            )
        )

    def _stored_event(self, number: int, node: Node, delta: int = 0) -> BlockEvent:
        parent = node.parent
        parent_block = int(parent.block_ids[-1]) if parent is not None and parent.parent is not None else None
        parent_hash = self.hashes.parent_hash(node)
        return BlockEvent(
            sequence_number=number,
            namespace=node.namespace,
            kind=EventKind.BLOCKS_STORED,
            block_ids=tuple(node.block_ids.tolist()),
            token_bytes=bytes(node.token_bytes),
            parent_block_id=parent_block,
            block_hashes=tuple(wire_hash(h) for h in self.hashes.node_hashes(node)),
            parent_block_hash=None if parent_hash is None else wire_hash(parent_hash),
            extra_keys=tuple(self.hashes.event_extra_keys(node)),
            pool_sequence_number=self._count_for(node.namespace),
            namespace_digest=self.digests.get(node.namespace, 0),
            digest_delta=delta,
        )

    def _tenant_prefix(self, namespace: str) -> str | None:
        """ "<tenant>/" of `namespace` (auth on), "" with auth off, None for a name of no tenant."""
        if not self.tenant_prefixes:
            return ""
        prefix = namespace[: namespace.find(SCOPE_SEPARATOR) + 1]
        return prefix if prefix in self.tenant_prefixes else None

    def _count_for(self, namespace: str) -> int:
        """The count an event of `namespace` carries: its tenant's, never the pool's (auth off: the pool's)."""
        prefix = self._tenant_prefix(namespace)
        return 0 if prefix is None else self.num_events_seen_by(prefix)

    def _publish(self, event: BlockEvent) -> None:
        if self.sinks:
            self._unit.append(event)
        for watcher in self._watchers:
            if watcher.accepts(event.namespace):
                watcher.push(event)

    def watch(self, accepts: Callable[[str], bool]) -> Watcher:
        """A new watcher; call under the pool's lock (with `snapshot`, if one is wanted)."""
        watcher = Watcher(accepts, self._max_events, digest=self.digest(accepts))
        with self._watchers_lock:
            self._watchers = (*self._watchers, watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Any thread, no pool lock needed."""
        watcher.close()
        with self._watchers_lock:
            self._watchers = tuple(w for w in self._watchers if w is not watcher)

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    def close_all(self) -> None:
        """Server shutdown: wake every stream so it ends."""
        with self._watchers_lock:
            watchers, self._watchers = self._watchers, ()
        for watcher in watchers:
            watcher.close()

    def digest(self, accepts: Callable[[str], bool]) -> int:
        """The digest of every namespace `accepts`: what a router watching them must hold."""
        return sum(d for ns, d in self.digests.items() if accepts(ns)) & WIRE_MASK

    def snapshot(self, accepts: Callable[[str], bool]) -> list[BlockEvent]:
        """The cached blocks now, as BLOCKS_STORED events numbered with each namespace's last number."""
        return [
            self._stored_event(self._numbers.get(namespace, 0), node)
            for namespace, node in self._tree.nodes()
            if accepts(namespace)
        ]


class PoolLock:
    """The pool's lock. Releasing it first hands the hold's tree events to the hub's sinks as one unit
    (`EventHub.flush`), so what one call stored and removed again reaches no stream
    (`radixkv.server.events.kv_events`)."""

    __slots__ = ("_lock", "_hub")

    def __init__(self, hub: EventHub) -> None:
        self._lock = threading.Lock()
        self._hub = hub

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        try:
            self._hub.flush()
        finally:
            self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()
