"""Restarts that keep the cache, with real processes: a keeper holding the memory, servers coming and going.

- an upgrade (the admin `Upgrade` call, or SIGTERM) under load: clients keep going (a call may be refused
  SERVER_RESTARTING or find the server down, and is retried), their sessions and sequence ids survive,
  the hit ratio after is at least 95% of before, the cached blocks' K/V bytes are identical, and the
  index digest and the events' new incarnation agree with what routers held;
- a corrupted snapshot is refused: the next server starts cold and says why (log line and metric);
- SIGKILL of the server: the crash policy, a cold start (`AllBlocksCleared`, old sessions SERVER_RESTARTED).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import msgpack
import pytest
import torch
import zmq

from radixkv.client import PoolView, RadixKVClient, Router
from radixkv.errors import RadixKVError, ServerRestarted
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc
from tests.reliability.conftest import TOKENS, Debug

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

T = TypeVar("T")
BLOCK_SIZE = 4
POOL = ["--pool", f"default:num_layers=2,num_kv_heads=1,head_dim=8,block_size={BLOCK_SIZE},num_blocks=2048"]
PROMPTS = [[1000 + 7 * i] * 3 + list(range(2000 + 50 * i, 2000 + 50 * i + 37)) for i in range(12)]


@pytest.fixture
def keeper(tmp_path: Path):
    k = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log")
    yield k
    k.stop()


def _serve(keeper: KeeperProcess, log_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess([*POOL, "--keeper", str(keeper.socket), "--debug-rpc", *extra], log_path)


def _warm(client: RadixKVClient) -> list[int]:
    """Cache PROMPTS with K/V written by a worker (random bytes through the mapped pool); their block ids."""
    gen = torch.Generator().manual_seed(1)
    block_ids: list[int] = []
    with PoolView.from_client(client) as view:
        for prompt in PROMPTS:
            opened = client.open(prompt)
            for b in opened.block_table.tolist():
                view.data[:, :, b] = torch.randn(view.data[:, :, b].shape, generator=gen).to(view.data.dtype)
            client.commit([opened.seq_id], [len(prompt)])
            block_ids += opened.block_table[: len(prompt) // BLOCK_SIZE].tolist()
            client.release(opened.seq_id)
    return block_ids


def _hit_ratio(client: RadixKVClient) -> float:
    return sum(client.match(p) for p in PROMPTS) / sum(len(p) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS)


def _upgrade(address: str) -> pb.UpgradeResponse:
    with grpc.insecure_channel(address) as channel:
        return kvcache_pb2_grpc.KVCacheStub(channel).Upgrade(pb.UpgradeRequest(), timeout=patient(60))


def _once_reachable(call: Callable[[], T]) -> T:
    """`call`, retried while the channel is still reconnecting to the restarted server (UNAVAILABLE)."""
    deadline = time.monotonic() + patient(60)
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:  # type: ignore[attr-defined]
                raise
            time.sleep(0.1)


def _log_lines(path: Path, message: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("msg") == message]


class Load:
    """Threads running multi-turn conversations through their own clients until stopped, retrying refusals."""

    def __init__(self, address: str, num_threads: int = 2) -> None:
        self.address = address
        self.num_turns = [0] * num_threads
        self.num_retries = [0] * num_threads
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, i: int) -> None:
        try:
            client = RadixKVClient(self.address, session_ttl=60, timeout=patient(60))
            history = [50_000 + i] * 5
            while not self._stop.is_set():
                try:
                    opened = client.open(history + [60_000 + self.num_turns[i]] * 3, f"load{i}")
                    prompt_len = len(history) + 3
                    client.commit([opened.seq_id], [prompt_len])
                    client.append(opened.seq_id, [7] * 6)
                    client.commit([opened.seq_id], [prompt_len + 6])
                    client.release(opened.seq_id)
                except (RadixKVError, grpc.RpcError) as e:
                    if isinstance(e, ServerRestarted):
                        raise  # an upgrade keeps the session: this must not happen
                    self.num_retries[i] += 1
                    time.sleep(0.05)
                    continue
                history = history + [60_000 + self.num_turns[i]] * 3 + [7] * 6
                self.num_turns[i] += 1
            client.close()
        except BaseException as e:  # noqa: BLE001 -- reported by stop()
            self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=patient(120))
        assert not self.errors, self.errors


# type: ignore[no-untyped-def]
def test_an_upgrade_under_load_keeps_sessions_sequences_hits_and_kv_bytes(keeper, tmp_path, wait_until) -> None:
    first = _serve(keeper, tmp_path / "server1.log")
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    block_ids = _warm(client)
    debug = Debug(first.address)
    checksum = debug.checksum(block_ids)
    hits_before = _hit_ratio(client)
    live = client.open(PROMPTS[0] + [5, 5, 5])  # mid-decode across the restart
    client.commit([live.seq_id], [len(PROMPTS[0]) + 3])
    load = Load(first.address)
    assert wait_until(lambda: min(load.num_turns) >= 3, timeout=60)

    response = _upgrade(first.address)
    (written,) = response.snapshots
    assert written.pool == "default" and written.num_cached_blocks >= len(block_ids)
    assert written.num_live_sequences >= 1
    assert first.proc.wait(patient(120)) == 0, "the server exits once the upgrade call has answered"
    turns_at_upgrade = list(load.num_turns)
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port))
    try:
        assert wait_until(
            lambda: all(n >= t + 3 for n, t in zip(load.num_turns, turns_at_upgrade, strict=True)), timeout=60
        )
        load.stop()
        assert _hit_ratio(client) >= 0.95 * hits_before
        debug2 = Debug(second.address)
        assert debug2.checksum(block_ids) == checksum, "the cached blocks' K/V bytes are the ones before"
        # The live sequence goes on under the same id and session.
        appended = client.append(live.seq_id, [6])
        assert appended.num_tokens == len(PROMPTS[0]) + 4
        client.release(live.seq_id)
        debug2.check()
        (adopted,) = _log_lines(tmp_path / "server2.log", "snapshot adopted")
        assert adopted["num_cached_blocks"] == written.num_cached_blocks
        assert max(load.num_retries) >= 1, "the load saw the restart (and went on)"
        debug.close()
        debug2.close()
    finally:
        client.close()
        second.stop()


# type: ignore[no-untyped-def]
def test_adopted_events_and_digest_are_the_ones_routers_hold(keeper, tmp_path, wait_until) -> None:
    zmq_flags = ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    first = _serve(keeper, tmp_path / "server1.log", *zmq_flags)
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    router = Router([first.address], block_size=BLOCK_SIZE, health_interval=0.2)
    _warm(client)
    before = client.verify()
    assert wait_until(lambda: router.status()[0].digest == before.digest, timeout=60)
    routed_before = [router.num_cached_blocks(first.address, p) for p in PROMPTS]
    assert all(routed_before)
    assert first.stop() == 0  # SIGTERM: the same snapshot as Upgrade
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port), *zmq_flags)
    try:
        after = _once_reachable(client.verify)  # the session is the same one
        assert after.digest == before.digest and after.epoch != before.epoch
        assert after.digests == before.digests and after.num_blocks == before.num_blocks
        # The router sees a new incarnation whose snapshot is the index it held: the same prefixes route here.
        assert wait_until(lambda: router.status()[0].epoch == after.epoch and router.status()[0].healthy, timeout=60)
        assert router.status()[0].digest == after.digest and router.status()[0].num_rebuilds == 1
        assert [router.num_cached_blocks(first.address, p) for p in PROMPTS] == routed_before
        # vLLM's stream of the new incarnation opens with the adopted blocks, not AllBlocksCleared.
        replayed = _replayed_events(second.announcement["kv_events"]["default"]["replay_endpoint"])
        kinds = {e["type"] for e in replayed}
        assert kinds == {"BlockStored"}, kinds
        assert sum(len(e["block_hashes"]) for e in replayed) == sum(before.num_blocks.values())
        # Twice in a row: the next server adopts what this one adopted.
        assert second.stop() == 0
        third = _serve(keeper, tmp_path / "server3.log", "--port", str(first.port))
        assert _once_reachable(client.verify).digest == before.digest
        third.stop()
    finally:
        router.close()
        client.close()


def _replayed_events(endpoint: str) -> list[dict[str, object]]:
    """Every event vLLM's stream has carried since the server started, from its replay socket."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(patient(60) * 1000))
    socket.connect(endpoint)
    events: list[dict[str, object]] = []
    try:
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _topic, seq, payload = socket.recv_multipart()  # vLLM's replay reply: [topic, seq, payload]
            if not payload:
                return events
            events += msgpack.unpackb(payload)[1]
    finally:
        socket.close()


