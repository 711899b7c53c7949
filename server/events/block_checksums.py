"""Writers' digests of the K/V bytes of tree blocks, by block id: what a reader that copies blocks out verifies.

A digest is the writer's claim about a block's bytes: 32 bytes of BLAKE3 over the block's K/V in the pool's
layout (the vLLM connector's saver computes it over the bytes it wrote, `radixkv.vllm`). The server keeps it,
so whoever can write pool memory cannot rewrite the claim, and a cryptographic digest cannot be met by other
bytes (the 64-bit linear checksums of earlier releases could: they are refused, and dropped from snapshots).
It is only recorded for blocks the prefix tree holds, whose bytes never change while they stay there (the
tree holds each block alone and no sequence writes a cached block), and only the first claim is kept; a
block that leaves the tree (evicted) forgets it, so a recycled block id never carries an old digest. The
table survives an upgrade in the pool's snapshot (`block_digests`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.errors import InvalidArgument

DIGEST_BYTES = 32


def check_digests(digests: Sequence[bytes], checksums: Sequence[int]) -> None:
    """InvalidArgument naming the field: old linear checksums, or a digest that is not 32 bytes."""
    if checksums:
        raise InvalidArgument(
            "checksums", "64-bit linear checksums are no longer recorded (they can be forged): send 32-byte digests"
        )
    for i, digest in enumerate(digests):
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument(f"digests[{i}]", f"a digest is {DIGEST_BYTES} bytes, not {len(digest)}")


class BlockChecksums:
    """One 32-byte digest per block of a pool, with a mask of those recorded. Used under the pool's lock."""

    def __init__(self, num_blocks: int) -> None:
        self.values = np.zeros((num_blocks, DIGEST_BYTES), dtype=np.uint8)
        self.recorded = np.zeros(num_blocks, dtype=bool)

    def record(self, block_ids: Sequence[int], digests: Sequence[bytes]) -> int:
        """Record `digests[i]` for `block_ids[i]` where none is yet; returns how many were recorded."""
        ids = np.asarray(block_ids, dtype=np.int64)
        empty = ~self.recorded[ids]
        if empty.any():
            new = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_BYTES)
            self.values[ids[empty]] = new[empty]
            self.recorded[ids[empty]] = True
        return int(empty.sum())

    def get(self, block_ids: Sequence[int]) -> list[bytes]:
        """The digest of each block, b"" where none is recorded."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return [self.values[b].tobytes() if self.recorded[b] else b"" for b in ids]

    def forget(self, block_ids: npt.NDArray[np.int32]) -> None:
        """These blocks left the tree: their bytes are no longer anyone's claim."""
        self.recorded[block_ids] = False

    def to_pairs(self) -> list[list[int | bytes]]:
        """[[block_id, digest], ...] of every recorded block (for the snapshot)."""
        return [[int(b), self.values[b].tobytes()] for b in np.flatnonzero(self.recorded)]

    def restore(self, pairs: Sequence[Sequence[int | bytes]], tree_block_ids: set[int]) -> None:
        """Take a snapshot's pairs back, keeping only well-formed ones of blocks the adopted tree holds."""
        self.recorded[:] = False
        for block_id, digest in pairs:
            if not (isinstance(block_id, int) and isinstance(digest, bytes) and len(digest) == DIGEST_BYTES):
                continue
            if block_id in tree_block_ids and 0 <= block_id < len(self.recorded):
                self.values[block_id] = np.frombuffer(digest, dtype=np.uint8)
                self.recorded[block_id] = True


def table_range(table: Sequence[int], first_block: int, num_blocks: int, field: str) -> list[int]:
    """Blocks [first_block, first_block + num_blocks) of a block table, or InvalidArgument naming `field`."""
    if first_block < 0 or num_blocks < 0 or first_block + num_blocks > len(table):
        raise InvalidArgument(
            field, f"blocks [{first_block}, {first_block + num_blocks}) are not within the sequence's {len(table)}"
        )
    return list(table[first_block : first_block + num_blocks])
