"""Building a served pool: size its layout, allocate its memory or attach what a keeper keeps, adopt the previous
server's snapshot of it (`radixkv.server.rules.restart`), start publishing its events; `Pool` is what comes out.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from radixkv.memory.layout import PoolLayout
from radixkv.server.rules.config import PoolConfig
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.restart import adopt_snapshot

if TYPE_CHECKING:
    from radixkv.memory.storage import KVStorage
    from radixkv.server.keeper.keeper_client import KeeperClient


def build_pool(
    config: PoolConfig,
    watch_queue_size: int,
    keeper: KeeperClient | None = None,
    tenant_prefixes: frozenset[str] = frozenset(),
) -> Pool:
    """`tenant_prefixes`: "<tenant>/" of every tenant (auth on), so each tenant's event count is its own.

    Size the layout (blocks, a byte budget or a fraction of free memory) and allocate its memory, or attach
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
        config.name,
        storage,
        config.limits,
        watch_queue_size=watch_queue_size,
        tombstones=config.tombstones,
        keeper=attachment,
        keeper_lost=lost,
        host_storage=host,
        reserve_fraction=config.reserve_fraction,
        watermark_fraction=config.watermark_fraction,
        eviction_policy=config.eviction_policy,
    )
    pool.events.tenant_prefixes = tenant_prefixes
    if attachment is not None:
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
        return PoolLayout(
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            dtype=c.dtype,
        )
    if keeper is not None:
        shape = {
            "num_layers": c.num_layers,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "block_size": c.block_size,
            "dtype": c.dtype,
        }
        for kept in keeper.list_pools():
            kept_shape = {k: v for k, v in kept["layout"].items() if k != "num_blocks"}
            same_pool = kept["pool"] == c.name and kept["tier"] == "device"
            if same_pool and kept_shape == shape and kept["device"] == _device_with_index(c.device):
                return PoolLayout(**kept["layout"])
    return layout_for_memory(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=c.block_size,
        dtype=c.dtype,
        device=c.device,
        budget_bytes=c.memory_bytes,
        memory_fraction=c.memory_fraction,
        reserved_bytes=c.reserved_bytes,
    )


def _device_with_index(device: str) -> str:
    """ "cpu" or "cuda:N": a keeper names one GPU ("cuda" alone means the current one)."""
    if device == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return device


def _host_storage(config: PoolConfig, layout: PoolLayout, pin: bool, keeper: KeeperClient | None) -> KVStorage | None:
    """The host tier's memory: the device pool's layout with `host_num_blocks`, or as many as `host_memory_bytes`
    holds; None without either. Shared memory of its own, or the keeper's (its "host" tier of the pool: kept across
    restarts, its index in the pool's snapshot and its bytes checksummed, see `radixkv.server.rules.restart`).
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
