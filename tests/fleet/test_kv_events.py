"""vLLM's KV-events stream from a real server: decoded with plain msgpack, checked against the server's tree.

The consumer here is what llm-d or Dynamo does: it keeps the hashes it has seen, drops nothing it
can place, recomputes each block's hash from `token_ids` and its parent, and replays what it missed.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import msgpack
import pytest
import zmq

from radixkv.client import RadixKVClient
from radixkv.errors import OutOfBlocks
from radixkv.tree.block_hash import block_hash, wire_hash

_spec = importlib.util.spec_from_file_location("fleet_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
fleet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fleet)
BLOCK_SIZE, FleetServer, wait_until = fleet.BLOCK_SIZE, fleet.FleetServer, fleet.wait_until

END_SEQ = (1 << 64) - 1


class Consumer:
    """A vLLM KV-events consumer's index: wire hash -> full hash, checked event by event."""

    def __init__(self) -> None:
        self.full: dict[int, bytes] = {}
        self.num_stored = self.num_removed = self.num_cleared = 0

    def apply(self, payload: bytes) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.full.clear()
                self.num_cleared += 1
            elif kind == "BlockStored":
                assert event["block_size"] == BLOCK_SIZE and event["medium"] == "GPU"
                assert event["lora_id"] is None and event["lora_name"] is None
                hashes, tokens = event["block_hashes"], event["token_ids"]
                assert len(tokens) == len(hashes) * BLOCK_SIZE, "token_ids hold full blocks only"
                parent = event["parent_block_hash"]
                assert parent is None or parent in self.full, "a parent is announced before its children"
                full = None if parent is None else self.full[parent]
                extra_keys = event["extra_keys"] or [None] * len(hashes)
                for i, h in enumerate(hashes):
                    salt = tuple(extra_keys[i]) if extra_keys[i] is not None else None
                    full = block_hash(full, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], salt)
                    assert wire_hash(full) == h, "the announced hash is the chain recomputed from token_ids"
                    assert h not in self.full, "a block is announced once while cached"
                    self.full[h] = full
                self.num_stored += len(hashes)
            else:
                assert kind == "BlockRemoved" and event["medium"] == "GPU"
                for h in event["block_hashes"]:
                    assert h in self.full, "only announced blocks are removed"
                    del self.full[h]
                self.num_removed += len(event["block_hashes"])


def replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from `start_seq`; returns (seq, payload) up to the end marker."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    socket.connect(endpoint)
    try:
        socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches = []
        while True:
            empty, seq, payload = socket.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big") == END_SEQ:
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        socket.close()


def tree_hashes(client: RadixKVClient) -> set[int]:
    """The server's tree in hash form: the WatchEvents snapshot."""
    with client.watch_events(include_snapshot=True) as stream:
        batch = next(stream.batches())
    assert batch.snapshot and batch.epoch != 0
    return {h for event in batch.events for h in event.block_hashes}


def random_workload(client: RadixKVClient, rng: random.Random, num_ops: int) -> None:
    """Shared prefixes, two namespaces, forks, evictions under a small pool."""
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    live: list[int] = []
    for _ in range(num_ops):
        r = rng.random()
        if r < 0.5 or not live:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 31)] + [
                rng.randrange(100) for _ in range(rng.randrange(8))
            ]
            try:
                live.append(client.open(tokens or [7], rng.choice(["", "chat"])).seq_id)
            except OutOfBlocks:
                pass
        elif r < 0.6:
            try:
                live.extend(client.fork(rng.choice(live), 1))
            except OutOfBlocks:
                pass
        elif r < 0.7:
            try:
                client.append(rng.choice(live), [rng.randrange(100) for _ in range(rng.randrange(1, 6))])
            except OutOfBlocks:
                pass
        else:
            client.release(live.pop(rng.randrange(len(live))), cache=rng.random() < 0.9)
    client.release_many(live)


