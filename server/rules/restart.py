"""Restart without losing the cache: a snapshot per pool on a graceful stop, adopted by the next server.

The keeper (`radixkv.server.process.keeper`) holds each pool's memory across server processes and says
whether the memory this server attached to is `fresh` (allocated now: zeros) or retained (the bytes
the previous server left), with an incarnation and a generation that count attaches. A graceful
stop (SIGTERM, or the admin `Upgrade` call) freezes each pool under its lock, so no later call
changes it, and writes `<snapshot_dir>/<pool>.snapshot` atomically: the core's bookkeeping
(`radixkv.state.snapshot`, the host tier's included), the live sessions and what each owns, and a sha256 of
the K/V bytes of every cached block on the device and of every held block of the host tier (the keeper
keeps that memory too). The next server adopts it only if everything matches: the pool, its layout, the memory
(same keeper incarnation, the generation just before its own), the checksum of the file and the
K/V bytes of every cached block on both tiers. Anything else is refused with the reason logged and counted, the
file kept aside as `.refused`, and the pool starts cold. An adopted file is removed before the pool
serves, so a crash of this server never finds a snapshot that no longer describes the memory.

The crash policy is a cold start: after SIGKILL nothing proves which blocks hold which K/V (a
worker may have been writing into any block the dead server had handed out), so the next server
indexes nothing and the event streams open with `AllBlocksCleared`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from radixkv.errors import SnapshotRefused
from radixkv.kv_cache import KVCache, Limits
from radixkv.server.rules.ledger import Pin
from radixkv.state.snapshot import Adopted, PoolIdentity, dump, load, write_atomically

if TYPE_CHECKING:
    from radixkv.memory.storage import KVStorage
    from radixkv.server.rules.pools import Pool
    from radixkv.server.rules.sessions import Session, SessionRegistry
    from radixkv.server.rules.tenants import Tenant

log = logging.getLogger("radixkv.server.rules.restart")

SNAPSHOT_SUFFIX = ".snapshot"
_CHECKSUM_CHUNK_BLOCKS = 256  # blocks copied out per checksum pass: bounded extra memory


class KeptMemory(Protocol):
    """What the keeper tells about one pool's memory (`radixkv.server.keeper.keeper_client.KeeperAttachment`)."""

    @property
    def fresh(self) -> bool: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def snapshot_dir(self) -> Path: ...


def memory_id(incarnation: str, generation: int) -> str:
    """The memory a snapshot indexes: one keeper incarnation's allocation, as one attach saw it."""
    return f"{incarnation}/{generation}"


def snapshot_path(pool_name: str, memory: KeptMemory) -> Path:
    return Path(memory.snapshot_dir) / f"{pool_name}{SNAPSHOT_SUFFIX}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """One pool's snapshot as `write_snapshot` left it."""

    pool: str
    path: Path
    num_bytes: int
    num_cached_blocks: int
    num_live_sequences: int
    seconds: float


def kv_checksums(storage: KVStorage, block_ids: list[int]) -> bytes:
    """sha256 of each block's K/V bytes (every layer, K then V), concatenated in `block_ids` order.

    A CPU pool is hashed in place, block by block (each layer's K or V of one block is contiguous);
    a CUDA pool is gathered to the host a chunk of blocks at a time.
    """
    import torch  # the server's pools need it anyway; imported here to keep this module light

    data = storage.data  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    digests = []
    for start in range(0, len(block_ids), _CHECKSUM_CHUNK_BLOCKS):
        ids = block_ids[start : start + _CHECKSUM_CHUNK_BLOCKS]
        if data.device.type == "cpu":
            chunk, rows = data, ids
        else:
            chunk = data[:, :, torch.tensor(ids, dtype=torch.long, device=data.device)].cpu()
            rows = list(range(len(ids)))
        raw = chunk.view(torch.uint8).numpy()  # [num_layers, 2, n, block_size, num_kv_heads, head_dim * dtype bytes]
        for row in rows:
            digest = hashlib.sha256()
            for layer in raw:
                digest.update(layer[0, row])
                digest.update(layer[1, row])
            digests.append(digest.digest())
    return b"".join(digests)


