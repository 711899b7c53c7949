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
that this session already answered (re-sent after a reconnect) is answered again, not re-applied.

Steps are answered where their requests complete, on gRPC's completion-queue thread, each response
leaving with the read of the next request (server/completion_stream.py); where gRPC's internals
are not as that module uses them, `serve` answers them from the stream's handler thread. Either
way a step's metrics are kept once its response has left, off the step's round trip.

A client with several steps queued sends them as one frame (`SessionRequest.steps`, see
client/step_stream.py): each is answered exactly as if it came alone, in order, and the answers go
back in one message, so gRPC's per-message cost is paid once for them. An append may carry its id
and count columns packed (`StepAppend.packed_seq_ids`, radixkv.sequences.packed); it is answered with its
result columns in the form it sent them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc
import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument, RadixKVError
from radixkv.sequences.packed import pack, unpack
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.completion_stream import CompletionStream
from radixkv.server.decoding import Undecodable
from radixkv.server.miss_reasons import wire_reason
from radixkv.server.service import KVService
from radixkv.server.sessions import Session
from radixkv.server.status import STATUS_BY_REASON
from radixkv.server.step import run_step
from radixkv.server.tenants import Tenant
from radixkv.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

Observe = Callable[[str, str, grpc.StatusCode, float], None]  # (method, pool, code, seconds), as the metrics take


class SessionStreams:
    """Counts the open Session streams of a server: each holds an RPC thread while open. Their bounds
    (`max_session_streams` and a tenant's share of it) are the stream gate's (server/stream_gate.py)."""

    def __init__(self) -> None:
        self._num_open = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._num_open

    def serve(
        self, service: KVService, caller: Tenant, requests: Iterable[pb.SessionRequest | Undecodable], observe: Observe
    ) -> Iterator[pb.SessionResponse]:
        """A response per request until the client half-closes: sent by a `CompletionStream` where one
        attaches (nothing is yielded then), else yielded. A generator: it counts as open once it starts."""
        with self._lock:
            self._num_open += 1
        stream = _Stream(service, caller, observe)
        try:
            on_completions = CompletionStream.attach(requests, stream.respond)
            if on_completions is not None:  # gRPC's internals allow it (server/completion_stream.py)
                on_completions.run()
                return
            incoming = iter(requests)
            while True:
                try:
                    request = next(incoming)
                except (StopIteration, grpc.RpcError):  # the client half-closed, cancelled or went away
                    return
                response, keep_timings = stream.respond(request)
                try:
                    yield response
                finally:
                    keep_timings()
        finally:
            stream.close()
            with self._lock:
                self._num_open -= 1


Timing = tuple[str, grpc.StatusCode, float]  # a step's (pool, code, seconds), as the metrics take them


def _answer_frame(stream: _Stream, frame: pb.SessionRequest) -> tuple[pb.SessionResponse, list[Timing]]:
    """A frame's steps, each answered as if it came alone, in order; their responses in one message."""
    response = pb.SessionResponse()
    timings: list[Timing] = []
    if len(frame.ListFields()) > 1:  # `steps` and something else
        refusal = _step_error(InvalidArgument("steps", "a frame of steps sets no other field"))
        for _ in frame.steps:
            response.steps.add(error=refusal)
        return response, timings
    for i, step in enumerate(frame.steps):
        if step.steps:
            refused = _step_error(InvalidArgument(f"steps[{i}].steps", "a step inside a frame is not a frame"))
            response.steps.add(request_id=step.request_id, error=refused)
        else:
            answer, timing = stream.answer(step)
            response.steps.append(answer)
            timings.append(timing)
    return response, timings


_CODES = {code.value[0]: code for code in grpc.StatusCode}
_INT64 = np.dtype("<i8")


