"""A served pool: the core's bookkeeping, the KV memory it describes, and the lock that serialises them.

`KVCache` is not thread-safe, so every call into it, and every piece of server bookkeeping that must
agree with it (the ledger: who owns each sequence, each tenant's blocks and pins; the event hub), happens under
`Pool.lock`. Pools are independent: calls on different pools never wait for each other's lock.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import TYPE_CHECKING

from radixkv.kv_cache import KVCache, Limits
from radixkv.layout import PoolLayout
from radixkv.server.config import PoolConfig
from radixkv.server.events import EventHub
from radixkv.server.ledger import PoolLedger

if TYPE_CHECKING:
    from radixkv.server.kv_events import ZmqEventPublisher
    from radixkv.storage import KVStorage


class Pool:
    """One named pool. Attributes other than the immutable ones are guarded by `lock`."""

    def __init__(
        self,
        name: str,
        storage: KVStorage,
        limits: Limits,
        watch_queue_size: int,
        tombstones: int = 65_536,
        host_storage: KVStorage | None = None,
    ) -> None:
        self.name = name
        self.storage = storage
        self.host_storage = host_storage  # the host tier's memory (same layout, its own num_blocks), if any
        self.layout: PoolLayout = storage.layout
        self.device = str(storage.device)
        self.lock = threading.Lock()
        # Ids start at a random point each run: an id from before a restart names nothing after it.
        self.cache = KVCache(
            self.layout.num_blocks,
            self.layout.block_size,
            limits,
            first_seq_id=secrets.randbelow(2**52) + 1,
            host_num_blocks=host_storage.layout.num_blocks if host_storage is not None else 0,
        )
        self.events = EventHub(self.cache, watch_queue_size, tombstones)
        self.ledger = PoolLedger(self.layout.block_size)  # who holds what, as the server sees it
        self.kv_publisher: ZmqEventPublisher | None = None
        self.num_miss_tokens: dict[str, int] = {}  # reason -> tokens, counted by Match with explain

    def publish_kv_events(self, config: PoolConfig) -> None:
        """Publish this pool's events in vLLM's ZMQ format (`radixkv.server.kv_events`), from now on."""
        # Imported here: pyzmq and msgpack are needed only by a server that publishes.
        from radixkv.server.kv_events import ZmqEventPublisher

        assert config.kv_events_endpoint is not None
        publisher = ZmqEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_topic,
            self.layout.block_size,
            config.kv_events_replay_endpoint,
            config.kv_events_buffer_steps,
        )
        publisher.start()
        with self.lock:
            self.events.sinks.append(publisher)
            self.kv_publisher = publisher

    def close(self) -> None:
        """Wake every event stream and free the memory (the shared-memory name goes with it)."""
        with self.lock:
            self.events.close_all()
            publisher, self.kv_publisher = self.kv_publisher, None
            self.events.sinks.clear()
        if publisher is not None:
            publisher.close()
        for storage in (self.storage, self.host_storage):
            if storage is not None:
                storage.close()
                storage.unlink()  # CUDA: a no-op; the memory goes with this process


def build_pool(config: PoolConfig, watch_queue_size: int) -> Pool:
    """Size the layout (blocks, a byte budget or a fraction of free memory) and allocate its memory."""
    # Imported here: torch comes with storage, and only a server that builds pools needs it.
    from radixkv.storage import KVStorage, layout_for_memory

    c = config
    if c.num_blocks is not None:
        layout = PoolLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.block_size, c.num_blocks, c.dtype)
    else:
        layout = layout_for_memory(
            num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=c.block_size,
            dtype=c.dtype, device=c.device, budget_bytes=c.memory_bytes, memory_fraction=c.memory_fraction,
            reserved_bytes=c.reserved_bytes,
        )  # fmt: skip
    storage = KVStorage.create(layout, config.device)
    try:
        host = _host_storage(config, layout, pin=storage.device.type == "cuda")
    except BaseException:
        storage.close()
        storage.unlink()
        raise
    pool = Pool(config.name, storage, config.limits, watch_queue_size, config.tombstones, host)
    if config.kv_events_endpoint is not None:
        try:
            pool.publish_kv_events(config)
        except BaseException:
            pool.close()
            raise
    return pool


def _host_storage(config: PoolConfig, layout: PoolLayout, pin: bool) -> KVStorage | None:
    """The host tier's memory: the device pool's layout with `host_num_blocks`, or as many as `host_memory_bytes`
    holds; None without either. Page-locked (`pin`) beside a CUDA pool, so swaps read and write it directly."""
    from radixkv.storage import KVStorage

    if config.host_num_blocks:
        host_layout = dataclasses.replace(layout, num_blocks=config.host_num_blocks)
    elif config.host_memory_bytes:
        shape = {f: getattr(layout, f) for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")}
        host_layout = PoolLayout.for_budget(config.host_memory_bytes, **shape)
    else:
        return None
    return KVStorage.create_host(host_layout, pin=pin)
