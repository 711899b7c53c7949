"""The disk tier's Prometheus metrics, per pool with one (`radixkv_disk_*`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.server.rules.disk_tier import PoolDisk

if TYPE_CHECKING:
    from radixkv.server.rules.pools import Pool

_GAUGES = (
    ("radixkv_disk_bytes", "Bytes of the disk tier's objects (headers included), plus those being written."),
    ("radixkv_disk_capacity_bytes", "The disk tier's byte cap."),
    ("radixkv_disk_blocks", "Blocks the disk tier's index holds."),
    ("radixkv_disk_objects", "Objects (files) in the disk tier."),
    ("radixkv_disk_pending_blocks", "Committed blocks not yet on disk (the crash window's contents)."),
    ("radixkv_disk_read_bytes_per_second", "The measured read bandwidth a load is weighed with (0: none yet)."),
    ("radixkv_disk_rebuild_seconds", "How long rebuilding the index from the directory took at start."),
)
_COUNTERS = (
    ("radixkv_disk_written_blocks", "Blocks written to the disk tier."),
    ("radixkv_disk_read_blocks", "Blocks read back from the disk tier and verified."),
    ("radixkv_disk_hit_tokens", "Tokens an open found on disk and loaded through the host tier."),
    ("radixkv_disk_evicted_blocks", "Blocks removed from the disk tier for room (LRU, or a tenant over its share)."),
    ("radixkv_disk_skipped_loads", "Disk hits left to recompute: reading them was slower than computing them."),
    ("radixkv_disk_write_errors", "Writes that failed (disk full, read-only, I/O error): the blocks stayed in memory."),
    ("radixkv_disk_unwritten_blocks", "Committed blocks evicted before the writer came, with 1 GiB already waiting."),
)


def values(disk: PoolDisk) -> dict[str, float]:
    store, cost = disk.store, disk.cost
    return {
        "radixkv_disk_bytes": store.num_bytes,
        "radixkv_disk_capacity_bytes": store.capacity_bytes,
        "radixkv_disk_blocks": len(store),
        "radixkv_disk_objects": store.num_objects,
        "radixkv_disk_pending_blocks": disk.num_pending,
        "radixkv_disk_read_bytes_per_second": cost.read_bytes_per_s or 0,
        "radixkv_disk_rebuild_seconds": store.rebuild_seconds,
        "radixkv_disk_written_blocks": store.num_written_blocks,
        "radixkv_disk_read_blocks": store.num_read_blocks,
        "radixkv_disk_hit_tokens": disk.num_hit_tokens,
        "radixkv_disk_evicted_blocks": store.num_evicted_blocks,
        "radixkv_disk_skipped_loads": cost.num_skipped_loads,
        "radixkv_disk_write_errors": store.num_write_errors,
        "radixkv_disk_unwritten_blocks": disk.num_unwritten_blocks,
    }


class DiskCollector:
    """Reads each disk tier's counters at scrape time (plain ints: no lock needed for a consistent-enough view)."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, doc, labels=["pool"]) for name, doc in _GAUGES}
        counters = {name: CounterMetricFamily(name, doc, labels=["pool"]) for name, doc in _COUNTERS}
        refused = CounterMetricFamily(
            "radixkv_disk_refused_objects",
            "Objects refused and removed (torn, corrupt, truncated, foreign, missing): "
            "never served, their prefix recomputed.",
            labels=["pool", "why"],
        )
        for pool in self._pools.values():
            if not isinstance(pool.disk, PoolDisk):
                continue
            for name, value in values(pool.disk).items():
                (gauges.get(name) or counters[name]).add_metric([pool.name], value)
            for why, num in sorted(pool.disk.store.refused.items()):
                refused.add_metric([pool.name, why], num)
        yield from gauges.values()
        yield from counters.values()
        yield refused
