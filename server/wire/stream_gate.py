"""Long-lived streams bounded so that they can never hold every RPC thread.

The server is synchronous: each open stream (health `Watch`, reflection, `WatchEvents`) holds one
thread of the `max_workers` pool for as long as the client keeps it open. Unbounded, sixteen idle
streams opened without a token take every thread, and `Health/Check` and every authenticated
call time out. So every streaming call passes `StreamGate` first, which holds it to:
  - `max_streams` open in all, below `max_workers`, so unary calls always find a thread;
  - `max_streams_per_peer` from one connection;
  - a tenant's share of `max_streams` (see `Shares`, tenants.py);
  - `max_public_streams` for the calls that need no token (health, reflection);
  - per method where one has its own bound (`StreamBound`: `max_session_streams` for Session), that
    bound in all and a tenant's share of it (`max_session_streams_per_tenant`).
A stream past a bound is refused at once, RESOURCE_EXHAUSTED naming the bound, before it waits
on anything; a refused stream releases its thread immediately.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import grpc

from radixkv.errors import LimitExceeded
from radixkv.server.wire.auth import current_caller, is_public
from radixkv.server.wire.interceptors import Behaviour, WrappingInterceptor, method_of, wrap_handler
from radixkv.server.wire.status import abort

_PUBLIC = "\0public"  # the count key of unauthenticated streams (no tenant name contains NUL)


@dataclasses.dataclass(frozen=True, slots=True)
class StreamBound:
    """One method's own bound: `max_streams` of its streams open in all (refused as `limit`), and `max_per_tenant`
    of them per tenant (`<limit>_per_tenant`)."""

    limit: str
    max_streams: int
    max_per_tenant: int


class StreamGate(WrappingInterceptor):
    """Counts open streams by peer, by tenant and by bounded method; refuses past any bound."""

    def __init__(
        self,
        *,
        max_streams: int,
        max_per_peer: int,
        max_per_tenant: int,
        max_public: int,
        bounds: Mapping[str, StreamBound] | None = None,
    ) -> None:
        super().__init__()
        self.max_streams = max_streams
        self.max_per_peer = max_per_peer
        self.max_per_tenant = max_per_tenant
        self.max_public = max_public
        self.bounds = dict(bounds or {})  # full method name -> its own bound
        self._lock = threading.Lock()
        self._num_open = 0
        self._by_peer: dict[str, int] = {}
        self._by_owner: dict[str, int] = {}
        self._by_method: dict[str, int] = {}
        self._by_method_owner: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return self._num_open

    def key(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> Hashable | None:
        if not (handler.response_streaming or handler.request_streaming):
            return None
        return method_of(details)

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, key: Hashable
    ) -> grpc.RpcMethodHandler:
        method = method_of(details)
        public = is_public(method)

        def gated(behaviour: Behaviour) -> Behaviour:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                peer, owner = context.peer(), _PUBLIC if public else current_caller().name
                try:
                    self._take(method, peer, owner)
                except LimitExceeded as e:
                    abort(context, e)
                try:
                    responses = behaviour(request, context)
                except BaseException:
                    self._give_back(method, peer, owner)
                    raise
                if not handler.response_streaming:
                    self._give_back(method, peer, owner)  # a client stream answered once: over when it returns
                    return responses
                return _Held(responses, lambda: self._give_back(method, peer, owner))

            return call

        return wrap_handler(handler, gated)

    def _take(self, method: str, peer: str, owner: str) -> None:
        with self._lock:
            if self._num_open >= self.max_streams:
                raise LimitExceeded("max_streams", self._num_open + 1, self.max_streams)
            by_owner = self._by_owner.get(owner, 0)
            if owner == _PUBLIC and by_owner >= self.max_public:
                raise LimitExceeded("max_public_streams", by_owner + 1, self.max_public)
            if owner != _PUBLIC and by_owner >= self.max_per_tenant:
                raise LimitExceeded("max_streams_per_tenant", by_owner + 1, self.max_per_tenant)
            by_peer = self._by_peer.get(peer, 0)
            if by_peer >= self.max_per_peer:
                raise LimitExceeded("max_streams_per_peer", by_peer + 1, self.max_per_peer)
            bound = self.bounds.get(method)
            if bound is not None:
                in_method, of_owner = self._by_method.get(method, 0), self._by_method_owner.get((method, owner), 0)
                if in_method >= bound.max_streams:
                    raise LimitExceeded(bound.limit, in_method + 1, bound.max_streams)
                if of_owner >= bound.max_per_tenant:
                    raise LimitExceeded(f"{bound.limit}_per_tenant", of_owner + 1, bound.max_per_tenant)
                self._by_method[method] = in_method + 1
                self._by_method_owner[(method, owner)] = of_owner + 1
            self._num_open += 1
            self._by_peer[peer] = by_peer + 1
            self._by_owner[owner] = by_owner + 1

    def _give_back(self, method: str, peer: str, owner: str) -> None:
        with self._lock:
            self._num_open -= 1
            counted: list[tuple[dict[Any, int], Any]] = [(self._by_peer, peer), (self._by_owner, owner)]
            if method in self.bounds:
                counted += [(self._by_method, method), (self._by_method_owner, (method, owner))]
            for counts, key in counted:
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]


class _Held:
    """A stream's responses; its slot is given back once, when they end or fail, or when gRPC drops the
    stream unread (a cancelled call: a generator never started would run no `finally`)."""

    def __init__(self, responses: Iterator[Any], give_back: Callable[[], None]) -> None:
        self._responses = iter(responses)
        self._give_back: Callable[[], None] | None = give_back
        self._lock = threading.Lock()

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._responses)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._lock:
            give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __del__(self) -> None:
        self._release()