@pytest.mark.parametrize("seed", [0, 1])
def test_events_decode_with_msgpack_and_match_the_tree(start_fleet_server, seed: int) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=40)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, server.topic.encode())
    sub.connect(server.events_endpoint)
    live = Consumer()
    live_seqs: list[int] = []
    with RadixKVClient(server.address) as client:
        random_workload(client, random.Random(seed), 120)
        expected = tree_hashes(client)
        # The replay socket holds the whole stream from seq 0 (AllBlocksCleared first).
        replayed = replay(server.replay_endpoint, 0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert msgpack.unpackb(replayed[0][1])[1][0] == {"type": "AllBlocksCleared"}
        from_start = Consumer()
        for _, payload in replayed:
            from_start.apply(payload)
        assert from_start.num_stored > 0 and from_start.num_removed > 0, "the workload must store and evict"
        assert set(from_start.full) == expected, "every stored hash reachable in the tree, every removed one gone"

        # The live subscriber joined late (PUB drops what came before): it catches up by replay from its first seq.
        def received() -> bool:
            while sub.poll(0):
                topic, seq, payload = sub.recv_multipart()
                assert topic.decode() == server.topic
                live_seqs.append(int.from_bytes(seq, "big"))
            return bool(live_seqs) and live_seqs[-1] >= len(replayed)

        _release_written(client, [client.open(list(range(200, 200 + 3 * BLOCK_SIZE + 1))).seq_id])  # one more batch
        assert wait_until(received)
        for _, payload in replay(server.replay_endpoint, 0):
            live.apply(payload)
        assert live_seqs == list(range(live_seqs[0], live_seqs[-1] + 1)), "in order, none lost on loopback"
        assert set(live.full) == tree_hashes(client)
    sub.close()


def test_replay_from_a_seq_returns_that_batch_onwards_then_the_end_marker(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=64)
    with RadixKVClient(server.address) as client:
        for i in range(6):
            _release_written(client, [client.open([i] * (2 * BLOCK_SIZE + 1)).seq_id])
        assert wait_until(lambda: len(replay(server.replay_endpoint, 0)) == 7)
    everything = replay(server.replay_endpoint, 0)
    tail = replay(server.replay_endpoint, 4)
    assert tail == everything[4:]
    assert replay(server.replay_endpoint, 100) == []  # past the end: only the end marker


def test_a_split_reannounces_nothing_and_a_fork_nothing_until_cached(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    server: FleetServer = start_fleet_server(num_blocks=64)
    consumer = Consumer()
    with RadixKVClient(server.address) as client:
        long = list(range(1, 4 * BLOCK_SIZE + 1))
        _release_written(client, [client.open([*long, 99]).seq_id])  # 4 blocks stored
        seq = client.open([*long[: 2 * BLOCK_SIZE], 50, 51])  # splits the 4-block node after 2
        children = client.fork(seq.seq_id, 2)  # shares 2 cached blocks and a partial one
        wait_until(lambda: len(replay(server.replay_endpoint, 0)) > 2, timeout=0.5)
        assert len(replay(server.replay_endpoint, 0)) == 2, "the split and the fork published nothing"
        client.append(children[0], [52, 53])  # the child fills a new full block
        _release_written(client, [seq.seq_id, *children])  # ... which is announced once, when cached
        assert wait_until(lambda: len(replay(server.replay_endpoint, 0)) == 3)
    for _, payload in replay(server.replay_endpoint, 0):
        consumer.apply(payload)
    assert consumer.num_stored == 5 and len(consumer.full) == 5
    stored = msgpack.unpackb(replay(server.replay_endpoint, 2)[0][1])[1]
    assert [e["type"] for e in stored] == ["BlockStored"] and stored[0]["parent_block_hash"] is not None


def test_kv_events_flags_configure_the_one_pool_and_refuse_ambiguity() -> None:
    from radixkv.server.app import parse_args

    pool = "num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8"
    config, _ = parse_args(
        ["serve", "--pool", f"default:{pool}", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv@x@m"]
    )
    assert config.pools[0].kv_events_endpoint == "tcp://*:5557" and config.pools[0].kv_events_topic == "kv@x@m"
    with pytest.raises(ValueError, match="exactly one pool"):
        parse_args(["--pool", f"a:{pool}", "--pool", f"b:{pool}", "--kv-events-endpoint", "tcp://*:5557"])
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        parse_args(["--pool", f"default:{pool}", "--kv-events-replay-endpoint", "tcp://*:5558"])


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error() -> None:
    from radixkv.server.kv_events import ZmqEventPublisher

    with pytest.raises(RuntimeError, match="cannot bind the KV-events socket"):
        ZmqEventPublisher("tcp://*:not-a-port", "kv@x@m", block_size=4)
    first = ZmqEventPublisher("tcp://127.0.0.1:0", "kv@x@m", block_size=4)
    try:
        with pytest.raises(RuntimeError, match="cannot bind the KV-events socket"):
            ZmqEventPublisher(first.endpoint.replace("127.0.0.1", "*"), "kv@x@m", block_size=4)  # port in use
    finally:
        first.close()


def _release_written(client: RadixKVClient, seq_ids: list[int]) -> None:
    """Release as a worker that wrote every token would: commit them all, then release cached."""
    client.commit(seq_ids, [n for n, _ in client.describe_sequences(seq_ids)])
    client.release_many(seq_ids)
