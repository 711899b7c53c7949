"""The disk tier's store: objects of whole blocks under one directory, an index by block hash, an LRU byte cap.

Directory `DIR`: `radixkv-disk.cbor` (the manifest: format version and the pool's `DiskShape`, written once),
`objects/<xx>/<name>.kvo` (`radixkv.disk.object_format`), `tmp/` (objects being written). A write goes to
`tmp/`, is fsynced (`durable`), renamed into `objects/`, and each directory fsynced once per batch: an object
in `objects/` is whole or was never there. Everything in `tmp/` at start is a write a crash interrupted (counted
as `torn`, removed).

The index (block hash -> object, slot) is rebuilt from `objects/` alone at start by reading each object's
header (`rebuild`), so the directory is the only state: it survives the server, the keeper and the host. A
directory whose manifest names another shape is refused at start (`DiskTierError` naming the fields); an object
that fails its header or a block checksum (torn, flipped, truncated, foreign) is refused, counted in
`refused[why]`, removed, and its blocks are a miss: never served.

Capacity: bytes of objects (headers and padding included) plus those being written never pass
`capacity_bytes`: room is made first by removing least recently used objects (an object is used when written
and when read). A tenant (`tenant_of(namespace)`) over its share (`share_bytes(tenant)`) loses its own LRU
objects first. ENOSPC, EROFS or any other OSError while writing is logged and counted (`num_write_errors`);
the blocks stay where they were in memory, and the next write tries again.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from radixkv.disk.block_io import DirectIO, aligned_buffer, aligned_rows, fsync_dir
from radixkv.disk.manifest import DiskTierError, check_manifest
from radixkv.disk.object_format import (
    ALIGN,
    CHECKSUM_BYTES,
    OBJECT_SUFFIX,
    DiskShape,
    ObjectRefused,
    block_checksums,
    decode_header,
    encode_header,
    fixed_header_bytes,
    header_length,
    object_bytes,
)

log = logging.getLogger("radixkv.disk")


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class DiskObject:
    name: str
    path: Path
    namespace: str
    hashes: list[bytes]
    checksums: list[bytes]
    writer_digests: list[bytes]  # per block, b"" where none was recorded (object_format)
    data_offset: int
    file_bytes: int


class DiskStore:
    """Block hash -> bytes on disk, whole objects at a time; thread-safe (one lock over the index)."""

    def __init__(
        self,
        directory: Path,
        shape: DiskShape,
        capacity_bytes: int,
        *,
        target_object_bytes: int = 2 << 20,
        durable: bool = True,
        io: DirectIO | None = None,
        num_threads: int = 8,
        tenant_of: Callable[[str], str] = lambda namespace: "",
        share_bytes: Callable[[str], int | None] = lambda tenant: None,
    ) -> None:
        self.directory, self.shape, self.capacity_bytes = Path(directory), shape, capacity_bytes
        self.blocks_per_object = max(1, target_object_bytes // shape.bytes_per_block)
        self.durable, self.io = durable, io or DirectIO()
        self.tenant_of, self.share_bytes = tenant_of, share_bytes
        self._lock = threading.Lock()
        self._objects: collections.OrderedDict[str, DiskObject] = collections.OrderedDict()  # LRU first
        self._where: dict[bytes, tuple[DiskObject, int]] = {}
        self.num_bytes = 0  # objects on disk plus objects being written
        self.bytes_in: dict[str, int] = {}  # tenant -> its objects' bytes
        self.refused: dict[str, int] = {}  # why -> objects refused (and removed)
        self.num_write_errors = 0
        self.num_written_blocks = self.num_read_blocks = self.num_evicted_blocks = 0
        self.num_written_bytes = self.num_read_bytes = 0
        self.read_seconds = 0.0
        self.rebuild_seconds = 0.0
        # Reads have threads of their own: an open waiting on its disk hit never queues behind a batch of writes.
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="radixkv-disk-write")
        self._read_pool = ThreadPoolExecutor(num_threads, thread_name_prefix="radixkv-disk-read")
        # Told (namespace, True: stored / False: removed, block hashes) of every object written or removed after
        # the rebuild, from whichever thread did it, holding nothing: it must only queue.
        self.on_change: Callable[[str, bool, list[bytes]], None] | None = None

    # -- start ------------------------------------------------------------------------------------

    def open(self) -> None:
        """Check the directory is this pool's and writable, clear interrupted writes, rebuild the index.

        Raises:
            DiskTierError: another shape's directory, or one that cannot be written (read-only, full).
        """
        objects, tmp = self.directory / "objects", self.directory / "tmp"
        try:
            objects.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(exist_ok=True)
            for i in range(256):  # every object's directory made once, not checked at every write
                (objects / f"{i:02x}").mkdir(exist_ok=True)
            check_manifest(self.directory, self.shape)
            probe = tmp / f"probe-{secrets.token_hex(4)}"
            buf = aligned_buffer(1)
            self.io.write_file(probe, [memoryview(buf)], durable=True)
            probe.unlink()
        except OSError as e:
            raise DiskTierError(f"disk_dir {self.directory}: cannot write ({os.strerror(e.errno or 0)})") from e
        for leftover in tmp.iterdir():
            self._count("torn")
            leftover.unlink(missing_ok=True)
        self.rebuild()

    def rebuild(self) -> int:
        """Index every object in `objects/` from its header (oldest file first into the LRU); returns blocks."""
        began = time.perf_counter()
        found = []
        for sub in (self.directory / "objects").iterdir():
            for entry in os.scandir(sub):
                if entry.name.endswith(OBJECT_SUFFIX):
                    st = entry.stat()
                    found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
                else:  # nothing of ours: a foreign file is never read, and leaves
                    self._count("foreign")
                    os.unlink(entry.path)
        found.sort()
        headers = self._pool.map(lambda f: self._read_header(f[1], f[2]), found)
        victims = []
        with self._lock:
            for obj in headers:
                if obj is not None:
                    self._add(obj)
                    self.num_bytes += obj.file_bytes
                    tenant = self.tenant_of(obj.namespace)
                    self.bytes_in[tenant] = self.bytes_in.get(tenant, 0) + obj.file_bytes
            while self.num_bytes > self.capacity_bytes:  # a smaller cap than the last server's
                victims.append(next(iter(self._objects.values())))
                self._drop(victims[-1])
        for v in victims:
            v.path.unlink(missing_ok=True)
        self.rebuild_seconds = time.perf_counter() - began
        return len(self._where)

    def _read_header(self, path: Path, size: int) -> DiskObject | None:
        try:
            with open(path, "rb") as f:  # buffered: a header is a page or two, read once per start
                data = f.read(ALIGN)
                length = header_length(data[: fixed_header_bytes()])
                if length > len(data):
                    data += f.read(length - len(data))
            header = decode_header(data, self.shape, size)
        except ObjectRefused as e:
            self._refuse(path, e)
            return None
        name = path.name[: -len(OBJECT_SUFFIX)]
        return DiskObject(
            name=name,
            path=path,
            namespace=header.namespace,
            hashes=header.hashes,
            checksums=header.checksums,
            writer_digests=header.writer_digests,
            data_offset=header.data_offset,
            file_bytes=size,
        )

    # -- the index --------------------------------------------------------------------------------

    def _add(self, obj: DiskObject) -> None:
        """Index `obj` (under the lock); its bytes were counted by `_reserve` (or `rebuild`)."""
        self._objects[obj.name] = obj
        for slot, h in enumerate(obj.hashes):
            self._where[h] = (obj, slot)

    def _drop(self, obj: DiskObject) -> None:
        """Unindex `obj` and uncount its bytes (under the lock); the caller removes the file."""
        if self._objects.pop(obj.name, None) is None:
            return
        for slot, h in enumerate(obj.hashes):
            if self._where.get(h, (None, 0)) == (obj, slot):
                del self._where[h]
        self.num_bytes -= obj.file_bytes
        tenant = self.tenant_of(obj.namespace)
        self.bytes_in[tenant] = self.bytes_in.get(tenant, 0) - obj.file_bytes

    def _count(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    def _refuse(self, path: Path, error: ObjectRefused) -> None:
        log.warning("disk tier: refused %s (%s); removed", path, error)
        self._count(error.why)
        path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._where

    def num_on_disk(self, hashes: Iterable[bytes]) -> int:
        """How many of `hashes`, from the first, are on disk (a prefix run)."""
        n = 0
        where = self._where
        for h in hashes:
            if h not in where:
                break
            n += 1
        return n

    def writer_digests(self, hashes: Iterable[bytes]) -> list[bytes]:
        """The writer's digest of each of `hashes` on disk (b"" where none was recorded, or not on disk)."""
        where = self._where
        found = [where.get(h) for h in hashes]
        return [b"" if f is None else f[0].writer_digests[f[1]] for f in found]

    def sample(self) -> list[bytes]:
        """The block hashes of the most recently used object (none when empty): what a bandwidth probe reads."""
        with self._lock:
            return list(next(reversed(self._objects.values())).hashes) if self._objects else []

    @property
    def num_objects(self) -> int:
        return len(self._objects)

    # -- writing ----------------------------------------------------------------------------------

    def put(
        self,
        namespace: str,
        hashes: list[bytes],
        blocks: npt.NDArray[np.uint8],
        writer_digests: list[bytes] | None = None,
    ) -> int:
        """Store `blocks` ([n, bytes_per_block] uint8, chain order) named `hashes`, with their writers' digests (b""
        where none; None: none at all), skipping those on disk.

        In phases over the whole batch, each phase's requests all in flight on the thread pool: write every object
        to `tmp/`; fdatasync (`durable`) and rename each into `objects/` (syncs issued together share the
        filesystem's journal commits, where a sync after each write would commit once per object); fsync each
        directory renamed into once. Returns the blocks written. Never raises for the disk's sake: a failed write
        is logged and counted, and those blocks are simply not on disk.
        """
        assert blocks.shape == (len(hashes), self.shape.bytes_per_block), "put's caller: one row per hash"
        keep = [i for i, h in enumerate(hashes) if h not in self._where]
        runs = [keep[i : i + self.blocks_per_object] for i in range(0, len(keep), self.blocks_per_object)]
        digests = writer_digests or [b""] * len(hashes)
        tmps = self._pool.map(
            lambda r: self._write_tmp(namespace, [hashes[i] for i in r], _rows(blocks, r), [digests[i] for i in r]),
            runs,
        )
        written = [w for w in tmps if w is not None]
        written = [w for w in self._pool.map(lambda w: self._settle(w, self._commit), written) if w is not None]
        if written and self.durable:  # the renames, once per directory
            try:
                list(self._pool.map(fsync_dir, {w.path.parent for w in written}))
            except OSError as e:
                self._write_failed(e)
        with self._lock:
            for obj in written:
                self._add(obj)
                self.num_written_blocks += len(obj.hashes)
                self.num_written_bytes += len(obj.hashes) * self.shape.bytes_per_block
        for obj in written:
            self._tell(obj, True)
        return sum(len(obj.hashes) for obj in written)

    def _subdir(self, first_hash: bytes) -> Path:
        return self.directory / "objects" / first_hash[:1].hex()

    def _tmp_path(self, obj: DiskObject) -> Path:
        return self.directory / "tmp" / obj.path.name

    def _write_tmp(
        self, namespace: str, hashes: list[bytes], blocks: npt.NDArray[np.uint8], writer_digests: list[bytes]
    ) -> DiskObject | None:
        """Write one object under `tmp/` (its bytes reserved); None: not written (counted)."""
        checksums = block_checksums(blocks)
        header = encode_header(self.shape, namespace, hashes, checksums, writer_digests)
        size = object_bytes(len(header), len(hashes), self.shape.bytes_per_block)
        if not self._reserve(namespace, size):
            return None
        name = f"{hashes[0][:8].hex()}-{secrets.token_hex(6)}"
        split = [checksums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES] for i in range(len(hashes))]
        obj = DiskObject(
            name=name,
            path=self._subdir(hashes[0]) / (name + OBJECT_SUFFIX),
            namespace=namespace,
            hashes=hashes,
            checksums=split,
            writer_digests=writer_digests,
            data_offset=len(header),
            file_bytes=size,
        )
        buffer = self.io.buffer(size)
        buffer[: len(header)] = header
        if blocks.size % ALIGN == 0 and blocks.ctypes.data % ALIGN == 0 and blocks.flags.c_contiguous:
            # Whole pages on aligned memory (`aligned_rows`, as the writer gathers them): written from where they
            # are, the header from the thread's buffer; no copy of the object.
            parts = [memoryview(buffer)[: len(header)], blocks.data.cast("B")]
        else:
            buffer[len(header) + blocks.size : size] = bytes(size - len(header) - blocks.size)
            np.frombuffer(buffer, dtype=np.uint8, count=blocks.size, offset=len(header))[:] = blocks.reshape(-1)
            parts = [memoryview(buffer)[:size]]
        return self._settle(obj, lambda path: self.io.write_file(path, parts, durable=False))

    def _commit(self, tmp: Path) -> None:
        """fdatasync (`durable`) and rename a written object into `objects/`."""
        if self.durable:
            self.io.sync(tmp)
        os.rename(tmp, self.directory / "objects" / tmp.name[:2] / tmp.name)

    def _settle(self, obj: DiskObject, step: Callable[[Path], None]) -> DiskObject | None:
        """`step(tmp path)`; on an OSError, remove the object's file, unreserve its bytes, count it, None."""
        try:
            step(self._tmp_path(obj))
        except OSError as e:
            self._tmp_path(obj).unlink(missing_ok=True)
            obj.path.unlink(missing_ok=True)
            self._unreserve(obj.namespace, obj.file_bytes)
            self._write_failed(e)
            return None
        return obj

    def _tell(self, obj: DiskObject, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(obj.namespace, stored, obj.hashes)

    def _write_failed(self, error: OSError) -> None:
        self.num_write_errors += 1
        what = {errno.ENOSPC: "disk full", errno.EROFS: "read-only", errno.EDQUOT: "quota"}.get(error.errno or 0)
        log.warning("disk tier: a write failed (%s): the blocks stay in memory only", what or error)

    def _reserve(self, namespace: str, size: int) -> bool:
        """Count `size` bytes about to be written, first removing LRU objects (the tenant's own when over its
        share) until the cap holds; False (nothing changes) when it cannot."""
        tenant = self.tenant_of(namespace)
        share = self.share_bytes(tenant)
        cap = self.capacity_bytes if share is None else min(self.capacity_bytes, share)
        if size > cap:
            return False
        victims = []
        with self._lock:
            while self.bytes_in.get(tenant, 0) + size > cap:
                own = next((o for o in self._objects.values() if self.tenant_of(o.namespace) == tenant), None)
                if own is None:
                    break
                victims.append(own)
                self._drop(own)
            while self.num_bytes + size > self.capacity_bytes and self._objects:
                victims.append(next(iter(self._objects.values())))
                self._drop(victims[-1])
            self.num_evicted_blocks += sum(len(v.hashes) for v in victims)
            self.num_bytes += size
            self.bytes_in[tenant] = self.bytes_in.get(tenant, 0) + size
        for v in victims:
            v.path.unlink(missing_ok=True)
            self._tell(v, False)
        return True

    def _unreserve(self, namespace: str, size: int) -> None:
        with self._lock:
            self.num_bytes -= size
            tenant = self.tenant_of(namespace)
            self.bytes_in[tenant] = self.bytes_in.get(tenant, 0) - size

    # -- reading ----------------------------------------------------------------------------------

    def read(self, hashes: list[bytes], out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """The bytes of the leading run of `hashes` found on disk and verified, [k, bytes_per_block], k <= n.

        Objects are read in parallel, straight into the rows returned: `out` ([>= n, bytes_per_block], from
        `aligned_rows`, reusable by the caller) or fresh aligned rows. A block whose checksum fails refuses its
        whole object (counted, removed) and ends the run there: what follows is recomputed.
        """
        bb = self.shape.bytes_per_block
        runs: list[tuple[DiskObject, int, int]] = []  # (object, first slot, blocks)
        with self._lock:
            for h in hashes:
                found = self._where.get(h)
                if found is None:
                    break
                obj, slot = found
                if runs and runs[-1][0] is obj and runs[-1][1] + runs[-1][2] == slot:
                    runs[-1] = (obj, runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((obj, slot, 1))
                self._objects.move_to_end(obj.name)
        began = time.perf_counter()
        total = sum(n for _, _, n in runs)
        if out is None:
            out = aligned_rows(total, bb)
        assert out.shape[0] >= total and out.shape[1] == bb and out.flags.c_contiguous, "read's out: rows for all"
        starts = np.cumsum([0] + [n for _, _, n in runs]).tolist()
        parts = [out[starts[i] : starts[i + 1]] for i in range(len(runs))]
        verified = list(self._read_pool.map(self._read_run, runs, parts))
        num_good = starts[verified.index(False)] if False in verified else total
        got = out[:num_good]
        with self._lock:
            self.read_seconds += time.perf_counter() - began
            self.num_read_blocks += len(got)
            self.num_read_bytes += got.nbytes
        return got

    def _read_run(self, run: tuple[DiskObject, int, int], into: npt.NDArray[np.uint8]) -> bool:
        """Read `run`'s blocks into `into` and verify them; False (the object refused) on any damage."""
        obj, first, n = run
        bb = self.shape.bytes_per_block
        try:
            got = self.io.read_into(obj.path, obj.data_offset + first * bb, into)
        except FileNotFoundError:
            self._forget(obj, ObjectRefused("missing", str(obj.path)))
            return False
        if got < n * bb:
            self._forget(obj, ObjectRefused("truncated", f"{obj.path}: {got} of {n * bb} bytes"))
            return False
        for i in range(n):
            if xxhash.xxh3_128_digest(into[i]) != obj.checksums[first + i]:
                self._forget(obj, ObjectRefused("corrupt", f"{obj.path}: block {first + i} fails its checksum"))
                return False
        return True

    def _forget(self, obj: DiskObject, error: ObjectRefused) -> None:
        with self._lock:
            self._drop(obj)
        self._refuse(obj.path, error)
        self._tell(obj, False)

    def read_bandwidth(self) -> float | None:
        """Bytes per second the reads so far took (None before the first)."""
        return self.num_read_bytes / self.read_seconds if self.read_seconds > 0 else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(o.file_bytes for o in self._objects.values())
            assert total <= self.num_bytes <= self.capacity_bytes, f"disk bytes {total}/{self.num_bytes} past the cap"
            indexed = sum(1 for o in self._objects.values() for s, h in enumerate(o.hashes) if self._where[h] == (o, s))
            assert indexed == len(self._where), "disk index out of step with its objects"


def _rows(blocks: npt.NDArray[np.uint8], run: list[int]) -> npt.NDArray[np.uint8]:
    """`blocks[run]`: a view when the run is consecutive (the usual case), sparing a copy of the object."""
    return blocks[run[0] : run[-1] + 1] if run[-1] - run[0] + 1 == len(run) else blocks[run]
