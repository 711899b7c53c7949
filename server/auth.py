"""Bearer-token authentication: `authorization: Bearer <token>` metadata names the calling tenant.

`AuthInterceptor` refuses a call without a known token (UNAUTHENTICATED) and otherwise runs the
handler with the tenant as the current caller (`current_caller()`, a context variable the handler
reads before it returns). Health checking and reflection stay open: probes carry no token, and
neither reveals anything a tenant owns. Without auth configured, every caller is `ANONYMOUS`.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from radixkv.errors import Unauthenticated
from radixkv.server.config import TenantConfig
from radixkv.server.status import abort
from radixkv.server.tenants import ANONYMOUS, Tenant

_CALLER: contextvars.ContextVar[Tenant] = contextvars.ContextVar("radixkv_caller", default=ANONYMOUS)
PUBLIC_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_BEARER = "bearer "


def current_caller() -> Tenant:
    """The tenant of the RPC this thread is handling (ANONYMOUS when auth is off)."""
    return _CALLER.get()


def _digest(token: str) -> bytes:
    # Tokens are looked up by digest, so the table holds no token and lookups take no token-dependent time.
    return hashlib.sha256(token.encode()).digest()


class AuthInterceptor(grpc.ServerInterceptor):
    """Maps each call's bearer token to a tenant; refuses unknown or missing tokens."""

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        self._tenants = {_digest(t.token): Tenant.from_config(t) for t in tenants}
        self._handlers: dict[tuple[str, bytes], grpc.RpcMethodHandler] = {}

    def _tenant(self, metadata: Iterable[tuple[str, Any]] | None) -> tuple[bytes, Tenant] | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value[: len(_BEARER)].lower() == _BEARER:
                digest = _digest(value[len(_BEARER) :].strip())
                tenant = self._tenants.get(digest)
                return (digest, tenant) if tenant is not None else None
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(PUBLIC_METHOD_PREFIXES):  # type: ignore[attr-defined]
            return handler
        found = self._tenant(details.invocation_metadata)  # type: ignore[attr-defined]
        # One handler object per (method, tenant) and per method for refusals, built once.
        key = (details.method, found[0] if found else b"")  # type: ignore[attr-defined]
        wrapped = self._handlers.get(key)
        if wrapped is None:
            wrapped = self._handlers[key] = _replace_behaviour(handler, _as_caller(found[1]) if found else _refuse)
        return wrapped


def _refuse(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        abort(context, Unauthenticated("a valid 'authorization: Bearer <token>' is required"))

    return refuse


def _as_caller(tenant: Tenant) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            token = _CALLER.set(tenant)
            try:
                return behaviour(request, context)
            finally:
                _CALLER.reset(token)

        return call

    return wrap


def _replace_behaviour(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped (radixkv has no client-streaming-only RPCs).

    A streaming behaviour reads the caller before it returns its response iterator.
    """
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=wrap(handler.unary_unary))  # type: ignore[attr-defined]
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=wrap(handler.unary_stream))  # type: ignore[attr-defined]
    if handler.stream_stream is not None:
        return handler._replace(stream_stream=wrap(handler.stream_stream))  # type: ignore[attr-defined]
    raise AssertionError(f"auth interceptor: no known behaviour on {handler!r}")
