"""The blocking client's Session stream driven by the threads that use it: no thread between a step and the socket.

gRPC's public blocking stream API writes requests from an iterator on a thread of its own and
hands each response over from its channel thread, waking the waiting caller through a condition:
several thread switches per step. Here the callers drive the call themselves, as gRPC's blocking
unary calls do: a caller that waits for a result writes what is queued and then takes completions
from the call's own completion queue. Measured on this project's 2 vCPUs, in turns: an empty
step's round trip took 275 us through the public API and 195 us driven directly.

A submitted step is queued, and leaves when a caller waits for a result (or a waiting caller takes
a completion), together with every step queued by then, in one frame. A lone step leaves at once,
since its caller waits for it at once; a thread pipelining steps gets full frames. (The public
stream batches the same way by accident: its writer thread wakes once the submitting thread
blocks.) A step submitted and never waited for leaves when some caller next waits.

That is gRPC's Cython layer (`SegregatedCall`, which its own blocking calls are built on), not its
public API: `DirectStepStream.open` returns None where it is missing or changed, and the client
keeps the public stream (step_stream.StepStream) then. Both keep one contract: one write in flight
at a time (gRPC allows no more), queued steps leave together as one frame, responses settle steps
in order, and a stream that ends fails its unanswered steps through `broken`.
"""

from __future__ import annotations

import collections
import importlib
import threading
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from radixkv.client.step_stream import Broken, Settle, StepFuture, answers, frame, take_frame
from radixkv.v1 import kvcache_pb2 as pb

try:
    cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")  # no type stubs: not public API
except ImportError:  # a gRPC build without its Cython layer: the public stream serves
    cygrpc = None

