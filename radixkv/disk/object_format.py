"""One object on disk: a header naming what it holds, then a group of whole blocks' K/V bytes.

An object is a file `objects/<xx>/<name>.kvo` of one namespace's consecutive blocks (a run of a prefix chain,
sized for the device: `target_object_bytes`, 1 MiB by default). Layout, little-endian:

    [fixed 48 bytes] magic "RKVDISK\\0", format version, header bytes, meta bytes, num_blocks, block_bytes,
                     data offset, header checksum
    [meta]           canonical CBOR: the pool's shape (layers, kv heads, head_dim, dtype, block size), the hash
                     contract (`radixkv.tree.block_hash.HashContract`), the namespace, the checksum name, and
                     `writer_digests` when any block has one: per block the 32-byte digest its writer recorded with
                     the server (`server/events/block_checksums.py`; empty where none was), so a reader that verifies
                     blocks against their writer's claim (the vLLM connector) still can after every process restarts
    [hashes]         num_blocks x 32 bytes: each block's chain hash (the contract's), in chain order
    [checksums]      num_blocks x 16 bytes: XXH3-128 of each block's bytes
    [padding]        to `ALIGN` (the header is `header_bytes` long, a multiple of ALIGN)
    [data]           num_blocks x block_bytes, padded to ALIGN (O_DIRECT reads and writes whole aligned pages)

The header checksum (XXH3-64 of the fixed fields before it, the meta, hashes and checksums) refuses a torn or
foreign header; each block's checksum refuses a torn or flipped block at load. XXH3 (the `xxhash` package):
~30 GB/s on one core, so verifying costs ~2% of a 0.6 GB/s read; a bit flip or a torn page changes it with
probability 1 - 2^-128. It guards against media and crash damage, not against an attacker who can write the
directory (that one can write any K/V into the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any

import cbor2
import numpy as np
import numpy.typing as npt
import xxhash

from radixkv.memory.block_pool import cdiv

MAGIC = b"RKVDISK\0"
FORMAT_VERSION = 1
ALIGN = 4096  # O_DIRECT's alignment on every Linux block device we meet (logical block size <= 4 KiB)
HASH_BYTES = 32
CHECKSUM_BYTES = 16
WRITER_DIGEST_BYTES = (
    32  # server/events/block_checksums.py's DIGEST_BYTES (BLAKE3): the core does not import the server
)
CHECKSUM_NAME = "xxh3_128"
OBJECT_SUFFIX = ".kvo"
_FIXED = struct.Struct("<8sIIIIQQQ")  # magic, version, header_bytes, meta_bytes, num_blocks, block_bytes, data, csum


class ObjectRefused(Exception):
    """An object that must not be served: `why` is the counted reason (torn, truncated, foreign, corrupt, ...)."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(f"{why}: {detail}")
        self.why = why


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DiskShape:
    """What a block's bytes mean: the pool's shape and how its blocks are named. Two shapes that differ in any
    field never read each other's objects."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    bytes_per_block: int
    hash_contract: tuple[tuple[str, Any], ...]  # HashContract's fields, in order

    def as_dict(self) -> dict[str, Any]:
        return dict(_as_dict(self))

    def differences(self, other: dict[str, Any]) -> dict[str, tuple[object, object]]:
        """Field -> (this shape's value, `other`'s), for every field `other` (a stored shape) disagrees on."""
        return {k: (v, other.get(k)) for k, v in _as_dict(self).items() if other.get(k) != v}


@functools.lru_cache(maxsize=16)
def _as_dict(shape: DiskShape) -> dict[str, Any]:
    """Once per shape: a rebuild compares every object's header with it (do not mutate the result)."""
    d = dataclasses.asdict(shape)
    d["hash_contract"] = dict(shape.hash_contract)
    return d


def block_checksums(blocks: npt.NDArray[np.uint8]) -> bytes:
    """XXH3-128 of each row of `blocks` ([num_blocks, block_bytes] uint8), concatenated."""
    return b"".join(xxhash.xxh3_128_digest(row) for row in blocks)


def _header_length(meta_bytes: int, num_blocks: int) -> int:
    return cdiv(_FIXED.size + meta_bytes + num_blocks * (HASH_BYTES + CHECKSUM_BYTES), ALIGN) * ALIGN


