"""vLLM's KV-events wire format over ZMQ: what llm-d's endpoint picker, Dynamo and Ray Serve consume.

One publisher per pool. Byte for byte what vLLM 0.33/0.34 send (`vllm/distributed/kv_events.py`):
a PUB socket sends 3 frames per batch, `[topic, seq u64 BE, payload]`, `seq` counting batches from 0,
the payload `KVEventBatch` as msgspec encodes it (`radixkv.server.kv_events_wire`): `[ts, [events...],
data_parallel_rank]`, each event a map tagged "type" (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`);
a `BlockStored` has `extra_keys` only when a block carries a salt, untagged as vLLM publishes it.
Nothing else ever goes on that socket, so a subscriber of every topic decodes every frame as a batch.
Replays are `radixkv.server.kv_replay` (the ROUTER protocol, on its own thread).

Ordering comes from the tree: a node is announced when it becomes a leaf, after its parent; a
split moves no block and announces nothing; a fork stores nothing until its blocks are cached.
`AllBlocksCleared` opens the stream, so a consumer that replays from 0 starts from nothing; after a restart
that adopted the previous server's snapshot (`radixkv.server.restart`), BlockStored events of every
adopted block open it instead: a consumer keeps what it indexed, and one replaying from 0 learns it.
A tenant withheld from the stream (`publish_kv_events = false`) has no event in it at all, adopted or live.

The hub calls `publish` under the pool's lock, so it only queues; one thread owns the PUB sockets
(ZMQ sockets are not thread-safe) and sends whatever has queued as one batch.

The digest (a verifiable index, `radixkv.tree.block_hash.digest_of`) goes on a socket of its own
(`kv_events_digest_endpoint`), never on the vLLM one: after each batch, `[digest_topic(topic), seq,
payload]`, `seq` the batch's own, the payload `[ts, [], data_parallel_rank, {"epoch", "seq",
"num_events", "digest"}]`, the digest over every namespace the stream publishes after that batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import zmq

from radixkv.server.events import BlockEvent, EventKind
from radixkv.server.kv_events_config import KVEventsConfig
from radixkv.server.kv_events_sockets import StreamSockets
from radixkv.server.kv_events_wire import (
    AllBlocksCleared,
    Event,
    batch_payload,
    digest_payload,
    removed_event,
    stored_event,
    tier_event,
)
from radixkv.server.kv_replay import ReplayBuffer, ReplayServer
from radixkv.tree.block_hash import WIRE_MASK, mix64

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
        accepts and the pool's event count now (what the stream starts from; call under the pool's lock,
        then add this sink under the same hold). `publishes(namespace)`: False keeps its events out.

        Raises:
            RuntimeError: an endpoint cannot be bound or connected, or the stream cannot be secured.
        """
        self.topic = config.topic.encode()
        self.digest_topic = digest_topic(config.topic).encode()
        self.epoch = epoch
        self.publishes = publishes
        self._digest, self._num_events = digest, num_events  # after the last event queued (the pool's lock)
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._max_events = max_events_per_batch
        # Each event with the stream's digest and the pool's event count after it; None: stop.
        self._queue: queue.SimpleQueue[tuple[Event, int, int] | None] = queue.SimpleQueue()
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._next_seq = 0
        self._sockets = StreamSockets(config)
        opened: list[zmq.Socket[bytes]] = []
        try:
            self._pub, self.endpoint = self._sockets.open(zmq.PUB, config.endpoint, config.connect)
            opened.append(self._pub)
            self.replay_endpoint: str | None = None
            self.replay: ReplayServer | None = None
            if config.replay_endpoint is not None:
                router, self.replay_endpoint = self._sockets.open(zmq.ROUTER, config.replay_endpoint)
                opened.append(router)
                self.replay = ReplayServer(router, self._buffer, self.topic, config.max_replays)
            self._digest_pub: zmq.Socket[bytes] | None = None
            self.digest_endpoint: str | None = None
            if config.digest_endpoint is not None:
                self._digest_pub, self.digest_endpoint = self._sockets.open(zmq.PUB, config.digest_endpoint)
                opened.append(self._digest_pub)
        except BaseException:
            for socket in opened:
                socket.close(linger=0)
            self._sockets.close()
            raise
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        if adopted is None:  # a cold start: every stream starts from nothing
            self._queue.put((AllBlocksCleared(), digest, num_events))
        running = 0  # the digest of what the adopted events announced so far: `digest` after the last
        for event in adopted or ():
            if publishes(event.namespace):
                running = (running + sum(mix64(h) for h in event.block_hashes)) & WIRE_MASK
                self._queue.put((stored_event(event, block_size), running, num_events))

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
        """Queue one tree event (called under the pool's lock: never blocks)."""
        if not self.publishes(event.namespace):
            return
        self._digest = (self._digest + event.digest_delta) & WIRE_MASK
        self._num_events = event.pool_sequence_number
        if event.kind is EventKind.BLOCKS_STORED:
            self._queue.put((stored_event(event, self.block_size), self._digest, self._num_events))
        else:
            self._queue.put((removed_event(event), self._digest, self._num_events))

    def publish_tier(self, namespace: str, stored: bool, wire_hashes: list[int], medium: str) -> None:
        """Queue blocks another tier took or dropped (`tier_event`; under the pool's lock: never blocks). They move
        neither the digest nor the event count, which describe the device tier."""
        if self.publishes(namespace):
            self._queue.put((tier_event(stored, wire_hashes, medium), self._digest, self._num_events))

    def close(self) -> None:
        """Send what is queued, then stop both threads and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.replay is not None:
            self.replay.close()
        self._pub.close(linger=0)
        if self._digest_pub is not None:
            self._digest_pub.close(linger=0)
        self._sockets.close()

    # -- the publisher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            events, after, stop = self._drain(self._queue.get())  # `close` queues the stop: never waits forever
            if events:
                self._send(events, *after)
            if stop:
                return

    def _drain(self, first: tuple[Event, int, int] | None) -> tuple[list[Event], tuple[int, int], bool]:
        """`first` and whatever else has queued, up to a batch, with the (digest, event count) after its last
        event; True when the stop sentinel came."""
        events: list[Event] = []
        after = (0, 0)
        item = first
        while True:
            if item is None:
                return events, after, True
            events.append(item[0])
            after = item[1:]
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
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq_bytes, payload))
        self._buffer.append(seq, payload)
        if self._digest_pub is not None:
            proof = {"epoch": self.epoch, "seq": seq, "num_events": num_events, "digest": digest}
            proof_payload = digest_payload(now, self.data_parallel_rank, proof)
            self._digest_pub.send_multipart((self.digest_topic, seq_bytes, proof_payload))