# type: ignore[no-untyped-def]
def test_a_corrupted_snapshot_is_refused_and_the_server_starts_cold_saying_why(keeper, tmp_path) -> None:
    first = _serve(keeper, tmp_path / "server1.log")
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    _warm(client)
    assert first.stop() == 0
    snapshot = Path(keeper.announcement["state_dir"]) / "snapshots" / "default.snapshot"
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0x10
    snapshot.write_bytes(bytes(data))
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port), "--metrics-port", "0")
    try:
        (refused,) = _log_lines(tmp_path / "server2.log", "snapshot refused: starting cold")
        assert refused["why"] == "CORRUPTED"
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{second.metrics_port}/metrics", timeout=patient(10))
            .read()
            .decode()
        )
        assert 'radixkv_snapshot_refusals_total{pool="default",why="CORRUPTED"} 1.0' in metrics
        with pytest.raises(ServerRestarted):
            _once_reachable(lambda: client.match(PROMPTS[0]))  # nothing adopted: not the session either
        client.reopen()
        assert _hit_ratio(client) == 0.0
        Debug(second.address).check()
    finally:
        client.close()
        second.stop()


def test_a_sigkill_of_the_server_is_a_cold_start(keeper, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = _serve(keeper, tmp_path / "server1.log")
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    _warm(client)
    first.kill()
    second = _serve(keeper, tmp_path / "server2.log", "--port", str(first.port))
    try:
        assert not _log_lines(tmp_path / "server2.log", "snapshot adopted")
        with pytest.raises(ServerRestarted):
            _once_reachable(lambda: client.match(PROMPTS[0]))
        client.reopen()
        assert _hit_ratio(client) == 0.0, "a crash adopts nothing: no snapshot proves the index"
        assert client.verify().digest == 0
        Debug(second.address).check()
    finally:
        client.close()
        second.stop()


# type: ignore[no-untyped-def]
def test_upgrade_without_a_keeper_is_refused_and_the_server_keeps_serving(start_server) -> None:
    server = start_server(*POOL)
    with pytest.raises(grpc.RpcError) as refused:
        _upgrade(server.address)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with RadixKVClient(server.address, timeout=patient(60)) as client:
        assert client.match(PROMPTS[0]) == 0


# type: ignore[no-untyped-def]
def test_upgrade_after_the_keeper_died_is_refused_and_the_server_keeps_serving(tmp_path, wait_until) -> None:
    keeper = KeeperProcess(tmp_path / "state", log_path=tmp_path / "keeper.log")
    server = _serve(keeper, tmp_path / "server.log")
    try:
        keeper.kill()
        assert wait_until(lambda: "keeper lost" in (tmp_path / "server.log").read_text(), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            _upgrade(server.address)  # its memory dies with it now: an upgrade would lose the cache
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with RadixKVClient(server.address, timeout=patient(60)) as client:
            assert client.match(PROMPTS[0]) == 0
        assert server.stop() == 0
        assert not (tmp_path / "state" / "snapshots" / "default.snapshot").exists(), "nothing to adopt was written"
    finally:
        server.stop()


@pytest.mark.parametrize(("tenant", "code"), [("acme", "PERMISSION_DENIED"), ("globex", "FAILED_PRECONDITION")])
# type: ignore[no-untyped-def]
def test_upgrade_is_for_admins_only(secure, certificates, tenant: str, code: str) -> None:
    credentials = grpc.ssl_channel_credentials(certificates["server"][0].read_bytes())
    metadata = (("authorization", f"Bearer {TOKENS[tenant]}"),)
    with grpc.secure_channel(secure.address, credentials) as channel, pytest.raises(grpc.RpcError) as refused:
        kvcache_pb2_grpc.KVCacheStub(channel).Upgrade(pb.UpgradeRequest(), metadata=metadata, timeout=patient(10))
    assert refused.value.code() == getattr(grpc.StatusCode, code)  # globex may, but no keeper holds the pools
