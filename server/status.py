"""Domain errors on the wire: the one table from reason to gRPC status, and the decorator that applies it.

Every refusal leaves as a status code plus one `google.rpc.ErrorInfo` (reason, domain "radixkv",
metadata), so the client can rebuild the same exception class. Anything else a handler raises is a
server bug: it is logged with its traceback and leaves as INTERNAL with no detail of the cause.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
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


def translating_errors(handler: Handler) -> Handler:
    """Wrap a servicer method: domain errors become their status, anything else INTERNAL."""

    @functools.wraps(handler)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except RadixKVError as e:
            log.debug("refused", extra={"method": handler.__name__, "reason": e.reason, **e.metadata})
            abort(context, e)
        except Exception:
            log.exception("internal error", extra={"method": handler.__name__})
            abort(context, RadixKVError("internal error (logged on the server)"))

    return wrapper  # type: ignore[return-value]
