"""vLLM's KV-events wire format over ZMQ: what llm-d's endpoint picker, Dynamo and Ray Serve consume.

One publisher per pool. A PUB socket sends 3 frames per batch, `[topic, seq as u64 big-endian,
msgpack payload]`, `seq` counting batches from 0; the payload is `[ts, [events...],
data_parallel_rank]` and each event a msgpack map tagged "type" (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), field names as vLLM's `kv_events.py` defines them. A ROUTER socket answers a
replay request `[identity, "", start_seq u64]` with every buffered batch from `start_seq` as
`[identity, "", seq, payload]`, then an end marker `seq = -1` (all ones) with an empty payload.

Ordering comes from the tree: a node is announced when it becomes a leaf, after its parent; a
split moves no block and announces nothing; a fork stores nothing until its blocks are cached.
`AllBlocksCleared` opens the stream, so a consumer that replays from 0 starts from nothing; after a restart
that adopted the previous server's snapshot (`radixkv.server.restart`), BlockStored events of every
adopted block open it instead: a consumer keeps what it indexed, and one replaying from 0 learns it.

The hub calls `publish` under the pool's lock, so it only queues; one thread owns both sockets
(ZMQ sockets are not thread-safe) and sends whatever has queued as one batch.

The digest (a verifiable index, `radixkv.tree.block_hash.digest_of`) travels on its own topic, never in
the batch. A fourth element after `data_parallel_rank` is ignored by vLLM's msgspec decoder
(`array_like` structs skip extra trailing elements unless `forbid_unknown_fields`), but llm-d's
kv-cache-manager decodes the batch into a Go struct tagged `msgpack:",array"` with vmihailenco/msgpack
v5, which refuses any array whose length differs from its three fields ("number of fields in
array-encoded struct has changed") and drops the whole batch. So after each batch the same socket
sends `[digest_topic(topic), seq, payload]`, `seq` the batch's own number (a repeat, never a gap, for a
consumer of both topics), the payload `[ts, [], data_parallel_rank, {"epoch", "seq", "num_events",
"digest"}]`: the pool's digest over every namespace after that batch. ZMQ subscriptions match
prefixes, and the digest topic does not start with the events topic, so a subscriber of the events
topic (llm-d subscribes to "kv@") never receives it; one that subscribes to everything decodes it as
an empty batch with msgspec, and llm-d's decoder would drop it with a debug log, not crash.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from radixkv.server.events import BlockEvent, EventKind
from radixkv.tree.block_hash import WIRE_MASK, mix64

log = logging.getLogger("radixkv.server.kv_events")

END_SEQ = (1 << 64) - 1  # (-1).to_bytes(8, "big", signed=True): the replay's end marker
MEDIUM_GPU = "GPU"  # the device tier; a host tier would publish "CPU"
_POLL_SECONDS = 0.02  # how soon a replay request is answered when no events flow
_ALL_BLOCKS_CLEARED = {"type": "AllBlocksCleared"}
DIGEST_TOPIC_PREFIX = "radixkv-digest"


def digest_topic(topic: str) -> str:
    """Where the digests of the events on `topic` go: a topic that does not start with `topic`."""
    return f"{DIGEST_TOPIC_PREFIX}@{topic}" if topic else DIGEST_TOPIC_PREFIX


def stored_event(event: BlockEvent, block_size: int) -> dict[str, Any]:
    """One BlockStored map as vLLM encodes it (`extra_keys` None unless a block carries a salt)."""
    extra = [list(k) if k is not None else None for k in event.extra_keys]
    return {
        "type": "BlockStored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": np.frombuffer(event.token_bytes, dtype="<i4").tolist(),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
        "extra_keys": extra if any(k is not None for k in extra) else None,
    }


def removed_event(event: BlockEvent) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM_GPU}


class ZmqEventPublisher:
    """PUB + optional ROUTER replay for one pool's events; `start`, then `close`."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        max_events_per_batch: int = 1024,
        adopted: list[BlockEvent] | None = None,
        epoch: int = 0,
        digest: int = 0,
        num_events: int = 0,
    ) -> None:
        """`adopted`: the cache this server adopted from its predecessor's snapshot (`EventHub.snapshot`),
        announced as BlockStored events instead of `AllBlocksCleared`, so consumers keep their index.
        `epoch`, `digest`, `num_events`: the event hub's incarnation, pool-wide digest and event count now
        (what the stream starts from; call under the pool's lock, then add this sink under the same hold)."""
        self.topic = topic.encode()
        self.digest_topic = digest_topic(topic).encode()
        self.epoch = epoch
        self._digest, self._num_events = digest, num_events  # after the last event queued (the pool's lock)
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._max_events = max_events_per_batch
        # Each event with the pool's digest and event count after it; None: stop.
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], int, int] | None] = queue.SimpleQueue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)  # always bound: consumers ask this pod for what they missed
                self.replay_endpoint: str | None = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.replay_endpoint = None
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"cannot bind the KV-events socket: {e}") from e
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        if adopted is None:  # a cold start: every stream starts from nothing
            self._queue.put((_ALL_BLOCKS_CLEARED, digest, num_events))
        running = 0  # the digest of what the adopted events announced so far: `digest` after the last
        for event in adopted or ():
            running = (running + sum(mix64(h) for h in event.block_hashes)) & WIRE_MASK
            self._queue.put((stored_event(event, block_size), running, num_events))

    def start(self) -> None:
        self._thread.start()

    def publish(self, event: BlockEvent) -> None:
        """Queue one tree event (called under the pool's lock: never blocks)."""
        self._digest = (self._digest + event.digest_delta) & WIRE_MASK
        self._num_events = event.pool_sequence_number
        if event.kind is EventKind.BLOCKS_STORED:
            self._queue.put((stored_event(event, self.block_size), self._digest, self._num_events))
        else:
            self._queue.put((removed_event(event), self._digest, self._num_events))

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the publisher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                events, after, stop = self._drain(self._queue.get(timeout=_POLL_SECONDS))
            except queue.Empty:
                events, after, stop = [], (0, 0), False
            if events:
                self._send(events, *after)
            if stop:
                return
            while self._replay is not None and self._replay.poll(0):
                self._answer_replay()

    def _drain(
        self, first: tuple[dict[str, Any], int, int] | None
    ) -> tuple[list[dict[str, Any]], tuple[int, int], bool]:
        """`first` and whatever else has queued, up to a batch, with the (digest, event count) after its last
        event; True when the stop sentinel came."""
        events: list[dict[str, Any]] = []
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

    def _send(self, events: list[dict[str, Any]], digest: int, num_events: int) -> None:
        seq = self._next_seq
        self._next_seq += 1
        now = time.time()
        payload = msgpack.packb([now, events, self.data_parallel_rank])
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq_bytes, payload))
        self._buffer.append((seq, payload))
        proof = {"epoch": self.epoch, "seq": seq, "num_events": num_events, "digest": digest}
        self._pub.send_multipart(
            (self.digest_topic, seq_bytes, msgpack.packb([now, [], self.data_parallel_rank, proof]))
        )

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]  # polled, so present
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed replay request", extra={"num_frames": len(frames)})
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((identity, b"", END_SEQ.to_bytes(8, "big"), b""))  # type: ignore[union-attr]


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind or connect as vLLM does; returns the endpoint actually used.

    A wildcard (`tcp://*:5557`, `::`), ipc:// or inproc:// binds: consumers connect to this pod. Any
    other address connects out, as llm-d's endpoint picker expects (its subscriber binds and every
    model server connects to it). Port 0 binds any free port (tests, benchmarks).
    """
    if endpoint.endswith(":0"):
        port = socket.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.connect(endpoint)
    return endpoint
