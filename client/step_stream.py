"""Steps pipelined on a Session stream: several in flight, answered in order, queued ones sent as one frame.

The stream is ordered, so a client need not wait for a step's response before sending the next:
`RadixKVClient.submit(step)` returns a `StepFuture` at once, and `AsyncRadixKVClient.step` may be
awaited by many coroutines together. Steps queued while the message before them is being written
leave together in one message (a frame, `SessionRequest.steps`), so gRPC's per-message cost, which
is most of a small step's, is paid once per frame; each step is still applied alone, all or none,
and answered alone. Nothing waits to fill a frame: a lone step leaves at once, as itself.

The blocking stream has no reader thread: a caller waiting for its step reads responses until its
own arrives, settling the steps ahead of it on the way. A stream that breaks takes its unanswered
steps with it; the client re-sends them (UNAVAILABLE: once each, in order, with their request ids,
so a step the server did apply is answered, not applied again) on a new stream.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Generic, Protocol, TypeVar

import grpc
import grpc.aio

from radixkv.client.errors import error_from_rpc
from radixkv.sequences.step import Step, StepResult
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

MAX_FRAME_STEPS = 64  # steps per message at most: a frame's response stays small, and its steps' latency too
# Request bytes per frame at most (a larger step goes alone): a frame's response (slots are 8 bytes per
# prompt token against 4 in the request) stays well under the server's message limit.
MAX_FRAME_BYTES = 256 * 1024

S = TypeVar("S")  # the stream a pending step is on


class Pending(Generic[S]):
    """A step sent (or about to be) and not yet settled: the stream it is on, and how often it was sent."""

    __slots__ = ("step", "request", "stream", "attempts")

    def __init__(self, step: Step, request: pb.SessionRequest) -> None:
        self.step, self.request = step, request
        self.stream: S | None = None
        self.attempts = 0


class BlockingStream(Protocol):
    """A stream a blocking caller waits on: `StepStream` here, or `direct_stream.DirectStepStream`."""

    def read_until(self, pending: StepFuture) -> None: ...


class StepFuture(Pending[BlockingStream]):
    """A step submitted on a blocking client's stream; `result()` waits for it (see `RadixKVClient.submit`)."""

    __slots__ = ("_result", "_error", "_done")

    def __init__(self, step: Step, request: pb.SessionRequest) -> None:
        super().__init__(step, request)
        self._result: StepResult | None = None
        self._error: BaseException | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def result(self) -> StepResult:
        """The step's result, reading the stream until it arrives.

        Raises:
            RadixKVError: the step was refused (nothing of it applied), or its stream failed.
        """
        while not self._done:
            stream = self.stream
            assert stream is not None, "a StepFuture is sent before it is returned"
            stream.read_until(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def settle(self, result: StepResult | None, error: BaseException | None) -> None:
        self._result, self._error, self._done = result, error, True


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


# settle(pending, response): turn one step's response into its result and settle it;
# broken(stream, error, pendings): the stream failed with these steps unanswered, in order.
Settle = Callable[[Any, pb.SessionResponse], None]
Broken = Callable[[Any, grpc.RpcError, list[Any]], None]


def frame(requests: list[pb.SessionRequest]) -> pb.SessionRequest:
    """One message for the queued steps: the step itself when alone."""
    return requests[0] if len(requests) == 1 else pb.SessionRequest(steps=requests)


def take_frame(outbox: collections.deque[Any]) -> list[pb.SessionRequest]:
    """The requests of the steps queued first in `outbox` (taken off it) that fit one frame: at most
    MAX_FRAME_STEPS and MAX_FRAME_BYTES, and always the first step, whatever its size."""
    requests: list[pb.SessionRequest] = []
    num_bytes = 0
    while outbox and len(requests) < MAX_FRAME_STEPS:
        size = outbox[0].request.ByteSize() if requests or len(outbox) > 1 else 0  # alone: any size
        if requests and num_bytes + size > MAX_FRAME_BYTES:
            break
        requests.append(outbox.popleft().request)
        num_bytes += size
    return requests


def resend_or_fail(error: grpc.RpcError, unanswered: list[Any], send: Callable[[Any], None]) -> None:
    """A broken stream's unanswered steps, in order: re-sent once on UNAVAILABLE (the request ids keep a step
    the server did apply from applying twice), failed with `error` otherwise."""
    for pending in unanswered:
        if error.code() == grpc.StatusCode.UNAVAILABLE and pending.attempts < 2:
            send(pending)
        else:
            pending.settle(None, error_from_rpc(error))


def answers(response: pb.SessionResponse, num_steps: int) -> list[pb.SessionResponse]:
    """Each step's response in a message answering `num_steps` steps (a frame refused whole answers each alike).

    A server from before frames would read a frame as one empty step and answer it once: that answer
    must not pass for the results of the frame's steps, so each of them is refused instead (FAILED_PRECONDITION).
    """
    if num_steps == 1 or len(response.steps) == num_steps or response.HasField("error"):
        return list(response.steps) if len(response.steps) else [response] * num_steps
    error = pb.StepError(
        code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
        reason="FAILED_PRECONDITION",
        message=f"the server answered a frame of {num_steps} steps with {len(response.steps)}: upgrade the server",
    )
    return [pb.SessionResponse(request_id=response.request_id, error=error)] * num_steps


class StreamEnded(grpc.RpcError):
    """The server ended a Session stream without a status (it is stopping); its steps are re-sent on a new one."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the Session stream ended"


class StepStream:
    """A Session stream driven from blocking callers. gRPC reads requests from an iterator on a thread of
    its own; a queue feeds it, and it takes every step queued by then into the next message."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, settle: Settle, broken: Broken) -> None:
        self._settle, self._broken = settle, broken
        self._outbox: queue.SimpleQueue[StepFuture | None] = queue.SimpleQueue()
        self._in_flight: collections.deque[StepFuture] = collections.deque()  # sent, unanswered, in order
        self._frame_sizes: collections.deque[int] = collections.deque()  # steps per message sent, in order
        self._lock = threading.Lock()  # in_flight's order is the outbox's
        self._read_lock = threading.Lock()  # one reader at a time
        self.closed = False
        self._responses = stub.Session(self._messages(), metadata=metadata)

    def send(self, pending: StepFuture) -> bool:
        """Queue `pending`; False if the stream has failed already (send it on another)."""
        with self._lock:
            if self.closed:
                return False
            pending.stream = self
            self._in_flight.append(pending)
            self._outbox.put(pending)
        return True

    def _messages(self) -> Iterator[pb.SessionRequest]:
        """Runs on gRPC's request thread: a message per wake-up, holding every step queued by then."""
        carried: list[StepFuture | None] = []  # taken from the outbox for the next message
        while True:
            first = carried.pop() if carried else self._outbox.get()
            if first is None:
                return
            requests, num_bytes = [first.request], first.request.ByteSize()
            while len(requests) < MAX_FRAME_STEPS:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                size = 0 if more is None else more.request.ByteSize()
                if more is None or num_bytes + size > MAX_FRAME_BYTES:
                    carried.append(more)  # the stream's end, or a step that starts the next message
                    break
                requests.append(more.request)
                num_bytes += size
            self._frame_sizes.append(len(requests))
            yield frame(requests)

    def read_until(self, pending: StepFuture) -> None:
        """Read one response (unless `pending` settled or moved meanwhile) and settle the steps it answers."""
        with self._read_lock:
            if pending.done() or pending.stream is not self:
                return
            try:
                response = next(self._responses)
            except StopIteration:
                self._fail(StreamEnded())
                return
            except grpc.RpcError as e:
                self._fail(e)
                return
            num_steps = self._frame_sizes.popleft()
            with self._lock:
                settled = [self._in_flight.popleft() for _ in range(num_steps)]
            for step, answer in zip(settled, answers(response, num_steps), strict=True):
                self._settle(step, answer)

    def _fail(self, error: grpc.RpcError) -> None:
        with self._lock:
            self.closed = True
            unanswered = list(self._in_flight)
            self._in_flight.clear()
        self._broken(self, error, unanswered)

    def close(self) -> None:
        """End the stream; steps still unanswered fail (CANCELLED) when their callers wait for them."""
        self._outbox.put(None)
        self._responses.cancel()


class AsyncStepStream:
    """A Session stream on `grpc.aio`. A lone step (the only one unanswered: a scheduler stepping back to
    back) is written and read by its own coroutine, so it costs the loop no turn for a task or a future;
    its read is posted before its write (`_exchange`). Steps in flight together are written, a frame per
    write, by a writer task that runs once the loop turns (when the steps submitted together are all
    queued), and read by a reader task while any is unanswered."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, settle: Settle, broken: Broken) -> None:
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
        if self._writer is None and self._outbox and self._read_is_free():
            await self._exchange()
        else:
            if self._writer is None and self._outbox:
                await self._write_queued()
            if not self._read_is_free() or pending.future.done():
                return await pending.future
            await self._read_once()
        if self._in_flight and self._reader is None and not self.closed:  # steps queued meanwhile
            self._reader = asyncio.get_running_loop().create_task(self._read_while_unanswered())
        return await pending.future

    def _read_is_free(self) -> bool:
        return not self._reading and self._reader is None and not self.closed

    async def _exchange(self) -> None:
        """Write what is queued and read one response, the read posted first. Posted after the write, the
        read would wait for the write's own completion to reach the loop, which on a busy host comes after
        the server has answered (30-90 µs later, bench_service's asyncio rows)."""
        read = self._read_once()
        try:
            waiting_on = read.send(None)  # runs it up to its first wait: the receive is posted
        except StopIteration:  # the call was over: the read failed the stream already
            return
        try:
            await self._write_queued()
            await _run_to_end(read, waiting_on)
        except BaseException:  # a cancelled caller: the read is left unfinished, so the call is done with
            read.close()
            if isinstance(waiting_on, asyncio.Future):
                waiting_on.add_done_callback(_retrieve)
            self._cut_midway = True
            self._fail(StreamEnded())  # the steps in flight go on a new stream
            raise

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


async def _run_to_end(coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Drive `coroutine`, which waits on `waiting_on` now, to its end from this task, as a task would drive it.

    A cancellation of this task cancels what `coroutine` waits on (as a task's would), and `coroutine`
    meets it there; one that comes when that is done already is raised here, `coroutine` left unfinished.
    """
    while True:
        if waiting_on is None:  # a bare yield: one loop turn
            await asyncio.sleep(0)
        else:
            waiting_on._asyncio_future_blocking = False  # taken from the coroutine, as a task takes it
            try:
                await waiting_on
            except asyncio.CancelledError:
                if not waiting_on.cancelled():
                    raise
            except Exception:  # noqa: BLE001 -- the coroutine meets it when resumed
                pass
        try:
            waiting_on = coroutine.send(None)
        except StopIteration:
            return


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Take a left future's outcome, so that its error (the call cancelled) is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()
