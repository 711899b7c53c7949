"""Requests whose bytes do not parse: refused as INVALID_ARGUMENT with an ErrorInfo, like any other bad field.

Left to gRPC, a request its deserializer rejects ends as a bare INTERNAL ("Exception deserializing
request!") with no ErrorInfo, which reads as a server bug and which the client cannot map to an
exception class. `DecodingInterceptor` gives every unary-request method (radixkv's, health's) a
deserializer that never raises: bytes that do not parse become an `Undecodable`, which the handler
refuses before any other work. It is the innermost interceptor, so authentication still refuses an
unauthenticated caller first. radixkv's request-streaming methods (the Session stream) get the same
deserializer and answer an `Undecodable` message themselves, in-band; reflection keeps gRPC's handling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from radixkv.errors import InvalidArgument
from radixkv.server.status import abort

RADIXKV_METHOD_PREFIX = "/radixkv."


class Undecodable:
    """A request that did not parse as its method's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class DecodingInterceptor(grpc.ServerInterceptor):
    """Swaps each unary-request method's deserializer for one that turns a parse failure into `Undecodable`."""

    def __init__(self) -> None:
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming and not method.startswith(RADIXKV_METHOD_PREFIX):
            return handler
        cached = self._handlers.get(method)
        if cached is None or cached[0] is not handler:  # registered handlers are built once: wrap each once
            cached = self._handlers[method] = (handler, _tolerant(handler, method))
        return cached[1]


def _tolerant(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    assert parse is not None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError) as e:  # ValueError: a string field that is not UTF-8, on some runtimes
            return Undecodable(str(e) or type(e).__name__)

    def refusing(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                abort(context, InvalidArgument("request", f"not a valid {method} request: {request.error}"))
            return behaviour(request, context)

        return call

    if handler.request_streaming:  # the handler answers each Undecodable message itself
        return handler._replace(request_deserializer=deserialize)  # type: ignore[attr-defined]
    if handler.unary_unary is not None:
        return handler._replace(request_deserializer=deserialize, unary_unary=refusing(handler.unary_unary))  # type: ignore[attr-defined]
    assert handler.unary_stream is not None, f"{method}: a unary request, yet no unary behaviour"
    return handler._replace(request_deserializer=deserialize, unary_stream=refusing(handler.unary_stream))  # type: ignore[attr-defined]
