"""Prometheus metrics: pool gauges and counters read at scrape time, and per-RPC latency and codes.

Each server has its own `CollectorRegistry` (two servers in one process never share series). Pool
numbers are not mirrored into metric objects on every call: the collector reads each pool's
`stats()` (O(1)) under its lock when scraped, so the hot path pays only for the RPC histogram.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.server.process.disk_metrics import DiskCollector
from radixkv.server.process.kv_events_metrics import EventsCollector
from radixkv.server.rules.config import DEFAULT_POOL
from radixkv.server.wire.interceptors import Behaviour, WrappingInterceptor, method_of, wrap_handler
from radixkv.server.wire.status import forget_refusal, last_refusal

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from radixkv.server.rules.service import KVService
    from radixkv.server.wire.servicer import SessionStreams
    from radixkv.server.wire.stream_gate import StreamGate

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
    ("radixkv_reserved_blocks", "num_blocks_reserved", "Blocks reserved for budgeted sequences' growth."),
    (
        "radixkv_memory_pressure_ratio",
        "memory_pressure",
        "(Blocks in use + reserved) / blocks in the pool: < 0.7 normal, 0.7-0.9 high, > 0.9 danger.",
    ),
    ("radixkv_preempted_sequences", "num_preempted_sequences", "Sequences preempted and not yet resumed."),
    (
        "radixkv_swapped_sequences",
        "num_swapped_sequences",
        "Sequences preempted by swap: their blocks on the host tier.",
    ),
)
# radixkv_host_blocks{state}: the host tier's blocks by what holds them (Stats field per state).
_HOST_STATES = (
    ("free", "num_host_blocks_free"),
    ("cached", "num_host_blocks_cached"),
    ("swapped", "num_host_blocks_swapped"),
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
    ("radixkv_resumed_sequences", "num_resumed_sequences", "Preempted sequences resumed."),
    ("radixkv_recomputed_tokens", "num_recomputed_tokens", "Tokens resumes after recompute handed back to prefill."),
    (
        "radixkv_host_hit_tokens",
        "num_host_hit_tokens",
        "Prompt tokens loaded back from the host tier (in hit_tokens too).",
    ),
    ("radixkv_offloaded_blocks", "num_offloaded_blocks", "Blocks copied from the device to the host tier."),
    ("radixkv_loaded_blocks", "num_loaded_blocks", "Blocks copied from the host tier back to the device."),
    ("radixkv_host_evicted_blocks", "num_host_evicted_blocks", "Host-tier blocks evicted to make room."),
)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _PoolCollector:
    def __init__(self, service: KVService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, doc, labels=["pool"]) for name, _, doc in _GAUGES}
        counters = {name: CounterMetricFamily(name, doc, labels=["pool"]) for name, _, doc in _COUNTERS}
        usage = GaugeMetricFamily("radixkv_block_usage_ratio", "Blocks in use / blocks in the pool.", labels=["pool"])
        hits = GaugeMetricFamily(
            "radixkv_prefix_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens opened, since the pool started "
            "(radixkv_hit_tokens_total / radixkv_requested_tokens_total; 0 before any open).",
            labels=["pool"],
        )
        watchers = GaugeMetricFamily("radixkv_event_watchers", "Open WatchEvents streams.", labels=["pool"])
        misses = CounterMetricFamily(
            "radixkv_miss_tokens",
            "Tokens past the cached prefix, by reason (Match with explain only).",
            labels=["pool", "reason"],
        )
        preemptions = CounterMetricFamily(
            "radixkv_preemptions", "Sequences preempted, by mode.", labels=["pool", "mode"]
        )
        refusals = CounterMetricFamily(
            "radixkv_admission_refusals",
            "Opens refused by admission (NOT_ADMITTED) or a tenant's token budget (TOKEN_BUDGET).",
            labels=["pool", "reason"],
        )
        host_blocks = GaugeMetricFamily(
            "radixkv_host_blocks",
            "Host-tier blocks by state (free, cached, swapped); none without a host tier.",
            labels=["pool", "state"],
        )
        tombstones = GaugeMetricFamily(
            "radixkv_tombstone_bytes", "Estimated memory of the evicted-block table explain reads.", labels=["pool"]
        )
        refused = CounterMetricFamily(
            "radixkv_snapshot_refusals",
            "Restart snapshots refused at start (the pool started cold), by why.",
            labels=["pool", "why"],
        )
        adopted = GaugeMetricFamily(
            "radixkv_adopted_blocks", "Cached blocks adopted from the previous server's snapshot.", labels=["pool"]
        )
        visited = CounterMetricFamily(
            "radixkv_eviction_leaves_visited",
            "Leaves eviction looked at (the work it did under the pool's lock).",
            labels=["pool"],
        )
        restart_safe = GaugeMetricFamily(
            "radixkv_pool_restart_safe",
            "1 while a live keeper holds the pool's memory (it outlives this server), else 0.",
            labels=["pool"],
        )
        for pool in self._service.pools.values():
            for why, num in sorted(pool.snapshot_refusals.items()):
                refused.add_metric([pool.name, why], num)
            adopted.add_metric([pool.name], pool.num_adopted_blocks)
            with pool.lock:
                stats = pool.cache.stats()
                num_miss_tokens = dict(pool.num_miss_tokens)
                tombstones.add_metric([pool.name], pool.events.tombstones.num_bytes)
                num_token_budget_refusals = pool.num_token_budget_refusals
                visited.add_metric([pool.name], pool.cache.tree.num_leaves_visited)
            preemptions.add_metric([pool.name, "swap"], stats.num_preemptions_swap)
            preemptions.add_metric([pool.name, "recompute"], stats.num_preemptions_recompute)
            refusals.add_metric([pool.name, "NOT_ADMITTED"], stats.num_admission_refusals)
            refusals.add_metric([pool.name, "TOKEN_BUDGET"], num_token_budget_refusals)
            for reason, num in sorted(num_miss_tokens.items()):
                misses.add_metric([pool.name, reason], num)
            for name, field, _ in _GAUGES:
                gauges[name].add_metric([pool.name], getattr(stats, field))
            for name, field, _ in _COUNTERS:
                counters[name].add_metric([pool.name], getattr(stats, field))
            if stats.num_host_blocks_total:
                for state, field in _HOST_STATES:
                    host_blocks.add_metric([pool.name, state], getattr(stats, field))
            usage.add_metric([pool.name], stats.usage_ratio)
            hits.add_metric([pool.name], stats.hit_ratio)
            watchers.add_metric([pool.name], pool.events.num_watchers)
            restart_safe.add_metric([pool.name], 1 if pool.restart_safe() else 0)
        yield from gauges.values()
        yield from counters.values()
        yield usage
        yield hits
        yield watchers
        yield misses
        yield host_blocks
        yield preemptions
        yield refusals
        yield tombstones
        yield refused
        yield adopted
        yield restart_safe
        yield visited
        yield GaugeMetricFamily("radixkv_sessions", "Live sessions.", value=len(self._service.sessions))
        yield GaugeMetricFamily(
            "radixkv_request_window_bytes",
            "Bytes the sessions' request-id windows keep for retries, all together (server/rules/sessions.py).",
            value=self._service.sessions.windows.num_bytes,
        )


class _StreamCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        gate = self._metrics.gate
        if gate is not None:
            yield GaugeMetricFamily("radixkv_open_streams", "Open long-lived streams (all kinds).", value=len(gate))
        frames = self._metrics.frames
        if frames is not None:
            yield CounterMetricFamily(
                "radixkv_frame_bytes_measured",
                "Bytes of Session frames' answers measured to fit their responses.",
                value=frames.num_bytes_measured,
            )
            yield CounterMetricFamily(
                "radixkv_frame_steps_abandoned",
                "Steps of Session frames never applied: their caller had left.",
                value=frames.num_steps_abandoned,
            )


class ServerMetrics:
    """The registry, the RPC interceptor feeding it, and the HTTP endpoint serving it."""

    def __init__(self, service: KVService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(service))
        self.registry.register(DiskCollector(service.pools))
        self.registry.register(EventsCollector(service))
        self._latency = Histogram(
            "radixkv_rpc_duration_seconds",
            "Unary RPC handling time.",
            ["method", "pool"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self._calls = Counter(
            "radixkv_rpcs",
            "RPCs (streams included) by final status code.",
            ["method", "pool", "code"],
            registry=self.registry,
        )
        self._refusals = Counter(
            "radixkv_refusals",
            "Calls refused, by reason and by the limit that refused them (empty when not a limit).",
            ["method", "reason", "limit"],
            registry=self.registry,
        )
        self.gate: StreamGate | None = None  # the open streams it reports, once set (`watch_streams`)
        self.frames: SessionStreams | None = None  # the Session frames' work it reports, once set (`count_frames`)
        self.registry.register(_StreamCollector(self))
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

    def observe(self, method: str, pool: str, code: grpc.StatusCode, seconds: float | None) -> None:
        """One finished call: its code, its time (unary calls), and what refused it, if anything did."""
        if pool and pool not in self._pool_names:
            pool = "unknown"  # a label per name a client makes up would grow without bound
        children = self._children
        if seconds is not None:
            latency = children.get((method, pool))
            if latency is None:
                latency = children[(method, pool)] = self._latency.labels(method, pool)
            latency.observe(seconds)
        calls = children.get((method, pool, code.name))
        if calls is None:
            calls = children[(method, pool, code.name)] = self._calls.labels(method, pool, code.name)
        calls.inc()
        refusal = last_refusal()
        if refusal is not None:
            # Reasons and limit names come from the code, never from a request: a bounded label set.
            self._refusals.labels(method, refusal.reason, refusal.metadata.get("limit", "")).inc()

    def watch_streams(self, gate: StreamGate) -> None:
        """Report the open streams `gate` counts."""
        self.gate = gate

    def count_frames(self, streams: SessionStreams) -> None:
        """Report the work of the Session frames `streams` answers."""
        self.frames = streams


class _MetricsInterceptor(WrappingInterceptor):
    """Times unary calls and counts every call, streams included, by final code; counts refusals by reason
    and limit. Outermost, so refusals by auth and the stream gate are counted too."""

    def __init__(self, metrics: ServerMetrics) -> None:
        super().__init__()
        self._metrics = metrics

    def key(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> Hashable | None:
        return method_of(details).rsplit("/", 1)[-1]

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails, key: Hashable
    ) -> grpc.RpcMethodHandler:
        method = str(key)
        if handler.response_streaming:
            return wrap_handler(handler, lambda behaviour: self._counted(method, behaviour))
        return wrap_handler(handler, lambda behaviour: self._timed(method, behaviour))

    def _timed(self, method: str, behaviour: Behaviour) -> Behaviour:
        observe = self._metrics.observe

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            forget_refusal()
            try:
                return behaviour(request, context)
            finally:
                observe(method, _pool_of(request), _code_of(context) or grpc.StatusCode.OK, time.perf_counter() - start)

        return timed

    def _counted(self, method: str, behaviour: Behaviour) -> Behaviour:
        """A stream is counted when it ends (its final code), or when it is refused before it starts."""
        observe = self._metrics.observe

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            forget_refusal()
            pool = _pool_of(request)
            try:
                responses = behaviour(request, context)
            except BaseException:
                observe(method, pool, _code_of(context) or grpc.StatusCode.UNKNOWN, None)
                raise
            return _counted_stream(
                responses, lambda: observe(method, pool, _code_of(context) or grpc.StatusCode.OK, None)
            )

        return counted


def _counted_stream(responses: Iterator[Any], done: Callable[[], None]) -> Iterator[Any]:
    try:
        yield from responses
    finally:
        done()


def _code_of(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """The status set so far; `ServicerContext.code()` exists since grpcio 1.38, types-grpcio does not declare it."""
    code: grpc.StatusCode | None = context.code()  # type: ignore[attr-defined]
    return code


def _pool_of(request: Any) -> str:
    pool = getattr(request, "pool", None)
    return (pool or DEFAULT_POOL) if isinstance(pool, str) else ""
