"""The online audit (`radixkv serve --audit-interval S`): recount each live pool's bookkeeping, one pool per run.

Every `interval` seconds a background thread takes the next pool (round robin) and runs the same
recount tests run: the core (tree, block tables, ref counts, free list), the server's ledger, and
the event hub's per-namespace digests and block counts against a recount from the tree. It never
recounts under the pool's lock: it copies the pool in slices of at most about `slice_seconds` each
(`radixkv.server.process.audit_image`), whatever the pool's size, and recounts the copy with no lock held.
A slice takes the lock only when it is free within `_BUSY_WAIT` seconds: a run whose first slice
finds the pool busy is skipped (counted); a later busy slice just waits its turn again. How long each
slice held the lock is a histogram and a max gauge, so its cost is measured, not assumed. A
divergence is counted and logged once (until the pool passes again); the audit keeps running.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixkv.server.process.audit_image import PoolImage, compare_digests
from radixkv.server.rules.pools import Pool
from radixkv.tree.block_hash import wire_hash

log = logging.getLogger("radixkv.server.process.audit")

_BUSY_WAIT = 0.005  # seconds the audit waits for a pool's lock before it skips the slice
_PAUSE = 0.001  # seconds between two slices of one run: RPCs waiting for the lock get it first
_MAX_SLICES = 10_000  # a run whose copy never settles (writes outpacing it) gives up, counted as skipped
_SLICE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def check_digests(pool: Pool) -> None:
    """The hub's hash table, per-namespace block counts and digests equal a recount from the tree (under the lock)."""
    hub, tree = pool.events, pool.cache.tree
    hub.hashes.check_against(tree.tree_block_ids())
    wires: dict[str, list[int]] = {}
    for namespace, node in tree.nodes():
        wires.setdefault(namespace, []).extend(wire_hash(hub.hashes[block_id]) for block_id in node.block_ids)
    compare_digests(wires, hub.num_blocks, hub.digests)


def check_pool(pool: Pool) -> None:
    """Raises AssertionError naming the first divergence of `pool` (call under its lock)."""
    pool.cache.check_invariants()
    pool.ledger.check_invariants(pool.cache)
    check_digests(pool)


class PoolAuditor:
    """A daemon thread auditing one pool per `interval` seconds; `start`, then `stop`."""

    def __init__(
        self, pools: Mapping[str, Pool], *, interval: float, registry: CollectorRegistry, slice_seconds: float = 0.002
    ) -> None:
        if interval <= 0:
            raise ValueError("audit interval must be > 0 seconds")
        if slice_seconds <= 0:
            raise ValueError("audit slice must be > 0 seconds")
        self._pools = list(pools.values())
        self._interval = interval
        self._slice_seconds = slice_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-audit", daemon=True)
        self._failing: set[str] = set()  # pools whose divergence was logged and has not cleared since
        self._runs = Counter("radixkv_audit_runs", "Audit runs completed (one pool each).", ["pool"], registry=registry)
        self._failures = Counter(
            "radixkv_audit_failures", "Audit runs that found a divergence.", ["pool"], registry=registry
        )
        self._skips = Counter(
            "radixkv_audit_skipped", "Audit runs skipped because the pool was busy.", ["pool"], registry=registry
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
        """One run: True when `pool` passed, False on a divergence, None when it was busy (skipped)."""
        image = PoolImage(pool)
        done = False
        try:
            done = self._slice(pool, image)
            while image.num_holds and not done and image.num_holds < _MAX_SLICES and not self._stop.wait(_PAUSE):
                done = self._slice(pool, image)
        finally:
            if image.num_holds and not done:
                with pool.lock:
                    image.abort()
        if not done:
            self._skips.labels(pool.name).inc()
            return None
        try:
            image.check()
            violation = None
        except AssertionError as e:
            violation = str(e) or "assertion failed"
        self._runs.labels(pool.name).inc()
        if violation is None:
            self._failing.discard(pool.name)
            return True
        self._failures.labels(pool.name).inc()
        if pool.name not in self._failing:
            self._failing.add(pool.name)
            log.error(
                "audit divergence",
                extra={"pool": pool.name, "violation": violation, "at": time.time(), "slices": image.num_holds},
            )
        return False

    def _slice(self, pool: Pool, image: PoolImage) -> bool:
        """One lock hold of at most about the slice budget; True once the image is complete, False when not yet
        (or when the pool stayed busy for `_BUSY_WAIT`: then `image.num_holds` does not move)."""
        if not pool.lock.acquire(timeout=_BUSY_WAIT):
            return False
        collecting = gc.isenabled()
        gc.disable()  # a collection the copy's allocations set off runs after the hold, not inside it
        start = time.perf_counter()
        try:
            done = image.step(self._slice_seconds)
        finally:
            held = time.perf_counter() - start
            pool.lock.release()
            if collecting:
                gc.enable()
        self._held.labels(pool.name).observe(held)
        if held > self.max_held_seconds.get(pool.name, 0.0):
            self.max_held_seconds[pool.name] = held
            self._max_held.labels(pool.name).set(held)
        return done
