"""Steps pipelined on a Session stream: several in flight, answered in order, queued ones sent as one frame.

The stream is ordered, so a client need not wait for a step's response before sending the next:
`RadixKVClient.submit(step)` returns a `StepFuture` at once, and `AsyncRadixKVClient.step` may be
awaited by many coroutines together. Steps queued while the message before them is being written
leave together in one message (a frame, `SessionRequest.steps`), so gRPC's per-message cost, which
is most of a small step's, is paid once per frame; each step is still applied alone, all or none,
and answered alone. Nothing waits to fill a frame: a lone step leaves at once, as itself.

Both clients' streams keep one contract (the blocking one in `step_stream.py`, the asyncio one in
`aio_stream.py`), on gRPC's public stream API: at most `MAX_IN_FLIGHT` steps unanswered (a client
with more waits for the oldest), queued steps leave together as one frame, responses settle steps
in order, and a stream that breaks takes its unanswered steps with it: the client re-sends them
(UNAVAILABLE: in order, with their request ids, each sent at most 3 times) on a new stream. The server keeps more
results per session than `MAX_IN_FLIGHT` (server/rules/sessions.py), so a re-sent step the server did
apply is answered with its first result, never applied again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

from radixkv.client.errors import error_from_rpc
from radixkv.client.session.retries import MAX_ATTEMPTS, retry_delay
from radixkv.sequences.step import Step, StepResult
from radixkv.v1 import kvcache_pb2 as pb

MAX_FRAME_STEPS = 64  # steps per message at most: a frame's response stays small, and its steps' latency too
# Request bytes per frame at most (a larger step goes alone): a frame's response (slots are 8 bytes per
# prompt token against 4 in the request) stays well under the server's message limit.
MAX_FRAME_BYTES = 256 * 1024
# Steps unanswered per stream at most: what a broken stream re-sends. The server's request window keeps
# four times as many results per session (server/rules/sessions.py DEFAULT_MAX_RESULTS), unary calls besides.
MAX_IN_FLIGHT = 256

S = TypeVar("S")  # the stream a pending step is on


class Pending(Generic[S]):
    """A step sent (or about to be) and not yet settled: the stream it is on, and how often it was sent."""

    __slots__ = ("step", "request", "stream", "attempts")

    def __init__(self, step: Step, request: pb.SessionRequest) -> None:
        self.step, self.request = step, request
        self.stream: S | None = None
        self.attempts = 0

    def settle(self, result: StepResult | None, error: BaseException | None) -> None:
        """Its result, or the error it failed with: what its waiter gets."""
        raise NotImplementedError


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
    """A broken stream's unanswered steps, in order: re-sent on UNAVAILABLE, each sent at most MAX_ATTEMPTS times
    as a unary call is (the request ids keep a step the server did apply from applying twice), failed with `error`
    otherwise."""
    for pending in unanswered:
        if error.code() == grpc.StatusCode.UNAVAILABLE and pending.attempts < MAX_ATTEMPTS:
            send(pending)
        else:
            pending.settle(None, error_from_rpc(error))


def resend_delay(unanswered: list[Any]) -> float:
    """Seconds to wait before re-sending a broken stream's steps: none when a stream first breaks (re-sent at once,
    on a new connection), `retry_delay` when the stream they were re-sent on broke too (the server may be down)."""
    attempts = max((p.attempts for p in unanswered), default=1)
    return 0.0 if attempts <= 1 else retry_delay(attempts - 2)


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
