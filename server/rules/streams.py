"""WatchEvents streams: each a watcher on one pool's event hub; at most `max_streams` open at once, and
a tenant's share of them.

An open stream holds one RPC thread for as long as its caller listens, so streams without a bound
would let one client take every thread and starve the unary calls (every stream, WatchEvents or
not, is bounded again by `StreamGate`). Past a bound a stream is refused when it starts:
LIMIT_EXCEEDED naming `max_watch_streams` or `max_watch_streams_per_tenant`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from radixkv.errors import LimitExceeded
from radixkv.server.events.hub import BlockEvent
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.tenants import Tenant

WATCH_POLL_SECONDS = 0.25  # how soon a stream notices its client left or the server is stopping


class WatchStreams:
    """Counts the open streams of a server; `stream` is one of them."""

    def __init__(self, max_streams: int, max_per_tenant: int | None = None) -> None:
        self.max_streams = max_streams
        self.max_per_tenant = max_streams if max_per_tenant is None else max_per_tenant
        self._num_open = 0
        self._per_tenant: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._num_open

    def stream(
        self,
        pool: Pool,
        caller: Tenant,
        accepts: Callable[[str], bool],
        include_snapshot: bool,
        is_active: Callable[[], bool],
    ) -> Iterator[tuple[list[BlockEvent], bool, int]]:
        """Batches of events with the digest after each (first the snapshot, if asked) until the caller leaves
        or the server stops.

        A generator: the slot is taken when the first batch is asked for and given back when the
        stream ends, so a stream never iterated holds nothing.

        Raises:
            LimitExceeded: `max_watch_streams` streams are open already, or the caller's share of them.
        """
        with self._lock:
            if self._num_open >= self.max_streams:
                raise LimitExceeded("max_watch_streams", self._num_open + 1, self.max_streams)
            held = self._per_tenant.get(caller.name, 0)
            if held >= self.max_per_tenant:
                raise LimitExceeded("max_watch_streams_per_tenant", held + 1, self.max_per_tenant)
            self._num_open += 1
            self._per_tenant[caller.name] = held + 1
        try:
            with pool.lock:
                watcher = pool.events.watch(accepts)
                snapshot = pool.events.snapshot(accepts) if include_snapshot else None
                digest = watcher.digest
            try:
                if snapshot is not None:
                    yield snapshot, True, digest
                while is_active() and not watcher.closed:
                    events, digest = watcher.take(WATCH_POLL_SECONDS)
                    if events:
                        yield events, False, digest
            finally:
                pool.events.unwatch(watcher)
        finally:
            with self._lock:
                self._num_open -= 1
                self._per_tenant[caller.name] -= 1
                if not self._per_tenant[caller.name]:
                    del self._per_tenant[caller.name]
