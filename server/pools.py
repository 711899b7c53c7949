"""A served pool: the core's bookkeeping, the KV memory it describes, and the lock that serialises them.

`KVCache` is not thread-safe, so every call into it, and every piece of server bookkeeping that must
agree with it (the ledger: who owns each sequence, each tenant's blocks and pins; the event hub), happens under
`Pool.lock`. Pools are independent: calls on different pools never wait for each other's lock.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import TYPE_CHECKING, Any

from radixkv.kv_cache import KVCache, Limits
from radixkv.memory.layout import PoolLayout
from radixkv.server.config import PoolConfig
from radixkv.server.events import EventHub
from radixkv.server.kv_events_config import KVEventsConfig
from radixkv.server.ledger import PoolLedger
from radixkv.server.tenants import SCOPE_SEPARATOR

if TYPE_CHECKING:
    from radixkv.memory.storage import KVStorage
    from radixkv.server.keeper_client import KeeperAttachment, KeeperClient
    from radixkv.server.kv_events import ZmqEventPublisher


class Pool:
    """One named pool. Attributes other than the immutable ones are guarded by `lock`."""

    def __init__(
        self,
        name: str,
        storage: KVStorage,
        limits: Limits,
        watch_queue_size: int,
        tombstones: int = 65_536,
        keeper: KeeperAttachment | None = None,
        keeper_lost: threading.Event | None = None,
        host_storage: KVStorage | None = None,
        *,
        reserve_fraction: float = 1.0,
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
        self.lock = threading.Lock()
        # Ids start at a random point each run: an id from before a restart names nothing after it.
        self.cache = KVCache(
            self.layout.num_blocks, self.layout.block_size, limits, first_seq_id=secrets.randbelow(2**52) + 1,
            reserve_fraction=reserve_fraction, watermark_fraction=watermark_fraction,
            host_num_blocks=host_storage.layout.num_blocks if host_storage is not None else 0,
        )  # fmt: skip
        self.events = EventHub(self.cache, watch_queue_size, tombstones)
        self.ledger = PoolLedger(self.layout.block_size)  # who holds what, as the server sees it
        self.kv_publisher: ZmqEventPublisher | None = None
        self.num_miss_tokens: dict[str, int] = {}  # reason -> tokens, counted by Match with explain
        self.num_token_budget_refusals = 0  # opens refused by a tenant's token bucket (NOT_ADMITTED: the core counts)
        # Set under the lock once a restart's snapshot is taken: from then on no call changes the pool.
        self.frozen = False
        self.snapshot_refusals: dict[str, int] = {}  # why -> snapshots refused at start (server/restart.py)
        self.num_adopted_blocks = 0  # cached blocks adopted from the previous server's snapshot
        self.adopted_extras: dict[str, Any] | None = None  # the adopted snapshot's sessions, until restored

    def publish_kv_events(self, config: KVEventsConfig) -> None:
        """Publish this pool's events in vLLM's ZMQ format (`radixkv.server.kv_events`), from now on; the
        namespaces of `config.withheld_tenants` never."""
        # Imported here: pyzmq and msgspec are needed only by a server that publishes.
        from radixkv.server.kv_events import ZmqEventPublisher

        withheld = tuple(f"{name}{SCOPE_SEPARATOR}" for name in config.withheld_tenants)

        def publishes(namespace: str) -> bool:
            return not namespace.startswith(withheld)

        with self.lock:  # the digest it starts from and the first event it is told of: one hold
            hub = self.events
            publisher = ZmqEventPublisher(
                config,
                self.layout.block_size,
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


def build_pool(config: PoolConfig, watch_queue_size: int, keeper: KeeperClient | None = None) -> Pool:
    """Size the layout (blocks, a byte budget or a fraction of free memory) and allocate its memory, or attach
    the memory `keeper` keeps for this pool (the same bytes a previous server left, when the layout matches).

    Raises:
        KeeperError: the keeper refused (e.g. LAYOUT_MISMATCH, naming the fields that differ).
    """
    # Imported here: torch comes with storage, and only a server that builds pools needs it.
    from radixkv.memory.storage import KVStorage

    layout = _layout(config, keeper)
    if keeper is None:
        storage, attachment = KVStorage.create(layout, config.device), None
    else:
        attachment = keeper.create_or_attach(config.name, layout, _device_with_index(config.device))
        storage = KVStorage.open(attachment.handle)
    try:
        host = _host_storage(config, layout, storage.device.type == "cuda", keeper)
    except BaseException:
        storage.close()
        if keeper is None:
            storage.unlink()
        raise
    lost = keeper.lost if keeper is not None else None
    pool = Pool(
        config.name, storage, config.limits, watch_queue_size, config.tombstones, attachment, lost, host,
        reserve_fraction=config.reserve_fraction, watermark_fraction=config.watermark_fraction,
    )  # fmt: skip
    if attachment is not None:
        from radixkv.server.restart import adopt_snapshot

        adopted = adopt_snapshot(pool, attachment, config.limits)
        pool.adopted_extras = adopted.extras if adopted is not None else None
    if config.kv_events is not None:
        try:
            pool.publish_kv_events(config.kv_events)
        except BaseException:
            pool.close()
            raise
    return pool


def _layout(config: PoolConfig, keeper: KeeperClient | None) -> PoolLayout:
    """The pool's layout. Sized by memory, a pool the keeper already keeps keeps its block count: its own memory
    is no longer free, so sizing again would come out smaller and never match."""
    from radixkv.memory.memory_sizing import layout_for_memory

    c = config
    if c.num_blocks is not None:
        return PoolLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.block_size, c.num_blocks, c.dtype)
    if keeper is not None:
        shape = {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                 "block_size": c.block_size, "dtype": c.dtype}  # fmt: skip
        for kept in keeper.list_pools():
            kept_shape = {k: v for k, v in kept["layout"].items() if k != "num_blocks"}
            same_pool = kept["pool"] == c.name and kept["tier"] == "device"
            if same_pool and kept_shape == shape and kept["device"] == _device_with_index(c.device):
                return PoolLayout(**kept["layout"])
    return layout_for_memory(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=c.block_size,
        dtype=c.dtype, device=c.device, budget_bytes=c.memory_bytes, memory_fraction=c.memory_fraction,
        reserved_bytes=c.reserved_bytes,
    )  # fmt: skip


def _device_with_index(device: str) -> str:
    """ "cpu" or "cuda:N": a keeper names one GPU ("cuda" alone means the current one)."""
    if device == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return device


def _host_storage(config: PoolConfig, layout: PoolLayout, pin: bool, keeper: KeeperClient | None) -> KVStorage | None:
    """The host tier's memory: the device pool's layout with `host_num_blocks`, or as many as `host_memory_bytes`
    holds; None without either. Shared memory of its own, or the keeper's (its "host" tier of the pool: kept across
    restarts, its index in the pool's snapshot and its bytes checksummed, see `radixkv.server.restart`).
    Page-locked (`pin`) beside a CUDA pool, so swaps read and write it directly."""
    from radixkv.memory.storage import KVStorage

    if config.host_num_blocks:
        host_layout = dataclasses.replace(layout, num_blocks=config.host_num_blocks)
    elif config.host_memory_bytes:
        shape = {f: getattr(layout, f) for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")}
        host_layout = PoolLayout.for_budget(config.host_memory_bytes, **shape)
    else:
        return None
    if keeper is None:
        return KVStorage.create_host(host_layout, pin=pin)
    host = KVStorage.open(keeper.create_or_attach(config.name, host_layout, "cpu", tier="host").handle)
    if pin:
        host.pin()
    return host