class _Stream:
    """One stream's state: the session it serves (held alive while the stream is open)."""

    def __init__(self, service: KVService, caller: Tenant, observe: Observe) -> None:
        self._service, self._caller, self._observe = service, caller, observe
        self._session: Session | None = None
        self._last_ids: tuple[bytes, list[int]] = (b"", [])  # the last packed batch of ids, unpacked

    def close(self) -> None:
        if self._session is not None:
            self._service.sessions.unhold(self._session)

    def respond(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, Callable[[], None]]:
        """The response to one message (a step or a frame of them), and what keeps its steps' metrics: to be
        called once the response has left, off the step's round trip."""
        if isinstance(request, Undecodable) or not request.steps:
            response, timing = self.answer(request)
            timings = [timing]
        else:
            response, timings = _answer_frame(self, request)
        return response, functools.partial(self._keep_timings, timings)

    def _keep_timings(self, timings: list[Timing]) -> None:
        for pool, code, seconds in timings:
            self._observe("Session", pool, code, seconds)

    def answer(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, Timing]:
        """The step's response (its results, or the refusal), and its timing."""
        start = time.perf_counter()
        response, pool = self._answer(request)
        code = grpc.StatusCode.OK if not response.HasField("error") else _CODES[response.error.code]
        return response, (pool, code, time.perf_counter() - start)

    def _answer(self, request: pb.SessionRequest | Undecodable) -> tuple[pb.SessionResponse, str]:
        """The step's response (its results, or the refusal), and the pool it named."""
        if isinstance(request, Undecodable):
            error = InvalidArgument("request", f"not a valid SessionRequest: {request.error}")
            return pb.SessionResponse(error=_step_error(error)), ""
        try:
            session = self._bind(request.session_id)
            step = _step(request, self._unpack_ids)
            result = run_step(self._service, self._caller, session, request.pool, step, request.request_id)
        except RadixKVError as e:
            log.debug("step refused", extra={"method": "Session", "reason": e.reason, **e.metadata})
            bound = self._session.session_id if self._session is not None else ""
            return pb.SessionResponse(
                request_id=request.request_id, session_id=bound, error=_step_error(e)
            ), request.pool
        packed = bool(request.append.packed_seq_ids or request.append.packed_num_token_ids)
        return _response(request.request_id, session.session_id, result, packed), request.pool

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


def _step(request: pb.SessionRequest, unpack_ids: Callable[[bytes], list[int]]) -> Step:
    """The request as a Step; empty item lists are left at their defaults (a decode step reads one field).
    `unpack_ids`: packed seq ids as a list, never changed by the step."""
    if not (request.opens or request.forks or request.cache_seq_ids or request.releases or request.HasField("commit")):
        return Step(append=_append(request.append, unpack_ids)) if request.HasField("append") else Step()  # decode
    items: dict[str, object] = {}
    if request.HasField("commit"):
        items["commit"] = Commit(list(request.commit.seq_ids), list(request.commit.num_tokens))
    if request.opens:
        items["opens"] = [(o.token_ids, o.namespace) for o in request.opens]
        if any(o.max_new_tokens or o.priority for o in request.opens):
            items["max_new_tokens"] = [o.max_new_tokens for o in request.opens]
            items["priorities"] = [o.priority for o in request.opens]
        if any(o.explain for o in request.opens):
            items["explain"] = [o.explain for o in request.opens]
    if request.HasField("append"):
        items["append"] = _append(request.append, unpack_ids)
    if request.forks:
        items["forks"] = [(f.seq_id, f.num_children) for f in request.forks]
    if request.cache_seq_ids:
        items["caches"] = list(request.cache_seq_ids)
    if request.releases:
        items["releases"] = [(list(r.seq_ids), r.cache if r.HasField("cache") else True) for r in request.releases]
    return Step(**items)  # type: ignore[arg-type]


