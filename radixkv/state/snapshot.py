"""The snapshot file: one pool's index written on a graceful stop, adopted by the next server, or refused.

Layout, in this order (integers little-endian):

    magic b"RADIXKV\\x00" | format version u32 | header length u32 | body length u64
    | header (msgpack map) | body (msgpack map) | sha256 of everything before it (32 bytes)

The header names what the index describes: the pool, its layout (and its host tier's), the memory it
indexes (the keeper's memory id: a snapshot of other memory, or of memory the keeper allocated afresh, describes bytes
that are not there) and the hashing contract. The body is `radixkv.state.cache_state.capture` plus what
the caller adds (the server: sessions, ownership, block hashes, per-block KV checksums). msgpack,
never pickle: reading a snapshot runs no code.

`load` refuses (`SnapshotRefused`, nothing adopted) in the order a reader can tell: too short, not
a snapshot, another format version, a length that does not add up, a checksum that does not match,
then another pool, layout, contract, host layout or memory, and last a body that is not a consistent cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import time
from pathlib import Path
from typing import Any

import msgpack

from radixkv.errors import SnapshotRefused
from radixkv.kv_cache import KVCache
from radixkv.memory.layout import PoolLayout
from radixkv.sequences.admission import Limits
from radixkv.state.cache_state import capture, rebuild
from radixkv.tree.block_hash import HashContract

MAGIC = b"RADIXKV\x00"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")  # magic, format version, header length, body length
_DIGEST_BYTES = 32


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolIdentity:
    """What must match for a snapshot to describe this pool's memory."""

    pool: str
    layout: PoolLayout
    memory_id: str  # the keeper's id for this allocation: new whenever the memory is new
    host_layout: PoolLayout | None = None  # the host tier's memory (same shape, its own num_blocks), if any

    @property
    def host_num_blocks(self) -> int:
        return self.host_layout.num_blocks if self.host_layout is not None else 0

    def header(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "layout": dataclasses.asdict(self.layout),
            "host_layout": dataclasses.asdict(self.host_layout) if self.host_layout is not None else None,
            "memory_id": self.memory_id,
            "hash_contract": dataclasses.asdict(HashContract(block_size=self.layout.block_size)),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Adopted:
    """A snapshot that passed every check: the rebuilt cache, the caller's extras, the header."""

    cache: KVCache
    extras: dict[str, Any]
    header: dict[str, Any]


def dump(cache: KVCache, identity: PoolIdentity, extras: dict[str, Any] | None = None) -> bytes:
    """The snapshot of `cache` (and the caller's `extras`, msgpack-able) as the bytes of one file."""
    if cache.block_size != identity.layout.block_size or cache.pool.num_blocks != identity.layout.num_blocks:
        raise ValueError(f"the cache's blocks ({cache.pool.num_blocks} x {cache.block_size}) are not {identity.layout}")
    if cache.host.pool.num_blocks != identity.host_num_blocks:
        raise ValueError(f"the cache's host tier does not match {identity.host_layout}")
    header = {**identity.header(), "created_unix_ns": time.time_ns(), "num_cached_blocks": cache.tree.num_cached_blocks}
    body = {"cache": capture(cache), "extras": extras or {}}
    header_bytes: bytes = msgpack.packb(header, use_bin_type=True)
    body_bytes: bytes = msgpack.packb(body, use_bin_type=True)
    data = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes), len(body_bytes)) + header_bytes + body_bytes
    return data + hashlib.sha256(data).digest()


def read_header(data: bytes) -> dict[str, Any]:
    """The header of a snapshot whose framing and checksum are sound (SnapshotRefused otherwise)."""
    header, _ = _split(data)
    return header


def load(data: bytes, identity: PoolIdentity, limits: Limits | None = None, eviction_policy: str = "lru") -> Adopted:
    """Check `data` against `identity` and rebuild its cache (under the pool's `eviction_policy`).

    Raises:
        SnapshotRefused: any check failed (`why` says which); nothing is adopted.
    """
    header, body_bytes = _split(data)
    expected = identity.header()
    for field, why in (("pool", "OTHER_POOL"), ("layout", "LAYOUT"), ("hash_contract", "HASH_CONTRACT")):
        if header.get(field) != expected[field]:
            raise SnapshotRefused(why, f"{field}: the snapshot has {header.get(field)!r}, the pool {expected[field]!r}")
    # Absent from snapshots written before the host tier was kept: they restore with an empty host tier.
    if "host_layout" in header and header["host_layout"] != expected["host_layout"]:
        raise SnapshotRefused(
            "HOST_LAYOUT",
            f"host_layout: the snapshot has {header['host_layout']!r}, the pool {expected['host_layout']!r}",
        )
    if header.get("memory_id") != identity.memory_id:
        raise SnapshotRefused(
            "MEMORY",
            f"the snapshot indexes memory {header.get('memory_id')!r}, the pool's memory is {identity.memory_id!r} "
            "(allocated afresh: its bytes are not the snapshot's)",
        )
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=False)
        state, extras = body["cache"], body["extras"]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise SnapshotRefused("INCONSISTENT", f"the body does not decode: {e}") from e
    return Adopted(rebuild(state, limits, identity.host_num_blocks, eviction_policy), extras, header)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, body bytes) after the framing and checksum checks."""
    if len(data) < _PREFIX.size + _DIGEST_BYTES:
        raise SnapshotRefused("TRUNCATED", f"{len(data)} bytes: shorter than an empty snapshot")
    magic, version, header_len, body_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotRefused("NOT_A_SNAPSHOT", f"the file starts with {magic!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise SnapshotRefused("VERSION", f"format version {version}; this server reads {FORMAT_VERSION}")
    expected_len = _PREFIX.size + header_len + body_len + _DIGEST_BYTES
    if len(data) != expected_len:
        why = "TRUNCATED" if len(data) < expected_len else "CORRUPTED"
        raise SnapshotRefused(why, f"{len(data)} bytes, the framing says {expected_len}")
    if hashlib.sha256(data[:-_DIGEST_BYTES]).digest() != data[-_DIGEST_BYTES:]:
        raise SnapshotRefused("CORRUPTED", "the sha256 of the contents does not match the one stored")
    start = _PREFIX.size
    try:
        header = msgpack.unpackb(data[start : start + header_len], raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise SnapshotRefused("CORRUPTED", f"the header does not decode: {e}") from e
    if not isinstance(header, dict):
        raise SnapshotRefused("CORRUPTED", "the header is not a map")
    return header, data[start + header_len : -_DIGEST_BYTES]


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` so that a reader sees the old file, or none, or all of `data`: never a part of it.

    A temporary file beside it, fsynced, renamed over it, and the directory fsynced (so the rename
    itself survives a power cut).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
