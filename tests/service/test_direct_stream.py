"""The blocking client's Session stream driven on gRPC's core call (client/direct_stream.py), and its fallback.

Where gRPC has the core call API, the blocking client drives its stream from the threads that submit
and wait, with no thread of gRPC's own per stream; both kinds must end alike: a stream the server
refuses raises the unary call's exception, a closed one fails what is in flight and leaves nothing
behind, and threads sharing one client each get their own results.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.direct_stream import DirectStepStream
from radixkv.client.step_stream import StepStream
from radixkv.errors import LimitExceeded
from radixkv.sequences.step import Append, Step
from radixkv.server.process import ServerProcess


def test_the_blocking_client_drives_its_stream_with_no_thread_of_its_own(server: ServerProcess) -> None:
    before = {t.ident for t in threading.enumerate()}
    with RadixKVClient(server.address) as client:
        opened = client.step(Step(opens=[([1, 2, 3, 4, 5], "direct")]))
        assert isinstance(client._steps, DirectStepStream), "this gRPC has the core call API: it must be used"
        seq_id = opened.opened[0].seq_id
        for token in range(6, 30):
            client.step(Step(append=Append([seq_id], [1], [token])))
        table = client.block_table(seq_id)  # followed from each step's result: 29 tokens in blocks of 4
        assert len(table) == 8 and table[:2] == opened.opened[0].block_table.tolist()
        assert client.num_tokens(seq_id) == 29
        new = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not [name for name in new if "consume_request_iterator" in name or "channel_spin" in name], new
        client.step(Step(releases=[([seq_id], False)]))


def test_submitted_steps_leave_together_when_a_caller_waits(server: ServerProcess, debug) -> None:  # type: ignore[no-untyped-def]
    """Submitting queues; the first wait writes everything queued as one frame, each step still answered alone."""
    with RadixKVClient(server.address) as client:
        client.step(Step())
        stream = client._steps
        assert isinstance(stream, DirectStepStream)
        written: list[int] = []
        original = stream._write_queued

        def counting() -> None:
            written.append(len(stream._outbox))  # steps queued when a message leaves (it takes up to a frame)
            original()

        stream._write_queued = counting  # type: ignore[method-assign]
        futures = [client.submit(Step(opens=[([300, i, 1], "gather")])) for i in range(7)]
        assert written == [] and len(stream._outbox) == 7, "nothing leaves before a caller waits"
        opened = [f.result().opened[0].seq_id for f in futures]
        assert written == [7], "the seven left in one frame"
        assert len(set(opened)) == 7 and not stream._outbox and not stream._frame_sizes
        assert [len(client.block_table(s)) for s in opened] == [1] * 7
        lone = client.step(Step(opens=[([301, 1], "gather")])).opened[0].seq_id  # a lone step leaves at once
        assert written == [7, 1]
        client.step(Step(releases=[([*opened, lone], False)]))
    debug.check()


def test_a_lone_step_is_written_and_read_in_one_batch_and_pipelined_ones_are_not(server: ServerProcess, debug) -> None:  # type: ignore[no-untyped-def]
    """A step that is the only one unanswered leaves as one batch with its read (one completion to take); a
    frame with others behind it, or steps still unanswered, writes alone so that the next frame can follow."""
    with RadixKVClient(server.address) as client:
        client.step(Step())
        stream = client._steps
        assert isinstance(stream, DirectStepStream)
        batches: list[tuple[str, int]] = []  # (tag, operations in the batch)
        original = stream._start

        def recording(operations: tuple[Any, ...], tag: str) -> None:
            batches.append((tag, len(operations)))
            original(operations, tag)

        stream._start = recording  # type: ignore[method-assign]
        seq_id = client.step(Step(opens=[([400, 1, 2], "exchange")])).opened[0].seq_id
        for token in range(3):
            client.step(Step(append=Append([seq_id], [1], [token])))
        assert batches == [("exchange", 2)] * 4
        batches.clear()
        futures = [client.submit(Step(append=Append([seq_id], [1], [token]))) for token in range(3)]
        assert [f.result().appended.num_tokens for f in futures] == [[7], [8], [9]]  # type: ignore[union-attr]
        assert batches[:2] == [("write", 1), ("read", 1)]
        assert client.num_tokens(seq_id) == 9 and len(client.block_table(seq_id)) == 3  # blocks of 4
        client.step(Step(releases=[([seq_id], False)]))
    debug.check()


def test_a_channel_without_the_core_call_api_keeps_the_public_stream(server: ServerProcess) -> None:
    class Passing(grpc.StreamStreamClientInterceptor):
        def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
            return continuation(details, requests)

    with grpc.insecure_channel(server.address) as channel:
        intercepted = grpc.intercept_channel(channel, Passing())
        assert DirectStepStream.open(intercepted, None, lambda *a: None, lambda *a: None) is None
        direct = DirectStepStream.open(channel, None, lambda *a: None, lambda *a: None)
        assert direct is not None
        direct.close()  # cancelled and drained: the channel then closes at once


def test_a_stream_the_server_refuses_raises_the_unary_exception(start_server, blocking_stream) -> None:  # type: ignore[no-untyped-def]
    srv = start_server("--max-session-streams", "1")
    with RadixKVClient(srv.address) as holder, RadixKVClient(srv.address) as refused:
        holder.step(Step())  # the one stream allowed
        with pytest.raises(LimitExceeded) as caught:  # from the ErrorInfo in the stream's trailing metadata
            refused.step(Step())
        assert caught.value.limit == "max_session_streams"
        holder._drop_stream()  # the slot is free once the server sees that stream end
        deadline = time.monotonic() + 10
        while True:
            try:
                assert refused.step(Step()).opened == []
                break
            except LimitExceeded:
                assert time.monotonic() < deadline, "the stream slot was never given back"
                time.sleep(0.05)
        assert type(refused._steps) is (DirectStepStream if blocking_stream == "direct" else StepStream)


def test_closing_a_stream_with_a_step_in_flight_fails_it_and_the_next_step_reopens(
    server: ServerProcess, debug, blocking_stream: str
) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        future = client.submit(Step(opens=[([7, 7, 7, 7, 7], "direct-close")]))
        client._drop_stream()
        try:
            seq_ids = [r.seq_id for r in future.result().opened]  # answered before the cancel reached it
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
            seq_ids = []
        again = client.step(Step(opens=[([7, 7, 7, 7, 8], "direct-close")]))
        client.step(Step(releases=[(seq_ids + [again.opened[0].seq_id], False)]))
    debug.check()


def test_threads_sharing_one_client_each_get_their_own_results(
    server: ServerProcess, debug, blocking_stream: str
) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []
    with RadixKVClient(server.address) as client:

        def work(k: int) -> None:
            try:
                for i in range(30):
                    prompt = [1000 + k, i, 1, 2, 3]
                    seq_id = client.step(Step(opens=[(prompt, f"threads-{k}")])).opened[0].seq_id
                    grown = client.step(Step(append=Append([seq_id], [2], [k, i])))
                    assert grown.appended is not None and grown.appended.num_tokens == [7]
                    assert client.num_tokens(seq_id) == 7
                    client.step(Step(releases=[([seq_id], False)]))
            except BaseException as e:  # noqa: BLE001 -- reported by the test thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert all(not t.is_alive() for t in threads)
    debug.check()
