"""Bad steps on the Session stream get the status the unary call gets, in-band, and the stream carries on.

Each case is one bad request sent both ways on the same state: as its unary RPC (the status the
call ends with) and as the one item of a step (the StepError of the response). Code, reason and
metadata must agree; the step's error also names the item. The stream stays open after each.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from radixkv.client import RadixKVClient
from radixkv.errors import PermissionDenied, QuotaExceeded
from radixkv.sequences.step import Step
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

Code = grpc.StatusCode


def packed(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int64).astype("<i4").tobytes()  # ids >= 2^31 wrap, as uint32 does on unary


class Ends:
    """One session reached both ways: raw unary calls, and a raw Session stream."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.session = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self.other = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._responses = self.stub.Session(iter(self._requests.get, None), timeout=60)

    def open(self, tokens: list[int], session: str | None = None) -> int:
        request = pb.OpenSequencesRequest(session_id=session or self.session, prompts=[pb.Prompt(token_ids=tokens)])
        return self.stub.OpenSequences(request).sequences[0].seq_id

    def step(self, request: pb.SessionRequest) -> pb.SessionResponse:
        self._requests.put(request)
        return next(self._responses)

    def unary_refusal(self, rpc: Callable[..., object], request: object) -> tuple[grpc.StatusCode, str, dict[str, str]]:
        with pytest.raises(grpc.RpcError) as caught:
            rpc(request, timeout=patient(10))
        status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
        assert status is not None and len(status.details) == 1
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info)
        return caught.value.code(), info.reason, dict(info.metadata)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._responses) == [], "the stream ends cleanly once the client half-closes"
        for session in (self.session, self.other):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=session))
        self.channel.close()


@pytest.fixture
def ends(server) -> Iterator[Ends]:  # type: ignore[no-untyped-def]
    e = Ends(server.address)
    yield e
    e.close()


