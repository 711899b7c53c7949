"""Request ids over real failures (issue 32 item 2): an id returns its own first result or is refused, never twice.

The attacks, against a server process: a hundred steps in flight when the connection drops (the
server applied them all, their answers were lost), re-sent by the client on a new connection; a
retried 1M-token open with the same id (its result is too large to keep); the same id with another
prompt. Before: length 201 instead of 101 (the 64-result window cascaded), a second sequence opened,
the first prompt's result returned for the second. The window itself: tests/service/test_request_window.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.sequences.step import Append, Step
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc
from tests.reliability.conftest import Debug, ServerProcess
from tests.reliability.tcp_proxy import TcpProxy

NUM_IN_FLIGHT = 100
BIG = 1 << 20  # tokens in the large open: its result costs more than a session's whole request window
POOL = f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=16,num_blocks={BIG // 16 + 512},dtype=float16,"
FLAGS = ["--pool", POOL + f"max_tokens_per_request={BIG}", "--max-session-ttl", "300", "--debug-rpc"]
LARGE_MESSAGES = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(FLAGS, tmp_path_factory.mktemp("request-ids") / "server.log")
    yield proc
    assert proc.stop() == 0


@pytest.fixture
def proxy(server: ServerProcess) -> Iterator[TcpProxy]:
    p = TcpProxy(server.address)
    yield p
    p.close()


def _length(stub: kvcache_pb2_grpc.KVCacheStub, session_id: str, seq_id: int) -> int:
    request = pb.DescribeSequencesRequest(session_id=session_id, seq_ids=[seq_id])
    return int(stub.DescribeSequences(request, timeout=patient(30)).num_tokens[0])


def _all_applied(stub: kvcache_pb2_grpc.KVCacheStub, session_id: str, seq_id: int) -> Callable[[], bool]:
    return lambda: _length(stub, session_id, seq_id) == 1 + NUM_IN_FLIGHT


def test_steps_in_flight_when_the_connection_drops_are_answered_not_applied_again(
    server: ServerProcess, proxy: TcpProxy, wait_until
) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(proxy.address) as client, grpc.insecure_channel(server.address) as direct:
        stub = kvcache_pb2_grpc.KVCacheStub(direct)
        seq_id = client.step(Step(opens=[([1], "dropped")])).opened[0].seq_id
        proxy.hold()  # the steps reach the server; their answers never come back
        futures = [client.submit(Step(append=Append([seq_id], [1], [i]))) for i in range(NUM_IN_FLIGHT)]
        assert wait_until(_all_applied(stub, client.session_id, seq_id), timeout=60), "the server applied them all"
        broken = client._steps._stream
        proxy.drop()  # the connection fails: every step is unanswered, and re-sent on a new one
        lengths = [f.result().appended.num_tokens for f in futures]  # type: ignore[union-attr]
        assert lengths == [[2 + i] for i in range(NUM_IN_FLIGHT)], "each re-sent step answers its own first result"
        assert client._steps._stream is not broken, "the steps were re-sent on a new stream"
        assert _length(stub, client.session_id, seq_id) == 1 + NUM_IN_FLIGHT, "a re-sent step applied again"
        table = client.block_table(seq_id)
        assert len(table) == -(-(1 + NUM_IN_FLIGHT) // 16), "the block table followed each step once"
        client.step(Step(releases=[([seq_id], False)]))
    debug = Debug(server.address)
    debug.check()
    debug.close()


def test_async_steps_in_flight_when_the_connection_drops_are_answered_not_applied_again(
    server: ServerProcess, proxy: TcpProxy, wait_until
) -> None:  # type: ignore[no-untyped-def]
    async def run() -> tuple[list[list[int]], int, str, int]:
        async with AsyncRadixKVClient(proxy.address) as client:
            seq_id = (await client.step(Step(opens=[([1], "dropped-aio")]))).opened[0].seq_id
            proxy.hold()
            steps = [
                asyncio.ensure_future(client.step(Step(append=Append([seq_id], [1], [i]))))
                for i in range(NUM_IN_FLIGHT)
            ]
            await asyncio.sleep(0)  # they are written
            with grpc.insecure_channel(server.address) as direct:
                stub = kvcache_pb2_grpc.KVCacheStub(direct)
                applied = await asyncio.to_thread(wait_until, _all_applied(stub, client.session_id, seq_id), 60)
            assert applied, "the server applied them all"
            proxy.drop()
            results = await asyncio.wait_for(asyncio.gather(*steps), 60)
            length = await client.num_tokens(seq_id)
            await client.step(Step(releases=[([seq_id], False)]))
            return [r.appended.num_tokens for r in results], length, client.session_id, seq_id  # type: ignore[union-attr]

    lengths, length, _, _ = asyncio.run(run())
    assert lengths == [[2 + i] for i in range(NUM_IN_FLIGHT)]
    assert length == 1 + NUM_IN_FLIGHT, "a re-sent step applied again"


def test_a_retried_large_open_is_refused_not_opened_twice(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address, LARGE_MESSAGES) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        session_id = stub.OpenSession(pb.OpenSessionRequest(), timeout=patient(30)).session_id
        prompt = pb.Prompt(token_ids=np.arange(BIG, dtype=np.int64) % 50_000 + 7)
        request = pb.OpenSequencesRequest(session_id=session_id, prompts=[prompt], request_id=77)
        first = stub.OpenSequences(request, timeout=120).sequences[0]
        with pytest.raises(grpc.RpcError) as retried:  # as a client retrying after a lost answer
            stub.OpenSequences(request, timeout=120)
        assert retried.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        stats = stub.Stats(pb.StatsRequest(session_id=session_id), timeout=patient(30)).stats
        assert stats.num_live_sequences == 1, "the retry opened a second sequence"
        small = pb.OpenSequencesRequest(session_id=session_id, prompts=[pb.Prompt(token_ids=[1, 2, 3])], request_id=78)
        opened = stub.OpenSequences(small, timeout=patient(30)).sequences[0]
        assert stub.OpenSequences(small, timeout=patient(30)).sequences[0] == opened, "a kept result answers its retry"
        other = pb.OpenSequencesRequest(session_id=session_id, prompts=[pb.Prompt(token_ids=[4, 5, 6])], request_id=78)
        with pytest.raises(grpc.RpcError) as reused:  # the same id, another prompt: refused, not the first's result
            stub.OpenSequences(other, timeout=patient(30))
        assert reused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert stub.Stats(pb.StatsRequest(session_id=session_id), timeout=patient(30)).stats.num_live_sequences == 2
        stub.ReleaseSequences(
            pb.ReleaseSequencesRequest(session_id=session_id, seq_ids=[first.seq_id, opened.seq_id], cache=False),
            timeout=60,
        )
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=patient(30))
    debug = Debug(server.address)
    debug.check()
    debug.close()
