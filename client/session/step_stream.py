"""The blocking client's Session stream, on gRPC's public stream API.

gRPC reads the requests from an iterator on a thread of its own; a queue feeds it, and it takes
every step queued by then into the next message. There is no reader thread: a caller waiting for
its step reads responses until its own arrives, settling the steps ahead of it on the way.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from radixkv.client.session.pipeline import (
    MAX_FRAME_BYTES,
    MAX_FRAME_STEPS,
    MAX_IN_FLIGHT,
    Broken,
    Pending,
    Settle,
    StreamEnded,
    answers,
    frame,
    resend_delay,
    resend_or_fail,
)
from radixkv.sequences.step import Step, StepResult
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


class StepFuture(Pending["StepStream"]):
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


class StepStream:
    """A Session stream driven from blocking callers (see the module docstring)."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, *, settle: Settle, broken: Broken) -> None:
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

    def has_room(self) -> bool:
        """Whether a step may be sent now: fewer than MAX_IN_FLIGHT unanswered, or the stream ended."""
        return len(self._in_flight) < MAX_IN_FLIGHT or self.closed

    def wait_for_room(self) -> None:
        """Until fewer than MAX_IN_FLIGHT steps are unanswered (reading the oldest's answers), or the stream ends."""
        while True:
            with self._lock:
                if self.has_room():
                    return
                oldest = self._in_flight[0]
            self.read_until(oldest)

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
            if num_steps == 1 and not response.steps:  # a step that went alone, answered alone
                self._settle(settled[0], response)
                return
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


class SessionSteps:
    """A blocking client's steps on its session's stream: the stream is opened by the first step, and again
    whenever it breaks, the broken one's unanswered steps re-sent on the new one (`resend_or_fail`)."""

    def __init__(self, stub: kvcache_pb2_grpc.KVCacheStub, metadata: Any, settle: Settle) -> None:
        self._stub, self._metadata, self._settle = stub, metadata, settle
        self._lock = threading.RLock()  # the stream steps are sent on (a broken one re-sends on the next)
        self._stream: StepStream | None = None

    def submit(self, pending: StepFuture) -> None:
        """Send `pending` once fewer than MAX_IN_FLIGHT steps are unanswered (this caller reads the oldest's
        answers until then)."""
        stream = self._stream
        if stream is not None and not stream.has_room():
            stream.wait_for_room()
        with self._lock:
            self._send(pending)

    def _send(self, pending: StepFuture) -> None:
        """On the current stream, or a new one if it failed (holding `_lock`)."""
        pending.attempts += 1
        while self._stream is None or not self._stream.send(pending):
            self._stream = StepStream(self._stub, self._metadata, settle=self._settle, broken=self._broke)

    def _broke(self, stream: StepStream, error: grpc.RpcError, unanswered: list[StepFuture]) -> None:
        """Re-send the broken stream's unanswered steps, in order (UNAVAILABLE, see `resend_or_fail`); fail the rest.
        Called by the caller reading the stream when it broke: that caller waits out `resend_delay`."""
        delay = resend_delay(unanswered)
        if delay and error.code() == grpc.StatusCode.UNAVAILABLE:
            time.sleep(delay)
        with self._lock:
            if self._stream is stream:
                self._stream = None
            stream.close()
            resend_or_fail(error, unanswered, self._send)

    def close(self) -> None:
        """End the stream (the server then lets the lease run again); the next step opens a new one."""
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
