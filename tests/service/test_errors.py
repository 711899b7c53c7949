"""Every refusal on the wire: its status code and ErrorInfo reason (never message text), and nothing leaked after it.

Requests go through the raw generated stub, so the test sees exactly what the server sent; a second
test checks that `RadixKVClient` turns the same statuses back into the core's exception classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from radixkv.client import RadixKVClient
from radixkv.client.errors import error_from_rpc
from radixkv.errors import (
    InvalidArgument,
    LimitExceeded,
    NotPinned,
    OutOfBlocks,
    UnknownPool,
    UnknownSequence,
    UnknownSession,
)
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

Code = grpc.StatusCode


@dataclass
class Refusal:
    code: grpc.StatusCode
    reason: str | None  # None: no ErrorInfo (a transport-level refusal)
    metadata: dict[str, str]


class Wire:
    """Raw stub calls on one session (plus a second session to trespass on)."""

    def __init__(self, address: str) -> None:
        self.channel: grpc.Channel | None = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 8 << 20)]
        )
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.session = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self.other_session = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id

    def refusal(self, rpc: Callable[..., object], request: object) -> Refusal:
        with pytest.raises(grpc.RpcError) as caught:
            rpc(request, timeout=patient(10))
        error = caught.value
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        infos = []
        for detail in status.details if status else []:
            info = error_details_pb2.ErrorInfo()
            assert detail.Unpack(info)
            infos.append(info)
        assert len(infos) <= 1, "one ErrorInfo per error"
        if not infos:
            return Refusal(error.code(), None, {})  # type: ignore[attr-defined]
        assert infos[0].domain == "radixkv"
        return Refusal(error.code(), infos[0].reason, dict(infos[0].metadata))  # type: ignore[attr-defined]

    def open(self, tokens: list[int], namespace: str = "errors", pool: str = "", session: str | None = None) -> int:
        request = pb.OpenSequencesRequest(
            pool=pool, session_id=session or self.session, prompts=[pb.Prompt(token_ids=tokens, namespace=namespace)]
        )
        return self.stub.OpenSequences(request).sequences[0].seq_id

    def close(self) -> None:
        if self.channel is None:
            return
        for session in (self.session, self.other_session):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
        self.channel.close()
        self.channel = None


@pytest.fixture
def wire(server) -> Iterator[Wire]:  # type: ignore[no-untyped-def]
    w = Wire(server.address)
    yield w
    w.close()


def append_request(
    wire: Wire, seq_ids: list[int], tokens: list[int], counts: list[int] | None = None, pool: str = ""
) -> pb.AppendTokensRequest:
    counts = counts if counts is not None else [len(tokens)]
    return pb.AppendTokensRequest(
        pool=pool, session_id=wire.session, seq_ids=seq_ids, num_token_ids=counts, token_ids=tokens
    )


# (name, request builder, expected code, expected reason, metadata that must be present)
CASES: list[tuple[str, Callable[[Wire], tuple[Callable[..., object], object]], grpc.StatusCode, str, dict[str, str]]] = [
    ("unknown session", lambda w: (w.stub.OpenSequences, pb.OpenSequencesRequest(session_id="nope", prompts=[pb.Prompt(token_ids=[1])])), Code.NOT_FOUND, "UNKNOWN_SESSION", {"session_id": "nope"}),
    ("session of an earlier server run", lambda w: (w.stub.KeepAlive, pb.KeepAliveRequest(session_id="0badcafe-" + "0" * 32)), Code.NOT_FOUND, "SERVER_RESTARTED", {"session_id": "0badcafe-" + "0" * 32}),
    ("unknown pool", lambda w: (w.stub.Stats, pb.StatsRequest(pool="nope")), Code.NOT_FOUND, "UNKNOWN_POOL", {"pool": "nope"}),
    ("unknown sequence", lambda w: (w.stub.AppendTokens, append_request(w, [987654], [1])), Code.NOT_FOUND, "UNKNOWN_SEQUENCE", {"seq_id": "987654"}),
    # Answered exactly as an absent one: probing ids tells nothing about other sessions' sequences.
    ("another session's sequence", lambda w: (w.stub.AppendTokens, append_request(w, [w.open([1, 2], session=w.other_session)], [3])), Code.NOT_FOUND, "UNKNOWN_SEQUENCE", {}),
    ("empty prompt", lambda w: (w.stub.OpenSequences, pb.OpenSequencesRequest(session_id=w.session, prompts=[pb.Prompt(token_ids=[])])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "token_ids"}),
    ("bad namespace", lambda w: (w.stub.OpenSequences, pb.OpenSequencesRequest(session_id=w.session, prompts=[pb.Prompt(token_ids=[1], namespace="no spaces!")])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "namespace"}),
    ("token id out of range", lambda w: (w.stub.Match, pb.MatchRequest(session_id=w.session, token_ids=[2**31])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "token_ids"}),
    ("columns disagree", lambda w: (w.stub.AppendTokens, append_request(w, [w.open([1])], [1, 2], counts=[1, 1])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "num_token_ids"}),
    ("token count disagrees", lambda w: (w.stub.AppendTokens, append_request(w, [w.open([1])], [1, 2], counts=[3])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "token_ids"}),
    ("zero children", lambda w: (w.stub.ForkSequence, pb.ForkSequenceRequest(session_id=w.session, seq_id=w.open([1]), num_children=0)), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "num_children"}),
    ("negative ttl", lambda w: (w.stub.OpenSession, pb.OpenSessionRequest(ttl_seconds=-1)), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "ttl_seconds"}),
    ("out of blocks", lambda w: (w.stub.OpenSequences, pb.OpenSequencesRequest(pool="tiny", session_id=w.session, prompts=[pb.Prompt(token_ids=list(range(100)))])), Code.RESOURCE_EXHAUSTED, "OUT_OF_BLOCKS", {"needed": "25"}),
    ("too many children", lambda w: (w.stub.ForkSequence, pb.ForkSequenceRequest(session_id=w.session, seq_id=w.open([1]), num_children=9)), Code.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED", {"limit": "max_fork_children", "allowed": "8"}),
    ("unpin without a pin", lambda w: (w.stub.Unpin, pb.UnpinRequest(session_id=w.session, token_ids=[1, 2, 3, 4, 5])), Code.NOT_FOUND, "NOT_PINNED", {}),
    ("pin of an uncached prefix", lambda w: (w.stub.Pin, pb.PinRequest(session_id=w.session, token_ids=[77, 78, 79, 80, 81], namespace="never-cached")), Code.FAILED_PRECONDITION, "FAILED_PRECONDITION", {}),
    ("release twice in one batch", lambda w: (w.stub.ReleaseSequences, pb.ReleaseSequencesRequest(session_id=w.session, seq_ids=[s := w.open([5]), s])), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "seq_ids"}),
]  # fmt: skip


@pytest.mark.parametrize(("build", "code", "reason", "metadata"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusal_has_its_code_and_reason_and_leaks_nothing(wire: Wire, debug, build, code, reason, metadata) -> None:  # type: ignore[no-untyped-def]
    before = {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")}
    rpc, request = build(wire)
    after_setup = {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")}
    refusal = wire.refusal(rpc, request)
    assert (refusal.code, refusal.reason) == (code, reason)
    assert metadata.items() <= refusal.metadata.items()
    # The failed call changed nothing; closing the sessions releases what the set-up opened.
    assert {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")} == after_setup
    wire.close()
    assert {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")} == before


def test_a_message_over_the_size_limit_is_refused_before_the_servicer(wire: Wire, debug) -> None:  # type: ignore[no-untyped-def]
    huge = pb.MatchRequest(session_id=wire.session, token_ids=[2**20] * 400_000)  # ~1.2 MB > the server's 1 MiB
    refusal = wire.refusal(wire.stub.Match, huge)
    assert (refusal.code, refusal.reason) == (Code.RESOURCE_EXHAUSTED, None)
    debug.check()


def test_client_raises_the_core_exception_classes(server, debug) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client, RadixKVClient(server.address) as other:
        theirs = other.open([1, 2, 3], "errors")
        with pytest.raises(UnknownSequence):  # another session's: answered as an absent one
            client.append(theirs.seq_id, [4])
        with pytest.raises(UnknownSequence) as unknown:
            client.release(424242)
        assert unknown.value.seq_id == 424242
        with pytest.raises(InvalidArgument) as invalid:
            client.open([], "errors")
        assert invalid.value.field == "token_ids"
        with pytest.raises(InvalidArgument) as negative:
            client.open([1, -2], "errors")  # refused client-side, as the server would
        assert negative.value.field == "token_ids"
        with pytest.raises(LimitExceeded) as limit:
            client.fork(client.open([1], "errors").seq_id, 9)
        assert (limit.value.limit, limit.value.allowed) == ("max_fork_children", 8)
        with pytest.raises(NotPinned):
            client.unpin([9, 9, 9, 9], "errors")
    with RadixKVClient(server.address, pool="tiny") as tiny:
        with pytest.raises(OutOfBlocks) as out:
            tiny.open(list(range(100)))
        assert (out.value.needed, out.value.free) == (25, 8)
    with pytest.raises(UnknownPool):  # the pool is checked when the session opens
        RadixKVClient(server.address, pool="nope")
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        session_id = stub.OpenSession(pb.OpenSessionRequest()).session_id
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
        with pytest.raises(grpc.RpcError) as ended:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=session_id))
        assert isinstance(error_from_rpc(ended.value), UnknownSession)
    debug.check()
    debug.check("tiny")
