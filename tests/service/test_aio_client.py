"""`AsyncRadixKVClient` against a real server, inside a running event loop (pytest-asyncio, and plain asyncio.run)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.aio import AsyncRadixKVClient
from radixkv.errors import InvalidArgument, OutOfBlocks, UnknownSequence
from radixkv.sequences.step import Append, Commit, Step


@pytest.mark.asyncio
async def test_the_async_client_mirrors_the_blocking_one(server, debug) -> None:  # type: ignore[no-untyped-def]
    before = set(threading.enumerate())  # earlier tests' daemon threads may still be winding down
    async with AsyncRadixKVClient(server.address) as client:
        # gRPC's own poller aside, nothing runs beside the loop (the blocking client renews its lease on a thread).
        assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("radixkv")]
        first = await client.open(list(range(40, 49)), "aio")
        assert first.num_cached_tokens == 0 and len(first.slots) == 9
        [appended] = await client.append_many([(first.seq_id, [7])])
        assert appended.num_tokens == 10 and client.block_table(first.seq_id) == first.block_table.tolist()
        children = await client.fork(first.seq_id, 2)
        assert [client.block_table(c) for c in children] == [client.block_table(first.seq_id)] * 2
        assert await client.cache(first.seq_id) == 8
        await client.release_many([first.seq_id, *children])
        assert await client.match(list(range(40, 49)), "aio") == 8
        again = await client.open(list(range(40, 49)), "aio")
        assert again.num_cached_tokens == 8
        assert await client.pin(list(range(40, 48)), "aio") == 8
        await client.unpin(list(range(40, 48)), "aio")
        stats = await client.stats()
        assert stats.num_live_sequences >= 1
        assert (await client.get_pool()).layout.block_size == 4
        with pytest.raises(UnknownSequence):
            await client.release(first.seq_id)
        with pytest.raises(InvalidArgument):
            await client.open([])
        await client.release(again.seq_id)
    debug.check()


@pytest.mark.asyncio
async def test_async_steps_run_concurrently_with_other_coroutines(server, debug) -> None:  # type: ignore[no-untyped-def]
    async with AsyncRadixKVClient(server.address) as client:
        opened = (
            await client.step(Step(opens=[(list(range(100, 106)), "aio-step"), (list(range(200, 203)), "aio-step")]))
        ).opened
        ids = [o.seq_id for o in opened]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        for i in range(20):
            result = await client.step(Step(append=Append(ids, [1, 1], np.array([i, i], dtype=np.int32))))
            assert result.appended is not None and result.appended.num_tokens == [7 + i, 4 + i]
        task.cancel()
        assert ticks > 0, "the loop ran other coroutines while steps were in flight"
        with pytest.raises(OutOfBlocks) as refused:
            await client.step(Step(opens=[(list(range(5000)), "aio-step")], releases=[(ids, False)]))
        assert refused.value.metadata["item"] == "opens"
        assert (await client.stats()).num_live_sequences >= 2  # the refused step released nothing
        done = await client.step(Step(releases=[(ids, False)]))
        assert done.num_released_sequences == 2
    debug.check()


def test_the_async_client_under_plain_asyncio_run(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[int]:
        client = await AsyncRadixKVClient(server.address).connect()
        try:
            result = await client.step(Step(opens=[([1, 2, 3, 4, 5], "plain")]))
            seq_id = result.opened[0].seq_id
            await client.step(Step(commit=Commit([seq_id], [5]), releases=[([seq_id], True)]))  # the prompt is written
            return [seq_id]
        finally:
            await client.close()

    [seq_id] = asyncio.run(main())
    with RadixKVClient(server.address) as check:  # the session ended with the client
        assert check.match([1, 2, 3, 4, 5], "plain") == 4


@pytest.mark.asyncio
async def test_a_step_cancelled_while_it_writes_leaves_the_others_to_be_resent(server, debug) -> None:  # type: ignore[no-untyped-def]
    """A step's own coroutine writes it; cancelled mid-write, gRPC cancels the stream's call. The steps queued
    behind it are re-sent on a new stream (their request ids keep them from applying twice), not failed."""
    async with AsyncRadixKVClient(server.address) as client:
        await client.step(Step())  # the stream is open
        first_stream = client._steps._stream
        writer = asyncio.create_task(client.step(Step(opens=[([900, 1, 2], "cancel-write")])))
        await asyncio.sleep(0)  # the writer is inside gRPC's write now
        queued = asyncio.create_task(client.step(Step(opens=[([901, 1, 2], "cancel-write")])))
        await asyncio.sleep(0)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        result = await asyncio.wait_for(queued, 10)
        assert client._steps._stream is not first_stream, "the cancelled call's stream was replaced"
        seq_id = result.opened[0].seq_id
        assert (
            await client.num_tokens(seq_id) == 3 and client.block_table(seq_id) == result.opened[0].block_table.tolist()
        )
        await client.step(Step(releases=[([seq_id], False)]))  # the cancelled open, if applied, ends with the session
    debug.check()


@pytest.mark.asyncio
async def test_a_lone_step_cancelled_at_any_point_leaves_the_next_step_its_own_answer(server, debug) -> None:  # type: ignore[no-untyped-def]
    """A lone step writes, then reads its answer. Cancelled after 0, 1, 2, ... loop
    turns or a while (before it starts, mid-write, mid-read, or answered), it raises CancelledError or
    returns; the next step gets its own answer, never the cancelled one's, and the block table mirror
    followed the cancelled step wherever the server applied it."""
    async with AsyncRadixKVClient(server.address) as client:
        seq_id = (await client.step(Step(opens=[([930, 1, 2], "cancel-lone")]))).opened[0].seq_id
        outcomes = set()
        for turns, then in [*((n, 0.0) for n in range(10)), *((1, d) for d in (1e-4, 3e-4, 1e-3, 3e-3, 0.05))]:
            stream = client._steps._stream
            task = asyncio.create_task(client.step(Step(append=Append([seq_id], [1], [turns]))))
            for _ in range(turns):
                await asyncio.sleep(0)
            await asyncio.sleep(then)
            task.cancel()
            try:
                await task
                outcomes.add("answered")
            except asyncio.CancelledError:
                outcomes.add("cancelled" if client._steps._stream is stream else "cancelled, stream replaced")
            await client.step(Step())  # a cancelled step in flight is re-sent ahead of this one: applied by now
            length = await client.num_tokens(seq_id)  # the cancelled append applied or not: the server knows
            appended = await asyncio.wait_for(client.step(Step(append=Append([seq_id], [1], [99]))), 10)
            assert appended.appended is not None and appended.appended.num_tokens == [length + 1]
            table = client.block_table(seq_id)  # the mirror followed the cancelled step's answer, if it applied
            assert appended.appended.slots.tolist() == [table[length // 4] * 4 + length % 4]  # block size 4
        assert "answered" in outcomes and len(outcomes) > 1, outcomes
        await client.step(Step(releases=[([seq_id], False)]))
    debug.check()


@pytest.mark.asyncio
async def test_a_stream_that_ended_while_idle_is_replaced_by_the_next_step(server, debug) -> None:  # type: ignore[no-untyped-def]
    """No read waits on an idle stream (a lone step reads its own response): the next step finds the call
    over, as after a server stopping, and goes on a new stream instead of failing with the old one."""
    async with AsyncRadixKVClient(server.address) as client:
        seq_id = (await client.step(Step(opens=[([910, 1, 2], "idle-end")]))).opened[0].seq_id
        ended = client._steps._stream
        assert ended is not None
        ended._call.cancel()  # the call is over while nothing is in flight
        await asyncio.sleep(0.05)
        appended = (await client.step(Step(append=Append([seq_id], [1], [3])))).appended
        assert appended is not None and appended.num_tokens == [4]
        assert client._steps._stream is not ended
        await client.step(Step(releases=[([seq_id], False)]))
    debug.check()
