"""The disk tier's configuration keys: checked with the pool's, and the server-wide `--disk-dir` given to each pool."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from radixkv.planning.plan import parse_bytes


class DiskKeys(Protocol):
    """The `PoolConfig` fields read here (the config module imports this one, not the other way)."""

    name: str
    disk_dir: str | None
    disk_capacity: str | None
    disk_prefill_tokens_per_s: float | None
    host_num_blocks: int | None
    host_memory_bytes: int | None


P = TypeVar("P", bound=DiskKeys)

# The pool keys of a disk tier (server/rules/disk_tier.py), as `radixkv serve --help` lists them.
DISK_KEYS = {
    "disk_dir": "disk tier directory (needs a host tier): committed blocks are written there, read back on a miss",
    "disk_capacity": "disk tier byte cap, with a unit: 200GiB, 1.5TB (required with disk_dir)",
    "disk_prefill_tokens_per_s": "the model's prefill rate here: a disk hit is loaded only when reading is faster",
}


def check_disk_keys(pool: DiskKeys) -> None:
    """ValueError naming the key when a pool's disk keys do not make a disk tier."""
    if pool.disk_dir is None:
        if pool.disk_capacity is not None:
            raise ValueError(f"pool {pool.name!r}: disk_capacity needs disk_dir")
        return
    if pool.host_num_blocks is None and pool.host_memory_bytes is None:
        raise ValueError(f"pool {pool.name!r}: disk_dir needs a host tier (host_num_blocks or host_memory_bytes)")
    if pool.disk_capacity is None:
        raise ValueError(f"pool {pool.name!r}: disk_dir needs disk_capacity (e.g. 200GiB)")
    try:
        capacity = parse_bytes(pool.disk_capacity)
    except ValueError as e:
        raise ValueError(f"pool {pool.name!r}: disk_capacity {e}") from None
    if capacity <= 0:
        raise ValueError(f"pool {pool.name!r}: disk_capacity must be > 0")
    rate = pool.disk_prefill_tokens_per_s
    if rate is not None and not rate > 0:
        raise ValueError(f"pool {pool.name!r}: disk_prefill_tokens_per_s must be > 0")


def with_disk(pools: tuple[P, ...], disk_dir: str | None, capacity: str | None) -> tuple[P, ...]:
    """The pools with the server-wide disk tier (`DIR/POOL`, an even split of `capacity`) where they have none;
    ValueError naming the key when any pool's disk keys do not make a disk tier."""
    for pool in pools:
        check_disk_keys(pool)
    if disk_dir is None:
        if capacity is not None:
            raise ValueError("--disk-capacity needs --disk-dir")
        return pools
    if capacity is None:
        raise ValueError("--disk-dir needs --disk-capacity (e.g. 200GiB)")
    each = f"{parse_bytes(capacity) // len(pools)}B"  # a size keeps its unit (a bare number is refused)
    own = {"disk_capacity": each}
    return tuple(p if p.disk_dir else _replace(p, disk_dir=str(Path(disk_dir) / p.name), **own) for p in pools)


def _replace(pool: P, **changes: str) -> P:
    replaced: P = dataclasses.replace(cast(Any, pool), **changes)  # a PoolConfig: a dataclass the Protocol can't say
    return replaced