def pool_identity(pool: Pool, memory: str) -> PoolIdentity:
    """What a snapshot of `pool` names: the pool, its layout and its host tier's, the memory `memory`."""
    host_layout = pool.host_storage.layout if pool.host_storage is not None else None
    return PoolIdentity(pool=pool.name, layout=pool.layout, memory_id=memory, host_layout=host_layout)


def host_tier_checksums(pool: Pool, cache: KVCache) -> bytes:
    """sha256 of every host block `cache` says holds K/V (host-only nodes, host copies, swapped sequences),
    ascending, then of the device blocks its pending offloads will copy to the host (free on the device,
    never handed out before they are copied); b"" without a host tier or anything on it."""
    host = cache.host
    if pool.host_storage is None:  # no host tier (the cache's has no blocks)
        return b""
    held = [int(b) for b in np.flatnonzero(host.pool.ref_counts)]
    sources = [int(b) for pairs in host._pending for b in pairs[:, 0]]
    return kv_checksums(pool.host_storage, held) + kv_checksums(pool.storage, sources)


def write_snapshot(pool: Pool, memory: KeptMemory, sessions: list[Session]) -> Written:
    """Freeze `pool` (no call changes it afterwards) and write its snapshot beside the kept memory."""
    started = time.perf_counter()
    with pool.lock:
        pool.frozen = True
        cache = pool.cache
        tree_block_ids = sorted(int(b) for b in cache.tree.tree_block_ids())
        owned = cache.sequence_ids() + cache.preempted_sequence_ids()  # every sequence has its session
        extras = {
            "sessions": [[s.session_id, s.tenant.name, s.ttl] for s in sessions],
            "owners": [[seq_id, pool.ledger.owner(seq_id).session_id] for seq_id in owned],  # type: ignore[union-attr]
            "pins": [
                [s.session_id, p.namespace, p.token_bytes, p.num_blocks] for s in sessions for p in pool.ledger.pins(s)
            ],
            "kv_checksums": kv_checksums(pool.storage, tree_block_ids),
            "host_kv_checksums": host_tier_checksums(pool, cache),
            # Writers' digests (server/events/block_checksums.py); an older snapshot's "block_checksums" (linear,
            # forgeable) are not read back: those blocks fail a connector's load and are recomputed.
            "block_digests": pool.events.checksums.to_pairs(),
        }
        identity = pool_identity(pool, memory_id(memory.incarnation, memory.generation))
        data = dump(cache, identity, extras)
        num_sequences = len(cache.sequence_ids())
    path = snapshot_path(pool.name, memory)
    write_atomically(path, data)
    written = Written(
        pool=pool.name,
        path=path,
        num_bytes=len(data),
        num_cached_blocks=len(tree_block_ids),
        num_live_sequences=num_sequences,
        seconds=time.perf_counter() - started,
    )
    log.info("snapshot written", extra=dataclasses.asdict(written) | {"path": str(path)})
    return written


def snapshot_all(pools: dict[str, Pool], sessions: SessionRegistry) -> list[Written]:
    """A graceful stop's snapshots: every pool a keeper holds and can still keep, each frozen first.

    Leases stop running out from now on (a session ended now would be ended in memory only after its
    pool froze). Idempotent: a pool already frozen is not written again.
    """
    kept = [pool for pool in pools.values() if pool.keeper is not None and not pool.frozen]
    if not kept:
        return []
    sessions.pause()
    live = sessions.live()
    written = []
    for pool in kept:
        assert pool.keeper is not None
        if not pool.restart_safe():
            log.warning("keeper gone: no snapshot (the memory goes with this server)", extra={"pool": pool.name})
            continue
        written.append(write_snapshot(pool, pool.keeper, live))
    return written


