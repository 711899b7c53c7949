"""The KV-events digest (`radixkv.server.events.kv_events`): on its own socket after every batch, equal to what a
consumer recounts from the batches it applied; and the vLLM-format socket left to vLLM's frames alone.

Decoders: vLLM 0.33/0.34's own (msgspec structs, `vllm_wire.py`), llm-d v0.10.0's and Dynamo's rules
(`router_decoders.py`): every frame any of them can receive from the events socket, whatever its topic
filter, is a `KVEventBatch` each decodes.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import msgpack
import zmq

from radixkv.client import RadixKVClient
from radixkv.errors import OutOfBlocks
from radixkv.server.events.kv_events import digest_topic
from radixkv.server.process.spawn import patient
from radixkv.tree.block_hash import digest_of
from tests.subscribers import connect_and_handshake


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fleet_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


fleet, vllm, routers = _sibling("conftest"), _sibling("vllm_wire"), _sibling("router_decoders")
kv_events = _sibling("test_kv_events")  # its `replay`: a DEALER asking as llm-d's subscriber does
BLOCK_SIZE, FleetServer, wait_until = fleet.BLOCK_SIZE, fleet.FleetServer, fleet.wait_until


class DigestConsumer:
    """Applies batches as a router's index does and keeps the digest it can recount."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def apply(self, batch: object) -> None:
        for event in batch.events:  # type: ignore[attr-defined]
            if isinstance(event, vllm.AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, vllm.BlockStored):
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
    connect_and_handshake(sub, endpoint)  # the publisher drops what it sends before: wait for the connection
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
    """Every message until none has come for `patient(quiet_ms)` (the publisher sends within 20 ms of an event on an
    idle machine)."""
    messages: list[tuple[str, int, bytes]] = []
    while sub.poll(int(patient(quiet_ms / 1000 if messages else 10) * 1000)):
        frames = sub.recv_multipart()
        assert len(frames) == 3
        messages.append((frames[0].decode(), int.from_bytes(frames[1], "big"), frames[2]))
    return messages


# type: ignore[no-untyped-def]
def test_every_batch_is_followed_by_the_pools_digest_which_a_consumer_recounts(start_fleet_server) -> None:
    server: FleetServer = start_fleet_server(num_blocks=40)
    events = _subscribe(server.events_endpoint, server.topic)
    digests = _subscribe(server.digest_endpoint, digest_topic(server.topic))
    try:
        with RadixKVClient(server.address) as client:
            with client.watch_events(include_snapshot=True) as stream:
                epoch = next(stream.batches()).epoch
            _workload(client, random.Random(0), 60)
            probe = client.open([7] * (2 * BLOCK_SIZE + 1))
            client.commit([probe.seq_id], [2 * BLOCK_SIZE + 1])
            client.release(probe.seq_id)
            final = client.verify().digest  # what the Verify RPC states for the whole pool now
            batches = {seq: payload for _, seq, payload in _collect(events)}
            proofs = {seq: payload for _, seq, payload in _collect(digests)}
            # PUB drops what it sends before a subscription reaches it (a slow joiner, on a loaded machine): the
            # batches from the first are asked of the replay socket, as a router that joined late does.
            assert server.replay_endpoint is not None
            batches.update(dict(kv_events.replay(server.replay_endpoint, 0)))
    finally:
        events.close()
        digests.close()
    assert batches and sorted(batches) == list(range(len(batches))), "every batch from the first, in order"
    assert proofs and sorted(proofs) == list(range(min(proofs), len(batches))), "a digest per batch once joined"
    consumer = DigestConsumer()  # joined late: the stream started before from an empty pool
    num_events = 0
    for seq in sorted(batches):
        consumer.apply(vllm.DECODER.decode(batches[seq]))
        if seq not in proofs:  # sent before the digest socket's subscription took
            continue
        ts, no_events, rank, proof = msgpack.unpackb(proofs[seq])
        assert no_events == [] and rank == 0 and isinstance(ts, float)
        assert proof["seq"] == seq and proof["epoch"] == epoch
        assert proof["num_events"] > num_events
        num_events = proof["num_events"]
        assert proof["digest"] == consumer.digest, f"batch {seq}: the consumer's recount differs from the pool's"
    assert consumer.held, "the workload must leave blocks cached"
    assert final == consumer.digest


