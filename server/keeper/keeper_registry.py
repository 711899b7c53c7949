"""What the keeper owns: the pools' memory, keyed by pool name and tier, and the state directory that outlives it.

A pool has a device tier (its KV memory: CPU shared memory or a CUDA allocation) and may have a host tier
(CPU shared memory that evicted prefixes move to); each is kept, attached and freed as its own allocation,
and `release` frees both, since both are indexed by the same tree.

The memory is the point: a server attaches, is replaced (upgrade, restart), and the next server attaches
the same bytes. Which memory survives is honest by construction:
- each keeper start is a new *incarnation*; memory created under it is *fresh* to the server that created
  it and *retained* for every later attach;
- a keeper that ends on SIGTERM unlinks its memory; one that dies (SIGKILL) leaves `keeper.json` naming its
  shared-memory segments, and the next keeper removes them before it serves: a clean cold start;
- either way the snapshots directory is emptied, since no snapshot may outlive the memory it describes.

A pool is *held* by the connection that attached it until that connection closes (the server process
exits, however it exits); a second server cannot attach a held pool, so two servers never share one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from radixkv.memory.layout import PoolLayout
from radixkv.memory.shm_segment import SHM_DIR
from radixkv.memory.storage import KVStorage
from radixkv.server.keeper.keeper_protocol import LAYOUT_KEYS, VERSION, KeeperError

log = logging.getLogger("radixkv.keeper")

MAX_POOLS = 64
STATE_FILE = "keeper.json"
SNAPSHOT_DIR = "snapshots"
_SEGMENT_RE = re.compile(r"radixkv-keeper-[0-9a-f]{12}-[0-9]{1,4}")  # a state file names nothing else


@dataclasses.dataclass(slots=True, kw_only=True)
class KeptPool:
    """One pool's memory. `holder` is the connection that has it attached (None: waiting for a server)."""

    name: str
    tier: str  # "device" or "host"
    layout: PoolLayout
    device: str
    storage: KVStorage
    segment: str  # shared-memory name ("" on CUDA: nothing outlives the keeper's CUDA context)
    created_by: int
    created_at: float
    generation: int = 1  # attaches so far
    holder: int | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "pool": self.name,
            "tier": self.tier,
            "layout": dataclasses.asdict(self.layout),
            "device": self.device,
            "segment": self.segment,
            "generation": self.generation,
            "held": self.holder is not None,
            "created_at": self.created_at,
        }


