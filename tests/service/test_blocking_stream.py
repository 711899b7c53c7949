"""The blocking client's Session stream (client/session/step_stream.py), on gRPC's public stream API.

A stream the server refuses raises the unary call's exception, a closed one fails what is in flight
and leaves nothing behind, threads sharing one client each get their own results, and no more than
MAX_IN_FLIGHT steps are ever unanswered (what a broken stream re-sends stays inside the server's window).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.session.pipeline import MAX_IN_FLIGHT
from radixkv.errors import LimitExceeded
from radixkv.sequences.step import Append, Step
from radixkv.server.process.spawn import ServerProcess
from radixkv.server.rules.sessions import DEFAULT_MAX_RESULTS


# type: ignore[no-untyped-def]
def test_the_blocking_client_keeps_at_most_max_in_flight_steps_unanswered(server: ServerProcess, debug) -> None:
    """A client submitting more steps than MAX_IN_FLIGHT reads the oldest answers first: what a broken stream
    would re-send never outgrows what the server's request window keeps."""
    with RadixKVClient(server.address) as client:
        seq_id = client.step(Step(opens=[([1, 2, 3, 4, 5], "in-flight")])).opened[0].seq_id
        most = 0
        futures = []
        for token in range(MAX_IN_FLIGHT + 40):
            futures.append(client.submit(Step(append=Append([seq_id], [1], [token]))))
            most = max(most, len(client._steps._stream._in_flight))  # type: ignore[union-attr]
        assert most == MAX_IN_FLIGHT, most
        # type: ignore[union-attr]
        assert [f.result().appended.num_tokens for f in futures][-1] == [5 + MAX_IN_FLIGHT + 40]
        assert client.num_tokens(seq_id) == 5 + MAX_IN_FLIGHT + 40
        client.step(Step(releases=[([seq_id], False)]))
    debug.check()


def test_the_server_keeps_more_results_than_a_client_keeps_unanswered() -> None:
    assert DEFAULT_MAX_RESULTS >= 2 * MAX_IN_FLIGHT


# type: ignore[no-untyped-def]
def test_a_stream_the_server_refuses_raises_the_unary_exception(start_server, wait_until) -> None:
    srv = start_server("--max-session-streams", "1")
    with RadixKVClient(srv.address) as holder, RadixKVClient(srv.address) as refused:
        holder.step(Step())  # the one stream allowed
        with pytest.raises(LimitExceeded) as caught:  # from the ErrorInfo in the stream's trailing metadata
            refused.step(Step())
        assert caught.value.limit == "max_session_streams"
        holder._steps.close()  # the slot is free once the server sees that stream end

        def stepped() -> bool:
            try:
                return refused.step(Step()).opened == []
            except LimitExceeded:
                return False

        assert wait_until(stepped, timeout=60), "the stream slot was never given back"


def test_closing_a_stream_with_a_step_in_flight_fails_it_and_the_next_step_reopens(
    server: ServerProcess, debug
) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        future = client.submit(Step(opens=[([7, 7, 7, 7, 7], "direct-close")]))
        client._steps.close()
        try:
            seq_ids = [r.seq_id for r in future.result().opened]  # answered before the cancel reached it
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
            seq_ids = []
        again = client.step(Step(opens=[([7, 7, 7, 7, 8], "direct-close")]))
        client.step(Step(releases=[(seq_ids + [again.opened[0].seq_id], False)]))
    debug.check()


# type: ignore[no-untyped-def]
def test_threads_sharing_one_client_each_get_their_own_results(server: ServerProcess, debug) -> None:
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