def adopt_snapshot(pool: Pool, memory: KeptMemory, limits: Limits) -> Adopted | None:
    """At start, before `pool` serves: adopt the snapshot beside its memory, or start cold and say why.

    Returns the adopted snapshot (its extras name the sessions and owners `restore_sessions` rebuilds),
    or None for a cold start. The snapshot file is gone afterwards either way (a refused one is kept
    as `<pool>.snapshot.refused` for whoever investigates).
    """
    path = snapshot_path(pool.name, memory)
    if not path.exists():
        log.info("no snapshot: starting cold", extra={"pool": pool.name, "fresh": memory.fresh})
        return None
    started = time.perf_counter()
    try:
        if memory.fresh:
            raise SnapshotRefused("MEMORY", "the keeper allocated this memory afresh: it holds none of the snapshot")
        expected = pool_identity(pool, memory_id(memory.incarnation, memory.generation - 1))
        adopted = load(path.read_bytes(), expected, limits, pool.cache.tree.policy.name)
        tree_block_ids = sorted(int(b) for b in adopted.cache.tree.tree_block_ids())
        if kv_checksums(pool.storage, tree_block_ids) != adopted.extras.get("kv_checksums"):
            raise SnapshotRefused("KV_CHECKSUM", "the memory's K/V bytes differ from those the snapshot recorded")
        if host_tier_checksums(pool, adopted.cache) != adopted.extras.get("host_kv_checksums", b""):
            raise SnapshotRefused(
                "HOST_KV_CHECKSUM", "the host tier's K/V bytes differ from those the snapshot recorded"
            )
    except SnapshotRefused as e:
        path.replace(path.with_name(path.name + ".refused"))
        pool.snapshot_refusals[e.why] = pool.snapshot_refusals.get(e.why, 0) + 1
        log.warning("snapshot refused: starting cold", extra={"pool": pool.name, "why": e.why, "detail": e.message})
        return None
    path.unlink()  # consumed: a crash from here on must not find it
    pool.cache = adopted.cache
    pool.events.adopt(adopted.cache)
    pool.events.checksums.restore(adopted.extras.get("block_digests", []), set(tree_block_ids))
    pool.num_adopted_blocks = len(tree_block_ids)
    log.info(
        "snapshot adopted",
        extra={
            "pool": pool.name,
            "num_cached_blocks": len(tree_block_ids),
            "num_live_sequences": len(adopted.cache.sequence_ids()),
            "seconds": time.perf_counter() - started,
        },
    )
    return adopted


def restore_sessions(pool: Pool, extras: dict[str, Any], registry: SessionRegistry, tenants: dict[str, Tenant]) -> int:
    """The adopted pool's sessions back in `registry` (a full lease each) and its ledger rebuilt.

    A sequence or pin whose tenant no longer exists is released (uncached); returns how many were.
    """
    sessions: dict[str, Session] = {}
    for session_id, tenant_name, ttl in extras.get("sessions", []):
        tenant = tenants.get(tenant_name)
        if tenant is not None:
            sessions[session_id] = registry.restore(session_id, tenant, float(ttl))
    orphans: list[int] = []
    with pool.lock:
        cache = pool.cache
        for seq_id, session_id in extras.get("owners", []):
            session = sessions.get(session_id)
            if session is None:
                orphans.append(int(seq_id))
            else:
                pool.ledger.adopt(session, cache, int(seq_id))
        for session_id, namespace, token_bytes, num_blocks in extras.get("pins", []):
            session = sessions.get(session_id)
            if session is None:
                cache.unpin(bytes(token_bytes), namespace)
            else:
                pool.ledger.add_pin(session, Pin(namespace, bytes(token_bytes), int(num_blocks)))
        cache.release_many(orphans, cache=False)
        pool.ledger.check_invariants(cache)
    if orphans:
        log.warning("released sequences of tenants that are gone", extra={"pool": pool.name, "num": len(orphans)})
    return len(orphans)