# type: ignore[no-untyped-def]
def test_a_dropped_batch_shows_as_a_digest_that_no_longer_matches(start_fleet_server) -> None:
    server: FleetServer = start_fleet_server(num_blocks=64)
    events = _subscribe(server.events_endpoint, server.topic)
    digests = _subscribe(server.digest_endpoint, "")
    try:
        with RadixKVClient(server.address) as client:
            for i in range(4):
                opened = client.open([i + 1] * (2 * BLOCK_SIZE + 1))
                client.commit([opened.seq_id], [2 * BLOCK_SIZE + 1])
                client.release(opened.seq_id)
            batches = sorted((seq, p) for _, seq, p in _collect(events))
            proofs = {seq: msgpack.unpackb(p)[3]["digest"] for _, seq, p in _collect(digests)}
    finally:
        events.close()
        digests.close()
    assert len(batches) >= 3
    consumer = DigestConsumer()
    matched = []
    for i, (seq, payload) in enumerate(batches):
        if i != 1:  # the second batch is lost on the way
            consumer.apply(vllm.DECODER.decode(payload))
        matched.append(proofs[seq] == consumer.digest)
    assert matched[0] and not any(matched[1:]), matched


# type: ignore[no-untyped-def]
def test_every_frame_on_the_vllm_socket_is_a_batch_every_router_decodes(start_fleet_server) -> None:
    """A subscriber of every topic (Dynamo's listener, a plain vLLM consumer) and llm-d's "kv@" filter receive
    the same frames: vLLM batches only; the digests are on their own socket."""
    server: FleetServer = start_fleet_server(num_blocks=40)
    llm_d = _subscribe(server.events_endpoint, "kv@")  # llm-d's default topic filter
    everything = _subscribe(server.events_endpoint, "")  # Dynamo's listener subscribes to every topic
    try:
        with RadixKVClient(server.address) as client:
            _workload(client, random.Random(1), 30)
            from_everything = _collect(everything)
            from_llm_d = _collect(llm_d)
    finally:
        llm_d.close()
        everything.close()
    assert from_everything == from_llm_d, "nothing but the events topic on the vLLM socket"
    assert len(from_everything) > 3
    for topic, seq, payload in from_everything:
        frames = [topic.encode(), seq.to_bytes(8, "big"), payload]
        assert topic == server.topic
        assert vllm.DECODER.decode(payload).events, "a batch with events in it"
        assert routers.llm_d_batch(payload) and routers.dynamo_batch(frames)
    assert [seq for _, seq, _ in from_everything] == list(range(from_everything[0][1], from_everything[-1][1] + 1))


def test_an_adopted_stream_carries_the_digest_of_what_it_announced_so_far() -> None:
    """After a restart that adopted a snapshot the stream opens with BlockStored events, batch by batch here."""
    from radixkv.server.events.hub import BlockEvent, EventKind
    from radixkv.server.events.kv_events import ZmqEventPublisher
    from radixkv.server.events.kv_events_config import KVEventsConfig

    adopted = [
        BlockEvent(
            sequence_number=1,
            namespace="",
            kind=EventKind.BLOCKS_STORED,
            block_ids=(i,),
            token_bytes=bytes(4 * BLOCK_SIZE),
            parent_block_id=None,
            block_hashes=(1000 + i,),
            parent_block_hash=None,
            extra_keys=(None,),
        )
        for i in range(3)
    ]
    total = digest_of([1000, 1001, 1002])
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="kv@x@m", digest_endpoint="tcp://127.0.0.1:0")
    proofs: list[dict] = []
    # A connected SUB's subscription can still reach the PUB after the first batches (which PUB then drops): a
    # fresh publisher each try until one's stream was read from its first batch.
    for _ in range(5):
        publisher = ZmqEventPublisher(
            config, block_size=BLOCK_SIZE, max_events_per_batch=1, adopted=adopted, epoch=5, digest=total
        )
        sub = _subscribe(publisher.digest_endpoint, digest_topic("kv@x@m"))
        try:
            publisher.start()
            proofs = [msgpack.unpackb(payload)[3] for _, _, payload in _collect(sub)]
        finally:
            sub.close()
            publisher.close()
        if proofs and proofs[0]["seq"] == 0:
            break
    assert [p["seq"] for p in proofs] == [0, 1, 2]
    assert [p["digest"] for p in proofs] == [digest_of([1000]), digest_of([1000, 1001]), total]
    assert {p["epoch"] for p in proofs} == {5}
