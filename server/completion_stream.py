"""A Session stream answered on gRPC's completion-queue thread: one completion and no thread hand-off per step.

gRPC's sync server runs a stream's handler on a thread of its own. Each request reaches it from
the server's completion-queue thread (a wake-up), and each response it sends waits for its own
completion there before the handler may ask for the next request (two more): per decode step, two
completions and two wake-ups of the handler, one of them on the step's round trip. Here the
handler only opens the stream and waits for its end. Each step is answered by the completion of
its request, on the completion-queue thread, and its response leaves in one batch with the read
of the next request, so a step costs one completion and no hand-off (the blocking client does the
same on its side, client/direct_stream.py).

Steps run one at a time per stream, in order. A step answered on the completion-queue thread holds
every other call's completions back while it runs (on any thread it would hold the interpreter's
lock, yet let the queue's thread in every few milliseconds): so only a small message is answered
there (a decode step of hundreds of sequences is a few KiB), and a larger one, whose opens may take
milliseconds, is handed to the handler thread, as gRPC would hand it.

That is gRPC's internal server call API (the request iterator's call and state, callable batch
tags), not its public one: `CompletionStream.attach` returns None where it is missing or changed,
and the stream is then served from the handler thread (session_stream.SessionStreams.serve).
"""

from __future__ import annotations

import contextvars
import importlib
import queue
from collections.abc import Callable
from typing import Any

from radixkv.server.decoding import Undecodable
from radixkv.v1 import kvcache_pb2 as pb

try:
    cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")  # no type stubs: not public API
    grpc_server: Any = importlib.import_module("grpc._server")
except ImportError:
    cygrpc = grpc_server = None

# A request's (response, keep): `keep()` records its steps' metrics once the response has left (session_stream).
Respond = Callable[[pb.SessionRequest | Undecodable], tuple[pb.SessionResponse, Callable[[], None]]]
_NO_CALLBACKS: tuple[()] = ()
INLINE_MAX_BYTES = 64 * 1024  # a request larger than this is answered on the handler thread
# How often the waiting handler checks that its call is still live: a server stopping may stop reading its
# completion queue before the cancelled batch's completion is read, which would leave the handler waiting.
LIVENESS_CHECK_SECONDS = 1.0


class CompletionStream:
    """Drives one Session stream from its batches' completions; `run` returns when the stream has ended."""

    def __init__(self, call: Any, state: Any, parse: Callable[[bytes], Any], respond: Respond) -> None:
        self._call, self._state, self._parse, self._respond = call, state, parse, respond
        self._context = contextvars.copy_context()  # the handler's: the steps answered inline see what it sees
        # For the handler thread: large requests to answer, then None (the stream ended) or the error that ended it.
        self._inbox: queue.SimpleQueue[bytes | BaseException | None] = queue.SimpleQueue()
        self._metadata_sent = False  # by a response of this stream (steps answer one at a time: no lock)

    @classmethod
    def attach(cls, requests: object, respond: Respond) -> CompletionStream | None:
        """A driver for the stream `requests` iterates, or None where gRPC's internals are not as used here."""
        call, state = getattr(requests, "_call", None), getattr(requests, "_state", None)
        parse = getattr(requests, "_request_deserializer", None)
        if cygrpc is None or call is None or state is None or parse is None:
            return None
        if not hasattr(call, "start_server_batch") or not all(
            hasattr(grpc_server, name) for name in ("_get_initial_metadata_operation", "_is_rpc_state_active")
        ):
            return None
        if not all(hasattr(state, name) for name in ("condition", "initial_metadata_allowed")):
            return None
        return cls(call, state, parse, respond)

    def run(self) -> None:
        """Answer steps until the client half-closes, cancels or goes away; on the handler thread.

        Raises:
            BaseException: what answering a step raised that was not a refusal (a server bug): the stream ends.
        """
        if not self._start((cygrpc.ReceiveMessageOperation(0),)):
            return
        while True:
            try:
                item = self._inbox.get(timeout=LIVENESS_CHECK_SECONDS)
            except queue.Empty:
                if grpc_server._is_rpc_state_active(self._state):
                    continue
                return  # cancelled or ended meanwhile: the completion of the batch in flight may never be read
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            self._answer(item)

    def _start(self, operations: tuple[Any, ...]) -> bool:
        try:
            self._call.start_server_batch(operations, self._completed)
        except ValueError:  # gRPC refused the batch (the call is over)
            return False
        return True

    def _completed(self, event: Any) -> tuple[None, tuple[()]]:
        """A batch's completion, on the completion-queue thread: the next request, answered at once if small.

        Never raises: gRPC calls it from the loop that serves every call, which an exception would end."""
        try:
            message = event.batch_operations[-1].message() if event.success else None  # the receive is last
            if message is None:  # half-closed, cancelled or gone: the handler ends the call
                self._inbox.put(None)
            elif len(message) > INLINE_MAX_BYTES:
                self._inbox.put(message)
            else:
                self._context.run(self._answer, message)
        except BaseException as e:  # noqa: BLE001 -- raised on the handler thread, which ends the call with it
            self._inbox.put(e)
        return None, _NO_CALLBACKS

    def _answer(self, message: bytes) -> None:
        response, keep_timings = self._respond(self._parse(message))
        operations = [
            cygrpc.SendMessageOperation(response.SerializeToString(), 0),
            cygrpc.ReceiveMessageOperation(0),
        ]
        if not self._metadata_sent:  # the first response carries the initial metadata, which gRPC then never sends
            with self._state.condition:
                if self._state.initial_metadata_allowed:
                    operations.insert(0, grpc_server._get_initial_metadata_operation(self._state, None))
                    self._state.initial_metadata_allowed = False
            self._metadata_sent = True
        if not self._start(tuple(operations)):
            self._inbox.put(None)
        keep_timings()
