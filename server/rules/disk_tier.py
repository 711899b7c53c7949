"""A pool's disk tier: every committed full block written to a directory in the background, read back on a miss.

Writing (write-behind, off the request path). The event hub reports each block the device tree takes
(`stored`: a publish of computed K/V) and each it drops (`removed`). A published block not yet on disk waits in
`_pending`; every `flush_interval_s` the writer thread takes the pool's lock just long enough to copy the
pending blocks' bytes out of the pool's memory (one gather), then writes them as objects with the lock
released (`radixkv.disk.store`). A pending block the device drops before the writer came is copied at that
moment, inside the core call that dropped it, while its bytes are still the ones the tree named. Each object
keeps its blocks' writers' digests (`server/events/block_checksums.py`), so a flush leaves a block whose writer has not
recorded its digest yet for the next flush (the vLLM connector records it right after its commit). So a
committed block is on disk at most two `flush_interval_s` plus one write after its commit (1 s + the time to
write the batch by default); a crash loses at most that window. Blocks loaded back (from the host tier or the
disk) are on disk already and are never written again, and eviction from the host tier or the device never
writes: a block is dropped from memory without a write, because it is already on disk (or queued).

Reading. Before a step takes the pool's lock for its opens, `promote` extends each prompt's device and host
match with the blocks on disk that continue it: the hashes of the prompt's blocks past the match (the hash
contract's, so the same across restarts), looked up in the index; when loading beats recomputing
(`radixkv.disk.load_cost`), they are read (verified) with the pool's lock released, written into host-tier
blocks under it, and hung in the tree as a host-only node. The open then loads them to the device as any host
hit, with the existing transfer path: schedulers, the vLLM connector and routers see one prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from radixkv.disk.block_io import DirectIO, aligned_rows
from radixkv.disk.continuation import Continuation, continuation
from radixkv.disk.load_cost import LoadCost
from radixkv.disk.shape import disk_shape
from radixkv.disk.store import DiskStore
from radixkv.planning.plan import parse_bytes
from radixkv.server.rules.tenants import SCOPE_SEPARATOR, Shares
from radixkv.tree.block_hash import wire_hash
from radixkv.tree.radix_tree import TOKEN_BYTES, Node

if TYPE_CHECKING:
    from radixkv.server.rules.config import PoolConfig
    from radixkv.server.rules.pools import Pool

log = logging.getLogger("radixkv.disk")
FLUSH_INTERVAL_S = 0.5
MAX_FLUSH_BYTES = 256 << 20  # copied out per flush at most, and kept for a retry: bounds the writer's memory
MAX_STAGED_BYTES = 1 << 30  # copied at eviction and waiting for the writer, at most
MEDIUM_STORAGE = "STORAGE"  # vLLM's medium of a storage tier (vllm.v1.kv_offload.base.Medium.STORAGE)
THROTTLE_ENV = "RADIXKV_DISK_THROTTLE_BYTES_PER_S"  # tests and benchmarks: reads as slow as this (a slow disk)
REPROBE_S = 60.0
MAX_FREE_ROWS = 4  # promotes' read buffers kept for reuse (promotes run on the server's threads at once)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Staged:
    """Blocks of one namespace copied out of the pool for the writer: their hashes, bytes, writers' digests."""

    namespace: str
    hashes: list[bytes]
    data: npt.NDArray[np.uint8]
    digests: list[bytes]

    def rows(self, keep: list[int]) -> Staged:
        return Staged(
            namespace=self.namespace,
            hashes=[self.hashes[i] for i in keep],
            data=self.data[keep],
            digests=[self.digests[i] for i in keep],
        )


def tenant_of(namespace: str) -> str:
    """The tenant a core namespace belongs to ("" with auth off)."""
    tenant, sep, _ = namespace.partition(SCOPE_SEPARATOR)
    return tenant if sep else ""


