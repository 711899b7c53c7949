"""WatchEvents streams: each a watcher on one pool's event hub, and at most `max_streams` open at once.

An open stream holds one RPC thread for as long as its caller listens, so streams without a bound
would let one client take every thread and starve the unary calls. Past the bound a stream is
refused when it starts: LIMIT_EXCEEDED naming `max_watch_streams`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from radixkv.errors import LimitExceeded
from radixkv.server.events import BlockEvent
from radixkv.server.pools import Pool

WATCH_POLL_SECONDS = 0.25  # how soon a stream notices its client left or the server is stopping


class WatchStreams:
    """Counts the open streams of a server; `stream` is one of them."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self._num_open = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._num_open

    def stream(
        self, pool: Pool, accepts: Callable[[str], bool], include_snapshot: bool, is_active: Callable[[], bool]
    ) -> Iterator[tuple[list[BlockEvent], bool]]:
        """Batches of events (first the snapshot, if asked) until the caller leaves or the server stops.

        A generator: the slot is taken when the first batch is asked for and given back when the
        stream ends, so a stream never iterated holds nothing.

        Raises:
            LimitExceeded: `max_watch_streams` streams are open already.
        """
        with self._lock:
            if self._num_open >= self.max_streams:
                raise LimitExceeded("max_watch_streams", self._num_open + 1, self.max_streams)
            self._num_open += 1
        try:
            with pool.lock:
                watcher = pool.events.watch(accepts)
                snapshot = pool.events.snapshot(accepts) if include_snapshot else None
            try:
                if snapshot is not None:
                    yield snapshot, True
                while is_active() and not watcher.closed:
                    events = watcher.take(WATCH_POLL_SECONDS)
                    if events:
                        yield events, False
            finally:
                pool.events.unwatch(watcher)
        finally:
            with self._lock:
                self._num_open -= 1
