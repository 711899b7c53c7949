"""The ZMQ stream's digest (`radixkv.server.kv_events`): on its own topic after every batch, equal to what a
consumer recounts from the batches it applied, and invisible to the decoders the routers run.

Decoders: vLLM's own (msgspec, the `EventBatch` struct vLLM defines: `array_like`, events tagged by
"type"), and llm-d kv-cache-manager's rule (vmihailenco/msgpack v5 decoding a `msgpack:",array"` struct
refuses an array whose length is not its field count: exactly 3 for `EventBatch`), mimicked here.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from radixkv.client import RadixKVClient
from radixkv.errors import OutOfBlocks
from radixkv.server.kv_events import digest_topic
from radixkv.tree.block_hash import digest_of

msgspec = pytest.importorskip("msgspec")  # the `test` extra installs it

_spec = importlib.util.spec_from_file_location("fleet_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
fleet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fleet)
BLOCK_SIZE, FleetServer, wait_until = fleet.BLOCK_SIZE, fleet.FleetServer, fleet.wait_until


# vLLM's definitions (vllm/distributed/kv_events.py, the array-batch, map-event form radixkv speaks)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc, call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[misc, call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def llm_d_decode(payload: bytes) -> list[Any]:
    """llm-d's `msgpack.Unmarshal(payload, &EventBatch{})`: an array of exactly its 3 fields, else an error."""
    batch = msgpack.unpackb(payload)
    if not isinstance(batch, list) or len(batch) != 3:
        raise ValueError("msgpack: number of fields in array-encoded struct has changed")
    return batch


