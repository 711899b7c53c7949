"""Prometheus metrics: pool gauges and counters read at scrape time, and per-RPC latency and codes.

Each server has its own `CollectorRegistry` (two servers in one process never share series). Pool
numbers are not mirrored into metric objects on every call: the collector reads each pool's
`stats()` (O(1)) under its lock when scraped, so the hot path pays only for the RPC histogram.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.server.config import DEFAULT_POOL

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from radixkv.server.service import KVService

# (metric name, Stats field, help)
_GAUGES = (
    ("radixkv_pool_blocks", "num_blocks_total", "Blocks in the pool."),
    ("radixkv_blocks_free", "num_blocks_free", "Blocks on the free list."),
    ("radixkv_blocks_cached", "num_blocks_cached", "Blocks held by the prefix tree."),
    ("radixkv_blocks_evictable", "num_blocks_evictable", "Cached blocks no sequence holds: reclaimable on demand."),
    ("radixkv_blocks_pinned", "num_blocks_pinned", "Cached blocks kept resident by pins."),
    ("radixkv_blocks_in_use", "num_blocks_in_use", "Blocks neither free nor evictable."),
    ("radixkv_live_sequences", "num_live_sequences", "Open sequences."),
    ("radixkv_namespaces", "num_namespaces", "Namespaces with a prefix-tree root."),
)
_COUNTERS = (
    ("radixkv_requested_tokens", "num_requested_tokens", "Prompt tokens of opened sequences."),
    ("radixkv_hit_tokens", "num_hit_tokens", "Prompt tokens served from the prefix cache."),
    ("radixkv_evicted_blocks", "num_evicted_blocks", "Cached blocks evicted to make room."),
    ("radixkv_allocation_failures", "num_allocation_failures", "Requests refused for lack of blocks."),
    ("radixkv_cow_copies", "num_cow_copies", "Copy-on-write block copies handed to workers."),
    ("radixkv_opened_sequences", "num_opened_sequences", "Sequences opened."),
    ("radixkv_forked_sequences", "num_forked_sequences", "Sequences created by fork."),
    ("radixkv_released_sequences", "num_released_sequences", "Sequences released."),
)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _PoolCollector:
    def __init__(self, service: KVService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, doc, labels=["pool"]) for name, _, doc in _GAUGES}
        counters = {name: CounterMetricFamily(name, doc, labels=["pool"]) for name, _, doc in _COUNTERS}
        usage = GaugeMetricFamily("radixkv_block_usage_ratio", "Blocks in use / blocks in the pool.", labels=["pool"])
        watchers = GaugeMetricFamily("radixkv_event_watchers", "Open WatchEvents streams.", labels=["pool"])
        for pool in self._service.pools.values():
            with pool.lock:
                stats = pool.cache.stats()
            for name, field, _ in _GAUGES:
                gauges[name].add_metric([pool.name], getattr(stats, field))
            for name, field, _ in _COUNTERS:
                counters[name].add_metric([pool.name], getattr(stats, field))
            usage.add_metric([pool.name], stats.usage_ratio)
            watchers.add_metric([pool.name], pool.events.num_watchers)
        yield from gauges.values()
        yield from counters.values()
        yield usage
        yield watchers
        yield GaugeMetricFamily("radixkv_sessions", "Live sessions.", value=len(self._service.sessions))


class ServerMetrics:
    """The registry, the RPC interceptor feeding it, and the HTTP endpoint serving it."""

    def __init__(self, service: KVService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(service))
        self._latency = Histogram(
            "radixkv_rpc_duration_seconds",
            "Unary RPC handling time.",
            ["method", "pool"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self._calls = Counter(
            "radixkv_rpcs", "RPCs by final status code.", ["method", "pool", "code"], registry=self.registry
        )
        self._children: dict[tuple[str, ...], Any] = {}
        self._pool_names = frozenset(service.pools)
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics; returns the port bound (`port` 0 picks one)."""
        self._http, self._http_thread = start_http_server(port, host, registry=self.registry)
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def interceptor(self) -> grpc.ServerInterceptor:
        return _MetricsInterceptor(self)

    def observe(self, method: str, pool: str, code: grpc.StatusCode, seconds: float) -> None:
        if pool and pool not in self._pool_names:
            pool = "unknown"  # a label per name a client makes up would grow without bound
        children = self._children
        latency = children.get((method, pool))
        if latency is None:
            latency = children[(method, pool)] = self._latency.labels(method, pool)
        calls = children.get((method, pool, code.name))
        if calls is None:
            calls = children[(method, pool, code.name)] = self._calls.labels(method, pool, code.name)
        latency.observe(seconds)
        calls.inc()


class _MetricsInterceptor(grpc.ServerInterceptor):
    """Times unary handlers (outermost, so refusals by auth are counted too). Streams pass through."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        # Inner interceptors hand back one handler object per method (and tenant): wrap each once.
        cached = self._wrapped.get(id(handler))
        if cached is None or cached[0] is not handler:
            method = details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
            cached = self._wrapped[id(handler)] = (
                handler,
                handler._replace(unary_unary=self._timed(method, handler.unary_unary)),
            )  # type: ignore[attr-defined]
        return cached[1]

    def _timed(
        self, method: str, behaviour: Callable[[Any, grpc.ServicerContext], Any]
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        observe = self._metrics.observe

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return behaviour(request, context)
            finally:
                pool = getattr(request, "pool", None)
                observe(
                    method,
                    (pool or DEFAULT_POOL) if pool is not None else "",
                    context.code() or grpc.StatusCode.OK,
                    time.perf_counter() - start,
                )

        return timed
