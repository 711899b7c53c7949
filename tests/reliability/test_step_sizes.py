"""Nothing applied that the caller is told failed (issue 32 item 1): a response too large to send is refused first.

The attacks, against a server process with a 1 MiB message limit: a Session append whose answer
(8 bytes of slot per token) is over the limit; a frame of three opens that each fit alone but not
together in the frame's one response; a Resume whose answer (a slot per token to recompute) is over
the limit. Before: the append was applied while the client got RESOURCE_EXHAUSTED, the frame opened
three sequences the client never learned of, and the stream ended. Now each is refused, naming
`max_message_bytes`, before anything applies, and the stream stays open.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import LimitExceeded, SequencePreempted
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc
from tests.reliability.conftest import Debug, ServerProcess

MAX_MESSAGE_BYTES = 1 << 20
MAX_TOKENS = 1 << 18
POOL = (
    f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=16,num_blocks={MAX_TOKENS // 4},dtype=float16,"
    f"max_tokens_per_request={MAX_TOKENS}"
)
FLAGS = ["--pool", POOL, "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-session-ttl", "300", "--debug-rpc"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(FLAGS, tmp_path_factory.mktemp("step-sizes") / "server.log")
    yield proc
    assert proc.stop() == 0


class Stream:
    """A raw Session stream: one message written, one read, in turn."""

    def __init__(self, channel: grpc.Channel, session_id: str) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._responses = kvcache_pb2_grpc.KVCacheStub(channel).Session(iter(self._requests.get, None), timeout=120)
        self.session_id = session_id

    def send(self, request: pb.SessionRequest) -> pb.SessionResponse:
        (request.steps[0] if request.steps else request).session_id = self.session_id  # a frame sets nothing else
        self._requests.put(request)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._responses) == []


def _tokens(n: int, first: int = 1) -> bytes:
    return (np.arange(n, dtype=np.int32) % 30_000 + first).tobytes()


def _live(stub: kvcache_pb2_grpc.KVCacheStub, session_id: str) -> int:
    return int(stub.Stats(pb.StatsRequest(session_id=session_id), timeout=patient(30)).stats.num_live_sequences)


@pytest.fixture
def session(server: ServerProcess) -> Iterator[tuple[kvcache_pb2_grpc.KVCacheStub, Stream]]:
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        session_id = stub.OpenSession(pb.OpenSessionRequest(), timeout=patient(30)).session_id
        stream = Stream(channel, session_id)
        yield stub, stream
        stream.close()
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=patient(30))
    debug = Debug(server.address)
    debug.check()
    debug.close()


def test_an_append_whose_answer_cannot_be_sent_is_refused_before_it_applies(session) -> None:  # type: ignore[no-untyped-def]
    stub, stream = session
    opened = stream.send(pb.SessionRequest(opens=[pb.StepOpen(token_ids=_tokens(1))])).opened[0]
    num = 200_000  # within max_tokens_per_request; its slots alone are 1.6 MB of answer
    append = pb.StepAppend(seq_ids=[opened.seq_id], num_token_ids=[num], token_ids=_tokens(num))
    refused = stream.send(pb.SessionRequest(append=append)).error
    assert (refused.reason, refused.metadata["limit"], refused.metadata["item"]) == (
        "LIMIT_EXCEEDED",
        "max_message_bytes",
        "append",
    )
    described = pb.DescribeSequencesRequest(session_id=stream.session_id, seq_ids=[opened.seq_id])
    assert list(stub.DescribeSequences(described, timeout=patient(30)).num_tokens) == [1], (
        "the refused append was applied"
    )
    fits = pb.StepAppend(seq_ids=[opened.seq_id], num_token_ids=[50_000], token_ids=_tokens(50_000))
    assert not stream.send(pb.SessionRequest(append=fits)).HasField("error"), "the stream goes on"
    assert list(stub.DescribeSequences(described, timeout=patient(30)).num_tokens) == [50_001]


def test_a_frame_whose_answers_do_not_fit_one_message_opens_only_what_it_answers(session) -> None:  # type: ignore[no-untyped-def]
    """Three opens of 60k tokens: each answer (~720 KB) fits the 1 MiB message alone, two do not. The first is
    opened and answered; the others are refused before they open anything, in the same frame."""
    stub, stream = session
    steps = [pb.SessionRequest(request_id=i + 1, opens=[pb.StepOpen(token_ids=_tokens(60_000, i))]) for i in range(3)]
    answers = stream.send(pb.SessionRequest(steps=steps)).steps
    assert [a.request_id for a in answers] == [1, 2, 3]
    assert len(answers[0].opened) == 1 and len(answers[0].opened[0].slots) == 8 * 60_000
    for refused in answers[1:]:
        assert (refused.error.reason, refused.error.metadata["limit"]) == ("LIMIT_EXCEEDED", "max_message_bytes")
    assert _live(stub, stream.session_id) == 1, "a refused open of the frame opened a sequence"
    again = stream.send(pb.SessionRequest(request_id=2, opens=[pb.StepOpen(token_ids=_tokens(60_000, 1))]))
    assert len(again.opened) == 1, "alone, the refused open fits: it was refused, not applied (its id is free)"


def test_a_resume_whose_answer_cannot_be_sent_is_refused_and_the_sequence_stays_preempted(server) -> None:  # type: ignore[no-untyped-def]
    """A sequence grown by appends that each fit, preempted by recompute: resuming it answers a slot per token."""
    with RadixKVClient(server.address, max_message_bytes=64 << 20) as client:
        seq_id = client.open(np.arange(40_000, dtype=np.int32) % 30_000 + 1).seq_id
        for _ in range(5):
            client.append(seq_id, np.ones(40_000, dtype=np.int32))
        client.preempt([seq_id], "recompute")
        with pytest.raises(LimitExceeded) as refused:
            client.resume(seq_id)
        assert refused.value.limit == "max_message_bytes"
        assert client.num_tokens(seq_id) == 240_000
        with pytest.raises(SequencePreempted):  # still preempted: nothing was resumed
            client.append(seq_id, [1])
        client.release(seq_id, cache=False)