# (name, build -> (unary rpc, unary request, the same as a step), the item the step names)
CASES = [
    ("unknown session", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(session_id="nope", prompts=[pb.Prompt(token_ids=[1])]), pb.SessionRequest(session_id="nope", opens=[pb.StepOpen(token_ids=packed([1]))])), None),
    ("unknown pool", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(pool="nope", session_id=e.session, prompts=[pb.Prompt(token_ids=[1])]), pb.SessionRequest(pool="nope", session_id=e.session, opens=[pb.StepOpen(token_ids=packed([1]))])), None),
    ("unknown sequence", lambda e: (e.stub.AppendTokens, pb.AppendTokensRequest(session_id=e.session, seq_ids=[987654], num_token_ids=[1], token_ids=[1]), pb.SessionRequest(session_id=e.session, append=pb.StepAppend(seq_ids=[987654], num_token_ids=[1], token_ids=packed([1])))), "append"),
    ("another session's sequence", lambda e: (s := e.open([1, 2], e.other), e.stub.ForkSequence, pb.ForkSequenceRequest(session_id=e.session, seq_id=s, num_children=1), pb.SessionRequest(session_id=e.session, forks=[pb.StepFork(seq_id=s, num_children=1)]))[1:], "forks[0]"),
    ("empty prompt", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(session_id=e.session, prompts=[pb.Prompt(token_ids=[])]), pb.SessionRequest(session_id=e.session, opens=[pb.StepOpen()])), "opens"),
    ("bad namespace", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(session_id=e.session, prompts=[pb.Prompt(token_ids=[1], namespace="no spaces!")]), pb.SessionRequest(session_id=e.session, opens=[pb.StepOpen(token_ids=packed([1]), namespace="no spaces!")])), "opens"),
    ("token id out of range", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(session_id=e.session, prompts=[pb.Prompt(token_ids=[1, 2**31])]), pb.SessionRequest(session_id=e.session, opens=[pb.StepOpen(token_ids=packed([1, 2**31]))])), "opens"),
    ("columns disagree", lambda e: (s := e.open([1]), e.stub.AppendTokens, pb.AppendTokensRequest(session_id=e.session, seq_ids=[s], num_token_ids=[1, 1], token_ids=[1, 2]), pb.SessionRequest(session_id=e.session, append=pb.StepAppend(seq_ids=[s], num_token_ids=[1, 1], token_ids=packed([1, 2]))))[1:], "append"),
    ("token count disagrees", lambda e: (s := e.open([1]), e.stub.AppendTokens, pb.AppendTokensRequest(session_id=e.session, seq_ids=[s], num_token_ids=[3], token_ids=[1, 2]), pb.SessionRequest(session_id=e.session, append=pb.StepAppend(seq_ids=[s], num_token_ids=[3], token_ids=packed([1, 2]))))[1:], "append"),
    ("zero children", lambda e: (s := e.open([1]), e.stub.ForkSequence, pb.ForkSequenceRequest(session_id=e.session, seq_id=s, num_children=0), pb.SessionRequest(session_id=e.session, forks=[pb.StepFork(seq_id=s, num_children=0)]))[1:], "forks[0]"),
    ("too many children", lambda e: (s := e.open([1]), e.stub.ForkSequence, pb.ForkSequenceRequest(session_id=e.session, seq_id=s, num_children=9), pb.SessionRequest(session_id=e.session, forks=[pb.StepFork(seq_id=s, num_children=9)]))[1:], "forks[0]"),
    ("out of blocks", lambda e: (e.stub.OpenSequences, pb.OpenSequencesRequest(pool="tiny", session_id=e.session, prompts=[pb.Prompt(token_ids=list(range(100)))]), pb.SessionRequest(pool="tiny", session_id=e.session, opens=[pb.StepOpen(token_ids=packed(list(range(100))))])), "opens"),
    ("cache an unknown sequence", lambda e: (e.stub.CacheSequence, pb.CacheSequenceRequest(session_id=e.session, seq_id=987654), pb.SessionRequest(session_id=e.session, cache_seq_ids=[987654])), "caches[0]"),
    ("release twice in one batch", lambda e: (s := e.open([5]), e.stub.ReleaseSequences, pb.ReleaseSequencesRequest(session_id=e.session, seq_ids=[s, s]), pb.SessionRequest(session_id=e.session, releases=[pb.StepRelease(seq_ids=[s, s])]))[1:], "releases[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("build", "item"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_step_gets_the_unary_status_and_changes_nothing(ends: Ends, debug, build, item) -> None:  # type: ignore[no-untyped-def]
    rpc, unary_request, step = build(ends)
    live = {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")}
    code, reason, metadata = ends.unary_refusal(rpc, unary_request)
    response = ends.step(step)
    assert response.HasField("error") and not response.opened and not response.HasField("appended")
    error = response.error
    step_metadata = dict(error.metadata)
    if item is not None:
        assert step_metadata.pop("item") == item
    assert (error.code, error.reason, step_metadata) == (code.value[0], reason, metadata)
    assert {pool: debug.check(pool).num_live_sequences for pool in ("default", "tiny")} == live
    # The stream carries on: the next step (binding the session if the bad one could not) is served.
    ok = ends.step(pb.SessionRequest(session_id=ends.session))
    assert not ok.HasField("error") and ok.session_id == ends.session


def test_bytes_that_are_not_a_step_get_the_unary_status_in_band(server, debug) -> None:  # type: ignore[no-untyped-def]
    garbage = b"\xff\xff\xff"
    with grpc.insecure_channel(server.address) as channel:
        unary = channel.unary_unary("/radixkv.v1.KVCache/OpenSequences")
        with pytest.raises(grpc.RpcError) as caught:
            unary(garbage, timeout=patient(10))
        status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
        info = error_details_pb2.ErrorInfo()
        assert status is not None and status.details[0].Unpack(info)
        stream = channel.stream_stream(
            "/radixkv.v1.KVCache/Session", response_deserializer=pb.SessionResponse.FromString
        )
        responses = list(stream(iter([garbage, garbage]), timeout=patient(10)))
    assert len(responses) == 2  # the stream stayed open for the second message
    for response in responses:
        assert response.error.code == caught.value.code().value[0] == Code.INVALID_ARGUMENT.value[0]  # type: ignore[attr-defined]
        assert (response.error.reason, dict(response.error.metadata)) == (info.reason, dict(info.metadata))
    debug.check()


def test_a_stream_serves_one_session(ends: Ends) -> None:
    assert not ends.step(pb.SessionRequest(session_id=ends.session)).HasField("error")
    response = ends.step(pb.SessionRequest(session_id=ends.other))
    assert (response.error.code, response.error.reason, response.error.metadata["field"]) == (
        Code.INVALID_ARGUMENT.value[0],
        "INVALID_ARGUMENT",
        "session_id",
    )


def test_quota_and_namespaces_hold_on_the_stream_as_on_unary(auth_server, auth_debug, tls_files, tokens) -> None:  # type: ignore[no-untyped-def]
    cert = str(tls_files[0])
    with RadixKVClient(auth_server.address, token=tokens["acme"], tls_root_cert=cert) as client:  # 8-block quota
        seq = client.step(Step(opens=[(list(range(12)), "chat")])).opened[0].seq_id  # 3 blocks
        refusals = []
        for attempt in (
            lambda: client.step(Step(forks=[(seq, 2)])),  # 3 + 2 * 3 blocks > 8
            lambda: client.fork(seq, 2),
            lambda: client.step(Step(opens=[(list(range(20)), "chat"), (list(range(4)), "code")])),  # 3 + 5 + 1 > 8
            lambda: client.open_many([(list(range(20)), "chat"), (list(range(4)), "code")]),
            lambda: client.step(Step(opens=[([1, 2], "not-ours")])),
            lambda: client.open([1, 2], "not-ours"),
        ):
            with pytest.raises((QuotaExceeded, PermissionDenied)) as caught:
                attempt()
            refusals.append(caught.value)
        for by_stream, by_unary in zip(refusals[::2], refusals[1::2], strict=True):
            assert type(by_stream) is type(by_unary)
            item = by_stream.metadata.pop("item")
            assert item in ("forks[0]", "opens") and by_stream.metadata == by_unary.metadata
        assert client.step(Step(forks=[(seq, 1)])).forked[0]  # 6 blocks: within the quota
        assert client.stats().num_live_sequences >= 2
    auth_debug.check()
