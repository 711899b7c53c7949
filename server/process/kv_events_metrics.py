"""Prometheus series of each pool's event path: what its publisher, replay ring and replay socket hold now.

Each is a bound the operator can watch against its limit (`kv_events_buffer_bytes`, `kv_events_max_replay_peers`,
...): the ring's bytes, the replay socket's peers and what it may have queued for them, and the event hub's
namespaces (back to those with cached blocks when names come and go). Read at scrape time; the publisher's
numbers are written by its own threads and read here without a lock (ints, for a gauge).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from radixkv.server.rules.service import KVService

_PUBLISHER = (  # (name, kind, what, attribute of ZmqEventPublisher)
    ("radixkv_kv_events_batches", "counter", "KV-event batches published.", "num_batches"),
    ("radixkv_kv_events_split_events", "counter", "Events larger than a batch, sent as chains.", "num_split_events"),
    ("radixkv_kv_events_refused_events", "counter", "Events no batch could hold: not published.", "num_refused_events"),
    (
        "radixkv_kv_events_coalesced_blocks",
        "counter",
        "Blocks stored and removed within one call: not published.",
        "num_coalesced_blocks",
    ),
)
_RING = (  # (name, what, attribute of ReplayBuffer)
    ("radixkv_kv_events_ring_bytes", "Payload bytes in the replay ring (at most kv_events_buffer_bytes).", "num_bytes"),
)
_REPLAY = (  # (name, kind, what, attribute of ReplayServer)
    (
        "radixkv_kv_replay_queued_bytes",
        "gauge",
        "At most what the replay socket holds for its peers now.",
        "num_queued_bytes",
    ),
    ("radixkv_kv_replay_active", "gauge", "Replays being served.", "num_replays"),
    ("radixkv_kv_replay_served", "counter", "Replays answered to their end marker.", "num_served"),
    (
        "radixkv_kv_replay_preempted",
        "counter",
        "Replays cut short for a waiting peer or past their time.",
        "num_preempted",
    ),
    (
        "radixkv_kv_replay_dropped_requests",
        "counter",
        "Replay requests dropped (malformed, repeated, no room).",
        "num_dropped_requests",
    ),
    ("radixkv_kv_replay_dropped_peers", "counter", "Replays abandoned: the peer left or stalled.", "num_dropped_peers"),
)
_GATE = (  # (name, kind, what, attribute of PeerGate)
    (
        "radixkv_kv_replay_peers",
        "gauge",
        "Connections to the replay socket (at most kv_events_max_replay_peers).",
        "num_peers",
    ),
    ("radixkv_kv_replay_refused_peers", "counter", "Connections refused at kv_events_max_replay_peers.", "num_refused"),
)


def _family(name: str, kind: str, what: str) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, what, labels=["pool"])


class EventsCollector:
    """The event path's series, one per pool (the publisher's only where the pool publishes)."""

    def __init__(self, service: KVService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        namespaces = GaugeMetricFamily(
            "radixkv_event_namespaces", "Namespaces the event hub keeps numbers and digests for.", labels=["pool"]
        )
        subscribers = GaugeMetricFamily(
            "radixkv_kv_events_subscribers",
            "Connections to the bound PUB sockets (events, digest), each at most kv_events_max_subscribers.",
            labels=["pool"],
        )
        refused = CounterMetricFamily(
            "radixkv_kv_events_refused_subscribers",
            "Connections refused at kv_events_max_subscribers.",
            labels=["pool"],
        )
        families = {name: _family(name, kind, what) for name, kind, what, _ in (*_PUBLISHER, *_REPLAY, *_GATE)}
        families.update({name: _family(name, "gauge", what) for name, what, _ in _RING})
        for pool in self._service.pools.values():
            with pool.lock:
                namespaces.add_metric([pool.name], pool.events.num_namespaces)
                publisher = pool.kv_publisher
            if publisher is None:
                continue
            subscribers.add_metric([pool.name], sum(g.num_peers for g in publisher.subscriber_gates))
            refused.add_metric([pool.name], sum(g.num_refused for g in publisher.subscriber_gates))
            sources = [(_PUBLISHER, publisher), (tuple((n, "gauge", w, a) for n, w, a in _RING), publisher.buffer)]
            if publisher.replay is not None:
                sources.append((_REPLAY, publisher.replay))
                if publisher.replay.gate is not None:
                    sources.append((_GATE, publisher.replay.gate))
            for rows, source in sources:
                for name, _, _, attribute in rows:
                    families[name].add_metric([pool.name], getattr(source, attribute))
        yield namespaces
        yield subscribers
        yield refused
        yield from families.values()
