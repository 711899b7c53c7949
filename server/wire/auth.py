"""Bearer-token authentication: `authorization: Bearer <token>` metadata names the calling tenant.

`AuthInterceptor` refuses a call without a known token (UNAUTHENTICATED) and otherwise runs the
handler with the tenant as the current caller (`current_caller()`, a context variable the handler
reads before it returns). Health checking and reflection stay open: probes carry no token, and
neither reveals anything a tenant owns. Without auth configured, every caller is `ANONYMOUS`.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import grpc

from radixkv.errors import Unauthenticated
from radixkv.server.rules.tenant_config import TenantConfig
from radixkv.server.rules.tenants import ANONYMOUS, Tenant
from radixkv.server.wire.interceptors import WrappingInterceptor, method_of, wrap_handler
from radixkv.server.wire.status import abort

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


class AuthInterceptor(WrappingInterceptor):
    """Maps each call's bearer token to a tenant; refuses unknown or missing tokens."""

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        super().__init__()
        self._tenants = {_digest(t.token): Tenant.from_config(t) for t in tenants}

    def _tenant(self, metadata: Iterable[tuple[str, Any]] | None) -> tuple[bytes, Tenant] | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value[: len(_BEARER)].lower() == _BEARER:
                digest = _digest(value[len(_BEARER) :].strip())
                tenant = self._tenants.get(digest)
                return (digest, tenant) if tenant is not None else None
        return None

    def key(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> Hashable | None:
        if is_public(method_of(details)):
            return None
        found = self._tenant(details.invocation_metadata)
        return found if found is not None else b""  # one copy per tenant, and one for refusals

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, key: Hashable
    ) -> grpc.RpcMethodHandler:
        return wrap_handler(handler, _as_caller(key[1]) if isinstance(key, tuple) else _refuse)


def is_public(method: str) -> bool:
    """Health checking and reflection: open without a token (probes carry none)."""
    return method.startswith(PUBLIC_METHOD_PREFIXES)


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
