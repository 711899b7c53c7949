"""Domain errors on the wire: the one table from reason to gRPC status, and the decorator that applies it.

Every refusal leaves as a status code plus one `google.rpc.ErrorInfo` (reason, domain "radixkv",
metadata), so the client can rebuild the same exception class; a TOKEN_BUDGET refusal also carries a
`google.rpc.RetryInfo` (its retry delay). Anything else a handler raises is a
server bug: it is logged with its traceback and leaves as INTERNAL with no detail of the cause.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from radixkv.errors import ERRORS_BY_REASON, RadixKVError, TokenBudget
from radixkv.server.rules.deadlines import call_deadline

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
