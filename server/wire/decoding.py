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

from collections.abc import Callable, Hashable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from radixkv.errors import InvalidArgument
from radixkv.server.wire.interceptors import WrappingInterceptor, method_of, wrap_handler
from radixkv.server.wire.status import abort

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
