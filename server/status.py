"""Domain errors on the wire: the one table from reason to gRPC status, and the decorator that applies it.

Every refusal leaves as a status code plus one `google.rpc.ErrorInfo` (reason, domain "radixkv",
metadata), so the client can rebuild the same exception class. Anything else a handler raises is a
server bug: it is logged with its traceback and leaves as INTERNAL with no detail of the cause.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from radixkv.errors import ERRORS_BY_REASON, RadixKVError

log = logging.getLogger(__name__)

DOMAIN = "radixkv"

# The one table: each error class declares its gRPC code by name in radixkv/errors.py; this is
# where those names become status codes. A reason missing here is INTERNAL.
STATUS_BY_REASON: dict[str, grpc.StatusCode] = {
    reason: grpc.StatusCode[cls.grpc_code] for reason, cls in ERRORS_BY_REASON.items()
}


def to_status(error: RadixKVError) -> grpc.Status:
    code = STATUS_BY_REASON.get(error.reason, grpc.StatusCode.INTERNAL)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=error.message, details=[detail]))


def abort(context: grpc.ServicerContext, error: RadixKVError) -> None:
    """End the RPC with `error` (raises, as `context.abort_with_status` does)."""
    context.abort_with_status(to_status(error))


Handler = TypeVar("Handler", bound=Callable[..., Any])
Response = TypeVar("Response")


@contextlib.contextmanager
def _translated(context: grpc.ServicerContext, method: str) -> Iterator[None]:
    try:
        yield
    except RadixKVError as e:
        log.debug("refused", extra={"method": method, "reason": e.reason, **e.metadata})
        abort(context, e)
    except Exception:
        log.exception("internal error", extra={"method": method})
        abort(context, RadixKVError("internal error (logged on the server)"))


def translating_errors(handler: Handler) -> Handler:
    """Wrap a servicer method: domain errors become their status, anything else INTERNAL."""

    @functools.wraps(handler)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> Any:
        with _translated(context, handler.__name__):
            return handler(self, request, context)

    return wrapper  # type: ignore[return-value]


def translating_stream(context: grpc.ServicerContext, method: str, responses: Iterator[Response]) -> Iterator[Response]:
    """A response stream whose failures leave as `translating_errors`' do.

    Without it an error raised while the stream runs (a limit checked when it starts, a bug) would
    reach gRPC, which ends the call UNKNOWN with no ErrorInfo.
    """
    with _translated(context, method):
        yield from responses
