"""Steps pipelined on the Session stream: many in flight, frames of queued steps, each step as if alone.

A pipelined script must give what the same script gives one step at a time (the order is the
stream's, so a later step sees what the earlier ones did), a refused step must leave the steps
around it alone, a frame must be answered step by step, and steps whose stream broke are re-sent
once on a new stream without being applied twice.
"""

from __future__ import annotations

import asyncio
import queue

import grpc
import numpy as np
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.client.session.pipeline import StreamEnded, answers
from radixkv.client.session.step_stream import StepStream
from radixkv.errors import InvalidArgument, RadixKVError, UnknownSequence
from radixkv.sequences.step import Append, Step, StepResult
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

PROMPT = list(range(900, 912))  # three blocks of 4


def _shape(outcome: StepResult | RadixKVError) -> object:
    """What must agree between two runs of one script (block ids may differ)."""
    if isinstance(outcome, RadixKVError):
        return (outcome.reason, outcome.metadata.get("item"))
    opened = [(o.num_cached_tokens, len(o.block_table), len(o.slots)) for o in outcome.opened]
    appended = None if outcome.appended is None else (outcome.appended.num_tokens, outcome.appended.num_block_ids)
    return opened, appended, outcome.num_cached_tokens, outcome.num_released_sequences


def _outcomes(client: RadixKVClient, steps: list[Step], pipelined: bool) -> list[StepResult | RadixKVError]:
    outcomes: list[StepResult | RadixKVError] = []
    futures = [client.submit(step) for step in steps] if pipelined else []
    for i, step in enumerate(steps):
        try:
            outcomes.append(futures[i].result() if pipelined else client.step(step))
        except RadixKVError as e:
            outcomes.append(e)
    return outcomes


def _script(client: RadixKVClient, namespace: str, pipelined: bool) -> list[object]:
    """Opens, then steps on what they opened (each step sees the ones before it), with refusals between."""
    first = _outcomes(
        client,
        [
            Step(opens=[(PROMPT, namespace)]),
            Step(opens=[([], namespace)]),  # refused: empty prompt
            Step(opens=[(PROMPT[:8] + [1, 2, 3], namespace)]),
        ],
        pipelined,
    )
    a, b = (r.opened[0].seq_id for r in (first[0], first[2]) if isinstance(r, StepResult))
    second = _outcomes(
        client,
        [
            Step(append=Append([a], [1], np.array([5], dtype=np.int32))),
            Step(releases=[([a], True)]),  # caches a's three full blocks, as the open below sees
            Step(opens=[(PROMPT + [7], namespace)]),
            Step(releases=[([a], True)]),  # refused: released by the step before last
            Step(releases=[([b], False)]),
        ],
        pipelined,
    )
    last = second[2]
    assert isinstance(last, StepResult)
    client.step(Step(releases=[([last.opened[0].seq_id], False)]))
    return [_shape(o) for o in (*first, *second)]


# type: ignore[no-untyped-def]
def test_pipelined_steps_give_what_the_same_steps_give_one_at_a_time(server, debug) -> None:
    with RadixKVClient(server.address) as client:
        alone = _script(client, "pipe-alone", pipelined=False)
        pipelined = _script(client, "pipe-pipelined", pipelined=True)
        assert pipelined == alone
        assert alone[1] == ("INVALID_ARGUMENT", "opens") and alone[6] == ("UNKNOWN_SEQUENCE", "releases[0]")
        assert alone[5][0] == [(12, 4, 1)], "the open after the release hit the three blocks it cached"
        assert client.stats().num_live_sequences == 0
    debug.check()


def test_many_steps_in_flight_keep_block_tables_in_order(server, debug) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        opens = [client.submit(Step(opens=[([300 + i, 1, 2], "pipe-tables")])) for i in range(40)]
        ids = [f.result().opened[0].seq_id for f in opens]
        assert len(set(ids)) == 40
        appends = [client.submit(Step(append=Append(ids, [2] * 40, np.full(80, i, np.int32)))) for i in range(3)]
        results = [f.result() for f in appends]
        assert [r.appended.num_tokens[0] for r in results if r.appended is not None] == [5, 7, 9]
        for seq_id in ids:  # 9 tokens in blocks of 4: the tables grew in order, through every result
            assert len(client.block_table(seq_id)) == 3
        assert client.submit(Step(releases=[(ids, False)])).result().num_released_sequences == 40
        with pytest.raises(UnknownSequence):
            client.block_table(ids[0])
    debug.check()


def test_a_frame_is_answered_step_by_step(server, debug) -> None:  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(server.address)
    stub = kvcache_pb2_grpc.KVCacheStub(channel)
    session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
    responses = stub.Session(iter(requests.get, None), timeout=60)

    def send(request: pb.SessionRequest) -> pb.SessionResponse:
        requests.put(request)
        return next(responses)

    def opening(request_id: int, token_ids: list[int]) -> pb.SessionRequest:
        tokens = np.asarray(token_ids, dtype="<i4").tobytes()
        return pb.SessionRequest(request_id=request_id, opens=[pb.StepOpen(token_ids=tokens, namespace="frame")])

    frame = pb.SessionRequest(
        steps=[
            _with_session(opening(7, [60, 61, 62]), session),
            opening(8, []),  # refused alone: an empty prompt
            opening(9, [70, 71]),
        ]
    )
    answered = send(frame)
    assert [r.request_id for r in answered.steps] == [7, 8, 9]
    assert [r.HasField("error") for r in answered.steps] == [False, True, False]
    assert (answered.steps[1].error.reason, answered.steps[1].error.metadata["item"]) == ("INVALID_ARGUMENT", "opens")
    again = send(frame)  # re-sent: answered from the request window, nothing opened twice
    assert [r.opened[0].seq_id for r in (again.steps[0], again.steps[2])] == [
        r.opened[0].seq_id for r in (answered.steps[0], answered.steps[2])
    ]
    mixed = send(pb.SessionRequest(pool="default", steps=[opening(10, [80]), opening(11, [81])]))
    assert [(r.error.reason, r.error.metadata["field"]) for r in mixed.steps] == [("INVALID_ARGUMENT", "steps")] * 2
    nested = send(pb.SessionRequest(steps=[pb.SessionRequest(steps=[opening(12, [82])]), opening(13, [83])]))
    assert nested.steps[0].error.metadata["field"] == "steps[0].steps" and not nested.steps[1].HasField("error")
    ids = [answered.steps[0].opened[0].seq_id, answered.steps[2].opened[0].seq_id, nested.steps[1].opened[0].seq_id]
    done = send(pb.SessionRequest(releases=[pb.StepRelease(seq_ids=ids, cache=False)]))
    assert done.num_released_sequences == 3, "the stream carried on after every refusal"
    requests.put(None)
    assert list(responses) == []
    stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    channel.close()
    debug.check()


