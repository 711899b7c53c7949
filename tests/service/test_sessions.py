"""Leases: an unrenewed session ends and its sequences are released; a renewed one lives on."""

from __future__ import annotations

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


def test_an_expired_lease_releases_its_sequences_without_caching(server, debug, wait_until) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(500, 520))  # 5 full blocks
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        baseline = debug.check().num_live_sequences
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.3))
        assert session.ttl_seconds == pytest.approx(0.3)
        request = pb.OpenSequencesRequest(
            session_id=session.session_id, prompts=[pb.Prompt(token_ids=prompt, namespace="lease")] * 3
        )
        opened = stub.OpenSequences(request).sequences
        assert len(opened) == 3
        assert debug.check().num_live_sequences == baseline + 3
        # Nobody renews: the reaper ends the session and releases all three.
        assert wait_until(lambda: debug.check().num_live_sequences == baseline, timeout=60)
        with pytest.raises(grpc.RpcError) as ended:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=session.session_id))
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        # Released with cache=False: a dead client's blocks may hold unwritten K/V, so none is cached.
        assert stub.Match(pb.MatchRequest(token_ids=prompt, namespace="lease")).num_cached_tokens == 0


def test_the_client_keeps_a_short_lease_alive(server, debug, wait_until) -> None:  # type: ignore[no-untyped-def]
    """A session with the same lease and no renewals, opened after the client's, expires; the client's does not:
    only its background renewals kept it (an ordering fact, not a clock reading)."""
    with RadixKVClient(server.address, session_ttl=3.0) as client, grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        opened = client.open([1, 2, 3], "lease-kept")
        num_sessions = debug.check().num_sessions
        unrenewed = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=3.0)).session_id
        # Counted, not probed: any call naming a session renews it.
        assert wait_until(lambda: debug.check().num_sessions < num_sessions + 1, timeout=60), "a lease ends"
        with pytest.raises(grpc.RpcError) as ended:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=unrenewed))
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert client.append(opened.seq_id, [4]).num_tokens == 4
        assert client.keep_alive() == pytest.approx(3.0)
    debug.check()


def test_closing_a_session_releases_what_it_held(server, debug) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        baseline = debug.check().num_live_sequences
        session_id = stub.OpenSession(pb.OpenSessionRequest()).session_id
        stub.OpenSequences(pb.OpenSequencesRequest(session_id=session_id, prompts=[pb.Prompt(token_ids=[1, 2])] * 2))
        stub.OpenSequences(
            pb.OpenSequencesRequest(pool="tiny", session_id=session_id, prompts=[pb.Prompt(token_ids=[3])])
        )
        closed = stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
        assert closed.num_released_sequences == 3
        assert debug.check().num_live_sequences == baseline
        assert debug.check("tiny").num_live_sequences == 0


def test_ttl_is_capped_by_the_server(server) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=10**6))
        assert session.ttl_seconds == 600  # --max-session-ttl
        default = stub.OpenSession(pb.OpenSessionRequest())
        assert default.ttl_seconds == 30  # the server's default lease
        for s in (session, default):
            stub.CloseSession(pb.CloseSessionRequest(session_id=s.session_id))
