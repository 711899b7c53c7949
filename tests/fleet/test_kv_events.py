"""vLLM's KV-events stream from a real server, read as vLLM's own consumers read it, checked against the tree.

Every payload is decoded with vLLM 0.33/0.34's msgspec structs (`vllm_wire.py`) and must re-encode to the
same bytes with msgspec, as vLLM's publisher would send them; every block's hash is recomputed with vLLM's
hasher from `token_ids` and the salt the event carries; replays are asked for with a DEALER, as llm-d's
subscriber does, and read with llm-d v0.10.0's replay rules (`router_decoders.py`).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import msgpack
import pytest
import zmq

from radixkv.client import RadixKVClient
from radixkv.errors import OutOfBlocks
from radixkv.server.process.spawn import patient

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fleet_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


fleet, vllm, routers = _sibling("conftest"), _sibling("vllm_wire"), _sibling("router_decoders")
BLOCK_SIZE, FleetServer, wait_until = fleet.BLOCK_SIZE, fleet.FleetServer, fleet.wait_until


class Consumer:
    """A vLLM KV-events consumer's index: external hash -> full hash, each recomputed with vLLM's hasher."""

    def __init__(self) -> None:
        self.full: dict[int, bytes] = {}
        self.num_stored = self.num_removed = self.num_cleared = self.num_salted = 0

    def apply(self, payload: bytes) -> None:
        batch = vllm.DECODER.decode(payload)  # vLLM's own decoder: a type error anywhere raises
        assert vllm.ENCODER.encode(batch) == payload, "the bytes vLLM's publisher would send for the same batch"
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, vllm.AllBlocksCleared):
                self.full.clear()
                self.num_cleared += 1
            elif isinstance(event, vllm.BlockStored):
                self._stored(event)
            else:
                assert event.medium == "GPU"
                for h in event.block_hashes:
                    assert h in self.full, "only announced blocks are removed"
                    del self.full[h]
                self.num_removed += len(event.block_hashes)

    def _stored(self, event: object) -> None:
        assert event.block_size == BLOCK_SIZE and event.medium == "GPU"  # type: ignore[attr-defined]
        assert event.lora_id is None and event.lora_name is None  # type: ignore[attr-defined]
        hashes, tokens = event.block_hashes, event.token_ids  # type: ignore[attr-defined]
        assert len(tokens) == len(hashes) * BLOCK_SIZE, "token_ids hold full blocks only"
        parent = event.parent_block_hash  # type: ignore[attr-defined]
        assert parent is None or parent in self.full, "a parent is announced before its children"
        published = event.extra_keys or [None] * len(hashes)  # type: ignore[attr-defined]
        # The request's cache_salt, as the first block's untagged extra key says (vLLM publishes it so).
        salt = published[0][0] if parent is None and published[0] is not None else None
        full = None if parent is None else self.full[parent]
        for i, h in enumerate(hashes):
            keys = vllm.extra_keys(0 if parent is None and i == 0 else BLOCK_SIZE, salt)
            assert vllm.to_event_extra_keys(keys) == published[i], "extra_keys exactly as vLLM publishes them"
            full = vllm.hash_block_tokens(full, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], keys)
            assert vllm.external(full) == h, "the announced hash is vLLM's, recomputed from token_ids and salt"
            assert h not in self.full, "a block is announced once while cached"
            self.full[h] = full
        self.num_stored += len(hashes)
        self.num_salted += salt is not None


def replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from `start_seq` as llm-d's subscriber does (a DEALER), reading
    each reply with llm-d v0.10.0's rules; returns (seq, payload) up to the end marker."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(patient(60) * 1000))
    socket.connect(endpoint)
    try:
        socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            frames = socket.recv_multipart()
            expected = batches[-1][0] + 1 if batches else start_seq  # llm-d: the next seq, else it wipes the pod
            reply = routers.llm_d_replay_reply(frames, expected)
            if reply is None:
                assert frames == [b"", b"", vllm.END_SEQ, b""]
                return batches
            assert len(frames) == 4 and frames[0] == b"", "[empty delimiter, topic, seq, payload]"
            topic, seq, payload = reply
            assert topic.startswith("kv@")
            batches.append((seq, payload))
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
# type: ignore[no-untyped-def]
def test_events_decode_with_vllms_structs_and_match_the_tree(start_fleet_server, seed: int) -> None:
    server: FleetServer = start_fleet_server(num_blocks=40)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: nothing but vLLM batches is on this socket
    sub.connect(server.events_endpoint)
    live = Consumer()
    live_seqs: list[int] = []
    with RadixKVClient(server.address) as client:
        random_workload(client, random.Random(seed), 120)
        expected = tree_hashes(client)
        # The replay socket holds the whole stream from seq 0 (AllBlocksCleared first).
        replayed = replay(server.replay_endpoint, 0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert vllm.DECODER.decode(replayed[0][1]).events == [vllm.AllBlocksCleared()]
        from_start = Consumer()
        for _, payload in replayed:
            from_start.apply(payload)
        assert from_start.num_stored > 0 and from_start.num_removed > 0, "the workload must store and evict"
        assert from_start.num_salted > 0, "the chat namespace's chains carry its salt"
        assert set(from_start.full) == expected, "every stored hash reachable in the tree, every removed one gone"

        # The live subscriber joined late (PUB drops what came before): it catches up by replay from its first seq.
        def received() -> bool:
            while sub.poll(0):
                topic, seq, payload = routers.llm_d_event_frame(sub.recv_multipart())
                assert topic == server.topic
                vllm.DECODER.decode(payload)
                live_seqs.append(seq)
            return bool(live_seqs) and live_seqs[-1] >= len(replayed)

        _release_written(client, [client.open(list(range(200, 200 + 3 * BLOCK_SIZE + 1))).seq_id])  # one more batch
        assert wait_until(received)
        for _, payload in replay(server.replay_endpoint, 0):
            live.apply(payload)
        assert live_seqs == list(range(live_seqs[0], live_seqs[-1] + 1)), "in order, none lost on loopback"
        assert set(live.full) == tree_hashes(client)
    sub.close()


# type: ignore[no-untyped-def]
def test_replay_from_a_seq_returns_that_batch_onwards_then_the_end_marker(start_fleet_server) -> None:
    server: FleetServer = start_fleet_server(num_blocks=64)
    with RadixKVClient(server.address) as client:
        for i in range(6):
            _release_written(client, [client.open([i] * (2 * BLOCK_SIZE + 1)).seq_id])
        seen: list[list[tuple[int, bytes]]] = [[]]

        def settled() -> bool:  # every release published: two replays agree (a busy publisher may batch several)
            seen.append(replay(server.replay_endpoint, 0))
            return len(seen[-1]) >= 2 and seen[-1] == seen[-2]

        assert wait_until(settled, timeout=60, interval=0.2)
    everything = seen[-1]
    middle = everything[len(everything) // 2][0]
    tail = replay(server.replay_endpoint, middle)
    assert tail and tail == [batch for batch in everything if batch[0] >= middle]
    assert replay(server.replay_endpoint, 100) == []  # past the end: only the end marker


def test_the_replay_frames_are_vllms_exactly(start_fleet_server) -> None:  # type: ignore[no-untyped-def]
    """Raw frames at a DEALER: `["", topic, seq, payload]` per batch and `["", "", END_SEQ, ""]` last."""
    server: FleetServer = start_fleet_server(num_blocks=64)
    with RadixKVClient(server.address) as client:
        _release_written(client, [client.open([5] * (2 * BLOCK_SIZE + 1)).seq_id])
        assert wait_until(lambda: len(replay(server.replay_endpoint, 0)) == 2)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(patient(60) * 1000))
    dealer.connect(server.replay_endpoint)
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = dealer.recv_multipart()
        assert frames[:3] == [b"", server.topic.encode(), (1).to_bytes(8, "big")] and len(frames) == 4
        assert isinstance(vllm.DECODER.decode(frames[3]).events[0], vllm.BlockStored)
        assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]
    finally:
        dealer.close()


# type: ignore[no-untyped-def]
def test_a_split_reannounces_nothing_and_a_fork_nothing_until_cached(start_fleet_server) -> None:
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
    assert "extra_keys" not in stored[0], "msgspec's omit_defaults: no extra_keys on an unsalted chain"


def test_kv_events_flags_configure_the_one_pool_and_refuse_ambiguity() -> None:
    from radixkv.server.process.app import parse_args

    pool = "num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8"
    config, _ = parse_args(
        ["serve", "--pool", f"default:{pool}", "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-topic",
         "kv@x@m", "--kv-events-digest-endpoint", "tcp://127.0.0.1:5559"]
    )  # fmt: skip
    kv_events = config.pools[0].kv_events
    assert kv_events is not None and (kv_events.endpoint, kv_events.topic) == ("tcp://127.0.0.1:5557", "kv@x@m")
    assert kv_events.digest_endpoint == "tcp://127.0.0.1:5559" and not kv_events.connect
    with pytest.raises(ValueError, match="exactly one pool"):
        parse_args(["--pool", f"a:{pool}", "--pool", f"b:{pool}", "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        parse_args(["--pool", f"default:{pool}", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"])
    with pytest.raises(ValueError, match="did you mean kv_events_topic"):
        parse_args(["--pool", f"default:{pool},kv_events_endpoint=tcp://127.0.0.1:1,kv_events_topc=x"])
    with pytest.raises(ValueError, match="kv_events_connect='yes' must be true or false"):
        parse_args(["--pool", f"default:{pool},kv_events_endpoint=tcp://127.0.0.1:1,kv_events_connect=yes"])


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error() -> None:
    from radixkv.server.events.kv_events import ZmqEventPublisher
    from radixkv.server.events.kv_events_config import KVEventsConfig

    with pytest.raises(RuntimeError, match="cannot bind the KV-events socket"):
        ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:not-a-port", topic="kv@x@m"), block_size=4)
    first = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="kv@x@m"), block_size=4)
    try:
        with pytest.raises(RuntimeError, match="cannot bind the KV-events socket"):  # the port is in use
            ZmqEventPublisher(KVEventsConfig(endpoint=first.endpoint, topic="kv@x@m"), block_size=4)
        with pytest.raises(RuntimeError, match="cannot bind the KV-events socket"):  # so is the replay's
            ZmqEventPublisher(
                KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="kv@x@m", replay_endpoint=first.endpoint),
                block_size=4,
            )
    finally:
        first.close()


def _release_written(client: RadixKVClient, seq_ids: list[int]) -> None:
    """Release as a worker that wrote every token would: commit them all, then release cached."""
    client.commit(seq_ids, [n for n, _ in client.describe_sequences(seq_ids)])
    client.release_many(seq_ids)
