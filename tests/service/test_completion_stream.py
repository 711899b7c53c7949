"""A stream answered on gRPC's completion-queue thread (server/completion_stream.py), on a real in-process server.

The driver must answer every request in order, once, with the response gRPC would have sent (the
first one carrying the initial metadata); hand large requests to the handler thread; end the
handler when the client half-closes or cancels; and end the call with a bug's error, not hang.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import RadixKVError
from radixkv.sequences.step import Append, Step
from radixkv.server.app import build_pool
from radixkv.server.completion_stream import INLINE_MAX_BYTES, CompletionStream
from radixkv.server.config import ServerConfig, parse_pool_flag
from radixkv.server.decoding import Undecodable
from radixkv.server.service import KVService
from radixkv.server.session_stream import SessionStreams
from radixkv.server.tenants import ANONYMOUS
from radixkv.v1 import kvcache_pb2 as pb

METHOD = "/test.Echo/Session"


class Echo:
    """Answers each request with its id, noting where it was answered; a request id of 13 is a server bug."""

    def __init__(self) -> None:
        self.answered: list[tuple[int, str]] = []  # (request id, thread)
        # Request ids whose timings were kept, after their response left. Not in order: a large request's are kept
        # on the handler thread once its response is sent, when the next request may already be answered inline.
        self.kept: list[int] = []
        self.attached: list[bool] = []
        self.ended = threading.Event()

    def respond(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, Any]:
        assert isinstance(request, pb.SessionRequest)
        if request.request_id == 13:
            raise RuntimeError("a bug")
        self.answered.append((request.request_id, threading.current_thread().name))
        response = pb.SessionResponse(request_id=request.request_id, num_released_sequences=len(request.opens))
        return response, lambda: self.kept.append(request.request_id)

    def behaviour(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.SessionResponse]:
        try:
            driver = CompletionStream.attach(requests, self.respond)
            self.attached.append(driver is not None)
            assert driver is not None, "this gRPC has the internals the driver uses"
            self.handler_thread = threading.current_thread().name
            driver.run()
            return iter(())
        finally:
            self.ended.set()


@pytest.fixture
def echo() -> Iterator[tuple[Echo, grpc.Channel]]:
    servicer = Echo()
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.behaviour, request_deserializer=pb.SessionRequest.FromString,
        response_serializer=pb.SessionResponse.SerializeToString,
    )  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="echo-handler"))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Session": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, channel
    server.stop(grace=None)


def session(channel: grpc.Channel) -> Any:
    return channel.stream_stream(
        METHOD,
        request_serializer=pb.SessionRequest.SerializeToString,
        response_deserializer=pb.SessionResponse.FromString,
    )


def test_requests_are_answered_in_order_small_ones_off_the_handler_thread(echo) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = echo
    large = pb.StepOpen(token_ids=bytes(INLINE_MAX_BYTES + 4))
    requests = [pb.SessionRequest(request_id=i, opens=[large] * (i == 3)) for i in (1, 2, 3, 4)]
    call = session(channel)(iter(requests), timeout=10)
    assert [r.request_id for r in call] == [1, 2, 3, 4]
    assert call.code() == grpc.StatusCode.OK and call.initial_metadata() is not None
    threads = dict(servicer.answered)
    assert threads[3] == servicer.handler_thread, "a large request is answered on the handler thread"
    assert {threads[i] for i in (1, 2, 4)}.isdisjoint({servicer.handler_thread}), "small ones are answered inline"
    assert servicer.ended.wait(10) and sorted(servicer.kept) == [1, 2, 3, 4], "each request's timings kept once"


def test_an_empty_request_is_answered_not_taken_for_the_streams_end(echo) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = echo
    assert pb.SessionRequest().SerializeToString() == b""
    responses = list(session(channel)(iter([pb.SessionRequest(), pb.SessionRequest(request_id=5)]), timeout=10))
    assert [r.request_id for r in responses] == [0, 5]


def test_a_client_that_cancels_ends_the_handler(echo) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = echo
    gate = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(request_id=1)
        gate.wait(10)  # the stream stays open, the client neither sends nor half-closes

    call = session(channel)(requests(), timeout=10)
    assert next(call).request_id == 1
    call.cancel()
    assert servicer.ended.wait(10), "the handler kept waiting for a stream its client cancelled"
    gate.set()


def test_a_bug_while_answering_ends_the_call_with_an_error(echo) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = echo
    call = session(channel)(iter([pb.SessionRequest(request_id=1), pb.SessionRequest(request_id=13)]), timeout=10)
    assert next(call).request_id == 1
    with pytest.raises(grpc.RpcError) as ended:
        next(call)
    assert ended.value.code() == grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]  # the handler raised
    assert servicer.ended.wait(10)


def test_a_stream_not_from_grpc_is_not_attached() -> None:
    assert CompletionStream.attach(iter([pb.SessionRequest()]), lambda request: (pb.SessionResponse(), None)) is None


def test_a_stream_not_from_grpc_is_answered_from_its_own_thread_with_metrics_after_each_response() -> None:
    """Where the driver cannot attach, `SessionStreams.serve` answers request by request on the calling thread,
    keeping a step's metrics once its response has been taken (sent), and gives its slot back at the end."""
    config = ServerConfig(pools=(parse_pool_flag("default:num_layers=1,num_kv_heads=1,head_dim=4,num_blocks=16"),))
    service = KVService(config, {p.name: build_pool(p, config.watch_queue_size, None) for p in config.pools})
    try:
        session = service.open_session(ANONYMOUS, 60.0)
        opens = pb.SessionRequest(session_id=session.session_id, request_id=1, opens=[pb.StepOpen(token_ids=bytes(12))])
        observed: list[tuple[str, str, grpc.StatusCode]] = []
        streams = SessionStreams()
        responses = streams.serve(
            service, ANONYMOUS, iter([opens, Undecodable("junk")]), lambda m, p, c, s: observed.append((m, p, c))
        )
        first = next(responses)
        assert first.opened[0].num_cached_tokens == 0 and observed == [], "kept once the response is taken"
        refused = next(responses)
        assert refused.error.metadata["field"] == "request"
        assert observed == [("Session", "", grpc.StatusCode.OK)]  # the pool the request named: the default
        assert list(responses) == [] and len(streams) == 0
        assert observed[1:] == [("Session", "", grpc.StatusCode.INVALID_ARGUMENT)]
    finally:
        for pool in service.pools.values():
            pool.close()


def test_a_server_stopping_with_a_session_stream_open_exits_and_the_step_after_fails(start_server) -> None:  # type: ignore[no-untyped-def]
    """The stream's handler waits for completions; a server stopping cancels its call and must not wait on it."""
    proc = start_server("--grace", "1")
    client = RadixKVClient(proc.address)
    seq_id = client.step(Step(opens=[([1, 2, 3, 4, 5], "stopping")])).opened[0].seq_id
    client.step(Step(append=Append([seq_id], [1], [6])))  # the stream is open, its next read in flight
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=30) == 0
    with pytest.raises((RadixKVError, grpc.RpcError)):
        client.step(Step(append=Append([seq_id], [1], [7])))
    client.close()