def object_bytes(header_bytes: int, num_blocks: int, block_bytes: int) -> int:
    """The file's size: header, then the data padded to ALIGN."""
    return header_bytes + cdiv(num_blocks * block_bytes, ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """A parsed, verified header."""

    namespace: str
    hashes: list[bytes]
    checksums: list[bytes]
    writer_digests: list[bytes]  # per block, b"" where its writer recorded none
    block_bytes: int
    data_offset: int
    file_bytes: int


def encode_header(
    shape: DiskShape, namespace: str, hashes: list[bytes], checksums: bytes, writer_digests: list[bytes] | None = None
) -> bytes:
    """The header of an object holding blocks `hashes` (their `checksums`, their `writer_digests`), padded to ALIGN."""
    fields: dict[str, Any] = {"shape": shape.as_dict(), "namespace": namespace, "checksum": CHECKSUM_NAME}
    if writer_digests and any(writer_digests):
        assert len(writer_digests) == len(hashes), "encode_header's caller: one writer digest (or b'') per block"
        fields["writer_digests"] = writer_digests
    meta = cbor2.dumps(fields, canonical=True)
    n = len(hashes)
    assert len(checksums) == n * CHECKSUM_BYTES and all(len(h) == HASH_BYTES for h in hashes), "encode_header's caller"
    length = _header_length(len(meta), n)
    body = meta + b"".join(hashes) + checksums
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, length, len(meta), n, shape.bytes_per_block, length, 0)
    digest = xxhash.xxh3_64_intdigest(fixed[:-8] + body)
    fixed = fixed[:-8] + struct.pack("<Q", digest)
    return (fixed + body).ljust(length, b"\0")


def fixed_header_bytes() -> int:
    """How many bytes `header_length` needs to read: the fixed part."""
    return _FIXED.size


def header_length(prefix: bytes) -> int:
    """The whole header's length from its first `fixed_header_bytes()` bytes (ObjectRefused: not an object)."""
    if len(prefix) < _FIXED.size:
        raise ObjectRefused("truncated", f"{len(prefix)} bytes, shorter than a header")
    magic, version, length, *_ = _FIXED.unpack_from(prefix)
    if magic != MAGIC:
        raise ObjectRefused("foreign", "not a radixkv disk object (magic)")
    if version != FORMAT_VERSION:
        raise ObjectRefused("foreign", f"format version {version}, this server reads {FORMAT_VERSION}")
    if length % ALIGN or length > 64 << 20:
        raise ObjectRefused("corrupt", f"header length {length}")
    return int(length)


def decode_header(data: bytes, shape: DiskShape, file_bytes: int) -> Header:
    """Parse and verify a whole header (`header_length` bytes) of a file of `file_bytes`.

    Raises:
        ObjectRefused: torn or corrupt (checksum), foreign (magic, version, another shape or hash contract),
            truncated (the file is shorter than its blocks).
    """
    length = header_length(data)
    if len(data) < length:
        raise ObjectRefused("truncated", f"header of {length} bytes, {len(data)} read")
    _, _, _, meta_bytes, n, block_bytes, data_offset, digest = _FIXED.unpack_from(data)
    end = _FIXED.size + meta_bytes + n * (HASH_BYTES + CHECKSUM_BYTES)
    if end > length or data_offset != length:
        raise ObjectRefused("corrupt", "header fields disagree")
    if xxhash.xxh3_64_intdigest(data[: _FIXED.size - 8] + data[_FIXED.size : end]) != digest:
        raise ObjectRefused("corrupt", "header checksum")
    meta = cbor2.loads(data[_FIXED.size : _FIXED.size + meta_bytes])
    differences = shape.differences(meta.get("shape", {}))
    if differences or meta.get("checksum") != CHECKSUM_NAME:
        raise ObjectRefused("foreign", f"written for another pool shape or hash contract: {sorted(differences)}")
    if block_bytes != shape.bytes_per_block or n < 1:
        raise ObjectRefused("foreign", f"block bytes {block_bytes}, blocks {n}")
    size = object_bytes(length, n, block_bytes)
    if file_bytes < size:
        raise ObjectRefused("truncated", f"{file_bytes} bytes, its blocks need {size}")
    pos = _FIXED.size + meta_bytes
    hashes = [data[pos + i * HASH_BYTES : pos + (i + 1) * HASH_BYTES] for i in range(n)]
    pos += n * HASH_BYTES
    checksums = [data[pos + i * CHECKSUM_BYTES : pos + (i + 1) * CHECKSUM_BYTES] for i in range(n)]
    digests = meta.get("writer_digests", [b""] * n)
    if len(digests) != n or not all(isinstance(d, bytes) and len(d) in (0, WRITER_DIGEST_BYTES) for d in digests):
        raise ObjectRefused("corrupt", "writer digests")
    return Header(
        namespace=str(meta["namespace"]),
        hashes=hashes,
        checksums=checksums,
        writer_digests=digests,
        block_bytes=int(block_bytes),
        data_offset=int(data_offset),
        file_bytes=size,
    )
