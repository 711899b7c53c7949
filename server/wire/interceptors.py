"""How the server's interceptors wrap a method's handler: one helper, one cache, one order.

gRPC's Python server asks each interceptor for a method's handler on every call. An interceptor
that changes behaviour returns a copy of the handler with its behaviour (and perhaps its request
deserializer) wrapped. `WrappingInterceptor` builds that copy once per (inner handler, key) and
reuses it; `wrap_handler` is the one place that knows how a handler's behaviours are replaced.

The order, outermost first (set in `app.create_server`), and why:
  1. metrics: times and counts every call, refusals by any later interceptor included;
  2. auth: names the caller (`auth.current_caller()`), refuses an unknown token before any work;
  3. streams: bounds long-lived streams per peer, per tenant (known only after auth) and in all;
  4. decoding: refuses undecodable requests, after the caller was authenticated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import grpc

Behaviour = Callable[[Any, grpc.ServicerContext], Any]
Wrap = Callable[[Behaviour], Behaviour]
# Each kind of behaviour and grpc's public constructor of a handler that has it.
_CONSTRUCTORS: tuple[tuple[str, Callable[..., grpc.RpcMethodHandler]], ...] = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def wrap_handler(
    handler: grpc.RpcMethodHandler, wrap: Wrap, request_deserializer: Callable[[bytes], Any] | None = None
) -> grpc.RpcMethodHandler:
    """A new handler of the same kind, its behaviour wrapped (and its request deserializer replaced, if given),
    built with grpc's public constructors from the handler's public attributes."""
    for kind, construct in _CONSTRUCTORS:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return construct(
                wrap(behaviour),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise AssertionError(f"a handler without a behaviour: {handler!r}")


class WrappingInterceptor(grpc.ServerInterceptor):
    """Base of the server's interceptors: `key` says whether (and as what) to wrap, `wrap` builds the copy once."""

    def __init__(self) -> None:
        self._wrapped: dict[tuple[int, Hashable], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def key(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> Hashable | None:
        """What the wrapped copy depends on besides the handler (the method, a tenant); None: pass through."""
        raise NotImplementedError

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, key: Hashable
    ) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        key = self.key(handler, details)
        if key is None:
            return handler
        # Inner interceptors hand back one handler object per method (and tenant): wrap each once.
        # The identity check guards against a recycled id() of a handler that no longer exists.
        cache_key = (id(handler), key)
        cached = self._wrapped.get(cache_key)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[cache_key] = (handler, self.wrap(handler, details, key))
        return cached[1]


def method_of(details: grpc.HandlerCallDetails) -> str:
    """The full method name, "/package.Service/Method"."""
    return str(details.method)
