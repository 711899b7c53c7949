"""The asyncio client's Session stream, on `grpc.aio`'s public stream API (`write()` and `read()`)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import grpc
import grpc.aio

from radixkv.client.session.pipeline import (
    MAX_IN_FLIGHT,
    Broken,
    Pending,
    Settle,
    StreamEnded,
    answers,
    frame,
    resend_delay,
    resend_or_fail,
    take_frame,
)
from radixkv.sequences.step import Step, StepResult
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


class AsyncPending(Pending["AsyncStepStream"]):
    """A step on an asyncio client's stream; its future is what `step` awaits."""

    __slots__ = ("future",)

    def __init__(self, step: Step, request: pb.SessionRequest) -> None:
        super().__init__(step, request)
        self.future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()

    def settle(self, result: StepResult | None, error: BaseException | None) -> None:
        if self.future.done():  # its awaiter was cancelled; the step itself went through (or failed) all the same
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)  # type: ignore[arg-type]


class AsyncStepStream:
    """A Session stream on `grpc.aio`. A lone step (the only one unanswered: a scheduler stepping back to
    back) is written and read by its own coroutine, so it costs the loop no turn for a task or a future.
    Steps in flight together are written, a frame per write, by a writer task that runs once the loop
    turns (when the steps submitted together are all queued), and read by a reader task while any is
    unanswered."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, *, settle: Settle, broken: Broken) -> None:
        self._settle, self._broken = settle, broken
        self._call = stub.Session(metadata=metadata)
        self._outbox: collections.deque[AsyncPending] = collections.deque()
        self._in_flight: collections.deque[AsyncPending] = collections.deque()
        self._frame_sizes: collections.deque[int] = collections.deque()
        self._writer: asyncio.Task[Any] | None = None  # the task writing, if one is
        self._reader: asyncio.Task[None] | None = None  # the reader task, while steps in flight together
        self._reading = False  # a read is awaited (by a lone step's coroutine or the reader task)
        self._cut_midway = False  # a lone step's caller was cancelled mid-write or mid-read: gRPC cancelled the call
        self.closed = False

    def send(self, pending: AsyncPending, *, lone: bool = False) -> bool:
        """Queue `pending`; False if the stream has ended (send it on another). With `lone`, the caller then
        awaits `result(pending)`, which writes and reads it itself when it is the only step unanswered."""
        if self.closed or (self._call.done() and not self._in_flight):  # ended while idle (a server stopping)
            self.closed = True
            return False
        pending.stream = self
        self._in_flight.append(pending)
        self._outbox.append(pending)
        if lone and len(self._in_flight) == 1:
            return True
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())
        if self._reader is None and not self._reading:
            self._reader = asyncio.get_running_loop().create_task(self._read_while_unanswered())
        return True

    async def result(self, pending: AsyncPending) -> StepResult:
        """`pending`'s result. A lone step's caller writes and reads it here; a caller cancelled meanwhile
        takes the call down with it (gRPC cancels a call whose write or read is cancelled), and the steps
        in flight are then re-sent on a new stream, their request ids keeping them from applying twice."""
        if self._writer is None and self._outbox:
            await self._write_queued()
        if not self._read_is_free() or pending.future.done():
            return await pending.future
        await self._read_once()
        if self._in_flight and self._reader is None and not self.closed:  # steps queued meanwhile
            self._reader = asyncio.get_running_loop().create_task(self._read_while_unanswered())
        return await pending.future

    def has_room(self) -> bool:
        """Whether a step may be sent now: fewer than MAX_IN_FLIGHT unanswered, or the stream ended."""
        return len(self._in_flight) < MAX_IN_FLIGHT or self.closed

    async def wait_for_room(self) -> None:
        """Until fewer than MAX_IN_FLIGHT steps are unanswered (the oldest settle first), or the stream ends."""
        while not self.has_room():
            await asyncio.wait([self._in_flight[0].future])

    def _read_is_free(self) -> bool:
        return not self._reading and self._reader is None and not self.closed

    async def _write_queued(self) -> None:
        self._writer = asyncio.current_task()
        try:
            while self._outbox and not self.closed:
                requests = take_frame(self._outbox)
                self._frame_sizes.append(len(requests))
                await self._call.write(frame(requests))
        except asyncio.CancelledError:
            self._cut_midway = True
            if self._reader is None and not self._reading:  # no one will read the cancelled call: fail it now
                self._fail(StreamEnded())
            raise
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call failed: reading it answers for every unanswered step
        finally:
            self._writer = None

    async def _read_while_unanswered(self) -> None:
        try:
            while self._in_flight and not self.closed:
                await self._read_once()
        finally:
            self._reader = None

    async def _read_once(self) -> None:
        """Read one message and settle the steps it answers; a stream that ended fails its unanswered steps."""
        self._reading = True
        try:
            response = await self._call.read()
        except grpc.RpcError as e:
            self._fail(e)
            return
        except asyncio.CancelledError:  # the call was cancelled: by close(), or with a cancelled caller
            task = asyncio.current_task()
            own = task is not None and task.cancelling() > 0
            if own or self._cut_midway:
                self._cut_midway = True
                self._fail(StreamEnded())  # not the steps' doing: re-sent on a new stream
            else:
                self._fail(
                    grpc.aio.AioRpcError(
                        grpc.StatusCode.CANCELLED,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        "the Session stream was closed",
                    )
                )
            if own:
                raise
            return
        finally:
            self._reading = False
        if not isinstance(response, pb.SessionResponse):  # grpc.aio.EOF: ended without a status
            self._fail(StreamEnded())
            return
        num_steps = self._frame_sizes.popleft()
        settled = [self._in_flight.popleft() for _ in range(num_steps)]
        for step, answer in zip(settled, answers(response, num_steps), strict=True):
            self._settle(step, answer)

    def _fail(self, error: grpc.RpcError) -> None:
        if self.closed and not self._in_flight:
            return
        self.closed = True
        unanswered = list(self._in_flight)
        self._in_flight.clear()
        self._outbox.clear()
        self._broken(self, error, unanswered)

    def close(self) -> None:
        self._call.cancel()


class AsyncSessionSteps:
    """An asyncio client's steps on its session's stream, as `step_stream.SessionSteps` for the blocking one."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, settle: Settle) -> None:
        self._stub, self._metadata, self._settle = stub, metadata, settle
        self._stream: AsyncStepStream | None = None  # opened by the first step

    async def step(self, pending: AsyncPending) -> StepResult:
        """Send `pending` once fewer than MAX_IN_FLIGHT steps are unanswered, and await its result (a lone step
        is written and read by this coroutine)."""
        stream = self._stream
        if stream is not None and not stream.has_room():
            await stream.wait_for_room()
        self._send(pending, lone=True)
        assert pending.stream is not None
        return await pending.stream.result(pending)

    def _send(self, pending: AsyncPending, *, lone: bool = False) -> None:
        pending.attempts += 1
        while self._stream is None or not self._stream.send(pending, lone=lone):
            self._stream = AsyncStepStream(self._stub, self._metadata, settle=self._settle, broken=self._broke)

    def _broke(self, stream: AsyncStepStream, error: grpc.RpcError, unanswered: list[AsyncPending]) -> None:
        """Re-send the broken stream's unanswered steps, in order, on UNAVAILABLE (see `resend_or_fail`, after
        `resend_delay`); fail the rest."""
        if self._stream is stream:
            self._stream = None
        stream.close()
        delay = resend_delay(unanswered)
        if delay and error.code() == grpc.StatusCode.UNAVAILABLE:
            asyncio.get_running_loop().call_later(delay, resend_or_fail, error, unanswered, self._send)
        else:
            resend_or_fail(error, unanswered, self._send)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