class DigestConsumer:
    """Applies batches as a router's index does and keeps the digest it can recount."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                self.held.update(event.block_hashes)
            else:
                self.held.difference_update(event.block_hashes)

    @property
    def digest(self) -> int:
        return digest_of(self.held)


def _subscribe(endpoint: str, *topics: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    for topic in topics:
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    return sub


def _workload(client: RadixKVClient, rng: random.Random, num_ops: int) -> None:
    """Shared prefixes in two namespaces under a small pool: stores, splits and evictions."""
    stems = [[rng.randrange(100) for _ in range(rng.randrange(BLOCK_SIZE, 4 * BLOCK_SIZE))] for _ in range(5)]
    for _ in range(num_ops):
        tokens = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.randrange(1, 2 * BLOCK_SIZE))]
        try:
            opened = client.open(tokens, rng.choice(["", "chat"]))
        except OutOfBlocks:
            continue
        client.commit([opened.seq_id], [len(tokens)])
        client.release(opened.seq_id)


def _collect(sub: zmq.Socket, quiet_ms: int = 500) -> list[tuple[str, int, bytes]]:
    """Every message until none has come for `quiet_ms` (the publisher sends within 20 ms of an event)."""
    messages: list[tuple[str, int, bytes]] = []
    while sub.poll(quiet_ms if messages else 10_000):
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic.decode(), int.from_bytes(seq, "big"), payload))
    return messages


def test_every_batch_is_followed_by_the_pools_digest_which_a_consumer_recounts(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=40)
    sub = _subscribe(server.events_endpoint, server.topic, digest_topic(server.topic))
    try:
        with RadixKVClient(server.address) as client:
            with client.watch_events(include_snapshot=True) as stream:
                epoch = next(stream.batches()).epoch
            _workload(client, random.Random(0), 60)
            probe = client.open([7] * (2 * BLOCK_SIZE + 1))
            client.commit([probe.seq_id], [2 * BLOCK_SIZE + 1])
            client.release(probe.seq_id)
            final = client.verify().digest  # what the Verify RPC states for the whole pool now
            messages = _collect(sub)
    finally:
        sub.close()
    batches = {seq: payload for topic, seq, payload in messages if topic == server.topic}
    proofs = {seq: payload for topic, seq, payload in messages if topic == digest_topic(server.topic)}
    assert batches and set(proofs) == set(batches), "one digest per batch, under the batch's own seq"
    consumer = DigestConsumer()  # joined late: the stream started before from an empty pool
    num_events = 0
    for seq in sorted(batches):
        consumer.apply(VLLM_DECODER.decode(batches[seq]))
        ts, events, rank, proof = msgpack.unpackb(proofs[seq])
        assert events == [] and rank == 0 and isinstance(ts, float)
        assert proof["seq"] == seq and proof["epoch"] == epoch
        assert proof["num_events"] > num_events
        num_events = proof["num_events"]
        assert proof["digest"] == consumer.digest, f"batch {seq}: the consumer's recount differs from the pool's"
    assert consumer.held, "the workload must leave blocks cached"
    assert final == consumer.digest


def test_a_dropped_batch_shows_as_a_digest_that_no_longer_matches(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=64)
    sub = _subscribe(server.events_endpoint, server.topic, digest_topic(server.topic))
    try:
        with RadixKVClient(server.address) as client:
            for i in range(4):
                opened = client.open([i + 1] * (2 * BLOCK_SIZE + 1))
                client.commit([opened.seq_id], [2 * BLOCK_SIZE + 1])
                client.release(opened.seq_id)
            messages = _collect(sub)
    finally:
        sub.close()
    batches = sorted((seq, p) for topic, seq, p in messages if topic == server.topic)
    proofs = {seq: msgpack.unpackb(p)[3]["digest"] for topic, seq, p in messages if topic != server.topic}
    assert len(batches) >= 3
    consumer = DigestConsumer()
    matched = []
    for i, (seq, payload) in enumerate(batches):
        if i != 1:  # the second batch is lost on the way
            consumer.apply(VLLM_DECODER.decode(payload))
        matched.append(proofs[seq] == consumer.digest)
    assert matched[0] and not any(matched[1:]), matched


def test_the_routers_decoders_take_every_batch_and_never_see_a_digest(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=40)
    llm_d = _subscribe(server.events_endpoint, "kv@")  # llm-d's default topic filter
    everything = _subscribe(server.events_endpoint, "")  # a consumer of every topic
    try:
        with RadixKVClient(server.address) as client:
            _workload(client, random.Random(1), 30)
            from_everything = _collect(everything)
            from_llm_d = _collect(llm_d)
    finally:
        llm_d.close()
        everything.close()
    assert {topic for topic, _, _ in from_llm_d} == {server.topic}, "the digest topic is filtered out by ZMQ"
    assert [seq for _, seq, _ in from_llm_d] == sorted({seq for _, seq, _ in from_everything})
    for _, _, payload in from_llm_d:
        assert len(llm_d_decode(payload)[1]) > 0  # every batch: 3 elements, events in it
    digests = [payload for topic, _, payload in from_everything if topic != server.topic]
    assert digests
    for payload in digests:  # a consumer of every topic decodes a digest message as an empty batch
        assert VLLM_DECODER.decode(payload).events == []
        with pytest.raises(ValueError, match="number of fields"):
            llm_d_decode(payload)  # which is why the digest never rides in the batch itself


def test_an_adopted_stream_carries_the_digest_of_what_it_announced_so_far() -> None:
    """After a restart that adopted a snapshot the stream opens with BlockStored events, batch by batch here."""
    from radixkv.server.events import BlockEvent, EventKind
    from radixkv.server.kv_events import ZmqEventPublisher

    adopted = [
        BlockEvent(1, "", EventKind.BLOCKS_STORED, (i,), bytes(4 * BLOCK_SIZE), None, (1000 + i,), None, (None,))
        for i in range(3)
    ]
    total = digest_of([1000, 1001, 1002])
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:0", "kv@x@m", BLOCK_SIZE, max_events_per_batch=1, adopted=adopted, epoch=5, digest=total
    )
    sub = _subscribe(publisher.endpoint, digest_topic("kv@x@m"))
    try:
        wait_until(lambda: False, timeout=0.3)  # the subscription reaches the publisher before anything is sent
        publisher.start()
        proofs = [msgpack.unpackb(payload)[3] for _, _, payload in _collect(sub)]
    finally:
        sub.close()
        publisher.close()
    assert [p["seq"] for p in proofs] == [0, 1, 2]
    assert [p["digest"] for p in proofs] == [digest_of([1000]), digest_of([1000, 1001]), total]
    assert {p["epoch"] for p in proofs} == {5}
