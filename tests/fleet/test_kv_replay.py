"""Replays are bounded per peer and off the publishing path: a flood of requests never holds live events back.

Driven in-process: the publisher fed tree events directly, as the event hub feeds it under a pool's lock.
Assertions are about delivery and order, never about how long anything took (benchmarks/bench_kv_events.py
measures the lag).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import zmq

from radixkv.server.events.hub import BlockEvent, EventKind
from radixkv.server.events.kv_events import ZmqEventPublisher
from radixkv.server.events.kv_events_config import KVEventsConfig
from radixkv.server.events.kv_replay import SEND_HWM, ReplayBuffer
from radixkv.server.process.spawn import patient
from tests.subscribers import connect_and_handshake


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fleet_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


fleet, vllm = _sibling("conftest"), _sibling("vllm_wire")
BLOCK_SIZE, wait_until = fleet.BLOCK_SIZE, fleet.wait_until
TOPIC = "kv@127.0.0.1:8000@test-model"


def _event(i: int) -> BlockEvent:
    """The i-th stored block, a root of its own (hash 10_000_000_000 + i: above 2^32, as real hashes are)."""
    return BlockEvent(
        sequence_number=i,
        namespace="default",
        kind=EventKind.BLOCKS_STORED,
        block_ids=(i,),
        token_bytes=bytes(4 * BLOCK_SIZE),
        parent_block_id=None,
        block_hashes=(10**10 + i,),
        parent_block_hash=None,
        extra_keys=(None,),
        pool_sequence_number=i,
    )


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    config = KVEventsConfig(
        endpoint="tcp://127.0.0.1:0", topic=TOPIC, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=400, max_replays=8
    )
    publisher = ZmqEventPublisher(config, block_size=BLOCK_SIZE, max_events_per_batch=1)  # one event, one batch
    publisher.start()
    yield publisher
    publisher.close()


def _socket(kind: int, endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        connect_and_handshake(socket, endpoint)  # the publisher drops what it sends before: wait for the connection
    else:
        socket.connect(endpoint)
    return socket


def _read_replay(dealer: zmq.Socket) -> list[int]:
    """The seqs of one replay, checked frame by frame, up to its end marker."""
    seqs: list[int] = []
    while True:
        assert dealer.poll(int(patient(60) * 1000)), "the replay goes on to its end marker"
        frames = dealer.recv_multipart()
        if frames == [b"", b"", vllm.END_SEQ, b""]:
            return seqs
        assert frames[:2] == [b"", TOPIC.encode()] and len(frames) == 4
        vllm.DECODER.decode(frames[3])
        seqs.append(int.from_bytes(frames[2], "big"))


def test_the_ring_keeps_the_last_batches_by_seq() -> None:
    ring = ReplayBuffer(3)
    assert ring.window() == (0, 0) and ring.get(0) is None
    for seq in range(5):
        ring.append(seq, bytes([seq]))
    assert ring.window() == (2, 5)
    assert [ring.get(seq) for seq in range(6)] == [None, None, b"\x02", b"\x03", b"\x04", None]
    with pytest.raises(AssertionError, match="seq order"):
        ring.append(7, b"")


def test_live_events_keep_flowing_under_a_replay_flood(publisher: ZmqEventPublisher) -> None:
    """Peers that ask again and again and never read hold at most one replay each; live batches all arrive,
    in order, and a well-behaved consumer still gets its whole replay."""
    sub = _socket(zmq.SUB, publisher.endpoint)
    assert publisher.replay is not None and publisher.replay_endpoint is not None
    flooders = [_socket(zmq.DEALER, publisher.replay_endpoint) for _ in range(7)]  # one slot left of 8
    try:
        for i in range(300):  # the ring fills beyond what a peer's high-water mark holds
            publisher.publish(_event(i))
        assert wait_until(lambda: publisher.num_batches == 301), "AllBlocksCleared + 300 batches"
        live: list[int] = []
        for round_ in range(20):  # the flood: every flooder asks 50 times a round, reads nothing
            for flooder in flooders:
                for _ in range(50):
                    try:
                        flooder.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
                    except zmq.Again:
                        break
            for i in range(300 + 10 * round_, 310 + 10 * round_):
                publisher.publish(_event(i))
        assert wait_until(lambda: _drain(sub, live) and live[-1:] == [500]), f"every live batch: got {len(live)}"
        assert live[0] <= 1 and live == list(range(live[0], 501)), "in order, none lost (seq 0 may precede it)"
        consumer = _socket(zmq.DEALER, publisher.replay_endpoint)
        consumer.send_multipart([b"", (250).to_bytes(8, "big")])
        assert _read_replay(consumer) == list(range(250, 501)), "a consumer that reads gets its replay whole"
        consumer.close()
    finally:
        sub.close()
        for flooder in flooders:
            flooder.close()
    assert publisher.replay.num_dropped_requests > 0, "a peer's requests beyond its one replay were dropped"


def test_a_peer_gets_one_replay_at_a_time_whatever_it_asks(publisher: ZmqEventPublisher) -> None:
    """Ten requests at once: the replies are whole replays one after another, never interleaved, and each
    request was either answered or dropped."""
    for i in range(3 * SEND_HWM):
        publisher.publish(_event(i))
    assert wait_until(lambda: publisher.num_batches == 3 * SEND_HWM + 1)
    assert publisher.replay is not None and publisher.replay_endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 10)  # it reads nothing yet: its replay cannot finish behind its back
    dealer.connect(publisher.replay_endpoint)
    try:
        for _ in range(10):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replays = [_read_replay(dealer)]
        while dealer.poll(1000):  # whatever was answered after the first one finished
            replays.append(_read_replay(dealer))
    finally:
        dealer.close()
    assert all(seqs == list(range(3 * SEND_HWM + 1)) for seqs in replays), "each reply a whole replay, in order"
    assert len(replays) + publisher.replay.num_dropped_requests == 10
    assert publisher.replay.num_served == len(replays)


def test_a_malformed_request_is_dropped_and_the_socket_serves_on(publisher: ZmqEventPublisher) -> None:
    assert publisher.replay_endpoint is not None
    dealer = _socket(zmq.DEALER, publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"not empty", (0).to_bytes(8, "big")])
        dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"extra"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert _read_replay(dealer) == [0]
    finally:
        dealer.close()


def _drain(sub: zmq.Socket, seqs: list[int]) -> bool:
    while sub.poll(0):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        vllm.DECODER.decode(payload)
        seqs.append(int.from_bytes(seq, "big"))
    return True
