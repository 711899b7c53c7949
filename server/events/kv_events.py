"""vLLM's KV-events wire format over ZMQ: what llm-d's endpoint picker, Dynamo and Ray Serve consume.

One publisher per pool. Byte for byte what vLLM 0.33/0.34 send (`vllm/distributed/kv_events.py`):
a PUB socket sends 3 frames per batch, `[topic, seq u64 BE, payload]`, `seq` counting batches from 0,
the payload `KVEventBatch` as msgspec encodes it (`radixkv.server.events.kv_events_wire`): `[ts, [events...],
data_parallel_rank]`, each event a map tagged "type" (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`);
a `BlockStored` has `extra_keys` only when a block carries a salt, untagged as vLLM publishes it.
Nothing else ever goes on that socket, so a subscriber of every topic decodes every frame as a batch.
Replays are `radixkv.server.events.kv_replay` (the ROUTER protocol, on its own thread).

Ordering comes from the tree: a node is announced when it becomes a leaf, after its parent; a
split moves no block and announces nothing; a fork stores nothing until its blocks are cached.
`AllBlocksCleared` opens the stream, so a consumer that replays from 0 starts from nothing; after a restart
that adopted the previous server's snapshot (`radixkv.server.rules.restart`), BlockStored events of every
adopted block open it instead: a consumer keeps what it indexed, and one replaying from 0 learns it.
A tenant withheld from the stream (`publish_kv_events = false`) has no event in it at all, adopted or live.

The hub calls `publish_unit` under the pool's lock with the events of one hold of it, so it only queues;
one thread owns the PUB sockets (ZMQ sockets are not thread-safe) and sends whatever has queued as batches.
Nothing is published twice for nothing: blocks a unit both stored and removed (a preempted sequence cached
and evicted again past its tenant's share, a cached release over it) are published by neither event
(`kv_events_wire.coalesce`), so a preempt/resume loop costs the stream nothing. Every batch is at most
`kv_events_max_batch_bytes` (a larger event goes out as a chain of smaller ones; an event that cannot be
split, one block with a salt longer than the bound, is refused with a log line and counted), and the
replay ring keeps at most `kv_events_buffer_bytes` of them.

The digest (a verifiable index, `radixkv.tree.block_hash.digest_of`) goes on a socket of its own
(`kv_events_digest_endpoint`), never on the vLLM one: after each batch, `[digest_topic(topic), seq,
payload]`, `seq` the batch's own, the payload `[ts, [], data_parallel_rank, {"epoch", "seq",
"num_events", "digest"}]`, the digest over every namespace the stream publishes after that batch and
`num_events` the tree events of the tenants it publishes (a withheld tenant's are never counted).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from radixkv.server.events.hub import BlockEvent, EventKind
from radixkv.server.events.kv_events_config import KVEventsConfig
from radixkv.server.events.kv_events_sockets import PeerGate, StreamSockets
from radixkv.server.events.kv_events_wire import (
    BATCH_OVERHEAD,
    AllBlocksCleared,
    BlockStored,
    Event,
    batch_payload,
    coalesce,
    digest_payload,
    event_bytes,
    min_batch_bytes,
    removed_event,
    split,
    stored_event,
    tier_event,
)
from radixkv.server.events.kv_replay import ReplayBuffer, ReplayServer
from radixkv.tree.block_hash import WIRE_MASK, mix64

log = logging.getLogger("radixkv.server.events.kv_events")

DIGEST_TOPIC_PREFIX = "radixkv-digest"


def digest_topic(topic: str) -> str:
    """The topic of the digests of the events on `topic` (on the digest socket)."""
    return f"{DIGEST_TOPIC_PREFIX}@{topic}" if topic else DIGEST_TOPIC_PREFIX


def everything(namespace: str) -> bool:
    return True


class ZmqEventPublisher:
    """PUB, the replay ROUTER and the digest PUB for one pool's events; `start`, then `close`."""

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        block_size: int,
        data_parallel_rank: int = 0,
        max_events_per_batch: int = 1024,
        adopted: list[BlockEvent] | None = None,
        epoch: int = 0,
        digest: int = 0,
        num_events: int = 0,
        publishes: Callable[[str], bool] = everything,
    ) -> None:
        """`adopted`: the cache this server adopted from its predecessor's snapshot (`EventHub.snapshot`),
        announced as BlockStored events instead of `AllBlocksCleared`, so consumers keep their index.
        `epoch`, `digest`, `num_events`: the event hub's incarnation, the digest of the namespaces `publishes`
        accepts and their tenants' event count now (what the stream starts from; call under the pool's lock,
        then add this sink under the same hold). `publishes(namespace)`: False keeps its events out.

        Raises:
            ValueError: `kv_events_max_batch_bytes` cannot hold one block of `block_size`.
            RuntimeError: an endpoint cannot be bound or connected, or the stream cannot be secured.
        """
        if config.max_batch_bytes < min_batch_bytes(block_size):
            raise ValueError(
                f"kv_events_max_batch_bytes {config.max_batch_bytes} cannot hold one block of {block_size} tokens; "
                f"give at least {min_batch_bytes(block_size)}"
            )
        self.topic = config.topic.encode()
        self.digest_topic = digest_topic(config.topic).encode()
        self.epoch = epoch
        self.publishes = publishes
        self._digest, self._num_events = digest, num_events  # after the last event queued (the pool's lock)
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._max_events = max_events_per_batch
        self._max_event_bytes = config.max_batch_bytes - BATCH_OVERHEAD  # what the events of a batch may take
        # Each wire event with its size, the stream's digest and event count after it; None: stop.
        self._queue: queue.SimpleQueue[tuple[Event, int, int, int] | None] = queue.SimpleQueue()
        self._held: tuple[Event, int, int, int] | None = None  # drained but over the batch: the next one's first
        self.buffer = ReplayBuffer(config.buffer_steps, config.buffer_bytes)
        self._next_seq = 0
        self.num_split_events = 0  # events sent as several, each within kv_events_max_batch_bytes
        self.num_refused_events = 0  # events no batch could hold (a block whose salt is over the bound)
        self.num_coalesced_blocks = 0  # blocks stored and removed within one call: published by neither
        self._sockets = StreamSockets(config)
        self.replay: ReplayServer | None = None
        self.subscriber_gates: list[PeerGate] = []  # of the bound PUB sockets: at most max_subscribers each
        opened: list[zmq.Socket[bytes]] = []
        try:
            if config.connect:
                self._pub, self.endpoint = self._sockets.open(zmq.PUB, config.endpoint, connect=True)
            else:
                self._pub, self.endpoint, gate = self._sockets.open_gated(
                    zmq.PUB, config.endpoint, config.max_subscribers
                )
                self.subscriber_gates.append(gate)
            opened.append(self._pub)
            self.replay_endpoint: str | None = None
            self._digest_pub: zmq.Socket[bytes] | None = None
            if config.replay_endpoint is not None:
                router, self.replay_endpoint, gate = self._sockets.open_gated(
                    zmq.ROUTER, config.replay_endpoint, config.max_replay_peers
                )
                opened.append(router)
                self.replay = ReplayServer(
                    router,
                    self.buffer,
                    topic=self.topic,
                    max_replays=config.max_replays,
                    max_seconds=config.replay_seconds,
                    gate=gate,
                )
            self.digest_endpoint: str | None = None
            if config.digest_endpoint is not None:
                self._digest_pub, self.digest_endpoint, gate = self._sockets.open_gated(
                    zmq.PUB, config.digest_endpoint, config.max_subscribers
                )
                self.subscriber_gates.append(gate)
                opened.append(self._digest_pub)
        except BaseException:
            gates = [*self.subscriber_gates, *([self.replay.gate] if self.replay and self.replay.gate else [])]
            for gate in gates:
                gate.close()  # its monitor socket, before the context ends
            for socket in opened:
                socket.close(linger=0)
            self._sockets.close()
            raise
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        if adopted is None:  # a cold start: every stream starts from nothing
            self._put(AllBlocksCleared(), digest, num_events)
        running = 0  # the digest of what the adopted events announced so far: `digest` after the last
        for event in adopted or ():
            if publishes(event.namespace):
                for piece in self._sized(stored_event(event, block_size)):
                    running = (running + _delta(piece)) & WIRE_MASK
                    self._put(piece, running, num_events)

    @property
    def endpoints(self) -> dict[str, str | None]:
        """Where the stream is, for the server's announcement line."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "digest_endpoint": self.digest_endpoint,
        }

    @property
    def num_batches(self) -> int:
        """Batches sent so far (the next batch's seq)."""
        return self._next_seq

    def start(self) -> None:
        self._thread.start()
        if self.replay is not None:
            self.replay.start()

    def publish(self, event: BlockEvent) -> None:
        """Queue one tree event, a unit of its own (called under the pool's lock: never blocks)."""
        self.publish_unit([event])

    def publish_unit(self, events: list[BlockEvent]) -> None:
        """Queue the events of one hold of the pool's lock (under it: never blocks), less what they stored and
        removed again, each within the batch bound."""
        published = [e for e in events if self.publishes(e.namespace)]
        if not published:
            return
        wire: list[Event] = [
            stored_event(e, self.block_size) if e.kind is EventKind.BLOCKS_STORED else removed_event(e)
            for e in published
        ]
        kept = coalesce(wire) if len(wire) > 1 else wire
        deltas: list[int | None] = [e.digest_delta for e in published] if kept is wire else [None] * len(kept)
        if kept is not wire:
            self.num_coalesced_blocks += _num_blocks(wire) - _num_blocks(kept)
        num_before, self._num_events = self._num_events, self._num_events + len(published)
        pieces: list[tuple[Event, int | None]] = []
        for event, delta in zip(kept, deltas, strict=True):
            sized = self._sized(event)
            pieces.extend((piece, delta if len(sized) == 1 else None) for piece in sized)
        for i, (piece, delta) in enumerate(pieces):
            self._digest = (self._digest + (_delta(piece) if delta is None else delta)) & WIRE_MASK
            # Mid-unit, a batch's proof counts the events before the unit: its digest is exact either way.
            self._put(piece, self._digest, self._num_events if i == len(pieces) - 1 else num_before)

    def _sized(self, event: Event) -> list[Event]:
        """`event` as events a batch can hold; none when it cannot be split that small (refused, logged)."""
        pieces = split(event, self._max_event_bytes)
        if len(pieces) > 1:
            self.num_split_events += 1
        elif not pieces:
            self.num_refused_events += 1
            log.warning(
                "a KV event too large for any batch was not published (kv_events_max_batch_bytes)",
                extra={"num_bytes": event_bytes(event), "max_batch_bytes": self._max_event_bytes + BATCH_OVERHEAD},
            )
        return pieces

    def _put(self, event: Event, digest: int, num_events: int) -> None:
        self._queue.put((event, event_bytes(event), digest, num_events))

    def publish_tier(self, namespace: str, stored: bool, wire_hashes: list[int], medium: str) -> None:
        """Queue blocks another tier took or dropped (`tier_event`; under the pool's lock: never blocks). They move
        neither the digest nor the event count, which describe the device tier."""
        if self.publishes(namespace):
            event = tier_event(stored, wire_hashes, medium)
            self._queue.put((event, event_bytes(event), self._digest, self._num_events))

    def close(self) -> None:
        """Send what is queued, then stop both threads and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.replay is not None:
            self.replay.close()
        for gate in self.subscriber_gates:
            gate.close()
        self._pub.close(linger=0)
        if self._digest_pub is not None:
            self._digest_pub.close(linger=0)
        self._sockets.close()

    # -- the publisher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._held if self._held is not None else self._queue.get()  # `close` queues the stop
            self._held = None
            events, after, stop = self._drain(first)
            if events:
                self._send(events, *after)
            if stop:
                return

    def _drain(self, first: tuple[Event, int, int, int] | None) -> tuple[list[Event], tuple[int, int], bool]:
        """`first` and whatever else has queued, up to a batch in events and bytes, with the (digest, event count)
        after its last event; True when the stop sentinel came."""
        events: list[Event] = []
        after = (0, 0)
        num_bytes = 0
        item = first
        while True:
            if item is None:
                return events, after, True
            if events and num_bytes + item[1] > self._max_event_bytes:
                self._held = item  # the next batch's first
                return events, after, False
            events.append(item[0])
            num_bytes += item[1]
            after = item[2:]
            if len(events) >= self._max_events:
                return events, after, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return events, after, False

    def _send(self, events: list[Event], digest: int, num_events: int) -> None:
        seq = self._next_seq
        self._next_seq += 1
        now = time.time()
        payload = batch_payload(now, events, self.data_parallel_rank)
        assert len(payload) <= self._max_event_bytes + BATCH_OVERHEAD, "a batch over kv_events_max_batch_bytes"
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq_bytes, payload))
        self.buffer.append(seq, payload)
        if self._digest_pub is not None:
            proof = {"epoch": self.epoch, "seq": seq, "num_events": num_events, "digest": digest}
            proof_payload = digest_payload(now, self.data_parallel_rank, proof)
            self._digest_pub.send_multipart((self.digest_topic, seq_bytes, proof_payload))


def _num_blocks(events: list[Event]) -> int:
    return sum(len(getattr(e, "block_hashes", ())) for e in events)


def _delta(event: Event) -> int:
    """What `event` moves the stream's digest by (`radixkv.tree.block_hash.digest_of`)."""
    hashes = getattr(event, "block_hashes", ())
    delta = sum(mix64(h) for h in hashes)
    return delta & WIRE_MASK if isinstance(event, BlockStored) else -delta & WIRE_MASK
