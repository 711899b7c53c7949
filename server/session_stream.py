"""The Session stream: one session's scheduler steps, a request and a response each, on one open stream.

Errors: a refused step is answered in-band, and the stream stays open. Its response carries a
`StepError` with the code, reason and metadata the unary call for the refused item would have
ended with (plus `item`), so the clients raise the same exception class; nothing of the step was
applied. A scheduler refused for lack of blocks retries a smaller step on the same stream, with no
reconnect (which would cost more than the step). Bytes that do not parse as a SessionRequest are a
refused step too (INVALID_ARGUMENT naming `request`). Only what concerns the stream itself ends it
with a status, as a unary call ends: no valid token (UNAUTHENTICATED, before the stream starts),
too many streams open (LIMIT_EXCEEDED when it starts), a server bug (INTERNAL), shutdown.

The stream serves the session its first request names; later requests may leave `session_id`
empty. While the stream is open the session's lease does not run out (`SessionRegistry.hold`), and
the server's keepalive pings end the streams of peers that vanished. A step with a `request_id`
that this session already answered (re-sent after a reconnect) is answered with its first result or
refused, never applied again (`idempotency.py`).

Each stream is served by gRPC's handler thread for it, from the server's RPC pool: it reads a
request, answers it and sends the response, in order; no pool work runs on gRPC's own threads, so
a step that waits for its pool's lock holds back only the calls that need that lock. A step's
metrics are kept once its response has been sent, off the step's round trip.

A client with several steps queued sends them as one frame (`SessionRequest.steps`, see
client/step_stream.py): each is answered exactly as if it came alone, in order, and the answers go
back in one message, so gRPC's per-message cost is paid once for them. The answers share that
message's room: each step's response is bounded against what the answers before it left, less
room for a short refusal of each step after it, before it applies; a refusal that does not fit
is cut to its code and reason. The wire form of a step and its answer is `step_wire.py`.

A frame's work is what its caller pays for, and no more: at most `max_steps_per_frame` steps (a
larger frame is refused whole, LIMIT_EXCEEDED, before any step applies); each answer is measured
once, as it joins the response (the room left is a running sum: O(steps) for the frame, not
O(steps^2)); and a caller that leaves (cancelled, deadline, connection gone) stops its frame
between two steps, so the steps after are never applied. Counters: the bytes measured, and the
steps left unapplied because their caller left.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc

from radixkv.errors import InvalidArgument, LimitExceeded, RadixKVError
from radixkv.sequences.packed import unpack
from radixkv.server.checks import Reply
from radixkv.server.decoding import Undecodable
from radixkv.server.idempotency import request_key
from radixkv.server.service import KVService
from radixkv.server.sessions import Session
from radixkv.server.sizes import DEFAULT_MAX_STEPS_PER_FRAME
from radixkv.server.step import run_step
from radixkv.server.step_wire import response_of, step_error, step_of
from radixkv.server.tenants import Tenant
from radixkv.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# A refusal cut to its code and reason, with its request id, as one answer of a frame: the room each step of a frame
# keeps for the steps after it, so that whatever they answer, the frame's response fits its message.
SHORT_REFUSAL_BYTES = 128
_FRAMING_BYTES = 8  # an answer's tag and length inside the frame's response
Observe = Callable[[str, str, grpc.StatusCode, float], None]  # (method, pool, code, seconds), as the metrics take


class SessionStreams:
    """Counts the open Session streams of a server: each holds an RPC thread while open. Their bounds
    (`max_session_streams` and a tenant's share of it) are the stream gate's (server/stream_gate.py). Bounds each
    frame's steps (`max_steps_per_frame`), and counts the work frames took."""

    def __init__(self, max_steps_per_frame: int = DEFAULT_MAX_STEPS_PER_FRAME) -> None:
        self.max_steps_per_frame = max_steps_per_frame
        self._num_open = 0
        self.num_bytes_measured = 0  # answers' bytes measured to fit frames' responses: linear in what they answer
        self.num_steps_abandoned = 0  # steps of frames whose caller left before they applied: never applied
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._num_open

    def count_frame(self, num_bytes_measured: int, num_steps_abandoned: int) -> None:
        """A frame's work, for the counters: the bytes its answers were measured for, the steps it left unapplied."""
        with self._lock:
            self.num_bytes_measured += num_bytes_measured
            self.num_steps_abandoned += num_steps_abandoned

    def serve(
        self,
        service: KVService,
        caller: Tenant,
        requests: Iterable[pb.SessionRequest | Undecodable],
        observe: Observe,
        is_active: Callable[[], bool] = lambda: True,
    ) -> Iterator[pb.SessionResponse]:
        """A response per request until the client half-closes, on the stream's handler thread; `is_active`: whether
        the caller is still there (gRPC's context). A generator: it counts as open once it starts."""
        with self._lock:
            self._num_open += 1
        stream = _Stream(service, caller, observe, self, is_active)
        try:
            incoming = iter(requests)
            while True:
                try:
                    request = next(incoming)
                except (StopIteration, grpc.RpcError):  # the client half-closed, cancelled or went away
                    return
                response, timings = stream.respond(request)
                try:
                    yield response
                finally:
                    stream.keep_timings(timings)
        finally:
            stream.close()
            with self._lock:
                self._num_open -= 1


Timing = tuple[str, grpc.StatusCode, float]  # a step's (pool, code, seconds), as the metrics take them


def _answer_frame(stream: _Stream, frame: pb.SessionRequest) -> tuple[pb.SessionResponse, list[Timing]]:
    """A frame's steps, each answered as if it came alone, in order; their responses in one message, each step
    bounded by the room the ones before it left (less a short refusal's room for each one after it). A frame of
    too many steps is refused whole; a caller that left stops its frame between steps."""
    response = pb.SessionResponse()
    timings: list[Timing] = []
    num_steps, streams = len(frame.steps), stream.streams
    if num_steps > streams.max_steps_per_frame:
        too_many = LimitExceeded("max_steps_per_frame", num_steps, streams.max_steps_per_frame)
        return pb.SessionResponse(error=step_error(too_many)), timings  # the clients refuse each step alike
    if len(frame.ListFields()) > 1:  # `steps` and something else
        refusal = step_error(InvalidArgument("steps", "a frame of steps sets no other field"))
        for _ in frame.steps:
            response.steps.add(error=refusal)
        return response, timings
    max_bytes = stream.max_message_bytes
    used = 0  # the response's bytes so far: each answer measured once, with its tag and length
    abandoned = 0
    for i, step in enumerate(frame.steps):
        if not stream.is_active():  # the caller left: the rest of its frame would be answered to no one
            abandoned = num_steps - i
            break
        room = max_bytes - used - (num_steps - i - 1) * SHORT_REFUSAL_BYTES - _FRAMING_BYTES
        if step.steps:
            refused = step_error(InvalidArgument(f"steps[{i}].steps", "a step inside a frame is not a frame"))
            answer = pb.SessionResponse(request_id=step.request_id, error=refused)
        else:
            answer, timing = stream.answer(step, room)
            timings.append(timing)
        size = answer.ByteSize()
        if answer.HasField("error") and size > room:  # cut to the room left for it
            answer.error.message = "(cut to fit the frame's response)"
            answer.error.ClearField("metadata")
            size = answer.ByteSize()
        response.steps.append(answer)
        used += size + _FRAMING_BYTES
    streams.count_frame(used, abandoned)
    return response, timings


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Stream:
    """One stream's state: the session it serves (held alive while the stream is open)."""

    def __init__(
        self,
        service: KVService,
        caller: Tenant,
        observe: Observe,
        streams: SessionStreams,
        is_active: Callable[[], bool],
    ) -> None:
        self._service, self._caller, self._observe = service, caller, observe
        self.streams, self.is_active = streams, is_active
        self.max_message_bytes = service.max_message_bytes or sys.maxsize  # None: no limit
        self._reply = Reply(self.max_message_bytes)  # a lone step's: the whole message is its room
        self._session: Session | None = None
        self._last_ids: tuple[bytes, list[int]] = (b"", [])  # the last packed batch of ids, unpacked

    def close(self) -> None:
        if self._session is not None:
            self._service.sessions.unhold(self._session)

    def respond(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, list[Timing]]:
        """The response to one message (a step or a frame of them), and its steps' timings: kept with
        `keep_timings` once the response has been sent, off the step's round trip."""
        if isinstance(request, Undecodable) or not request.steps:
            response, timing = self.answer(request, self.max_message_bytes)
            return response, [timing]
        return _answer_frame(self, request)

    def keep_timings(self, timings: list[Timing]) -> None:
        for pool, code, seconds in timings:
            self._observe("Session", pool, code, seconds)

    def answer(self, request: pb.SessionRequest | Undecodable, max_bytes: int) -> tuple[pb.SessionResponse, Timing]:
        """The step's response (its results, or the refusal) in at most `max_bytes`, and its timing."""
        start = time.perf_counter()
        if isinstance(request, Undecodable):
            undecodable = InvalidArgument("request", f"not a valid SessionRequest: {request.error}")
            refused = pb.SessionResponse(error=step_error(undecodable))
            return refused, ("", grpc.StatusCode.INVALID_ARGUMENT, time.perf_counter() - start)
        pool = request.pool
        try:
            session = self._bind(request.session_id)
            step = step_of(request, self._unpack_ids)
            service = self._service
            reply = self._reply if max_bytes == self.max_message_bytes else Reply(max_bytes)
            result = run_step(
                service.checks,
                service.pool(pool, session.tenant),
                session,
                step,
                reply,
                request_key("Session", request),
            )
        except RadixKVError as e:
            log.debug("step refused", extra={"method": "Session", "reason": e.reason, **e.metadata})
            bound = self._session.session_id if self._session is not None else ""
            error = step_error(e)
            refused = pb.SessionResponse(request_id=request.request_id, session_id=bound, error=error)
            return refused, (pool, _CODES[error.code], time.perf_counter() - start)
        packed = step.append is not None and bool(request.append.packed_seq_ids or request.append.packed_num_token_ids)
        response = response_of(request.request_id, session.session_id, result, packed)
        return response, (pool, grpc.StatusCode.OK, time.perf_counter() - start)

    def _unpack_ids(self, packed: bytes) -> list[int]:
        """A packed append's ids: a decode loop sends the same batch step after step, unpacked once here."""
        if packed != self._last_ids[0]:
            self._last_ids = (packed, unpack(packed, 8, "packed_seq_ids"))
        return self._last_ids[1]

    def _bind(self, session_id: str) -> Session:
        """The stream's session: the first request names it; later ones leave it empty or repeat it."""
        bound = self._session
        if bound is not None and session_id in ("", bound.session_id):
            return self._service.sessions.get(bound.session_id, self._caller)  # live, and renewed
        if bound is not None:
            raise InvalidArgument(
                "session_id", f"this stream serves session {bound.session_id!r}: one stream per session"
            )
        session = self._service.sessions.get(session_id, self._caller)
        self._service.sessions.hold(session)
        self._session = session
        return session