def test_a_frame_answered_as_one_step_is_refused_not_taken_for_results() -> None:
    lone = pb.SessionResponse(request_id=0)  # what a server from before frames answers to a frame: one empty step
    assert [r.error.reason for r in answers(lone, 3)] == ["FAILED_PRECONDITION"] * 3
    assert answers(lone, 1) == [lone]
    refused = pb.SessionResponse(error=pb.StepError(reason="INVALID_ARGUMENT"))  # a frame that did not parse
    assert answers(refused, 2) == [refused, refused]
    framed = pb.SessionResponse(steps=[pb.SessionResponse(request_id=i) for i in (1, 2)])
    assert [r.request_id for r in answers(framed, 2)] == [1, 2]


def _with_session(request: pb.SessionRequest, session_id: str) -> pb.SessionRequest:
    request.session_id = session_id
    return request


def _lose_connection(stream: StepStream | None) -> None:
    """As a stream ended under its steps: it fails UNAVAILABLE with every step unanswered, sent or not (a real
    dropped connection: tests/reliability/test_request_ids.py)."""
    assert isinstance(stream, StepStream)
    stream._fail(StreamEnded())


# type: ignore[no-untyped-def]
def test_steps_of_a_broken_stream_are_resent_once_and_applied_once(server, debug) -> None:
    with RadixKVClient(server.address) as client:
        before = client.stats().num_opened_sequences
        futures = [client.submit(Step(opens=[([400 + i, 5], "pipe-broken")])) for i in range(6)]
        stream = client._steps._stream
        _lose_connection(stream)
        ids = [f.result().opened[0].seq_id for f in futures]
        assert client._steps._stream is not stream and len(set(ids)) == 6
        assert client.stats().num_opened_sequences == before + 6, "a re-sent step was applied twice"
        assert [len(client.block_table(s)) for s in ids] == [1] * 6
        client.step(Step(releases=[(ids, False)]))
    debug.check()


def test_queued_steps_too_large_for_one_message_leave_in_several(server, debug) -> None:  # type: ignore[no-untyped-def]
    """Six 280 KB prompts queued together would be a 1.7 MB frame, over the server's 1 MiB message limit."""
    with RadixKVClient(server.address) as client:
        prompts = [np.full(70_000, i, dtype=np.int32) for i in range(6)]
        futures = [client.submit(Step(opens=[(p, "pipe-large")])) for p in prompts]
        for future in futures:
            with pytest.raises(RadixKVError) as refused:  # refused in-band, each alone: the stream carried them
                future.result()
            assert refused.value.metadata.get("item") == "opens", refused.value
        assert client.step(Step()).opened == [], "the stream is still open"
    debug.check()


@pytest.mark.asyncio
async def test_async_large_steps_leave_in_several_messages(server, debug) -> None:  # type: ignore[no-untyped-def]
    async with AsyncRadixKVClient(server.address) as client:
        steps = [client.step(Step(opens=[(np.full(70_000, i, np.int32), "pipe-large")])) for i in range(6)]
        outcomes = await asyncio.gather(*steps, return_exceptions=True)
        assert all(isinstance(o, RadixKVError) and o.metadata.get("item") == "opens" for o in outcomes), outcomes
        assert (await client.step(Step())).opened == []
    debug.check()


@pytest.mark.asyncio
# type: ignore[no-untyped-def]
async def test_async_steps_awaited_together_are_pipelined_in_call_order(server, debug) -> None:
    async with AsyncRadixKVClient(server.address) as client:
        opened = await asyncio.gather(*(client.step(Step(opens=[([500 + i, 1], "pipe-aio")])) for i in range(24)))
        ids = [r.opened[0].seq_id for r in opened]
        assert len(set(ids)) == 24
        # Called in this order, so applied in this order: the append, then the release of what it grew.
        grown, released, refused = await asyncio.gather(
            client.step(Step(append=Append(ids[:1], [3], np.array([1, 2, 3], dtype=np.int32)))),
            client.step(Step(releases=[(ids[:1], False)])),
            client.step(Step(releases=[(ids[:1], False)])),
            return_exceptions=True,
        )
        assert isinstance(grown, StepResult) and grown.appended is not None and grown.appended.num_tokens == [5]
        assert isinstance(released, StepResult) and released.num_released_sequences == 1
        assert isinstance(refused, UnknownSequence)
        with pytest.raises(InvalidArgument):
            await client.step(Step(opens=[([], "pipe-aio")]))
        assert (await client.step(Step(releases=[(ids[1:], False)]))).num_released_sequences == 23
    debug.check()