SESSION_METHOD = b"/radixkv.v1.KVCache/Session"
# Messages written and not yet answered, at most: with threads sharing one client, one thread's step can
# leave while another's is being answered. (bench_service's open_release, 4 clients with 8 open + release
# cycles in flight each, measured in turns: 7.9 steps per message and 2.7-3.4x the unary rate, as gRPC's
# public stream gave in the same runs; writing each step as it was submitted left 2.7 per message, 2.1-2.6x.)
MAX_UNANSWERED = 2
# Completion tags, one batch each in flight; EXCHANGE writes and reads in one batch (then neither runs alone).
_START, _STATUS, _WRITE, _READ, _EXCHANGE = "start", "status", "write", "read", "exchange"
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamStatus(grpc.RpcError):
    """How a directly driven stream ended: the `grpc.RpcError` a public stream would raise (code, details,
    trailing metadata, so `error_from_rpc` reads the ErrorInfo the server sent)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[Any, ...]) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[Any, ...]:  # (key, value) pairs; the stubs' type for them is private
        return self._trailing

    def __repr__(self) -> str:
        return f"StreamStatus({self._code}, {self._details!r})"


class DirectStepStream:
    """A Session stream on one core call. Writes start from a caller about to wait, or from whichever thread
    takes a completion; one thread at a time takes completions."""

    def __init__(self, call: Any, settle: Settle, broken: Broken) -> None:
        self._call = call
        self._settle, self._broken = settle, broken
        self._lock = threading.Lock()  # everything below
        self._read_lock = threading.Lock()  # one thread takes completions at a time
        self._outbox: collections.deque[StepFuture] = collections.deque()  # queued behind the write in flight
        self._in_flight: collections.deque[StepFuture] = collections.deque()  # queued or sent, unanswered, in order
        self._frame_sizes: collections.deque[int] = collections.deque()  # steps per message written, unanswered
        # Batches started whose completion is still to be taken: gRPC frees the call's queue when none is, so
        # the queue is read exactly while this is not empty.
        self._due = {_START, _STATUS}
        self._writing = self._reading = False
        self.closed = False

    @classmethod
    def open(
        cls, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None, settle: Settle, broken: Broken
    ) -> DirectStepStream | None:
        """A stream on `channel`, or None where this gRPC build has no core call API of the shape used here.

        Raises:
            ValueError: the channel is closed (as a public stream call raises).
        """
        core = getattr(channel, "_channel", None)
        if cygrpc is None or core is None or not hasattr(core, "segregated_call"):
            return None
        start = (cygrpc.SendInitialMetadataOperation(metadata, 0), cygrpc.ReceiveInitialMetadataOperation(0))
        try:
            call = core.segregated_call(
                cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS,
                SESSION_METHOD,
                None,  # host
                None,  # deadline: none, the stream lives as long as the client uses it
                metadata,
                None,  # call credentials
                ((start, _START), ((cygrpc.ReceiveStatusOnClientOperation(0),), _STATUS)),
                None,  # census context
                None,  # registered call handle
            )
        except (AttributeError, TypeError):  # another signature: not this build's API
            return None
        return cls(call, settle, broken)

    def send(self, pending: StepFuture) -> bool:
        """Queue `pending`; it leaves when a caller waits for a result (see `read_until`). False if the stream
        has ended."""
        with self._lock:
            if self.closed:
                return False
            pending.stream = self
            self._in_flight.append(pending)
            self._outbox.append(pending)
        return True

    def _write_if_due(self) -> None:
        """Write what is queued unless a write is in flight or MAX_UNANSWERED messages wait for their response
        (then it leaves when the reader takes a completion), holding `_lock`."""
        if self._outbox and not self._writing and not self.closed and len(self._frame_sizes) < MAX_UNANSWERED:
            self._write_queued()

    def _write_queued(self) -> None:
        """Write the queued steps as one message, and read its response (holding `_lock`).

        A lone step, the only one unanswered (a scheduler stepping back to back), is written and read in
        one batch: one completion to take, one wake-up of the waiting caller less. Otherwise the write
        is a batch of its own, so that the next message may leave while this one is answered (steps
        pipelined by `submit`)."""
        requests = take_frame(self._outbox)
        self._frame_sizes.append(len(requests))
        send = cygrpc.SendMessageOperation(frame(requests).SerializeToString(), 0)
        if not self._reading and len(self._in_flight) == 1:
            self._start((send, cygrpc.ReceiveMessageOperation(0)), _EXCHANGE)
            self._writing = self._reading = True
            return
        self._start((send,), _WRITE)
        self._writing = True
        if not self._reading:
            self._start((cygrpc.ReceiveMessageOperation(0),), _READ)
            self._reading = True

    def _start(self, operations: tuple[Any, ...], tag: str) -> None:
        try:
            self._call.operate(operations, tag)
        except ValueError:  # gRPC refused the batch: end the call, its status fails what is in flight
            self._call.cancel(cygrpc.StatusCode.internal, f"the Session stream could not start a {tag}")
            return
        self._due.add(tag)

    def read_until(self, pending: StepFuture) -> None:
        """Write what is queued, then take completions until `pending` is settled or moved to another stream; a
        stream that ended is also drained of what was still due."""
        with self._lock:  # what is queued leaves now, before this caller waits for another one reading
            self._write_if_due()
        with self._read_lock:
            while self._due:
                if (pending.done() or pending.stream is not self) and not self.closed:
                    return
                self._take(self._call.next_event())

    def _take(self, event: Any) -> None:
        settled: list[tuple[StepFuture, pb.SessionResponse]] = []
        failed: tuple[grpc.RpcError, list[StepFuture]] | None = None
        with self._lock:
            tag = event.tag
            self._due.discard(tag)
            if tag == _WRITE:
                self._writing = False
                self._write_if_due()
            elif tag in (_READ, _EXCHANGE):
                self._reading = False
                if tag == _EXCHANGE:  # its write is done too
                    self._writing = False
                # The receive is the batch's last operation. None: the server ended the stream (or a write
                # failed as it did), its status follows.
                message = event.batch_operations[-1].message() if event.success else None
                if message is not None:
                    settled = self._answered(message)
                    self._write_if_due()
                    if self._frame_sizes and not self._reading and not self.closed:
                        self._start((cygrpc.ReceiveMessageOperation(0),), _READ)
                        self._reading = True
            elif tag == _STATUS:
                failed = self._ended(event.batch_operations[0])
        for step, response in settled:
            self._settle(step, response)
        if failed is not None:
            self._broken(self, *failed)

    def _answered(self, message: bytes) -> list[tuple[StepFuture, pb.SessionResponse]]:
        try:
            response = pb.SessionResponse.FromString(message)
        except DecodeError:  # as gRPC ends a call whose response it cannot deserialize
            self._call.cancel(cygrpc.StatusCode.internal, "Exception deserializing response!")
            return []
        num_steps = self._frame_sizes.popleft()
        steps = [self._in_flight.popleft() for _ in range(num_steps)]
        return list(zip(steps, answers(response, num_steps), strict=True))

    def _ended(self, status: Any) -> tuple[grpc.RpcError, list[StepFuture]]:
        self.closed = True
        unanswered = list(self._in_flight)
        self._in_flight.clear()
        self._outbox.clear()
        code = _CODES.get(status.code(), grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.OK:  # ended without an error while steps may wait: as the public stream reads it
            code = grpc.StatusCode.UNAVAILABLE
        return StreamStatus(code, status.details() or "", tuple(status.trailing_metadata() or ())), unanswered

    def close(self) -> None:
        """End the stream; steps still unanswered fail (CANCELLED). Drains the call unless another thread is
        reading it (that thread drains it then)."""
        with self._lock:
            if self.closed and not self._due:
                return
            self.closed = True
        self._call.cancel(cygrpc.StatusCode.cancelled, "the Session stream was closed")
        if self._read_lock.acquire(blocking=False):
            try:
                while self._due:
                    self._take(self._call.next_event())
            finally:
                self._read_lock.release()