class Keeper:
    """The pools and the state directory; every operation is atomic under one lock."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.snapshot_dir = state_dir / SNAPSHOT_DIR
        self.incarnation = secrets.token_hex(16)
        self.started_at = time.time()
        self._pools: dict[tuple[str, str], KeptPool] = {}  # (pool name, tier) -> memory
        self._lock = threading.Lock()
        self._num_segments = 0
        self.snapshot_dir.mkdir(mode=0o700, exist_ok=True)
        self.num_stale_segments = self._clean_up_after_a_dead_keeper()
        self._write_state()

    def hello(self) -> dict[str, Any]:
        return {
            "ok": True,
            "version": VERSION,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "state_dir": str(self.state_dir),
            "snapshot_dir": str(self.snapshot_dir),
        }

    def list_pools(self) -> dict[str, Any]:
        with self._lock:
            return {"ok": True, "pools": [p.describe() for p in self._pools.values()]}

    def create_or_attach(
        self, conn: int, name: str, layout_fields: dict[str, Any], device: str, tier: str = "device"
    ) -> dict[str, Any]:
        """The memory of one tier of a pool: created (zeros, fresh) or the same memory again (retained) when layout
        and device match. Raises KeeperError: LAYOUT_MISMATCH, POOL_BUSY, BAD_REQUEST, TOO_MANY, NO_MEMORY."""
        try:
            layout = PoolLayout(**layout_fields)
        except ValueError as e:
            raise KeeperError("BAD_REQUEST", f"layout: {e}") from None
        if tier == "host" and device != "cpu":
            raise KeeperError("BAD_REQUEST", f"device: a host tier lives in CPU memory, got {device}")
        with self._lock:
            pool = self._pools.get((name, tier))
            if pool is None:
                pool = self._create(conn, name, tier, layout, device)
            else:
                _check_same(pool, layout, device)
                if pool.holder not in (None, conn):
                    raise KeeperError("POOL_BUSY", f"pool {name!r} is attached by another live connection")
                if pool.holder is None:
                    pool.generation += 1
                self._write_state()
            pool.holder = conn
            handle = pool.storage.export_handle()
            fresh = pool.created_by == conn
            log.info("attached", extra={"pool": name, "tier": tier, "fresh": fresh, "generation": pool.generation})
            return {
                "ok": True,
                "handle": handle.to_dict(),
                "fresh": fresh,
                "generation": pool.generation,
                "incarnation": self.incarnation,
            }

    def _create(self, conn: int, name: str, tier: str, layout: PoolLayout, device: str) -> KeptPool:
        if len(self._pools) >= MAX_POOLS:
            raise KeeperError("TOO_MANY", f"the keeper holds {MAX_POOLS} pools already; release one")
        segment = ""
        try:
            if device == "cpu":
                self._num_segments += 1
                segment = f"radixkv-keeper-{self.incarnation[:12]}-{self._num_segments}"
                storage = KVStorage.create(layout, "cpu", name=segment)
            else:
                storage = KVStorage.create(layout, device)
        except (ValueError, OSError, RuntimeError) as e:  # no room in /dev/shm, CUDA out of memory, no such device
            raise KeeperError("NO_MEMORY", f"pool {name!r}: cannot allocate {layout.total_bytes} bytes: {e}") from None
        pool = KeptPool(
            name=name,
            tier=tier,
            layout=layout,
            device=device,
            storage=storage,
            segment=segment,
            created_by=conn,
            created_at=time.time(),
        )
        self._pools[(name, tier)] = pool
        self._write_state()
        log.info("created", extra={"pool": name, "tier": tier, "bytes": layout.total_bytes, "segment": segment})
        return pool

    def release(self, conn: int, name: str) -> dict[str, Any]:
        """Free a pool's memory now, every tier (its next attach creates it fresh). Raises KeeperError."""
        with self._lock:
            tiers = [key for key in self._pools if key[0] == name]
            if not tiers:
                kept = sorted({key[0] for key in self._pools})
                raise KeeperError("UNKNOWN_POOL", f"pool {name!r}: the keeper holds {kept}")
            if any(self._pools[key].holder not in (None, conn) for key in tiers):
                raise KeeperError("POOL_BUSY", f"pool {name!r} is attached by another live connection")
            for key in tiers:
                self._free(self._pools.pop(key))
            self._write_state()
        log.info("released", extra={"pool": name})
        return {"ok": True}

    def holds(self, conn: int) -> bool:
        """Whether connection `conn` has a pool attached (a live server's)."""
        with self._lock:
            return any(pool.holder == conn for pool in self._pools.values())

    def disconnect(self, conn: int) -> None:
        """A connection ended: what it held waits, retained, for the next server."""
        with self._lock:
            for pool in self._pools.values():
                if pool.holder == conn:
                    pool.holder = None
                    log.info("detached", extra={"pool": pool.name, "tier": pool.tier})

    def close(self) -> None:
        """Free every pool and forget the state: a graceful stop leaves nothing to clean up."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            for pool in pools:
                self._free(pool)
            _empty(self.snapshot_dir)
            (self.state_dir / STATE_FILE).unlink(missing_ok=True)

    @staticmethod
    def _free(pool: KeptPool) -> None:
        pool.storage.close()
        pool.storage.unlink()  # the name goes now; an attached server's mapping keeps its pages until it exits
        if pool.device != "cpu":
            import torch

            # Back to the driver, not kept in this process's cache (torch holds back an allocation that another
            # process still maps until that process lets go of it).
            torch.cuda.empty_cache()

    def _write_state(self) -> None:
        state = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "pools": [p.describe() for p in self._pools.values()],
        }
        tmp = self.state_dir / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_dir / STATE_FILE)

    def _clean_up_after_a_dead_keeper(self) -> int:
        """Remove the segments and snapshots a keeper that did not stop gracefully left; returns segments removed."""
        path = self.state_dir / STATE_FILE
        _empty(self.snapshot_dir)
        if not path.exists():
            return 0
        try:
            pools = json.loads(path.read_text()).get("pools", [])
            segments = [p.get("segment", "") for p in pools]
        except (ValueError, AttributeError) as e:
            log.warning("unreadable state file; removing it", extra={"path": str(path), "error": str(e)})
            segments = []
        removed = 0
        for segment in segments:
            if isinstance(segment, str) and _SEGMENT_RE.fullmatch(segment):
                try:
                    os.unlink(os.path.join(SHM_DIR, segment))
                    removed += 1
                except FileNotFoundError:
                    pass  # its resource tracker got there first
        path.unlink()
        log.warning("cold start after a keeper that did not stop", extra={"stale_segments_removed": removed})
        return removed


def _check_same(pool: KeptPool, layout: PoolLayout, device: str) -> None:
    kept = dataclasses.asdict(pool.layout)
    asked = dataclasses.asdict(layout)
    differences = [f"{k} {kept[k]} (kept) != {asked[k]} (asked)" for k in LAYOUT_KEYS if kept[k] != asked[k]]
    if device != pool.device:
        differences.append(f"device {pool.device} (kept) != {device} (asked)")
    if differences:
        raise KeeperError(
            "LAYOUT_MISMATCH",
            f"pool {pool.name!r} ({pool.tier} tier): {'; '.join(differences)}; release the kept pool (its cache is "
            "lost: radixkv keeper --release) or restart the keeper to change its layout",
        )


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_file() or entry.is_symlink():
            entry.unlink()
