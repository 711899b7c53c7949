"""A served pool: the core's bookkeeping, the KV memory it describes, and the lock that serialises them.

`KVCache` is not thread-safe, so every call into it, and every piece of server bookkeeping that must
agree with it (the ledger: who owns each sequence, each tenant's blocks and pins; the event hub), happens under
`Pool.lock`; releasing it hands the events of that hold to the event sinks as one unit (`events.hub.PoolLock`).
Pools are independent: calls on different pools never wait for each other's lock.
`radixkv.server.process.pool_setup` builds them.
"""

from __future__ import annotations

import secrets
import threading
from typing import TYPE_CHECKING, Any

from radixkv.kv_cache import KVCache, Limits
from radixkv.memory.layout import PoolLayout
from radixkv.server.events.hub import DiskTier, EventHub, PoolLock
from radixkv.server.events.kv_events_config import KVEventsConfig
from radixkv.server.rules.ledger import PoolLedger
from radixkv.server.rules.tenants import SCOPE_SEPARATOR

if TYPE_CHECKING:
    from radixkv.memory.storage import KVStorage
    from radixkv.server.events.kv_events import ZmqEventPublisher
    from radixkv.server.keeper.keeper_client import KeeperAttachment


class Pool:
    """One named pool. Attributes other than the immutable ones are guarded by `lock`."""

    def __init__(
        self,
        name: str,
        storage: KVStorage,
        limits: Limits,
        *,
        watch_queue_size: int,
        tombstones: int = 65_536,
        keeper: KeeperAttachment | None = None,
        keeper_lost: threading.Event | None = None,
        host_storage: KVStorage | None = None,
        reserve_fraction: float = 1.0,
        eviction_policy: str = "lru",
        watermark_fraction: float = 0.01,
    ) -> None:
        self.name = name
        self.storage = storage
        self.host_storage = host_storage  # the host tier's memory (same layout, its own num_blocks), if any
        # None: this process owns the memory. Else a keeper does: `keeper.fresh` says whether anything from a
        # previous server can be in it; `keeper_lost` is set once this server noticed the keeper die.
        self.keeper = keeper
        self._keeper_lost = keeper_lost
        self.layout: PoolLayout = storage.layout
        self.device = str(storage.device)
        # Ids start at a random point each run: an id from before a restart names nothing after it.
        self.cache = KVCache(
            self.layout.num_blocks,
            self.layout.block_size,
            limits,
            first_seq_id=secrets.randbelow(2**52) + 1,
            reserve_fraction=reserve_fraction,
            watermark_fraction=watermark_fraction,
            host_num_blocks=host_storage.layout.num_blocks if host_storage is not None else 0,
            eviction_policy=eviction_policy,
        )
        self.events = EventHub(self.cache, watch_queue_size, tombstones)
        self.lock = PoolLock(self.events)
        self.ledger = PoolLedger(self.layout.block_size)  # who holds what, as the server sees it
        self.kv_publisher: ZmqEventPublisher | None = None
        self.num_miss_tokens: dict[str, int] = {}  # reason -> tokens, counted by Match with explain
        self.num_token_budget_refusals = 0  # opens refused by a tenant's token bucket (NOT_ADMITTED: the core counts)
        # Set under the lock once a restart's snapshot is taken: from then on no call changes the pool.
        self.frozen = False
        self.snapshot_refusals: dict[str, int] = {}  # why -> snapshots refused at start (server/rules/restart.py)
        self.num_adopted_blocks = 0  # cached blocks adopted from the previous server's snapshot
        self.adopted_extras: dict[str, Any] | None = None  # the adopted snapshot's sessions, until restored
        self.disk: DiskTier | None = None  # the disk tier under the host tier (server/rules/disk_tier.py), if any

    def publish_kv_events(self, config: KVEventsConfig) -> None:
        """Publish this pool's events in vLLM's ZMQ format (`radixkv.server.events.kv_events`), from now on; the
        namespaces of `config.withheld_tenants` never."""
        # Imported here: pyzmq and msgspec are needed only by a server that publishes.
        from radixkv.server.events.kv_events import ZmqEventPublisher

        withheld = tuple(f"{name}{SCOPE_SEPARATOR}" for name in config.withheld_tenants)

        def publishes(namespace: str) -> bool:
            return not namespace.startswith(withheld)

        with self.lock:  # the digest it starts from and the first event it is told of: one hold
            hub = self.events
            publisher = ZmqEventPublisher(
                config,
                block_size=self.layout.block_size,
                adopted=hub.snapshot(publishes) if self.num_adopted_blocks else None,
                epoch=hub.epoch,
                digest=hub.digest(publishes),
                num_events=hub.num_events,
                publishes=publishes,
            )
            publisher.start()
            hub.sinks.append(publisher)
            self.kv_publisher = publisher

    def restart_safe(self) -> bool:
        """Whether this pool's memory outlives this process: a keeper holds it and is still alive."""
        return self.keeper is not None and self._keeper_lost is not None and not self._keeper_lost.is_set()

    def close(self) -> None:
        """Wake every event stream and drop the memory: freed if this process owns it, else left to the keeper."""
        if self.disk is not None:
            self.disk.close()  # writes what is pending first
        with self.lock:
            self.events.close_all()
            publisher, self.kv_publisher = self.kv_publisher, None
            self.events.sinks.clear()
        if publisher is not None:
            publisher.close()
        self.storage.close()
        if self.keeper is None:
            self.storage.unlink()  # CUDA: a no-op; the memory goes with this process
        if self.host_storage is not None:
            self.host_storage.close()
            if self.keeper is None:
                self.host_storage.unlink()
