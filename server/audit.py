"""The online audit (`radixkv serve --audit-interval S`): recount each live pool's bookkeeping, one pool per slice.

Every `interval` seconds a background thread takes the next pool (round robin) and, holding that
pool's lock, runs the same recount tests run: the core (tree, block tables, ref counts, free list),
the server's ledger, and the event hub's per-namespace digests and block counts against a recount
from the tree. The lock is held for one slice only, and only when it is free within `_BUSY_WAIT`
seconds: a busy pool skips its slice (counted) rather than queueing RPCs behind the audit. How long
each slice held the lock is a histogram and a max gauge, so its cost is measured, not assumed.
A divergence is counted and logged once (until the pool passes again); the audit keeps running.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixkv.block_hash import digest_of, wire_hash
from radixkv.server.pools import Pool

log = logging.getLogger("radixkv.server.audit")

_BUSY_WAIT = 0.005  # seconds the audit waits for a pool's lock before it skips the slice
_SLICE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def check_digests(pool: Pool) -> None:
    """The hub's hash table, per-namespace block counts and digests equal a recount from the tree (under the lock)."""
    hub, tree = pool.events, pool.cache.tree
    hub.hashes.check_against(tree.tree_block_ids())
    wires: dict[str, list[int]] = {}
    for namespace, node in tree.nodes():
        wires.setdefault(namespace, []).extend(wire_hash(hub.hashes[block_id]) for block_id in node.block_ids)
    counts = {namespace: len(w) for namespace, w in wires.items()}
    assert counts == hub.num_blocks, f"event hub block counts {hub.num_blocks} != recount {counts}"
    for namespace, namespace_wires in wires.items():
        recount = digest_of(namespace_wires)
        assert hub.digests.get(namespace) == recount, (
            f"namespace {namespace!r}: event hub digest {hub.digests.get(namespace)} != recount {recount}"
        )


def check_pool(pool: Pool) -> None:
    """Raises AssertionError naming the first divergence of `pool` (call under its lock)."""
    pool.cache.check_invariants()
    pool.ledger.check_invariants(pool.cache)
    check_digests(pool)


class PoolAuditor:
    """A daemon thread auditing one pool per `interval` seconds; `start`, then `stop`."""

    def __init__(self, pools: Mapping[str, Pool], interval: float, registry: CollectorRegistry) -> None:
        if interval <= 0:
            raise ValueError("audit interval must be > 0 seconds")
        self._pools = list(pools.values())
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-audit", daemon=True)
        self._failing: set[str] = set()  # pools whose divergence was logged and has not cleared since
        self._runs = Counter("radixkv_audit_runs", "Audit slices run (one pool each).", ["pool"], registry=registry)
        self._failures = Counter(
            "radixkv_audit_failures", "Audit slices that found a divergence.", ["pool"], registry=registry
        )
        self._skips = Counter(
            "radixkv_audit_skipped", "Audit slices skipped because the pool was busy.", ["pool"], registry=registry
        )
        self._held = Histogram(
            "radixkv_audit_slice_seconds",
            "Time one audit slice held its pool's lock.",
            ["pool"],
            registry=registry,
            buckets=_SLICE_BUCKETS,
        )
        self._max_held = Gauge(
            "radixkv_audit_max_slice_seconds",
            "Longest time one audit slice held its pool's lock.",
            ["pool"],
            registry=registry,
        )
        self.max_held_seconds: dict[str, float] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for pool in itertools.cycle(self._pools):
            if self._stop.wait(self._interval):
                return
            self.audit(pool)

    def audit(self, pool: Pool) -> bool | None:
        """One slice: True when `pool` passed, False on a divergence, None when it was busy (skipped)."""
        if not pool.lock.acquire(timeout=_BUSY_WAIT):
            self._skips.labels(pool.name).inc()
            return None
        start = time.perf_counter()
        try:
            check_pool(pool)
            violation = None
        except AssertionError as e:
            violation = str(e) or "assertion failed"
        finally:
            held = time.perf_counter() - start
            pool.lock.release()
        self._runs.labels(pool.name).inc()
        self._held.labels(pool.name).observe(held)
        if held > self.max_held_seconds.get(pool.name, 0.0):
            self.max_held_seconds[pool.name] = held
            self._max_held.labels(pool.name).set(held)
        if violation is None:
            self._failing.discard(pool.name)
            return True
        self._failures.labels(pool.name).inc()
        if pool.name not in self._failing:
            self._failing.add(pool.name)
            log.error(
                "audit divergence",
                extra={"pool": pool.name, "violation": violation, "at": time.time(), "held_seconds": held},
            )
        return False