class PoolDisk:
    """One pool's disk tier: its store, its writer thread, and `promote` for the opens. Thread-safety: `stored`,
    `removed` and `promote` run under the pool's lock; the writer takes it only to copy bytes."""

    def __init__(
        self,
        pool: Pool,
        *,
        directory: Path,
        capacity_bytes: int,
        prefill_tokens_per_s: float | None,
        shares: Shares,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        assert pool.host_storage is not None, "a disk tier loads through the host tier"
        self.pool, self.flush_interval_s = pool, flush_interval_s
        share = shares.of(capacity_bytes) if shares.num_tenants > 1 else None
        throttle = float(os.environ.get(THROTTLE_ENV, 0)) or None
        io = DirectIO(throttle_bytes_per_s=throttle)
        self.store = DiskStore(
            directory,
            disk_shape(pool.layout),
            capacity_bytes,
            tenant_of=tenant_of,
            share_bytes=lambda tenant: share,
            io=io,
        )
        self.cost = LoadCost(pool.layout.bytes_per_block, pool.layout.block_size, prefill_tokens_per_s)
        # device block -> (namespace, hash, the flush it was published before): published, not on disk
        self._pending: dict[int, tuple[str, bytes, int]] = {}
        self._staged: list[Staged] = []  # copied out (when the device dropped them, or by a flush), not written yet
        self._num_flushes = 0
        self._num_writing = 0  # blocks of the flush being written: pending still (a crash now loses them)
        self.num_promoted_blocks = 0  # read from disk into the host tier for an open
        self.num_hit_tokens = 0  # tokens those blocks hold
        self.num_unwritten_blocks = 0  # committed blocks the device dropped while MAX_STAGED_BYTES waited already
        self._last_probe = 0.0
        self._free_rows: list[npt.NDArray[np.uint8]] = []  # promotes' read rows (`_take_rows`)
        self._rows_lock = threading.Lock()  # a leaf lock
        self._changes: list[tuple[str, bool, list[bytes]]] = []  # objects written or removed, for the KV events
        self._changes_lock = threading.Lock()  # a leaf lock: the store tells from any thread, holding nothing
        self.store.on_change = self._changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"radixkv-disk-{pool.name}", daemon=True)

    @property
    def num_pending(self) -> int:
        return len(self._pending) + self._num_staged() + self._num_writing

    def _num_staged(self) -> int:
        return sum(len(s.hashes) for s in self._staged)

    def start(self) -> None:
        """Open the directory (DiskTierError when it cannot serve) and start writing."""
        self.store.open()
        self._probe()
        self._thread.start()

    # -- the event hub's reports, under the pool's lock ------------------------------------------

    def stored(self, node: Node, hashes: list[bytes]) -> None:
        """The device tree took `node`'s blocks (their `hashes`): queue the computed ones not yet on disk. Blocks
        loaded back from the host tier (their bytes came from there, and are on disk or were never) get the
        writer's digest their disk objects keep, for a reader that verifies against it (the vLLM connector)."""
        if len(node.host_block_ids):
            digests = self.store.writer_digests(hashes)
            known = [i for i, d in enumerate(digests) if d]
            if known:
                self.pool.events.checksums.record([int(node.block_ids[i]) for i in known], [digests[i] for i in known])
            return
        for block_id, h in zip(node.block_ids.tolist(), hashes, strict=True):
            if h not in self.store:
                self._pending[block_id] = (node.namespace, h, self._num_flushes)

    def removed(self, block_ids: npt.NDArray[np.int32]) -> None:
        """The device tree dropped `block_ids`: copy those still pending now, before the block is reused."""
        if not self._pending:
            return
        ids = [b for b in np.asarray(block_ids).tolist() if b in self._pending]
        if not ids:
            return
        staged = self._num_staged() * self.pool.layout.bytes_per_block
        if staged >= MAX_STAGED_BYTES:  # commits outrun the disk: these never reach it (counted), memory stays bounded
            for b in ids:
                del self._pending[b]
            self.num_unwritten_blocks += len(ids)
            return
        self._stage(ids)

    def _ready(self, room: int, everything: bool) -> list[int]:
        """Up to `room` pending blocks to copy out now: those whose writer recorded its digest (the vLLM connector
        records it right after its commit) and those that waited a whole flush for it (or every one: `everything`)."""
        digests = self.pool.events.checksums
        ids = list(self._pending)
        recorded = digests.recorded[np.asarray(ids, dtype=np.int64)].tolist()
        last = self._num_flushes - 1
        ready = [b for b, r in zip(ids, recorded, strict=True) if everything or r or self._pending[b][2] <= last]
        return ready[:room]

    def _stage(self, ids: list[int]) -> None:
        data = self._gather(ids)
        digests = self.pool.events.checksums.get(ids)
        runs: dict[str, tuple[list[bytes], list[int]]] = {}
        for i, block_id in enumerate(ids):
            namespace, h, _ = self._pending.pop(block_id)
            hashes, rows = runs.setdefault(namespace, ([], []))
            hashes.append(h)
            rows.append(i)
        for namespace, (hashes, rows) in runs.items():
            block_rows = data if len(runs) == 1 else data[rows]  # one namespace (the usual case): no copy
            self._staged.append(
                Staged(namespace=namespace, hashes=hashes, data=block_rows, digests=[digests[i] for i in rows])
            )

    def _gather(self, ids: list[int]) -> npt.NDArray[np.uint8]:
        """The K/V bytes of device blocks `ids`, one row each ([n, bytes_per_block]: layer, K/V, token, head, dim)."""
        import torch

        data = self.pool.storage.data  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        index = torch.tensor(ids, dtype=torch.int64, device=data.device)
        picked = data.index_select(2, index).permute(2, 0, 1, 3, 4, 5)
        rows = aligned_rows(len(ids), self.pool.layout.bytes_per_block)  # the store writes page-aligned rows as is
        torch.from_numpy(rows).view(data.dtype).view(picked.shape).copy_(picked)
        return rows

    # -- the writer --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
                if not self.cost.cheaper(1) and time.monotonic() - self._last_probe > REPROBE_S:
                    self._probe()
            except Exception:  # the writer must outlive any one bad batch
                log.exception("disk tier %s: a flush failed", self.pool.name)

    def flush(self, everything: bool = False) -> int:
        """Write the blocks published so far that are not on disk (at most `MAX_FLUSH_BYTES` of them copied out per
        flush; the rest wait for the next), but for those published since the last flush whose writer's digest is
        not recorded yet (`_ready`; `everything`: those too); returns how many were written. A batch whose write
        failed (disk full, read-only) is kept for the next flush while what waits stays under `MAX_FLUSH_BYTES`.
        Publishes the objects written and removed since the last flush as KV events of medium STORAGE."""
        bpb = self.pool.layout.bytes_per_block
        with self.pool.lock:
            room = max(0, MAX_FLUSH_BYTES // bpb - self._num_staged())
            ready = self._ready(room, everything) if self._pending and room else []
            if ready:
                self._stage(ready)
            self._num_flushes += 1
            staged, self._staged = self._staged, []
            self._num_writing = sum(len(batch.hashes) for batch in staged)
            with self._changes_lock:
                changes, self._changes = self._changes, []
            publisher = self.pool.kv_publisher
            if publisher is not None:
                for namespace, stored, hashes in changes:
                    publisher.publish_tier(namespace, stored, [wire_hash(h) for h in hashes], MEDIUM_STORAGE)
        num, errors = 0, self.store.num_write_errors
        for batch in staged:
            num += self.store.put(batch.namespace, batch.hashes, batch.data, batch.digests)
            self._num_writing -= len(batch.hashes)
            if self.store.num_write_errors > errors:  # not on disk, and not for want of room: try again next time
                keep = [i for i, h in enumerate(batch.hashes) if h not in self.store]
                with self.pool.lock:
                    if self._num_staged() + len(keep) <= MAX_FLUSH_BYTES // bpb:
                        self._staged.append(batch.rows(keep))
                errors = self.store.num_write_errors
        return num

    def _changed(self, namespace: str, stored: bool, hashes: list[bytes]) -> None:
        with self._changes_lock:
            self._changes.append((namespace, stored, hashes))

    def _probe(self) -> None:
        """Measure the read bandwidth on one stored object (the cost rule's estimate)."""
        self._last_probe = time.monotonic()
        sample = self.store.sample()
        if sample:
            began = time.perf_counter()
            got = self.store.read(sample)
            self.cost.observe(got.nbytes, time.perf_counter() - began)

    def close(self) -> None:
        """Stop the writer after writing what is pending (a graceful stop loses nothing)."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            while self.num_pending and self.flush(everything=True):
                pass
        self.store.close()

    # -- reading, for a step's opens ---------------------------------------------------------------

    def _continuation(self, key: bytes, namespace: str) -> Continuation | None:
        if not len(self.store):
            return None
        return continuation(self.pool.cache, key, namespace, self.pool.events.hashes.get)

    def num_on_disk_tokens(self, key: bytes, namespace: str) -> int:
        """Tokens past the device and host match that the disk holds (Match's count, under the pool's lock; reads
        no block)."""
        found = self._continuation(key, namespace)
        return 0 if found is None else self.store.num_on_disk(found.hashes) * self.pool.layout.block_size

    def promote(self, key: bytes, namespace: str) -> int:
        """Bring the disk blocks continuing `key`'s match into the host tier when loading them beats recomputing;
        returns the tokens brought (the step's open then loads them as a host hit). Called without the pool's
        lock, before the step takes it: the plan is made under the lock, the blocks read with it released (other
        calls on the pool do not wait for this disk), and installed under it again if the match still ends where
        it did (else nothing: what changed meanwhile, another open's promote or an eviction, wins)."""
        with self.pool.lock:
            found = self._continuation(key, namespace)
            num = 0 if found is None else self.store.num_on_disk(found.hashes)
            if found is None or not num or not self.cost.worth_loading(num):
                return 0
        rows = self._take_rows(num)
        try:
            began = time.perf_counter()
            data = self.store.read(found.hashes[:num], rows)
            self.cost.observe(data.nbytes, time.perf_counter() - began)
            if not len(data):
                return 0
            with self.pool.lock:
                now = self._continuation(key, namespace)
                if now is None or now.start != found.start:
                    return 0
                return self._install(key, namespace, now, data)
        finally:
            self._give_rows(rows)

    def _install(self, key: bytes, namespace: str, found: Continuation, data: npt.NDArray[np.uint8]) -> int:
        """Hang `data` (the blocks continuing `found`) in the tree as a host-only node (under the pool's lock)."""
        host = self.pool.cache.host
        bs, bb = self.pool.layout.block_size, self.pool.layout.block_size * TOKEN_BYTES
        tokens = key[found.start * bb : (found.start + len(data)) * bb]
        tree = self.pool.cache.tree
        node = host.adopt(found.hang_point(tree, namespace), tokens, lambda host_ids: self._fill(host_ids, data))
        if node is None:
            if found.parent is None:
                tree.drop_empty_roots()  # the root made for it
            return 0
        self.num_promoted_blocks += len(data)
        self.num_hit_tokens += len(data) * bs
        return len(data) * bs

    def _take_rows(self, num: int) -> npt.NDArray[np.uint8] | None:
        """Aligned rows the disk reads `num` blocks straight into, reused across promotes (a fresh mapping per read
        costs a page fault per 4 KiB, as much as the read itself); at most MAX_FLUSH_BYTES of them, else None (the
        store maps rows of its own)."""
        bpb = self.pool.layout.bytes_per_block
        if num * bpb > MAX_FLUSH_BYTES:
            return None
        with self._rows_lock:
            rows = self._free_rows.pop() if self._free_rows else None
        if rows is None or len(rows) < num:
            rows = aligned_rows(max(num, (4 << 20) // bpb + 1), bpb)
        return rows

    def _give_rows(self, rows: npt.NDArray[np.uint8] | None) -> None:
        with self._rows_lock:
            if rows is not None and len(self._free_rows) < MAX_FREE_ROWS:
                self._free_rows.append(rows)

    def _fill(self, host_ids: npt.NDArray[np.int32], data: npt.NDArray[np.uint8]) -> bool:
        """Write `data` (rows as `_gather` makes them) into host-tier blocks `host_ids`."""
        import torch

        host = self.pool.host_storage
        assert host is not None
        dest = host.data  # [num_layers, 2, host_num_blocks, block_size, num_kv_heads, head_dim]
        rows = torch.from_numpy(np.ascontiguousarray(data)).view(dest.dtype)
        blocks = rows.reshape(len(host_ids), *dest.shape[:2], *dest.shape[3:]).permute(1, 2, 0, 3, 4, 5)
        dest.index_copy_(2, torch.tensor(host_ids.tolist(), dtype=torch.int64), blocks.to(dest.device))
        return True


def attach_disk(pool: Pool, config: PoolConfig, shares: Shares) -> None:
    """Give `pool` its disk tier when `config` asks for one, started (DiskTierError: the directory cannot serve)."""
    if config.disk_dir is None:
        return
    assert config.disk_capacity is not None, "PoolConfig checks a disk tier has a capacity"
    disk = PoolDisk(
        pool,
        directory=Path(config.disk_dir),
        capacity_bytes=parse_bytes(config.disk_capacity),
        prefill_tokens_per_s=config.disk_prefill_tokens_per_s,
        shares=shares,
    )
    disk.start()
    with pool.lock:  # blocks already cached (adopted from a keeper's snapshot) reach the disk too
        pool.disk, pool.events.disk = disk, disk
        for _, node in pool.cache.tree.nodes():
            disk.stored(node, pool.events.hashes.node_hashes(node))
