"""Server restarts: UNAVAILABLE while it is down, then one clear exception for everything from before, then recovery.

Nothing survives a restart: sessions, sequences, pins, the prefix cache, and the pool memory itself
(each run creates a shared-memory segment under a new name; the old one is unlinked on a graceful
stop, or by the crashed server's resource tracker).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import ServerRestarted, UnknownSequence, UnknownSession
from radixkv.server.process.app import create_server, parse_args
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

POOL = ["--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=64,dtype=float16"]
SHM = Path("/dev/shm")


def _until_reachable(call: Callable[[], object], wait_until: Callable[..., bool]) -> object:
    """Call until the channel has reconnected (gRPC backs off between attempts).

    Returns what the call raised or returned."""
    outcome: list[object] = []

    def attempt() -> bool:
        try:
            outcome.append(call())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                return False
            outcome.append(e)
        except Exception as e:  # noqa: BLE001 -- the domain exception is the point
            outcome.append(e)
        return True

    assert wait_until(attempt, timeout=60, interval=0.2), "the restarted server never became reachable"
    return outcome[-1]


# type: ignore[no-untyped-def]
def test_a_crash_and_restart_reads_as_unavailable_then_server_restarted_then_recovers(start_server, wait_until) -> None:
    first = start_server(*POOL)
    client = RadixKVClient(first.address, session_ttl=60, timeout=patient(60))
    try:
        prompt = list(range(40, 52))
        opened = client.open(prompt + [1], "restart")
        client.cache(opened.seq_id)
        old_segment = client.get_pool().handle.shared_memory.name
        assert (SHM / old_segment).exists()

        first.proc.kill()  # a crash: no graceful stop, no unlink by the server itself
        first.proc.wait()
        with pytest.raises(grpc.RpcError) as down:
            client.append(opened.seq_id, [2])
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE  # transport: retry later, nothing is lost yet
        assert wait_until(lambda: not (SHM / old_segment).exists(), timeout=60), "the crashed server's segment lingers"

        second = start_server(*POOL, "--port", str(first.port))  # the same address: the client's channel reconnects
        raised = _until_reachable(lambda: client.append(opened.seq_id, [2]), wait_until)
        assert isinstance(raised, ServerRestarted) and isinstance(raised, UnknownSession), raised
        # One exception, whatever the call: every request names the old session.
        for call in (
            lambda: client.open(prompt, "restart"),
            client.keep_alive,
            client.stats,
            lambda: client.release(opened.seq_id),
        ):
            with pytest.raises(ServerRestarted):
                call()
        with grpc.insecure_channel(second.address) as channel, pytest.raises(grpc.RpcError) as wire:
            kvcache_pb2_grpc.KVCacheStub(channel).KeepAlive(
                pb.KeepAliveRequest(session_id=client.session_id), timeout=patient(30)
            )
        assert wire.value.code() == grpc.StatusCode.NOT_FOUND  # on the wire: the session is gone for good

        client.reopen()
        assert not _has_table(client, opened.seq_id)  # the old session's tables are forgotten
        again = client.open(prompt + [1], "restart")
        assert again.num_cached_tokens == 0  # the prefix cache did not survive either
        new_segment = client.get_pool().handle.shared_memory.name
        assert new_segment != old_segment  # new memory, under a new name
        client.release(again.seq_id)
    finally:
        client.close()
    assert second.stop() == 0
    assert not (SHM / new_segment).exists()  # a graceful stop unlinks its segment itself


def _has_table(client: RadixKVClient, seq_id: int) -> bool:
    try:
        client.block_table(seq_id)
    except UnknownSequence:
        return False
    return True


def test_a_sequence_id_from_before_a_restart_names_nothing_after_it() -> None:
    config, _ = parse_args(["serve", *POOL])
    server, port = create_server(config, "127.0.0.1:0")
    server.start()
    try:
        client = RadixKVClient(f"127.0.0.1:{port}", timeout=patient(60))
        old = client.open([1, 2, 3]).seq_id
    finally:
        server.stop(0)
    server, _ = create_server(config, f"127.0.0.1:{port}")
    server.start()
    try:
        with pytest.raises(ServerRestarted):
            client.keep_alive()
        client.reopen()
        client.open([7, 8, 9])
        with pytest.raises(UnknownSequence):
            client.append(old, [4])  # an orchestrator that missed the restart, still stepping its old sequence
    finally:
        client.close()
        server.stop(0)