def _append(a: pb.StepAppend, unpack_ids: Callable[[bytes], list[int]]) -> Append:
    """The append item, from its repeated or its packed columns (see radixkv.sequences.packed)."""
    if not (a.packed_seq_ids or a.packed_num_token_ids):
        return Append(list(a.seq_ids), list(a.num_token_ids), a.token_ids)
    try:
        if a.seq_ids or a.num_token_ids:
            raise InvalidArgument("packed_seq_ids", "set seq_ids and num_token_ids or their packed forms, not both")
        seq_ids = unpack_ids(a.packed_seq_ids)
        if not a.packed_num_token_ids:
            return Append(seq_ids, [1] * len(seq_ids), a.token_ids)  # a decode step: one token each
        counts = unpack(a.packed_num_token_ids, 4, "packed_num_token_ids")
        if len(counts) != len(seq_ids):
            raise InvalidArgument(
                "packed_num_token_ids", f"needs one entry per sequence ({len(seq_ids)}), got {len(counts)}"
            )
    except InvalidArgument as e:
        e.metadata["item"] = "append"
        raise
    return Append(seq_ids, counts, a.token_ids)


def _response(request_id: int, session_id: str, result: StepResult, packed: bool) -> pb.SessionResponse:
    """Only the fields the step has results for are set, in place (protobuf costs per field given, even an
    empty one, and a submessage passed to a constructor is copied again). `packed`: the append's columns
    as the request sent its own."""
    response = pb.SessionResponse(request_id=request_id, session_id=session_id)
    for r in result.opened:
        response.opened.add(
            seq_id=r.seq_id,
            num_cached_tokens=r.num_cached_tokens,
            block_ids=r.block_table.tolist(),
            slots=r.slots.astype(_INT64, copy=False).tobytes(),
            num_host_hit_tokens=r.num_host_hit_tokens,
        )
    if result.explanations:  # explained opens: as OpenSequences
        for item, why in zip(response.opened, result.explanations, strict=False):
            if why is not None:
                item.miss_reason = wire_reason(why)
                item.miss_block_index, item.evicted_at_unix_ns = why.block_index, why.evicted_at_unix_ns
                item.other_namespace = why.other_namespace
    b = result.appended
    if b is not None:
        appended = response.appended
        appended.SetInParent()  # an append of no sequences still answers with an (empty) `appended`
        if packed:
            appended.packed_num_tokens = pack(b.num_tokens, 4)
            appended.packed_table_offsets = pack(b.table_offsets, 4)
            appended.packed_num_block_ids = pack(b.num_block_ids, 4)
            appended.packed_block_ids = pack(b.block_ids, 4)
        else:
            appended.num_tokens.extend(b.num_tokens)
            appended.table_offsets.extend(b.table_offsets)
            appended.num_block_ids.extend(b.num_block_ids)
            if b.block_ids:
                appended.block_ids.extend(b.block_ids)
        appended.slots = b.slots.astype(_INT64, copy=False).tobytes()
        for s, d, i in b.copies:
            appended.copies.add(src_block_id=s, dst_block_id=d, sequence_index=i)
    if len(result.offloads):
        response.offloads.extend(transfers([result.offloads]))
    if len(result.loads):
        response.loads.extend(transfers([result.loads]))
    for children in result.forked:
        response.forked.add(child_seq_ids=children)
    if result.num_cached_tokens:
        response.num_cached_tokens.extend(result.num_cached_tokens)
    if result.num_released_sequences:
        response.num_released_sequences = result.num_released_sequences
    return response


def transfers(runs: Iterable[npt.NDArray[np.int64]]) -> list[pb.BlockTransfer]:
    """Host-tier pairs `(src_block, dst_block)`, run after run in order, as wire messages."""
    return [pb.BlockTransfer(src_block_id=s, dst_block_id=d) for run in runs for s, d in run.tolist()]


def _step_error(error: RadixKVError) -> pb.StepError:
    code = STATUS_BY_REASON.get(error.reason, grpc.StatusCode.INTERNAL)
    return pb.StepError(code=code.value[0], message=error.message, reason=error.reason, metadata=error.metadata)
