"""Domain errors on the wire: the one table from reason to gRPC status, and the decorator that applies it.

Every refusal leaves as a status code plus one `google.rpc.ErrorInfo` (reason, domain "radixkv",
metadata), so the client can rebuild the same exception class; a TOKEN_BUDGET refusal also carries a
`google.rpc.RetryInfo` (its retry delay). Anything else a handler raises is a
server bug: it is logged with its traceback and leaves as INTERNAL with no detail of the cause. A request whose
bytes do not parse is refused the same way (`DecodingInterceptor`, below).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from radixkv.errors import ERRORS_BY_REASON, InvalidArgument, RadixKVError, TokenBudget
from radixkv.server.rules.checks import call_deadline
from radixkv.server.wire.interceptors import WrappingInterceptor, method_of, wrap_handler

log = logging.getLogger(__name__)

DOMAIN = "radixkv"

# The one table: each error class declares its gRPC code by name in radixkv/errors.py; this is
# where those names become status codes. A reason missing here is INTERNAL.
STATUS_BY_REASON: dict[str, grpc.StatusCode] = {
    reason: grpc.StatusCode[cls.grpc_code] for reason, cls in ERRORS_BY_REASON.items()
}


MAX_ECHO_CHARS = 200  # an echoed value (a session id, a pool name) is cut here: the status must fit in metadata


def truncated(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def to_status(error: RadixKVError) -> grpc.Status:
    """The error as a status; every echoed value truncated, so a 4 KB field cannot push it past the metadata limit."""
    code = STATUS_BY_REASON.get(error.reason, grpc.StatusCode.INTERNAL)
    detail = any_pb2.Any()
    metadata = {truncated(k, 64): truncated(v) for k, v in error.metadata.items()}
    detail.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata))
    details = [detail]
    if isinstance(error, TokenBudget):  # when to retry, in the form gRPC clients and proxies read
        retry = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    message = truncated(error.message, 4 * MAX_ECHO_CHARS)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))


_REFUSAL: contextvars.ContextVar[RadixKVError | None] = contextvars.ContextVar("radixkv_refusal", default=None)


def abort(context: grpc.ServicerContext, error: RadixKVError) -> None:
    """End the RPC with `error` (raises, as `context.abort_with_status` does); metrics read it back (`last_refusal`)."""
    _REFUSAL.set(error)
    context.abort_with_status(to_status(error))


def last_refusal() -> RadixKVError | None:
    """The error this thread's current call was refused with, if any (set by `abort`)."""
    return _REFUSAL.get()


def forget_refusal() -> None:
    """A new call starts on this thread."""
    _REFUSAL.set(None)


Handler = TypeVar("Handler", bound=Callable[..., Any])
Response = TypeVar("Response")


@contextlib.contextmanager
def _translated(context: grpc.ServicerContext, method: str) -> Iterator[None]:
    try:
        yield
    except RadixKVError as e:
        log.debug(
            "refused", extra={"method": method, "reason": e.reason, **{k: truncated(v) for k, v in e.metadata.items()}}
        )
        abort(context, e)
    except Exception:
        log.exception("internal error", extra={"method": method})
        abort(context, RadixKVError("internal error (logged on the server)"))


def translating_errors(handler: Handler) -> Handler:
    """Wrap a servicer method: domain errors become their status, anything else INTERNAL."""

    @functools.wraps(handler)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> Any:
        with _translated(context, handler.__name__), call_deadline(context):
            return handler(self, request, context)

    return wrapper  # type: ignore[return-value]


def translating_stream(context: grpc.ServicerContext, method: str, responses: Iterator[Response]) -> Iterator[Response]:
    """A response stream whose failures leave as `translating_errors`' do.

    Without it an error raised while the stream runs (a limit checked when it starts, a bug) would
    reach gRPC, which ends the call UNKNOWN with no ErrorInfo.
    """
    with _translated(context, method):
        yield from responses


# -- from wire/decoding.py (merged, issue 41: one concept, one module):
# Requests whose bytes do not parse: refused as INVALID_ARGUMENT with an ErrorInfo, like any other bad field.
#
# Left to gRPC, a request its deserializer rejects ends as a bare INTERNAL ("Exception deserializing
# request!") with no ErrorInfo, which reads as a server bug and which the client cannot map to an
# exception class. `DecodingInterceptor` gives every unary-request method (radixkv's, health's) a
# deserializer that never raises: bytes that do not parse become an `Undecodable`, which the handler
# refuses before any other work. It is the innermost interceptor, so authentication still refuses an
# unauthenticated caller first. radixkv's request-streaming methods (the Session stream) get the same
# deserializer and answer an `Undecodable` message themselves, in-band; reflection keeps gRPC's handling.

RADIXKV_METHOD_PREFIX = "/radixkv."


class Undecodable:
    """A request that did not parse as its method's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class DecodingInterceptor(WrappingInterceptor):
    """Swaps each method's deserializer for one that turns a parse failure into `Undecodable`.

    A unary request is then refused before the handler runs; radixkv's request streams (Session)
    get the `Undecodable` as one of their messages and answer it themselves, keeping the stream open.
    """

    def key(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> Hashable | None:
        if handler.request_deserializer is None:
            return None
        if handler.request_streaming and not method_of(details).startswith(RADIXKV_METHOD_PREFIX):
            return None  # reflection keeps gRPC's handling
        return method_of(details)

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, key: Hashable
    ) -> grpc.RpcMethodHandler:
        method = method_of(details)
        parse = handler.request_deserializer
        assert parse is not None

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except (DecodeError, ValueError) as e:  # ValueError: a string field that is not UTF-8, on some runtimes
                return Undecodable(str(e) or type(e).__name__)

        def refusing(behaviour: Callable[..., Any]) -> Callable[..., Any]:
            if handler.request_streaming:
                return behaviour  # the handler answers each Undecodable message itself

            def call(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, Undecodable):
                    abort(context, InvalidArgument("request", f"not a valid {method} request: {request.error}"))
                return behaviour(request, context)

            return call

        return wrap_handler(handler, refusing, deserialize)
